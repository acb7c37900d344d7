"""The suite judging a user engine: transformers' DeepseekV4ForCausalLM through examples/transformers_engine.py
(`--cdna2-engine=module:factory`), an independent implementation, on a random official-layout checkpoint with
goldens from the bundled float64 reference. What a user's run does: the token, determinism and weight tiers
judge it; the kernel and isa tiers, which check the bundled engine's own ops and kernels, skip and say why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
