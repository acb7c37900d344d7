"""Token tier: the engine's logits and greedy continuations against the float64 reference goldens.

Sparse selections (indexer and router top-k) are discontinuous; a prompt that fails only through flips
at near-ties is judged again with the golden's selections forced in (pytest_cdna2.judge): a pure flip
passes and is counted, a bug still fails. A failure names the first layer and sub-block whose hidden
state drifted and, on the triton backend, the kernel whose reference twin removes the failure.
"""

from __future__ import annotations

import pytest

from pytest_cdna2.bisect import kernel_culprit, locate, taps_for
from pytest_cdna2.compare import assert_logits_close
from pytest_cdna2.judge import forced_selections, has_trace, judge_prompt

pytestmark = pytest.mark.token


def _why(engine, golden, prompt, limit) -> str:
    name, taps = taps_for(golden, prompt)
    if not taps or not has_trace(engine):
        return ""
    ids = golden.input_ids(name).unsqueeze(0).to(engine.device)
    drift = locate(engine, ids, taps, limit, selections=forced_selections(golden, name, engine.device))
    where = ("" if name == prompt else f" on prompt {name}") + ", the golden's selections forced"
    return f" [{drift}{where}]" if drift else f" [every tap within limits{where}]"


def _kernel(settings, engine, golden, prompt, lim) -> str:
    """On the bundled triton backend: the first op whose reference twin makes this prompt pass."""
    if settings.backend != "triton" or settings.engine != "bundled":
        return ""
    op = kernel_culprit(engine, lambda m: judge_prompt(m, golden, prompt, lim).ok)
    return f" [kernel {op}: its reference twin removes the failure]" if op else " [no single kernel explains it]"


def test_teacher_forced_logits(golden_prompt, cdna2_engine, cdna2_golden, cdna2_tolerance, cdna2_record,
                               cdna2_settings):
    """Every step of the prompt and its golden continuation, teacher-forced, against the golden logits."""
    lim = cdna2_tolerance.token
    v = judge_prompt(cdna2_engine, cdna2_golden, golden_prompt, lim)
    what = f"prompt {golden_prompt}" + (f" ({v.near_tie_flips} near-tie flips forced)" if v.near_tie_flips else "")
    if v.metrics is not None:  # None: logits of another shape
        cdna2_record("kl_max", v.metrics.kl_max, lim.kl_max, what=what)
        cdna2_record("cosine_min", v.metrics.cosine_min, lim.cosine_min, higher_is_better=True, what=what)
        cdna2_record("max_abs", v.metrics.max_abs, lim.max_abs, what=what)
    if v.near_tie_flips:
        cdna2_record("near_tie_flips", v.near_tie_flips, float("inf"), what=what)
    if not v.ok:
        why = _why(cdna2_engine, cdna2_golden, golden_prompt, lim.tap_rtol_fro)
        raise AssertionError(v.message + why + _kernel(cdna2_settings, cdna2_engine, cdna2_golden, golden_prompt, lim))


def test_greedy_continuation(golden_prompt, cdna2_engine, cdna2_golden, cdna2_tolerance, cdna2_record):
    """Free-running greedy decode (prefill, then one incremental step per token) against the golden tokens:
    every token before the first divergence agrees by definition, and at the divergence the golden token
    must be in the engine's top-k (vLLM's containment check; a near-tie argmax flip passes, a wrong model
    does not). The logits at these positions are held to the full limits by the teacher-forced test, and
    incremental decode against prefill by the determinism tier."""
    lim = cdna2_tolerance.token
    golden_tokens = cdna2_golden.greedy_tokens(golden_prompt)
    prompt_ids = cdna2_golden.input_ids(golden_prompt)[: len(cdna2_golden.prompt(golden_prompt).tokens)]
    gen = cdna2_engine.generate(prompt_ids.unsqueeze(0).to(cdna2_engine.device), len(golden_tokens))
    tokens, logits = gen.tokens[0].cpu(), gen.logits[0].cpu()
    what = f"prompt {golden_prompt} greedy"
    same = (tokens == golden_tokens).tolist()
    first = same.index(False) if False in same else len(same)
    cdna2_record("greedy_agree_fraction", first / len(same), 0.0, higher_is_better=True, what=what)
    expected = cdna2_golden.greedy_logits(golden_prompt)
    upto = min(first + 1, len(same))
    assert_logits_close(logits[:upto], expected[:upto], limits={"topk": lim.topk}, what=what)
