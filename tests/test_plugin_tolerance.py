"""Tolerance profiles: defaults, key-by-key overrides, one-line errors naming file and key."""

from __future__ import annotations

import pytest
import torch

from pytest_cdna2.tolerance import DEFAULT_PROFILE, ToleranceError, load_profile, with_limits


def test_default_profile_is_complete():
    p = load_profile()
    assert p.name == "float32-derived" and p.path == str(DEFAULT_PROFILE)
    assert p.kernel.rtol_for(torch.float32) == 1e-5  # DESIGN.md section 5 gates
    assert p.kernel.rtol_for(torch.bfloat16) == 1e-2
    assert p.kernel.rtol_for(torch.float8_e4m3fn) == p.kernel.rtol_for(torch.bfloat16)
    assert isinstance(p.token.topk, int) and p.determinism.repeat_max_abs == 0.0
    with pytest.raises(KeyError, match="int32"):
        p.kernel.rtol_for(torch.int32)


def test_bf16_engines_get_the_bf16_profile():
    p32, p16 = load_profile(dtype="float32"), load_profile(dtype="bfloat16")
    assert p16.name == "bfloat16-derived" and p16.path.endswith("tolerance_bf16.toml")
    assert p16.token.kl_max > p32.token.kl_max
    assert p16.token.tie_margin_router > p32.token.tie_margin_router
    assert p16.token.tie_margin_indexer > p16.token.tie_margin_router  # bf16 indexer scores round far more


def test_user_profile_overrides_only_its_keys(tmp_path):
    f = tmp_path / "strict.toml"
    f.write_text("[token]\nkl_max = 1e-6\ntopk = 3\n")
    p = load_profile(f)
    assert (p.name, p.token.kl_max, p.token.topk) == ("strict", 1e-6, 3)
    assert p.token.cosine_min == load_profile().token.cosine_min
    f.write_text('name = "mi250-bf16"\n[kernel]\nrtol_fro_bfloat16 = 2e-2\n')
    k = load_profile(f)
    assert k.name == "mi250-bf16" and k.kernel.rtol_for(torch.bfloat16) == 2e-2
    assert k.kernel.rtol_for(torch.float32) == load_profile().kernel.rtol_for(torch.float32)  # only its key
    assert with_limits(p, token={"kl_max": 0.5}).token.kl_max == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[token]\nkl_mx = 1\n", r"\[token\] kl_mx: unknown key \(known: cosine_min, kl_max"),
        ("[token]\ntie_margin = 1e-3\n", r"\[token\] tie_margin: split in two since 2026-12-07: set tie_margin_router "
         "and tie_margin_indexer"),
        ("[tokens]\n", r"unknown key 'tokens' \(known: name, \[token\], \[kernel\], \[determinism\]\)"),
        ("[token]\nkl_max = -1.0\n", r"\[token\] kl_max: expected a finite number >= 0, got -1.0"),
        ("[token]\nkl_max = nan\n", r"\[token\] kl_max: expected a finite number >= 0"),
        ('[token]\nkl_max = "1e-3"\n', r"\[token\] kl_max: expected a number, got '1e-3'"),
        ("[token]\nkl_max = true\n", r"\[token\] kl_max: expected a number, got True"),
        ("[token]\ncosine_min = 1.5\n", r"\[token\] cosine_min: expected a fraction in \[0, 1\], got 1.5"),
        ("[token]\ntopk = 2.5\n", r"\[token\] topk: expected an integer >= 1, got 2.5"),
        ("[token]\ntopk = 0\n", r"\[token\] topk: expected an integer >= 1, got 0"),
        ("token = 3\n", r"token: expected a \[token\] table"),
        ("name = 3\n", r"name: expected a non-empty string"),
        ("[token\n", r"not valid TOML"),
    ],
)
def test_bad_profiles_are_one_line_errors_naming_file_and_key(tmp_path, text, message):
    f = tmp_path / "p.toml"
    f.write_text(text)
    with pytest.raises(ToleranceError, match=message) as ei:
        load_profile(f)
    assert str(ei.value).startswith(str(f)) and "\n" not in str(ei.value)


def test_missing_profile(tmp_path):
    with pytest.raises(ToleranceError, match=r"nope.toml: tolerance profile not found"):
        load_profile(tmp_path / "nope.toml")
