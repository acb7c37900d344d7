"""The suite judging a user engine: transformers' DeepseekV4ForCausalLM through examples/transformers_engine.py
(`--cdna2-engine=module:factory`), an independent implementation, on a random official-layout checkpoint with
goldens from the bundled float64 reference. What a user's run does: the token, determinism and weight tiers
judge it; the kernel and isa tiers, which check the bundled engine's own ops and kernels, skip and say why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pytest_cdna2.goldens import build_goldens

from tiny_configs import make_checkpoint, make_config

pytest.importorskip("transformers", reason="the user engine here is transformers' implementation (dev extra)")
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [b"def f(x):\n    return x + 1\n" * 3, b"import os\nimport sys\n" * 4]
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    model = make_checkpoint(root / "model", make_config("mixed", vocab_size=256), seed=21)
    build_goldens(model, root / "goldens", PROMPTS, 8, progress=False)
    return model, root / "goldens"


def run_suite(pytester, monkeypatch, model, goldens, *args):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT / "examples"), os.environ.get("PYTHONPATH"))
                                                     if p))
    return pytester.runpytest_subprocess(
        str(ROOT / "suite"), "-p", "no:cacheprovider", "--cdna2-device=cpu", f"--cdna2-model={model}",
        f"--cdna2-goldens={goldens}", "--cdna2-engine=transformers_engine:load", "-rs", "-q", *args)


def test_transformers_as_a_user_engine_passes_the_suite(pytester, monkeypatch, made):
    r = run_suite(pytester, monkeypatch, *made, "-m", "not perf")
    out = r.stdout.str()
    # 2 token tests a prompt, 3 determinism, 5 weight; skipped: device-vs-device, the round trip, every kernel and
    # isa case (their reasons below)
    assert r.ret == 0 and r.parseoutcomes()["passed"] == 2 * len(PROMPTS) + 3 + 5, out[-3000:]
    assert "the kernel tier checks the bundled engine's ops; your engine is judged by the token tier" in out
    assert "the isa tier compiles the bundled engine's Triton kernels; your engine is judged by the token tier" in out
    assert "token        4 passed, 0 failed, 0 skipped" in out and "isa          0 passed, 0 failed" in out


def test_goldens_of_another_checkpoint_stop_a_user_engines_run(pytester, monkeypatch, made, tmp_path):
    """The engine names no sha256: the store is tied to the official folder's, so another checkpoint of the same
    shape (another seed) stops the run in one line instead of failing every token test on drift."""
    from cdna2_engine.checkpoint import checkpoint_sha256

    model, goldens = made
    other = make_checkpoint(tmp_path / "other", make_config("mixed", vocab_size=256), seed=22)
    r = run_suite(pytester, monkeypatch, other, goldens, "-m", "token")
    r.stdout.fnmatch_lines([f"*Interrupted: cdna2: goldens at * are for model sha256 {checkpoint_sha256(model)}, but "
                            f"the model under test has sha256 {checkpoint_sha256(other)}*"])


@pytest.mark.parametrize("name, T", [("mixed", 12), ("mixed", 40), ("hca-first", 40), ("csa-only", 40)])
def test_the_example_traces_as_the_bundled_engine_does(tmp_path, monkeypatch, name, T):
    """The example's trace against the bundled float64 reference, batch 2 (float64 both; transformers keeps float32
    islands, so 1e-5, DESIGN.md section 7): the same taps, the same selection keys, widths and picks (the indexer's
    k at most the closed entries: 12 tokens close 3 at ratio 4), margins, best k + 4 scores, and forced picks that
    change the logits alike. The suite's run above passes on logits alone and never reaches this code."""
    import sys

    import cdna2_engine

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    sys.modules.pop("transformers_engine", None)
    import transformers_engine

    model = make_checkpoint(tmp_path / "m", make_config(name, vocab_size=256), seed=5)
    ref = cdna2_engine.load_model(str(model), dtype="float64")
    hf = transformers_engine.load(str(model), dtype="float64")
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    taps = ref.tap_names()
    a, b = ref.trace(ids, taps=taps), hf.trace(ids, taps=taps)
    assert set(a.taps) == set(b.taps) == set(taps)
    for k in taps:
        assert a.taps[k].shape == b.taps[k].shape, k
        assert ((a.taps[k] - b.taps[k]).norm() / a.taps[k].norm()).item() < 1e-5, k
    assert set(a.selections) == set(b.selections) and a.selections
    for k, x in a.selections.items():
        y = b.selections[k]
        assert x.indices.shape == y.indices.shape, (k, x.indices.shape, y.indices.shape)
        assert torch.equal(x.indices.sort(-1).values, y.indices.sort(-1).values), k
        xm, ym = x.margin.double(), y.margin.double()
        alone = (xm > 1e30, ym > 1e30)  # no competitor (inf, or the dtype's largest after nan_to_num)
        assert torch.equal(*alone), k
        assert torch.allclose(xm[~alone[0]], ym[~alone[0]], rtol=1e-4, atol=1e-6), k
        xs, ys = x.scores.double(), y.scores.double()  # the near-tie band: the same best k + 4 scores
        assert x.ranked.shape == y.ranked.shape == xs.shape and torch.equal(xs.isinf(), ys.isinf()), k
        assert torch.allclose(xs[xs.isfinite()], ys[xs.isfinite()], rtol=1e-4, atol=1e-6), k
        assert torch.equal(x.ranked == -1, y.ranked == -1), k
    changed = {}
    for (layer, kind), sel in a.selections.items():  # every router's first pick moved to another expert
        idx = sel.indices.clone()
        if kind == "router":
            idx[..., 0] = (idx[..., 0] + 1) % ref.config.n_routed_experts
            idx = torch.where((idx[..., :1] == idx[..., 1:]).any(-1, keepdim=True), sel.indices, idx)  # no repeats
        changed[(layer, kind)] = idx
    fa, fb = ref.trace(ids, selections=changed), hf.trace(ids, selections=changed)
    assert (fa.logits - a.logits).abs().max() > 1e-3  # the forcing changed something
    assert ((fa.logits - fb.logits).norm() / fa.logits.norm()).item() < 1e-5
