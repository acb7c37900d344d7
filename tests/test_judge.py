"""The token tier's near-tie rule (pytest_cdna2/judge.py) on a fake engine and store: a failing prompt is
forgiven only when every selection it flips sits at a near-tie of the golden AND its logits with the golden's
selections forced pass; a flip away from a near-tie fails whatever the logits."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import cdna2_engine
from cdna2_engine.model import Selection
from pytest_cdna2.judge import batch_spread, judge_incremental, judge_prompt
from pytest_cdna2.tolerance import load_profile

T, V, K = 6, 50, 2
LIMITS = replace(load_profile().token, tie_margin_router=1e-3, tie_margin_indexer=1e-3)
MARGINS = torch.tensor([0.5, 0.5, 1e-5, 0.5, 0.5, 0.5])  # step 2 is a near-tie of the golden (< tie_margin)


class Store:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, V, (T,), generator=g)
        self.logits = torch.randn(T, V, generator=g, dtype=torch.float64).float() * 3
        self.picks = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(T)])

    def input_ids(self, name: str) -> torch.Tensor:
        return self.ids

    def teacher_logits(self, name: str) -> torch.Tensor:
        return self.logits

    def selections(self, name: str) -> dict:
        return {(0, "router"): Selection(self.picks, MARGINS)}


class Engine:
    """forward: the golden's logits plus `error`; trace (selections forced): its own picks with `flip_at`
    changed, and the golden's logits plus `forced_error`."""

    device = "cpu"

    def __init__(self, store: Store, error: float, flip_at: int | None, forced_error: float) -> None:
        self.store, self.error, self.flip_at, self.forced_error = store, error, flip_at, forced_error

    def _off(self, by: float) -> torch.Tensor:
        noise = torch.randn(T, V, generator=torch.Generator().manual_seed(11)) * by
        return (self.store.logits + noise)[None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._off(self.error)

    def trace(self, ids: torch.Tensor, selections: dict) -> SimpleNamespace:
        picks = self.store.picks.clone()
        if self.flip_at is not None:
            picks[self.flip_at] = torch.tensor([8, 9])  # entries the golden never picked
        return SimpleNamespace(selections={(0, "router"): Selection(picks[None], None)},
                               logits=self._off(self.forced_error))


@pytest.mark.parametrize("error, flip_at, forced_error, ok, flips, message", [
    (0.0, None, 0.0, True, 0, ""),  # passes outright
    (2.0, 2, 0.0, True, 1, ""),  # off, one flip at the near-tie, forced logits right: forgiven
    (2.0, 2, 2.0, False, 1, "prompt p with the golden's selections forced (1 near-tie flips)"),
    (2.0, 3, 0.0, False, 0, "1 selections differ outside the near-tie band (first: layer 0 router at step 3)"),
    (2.0, None, 0.0, False, 0, "prompt p: "),  # off with no flip at all: the logits' failure stands
])
def test_near_tie_rule(error, flip_at, forced_error, ok, flips, message):
    store = Store()
    v = judge_prompt(Engine(store, error, flip_at, forced_error), store, "p", LIMITS)
    assert (v.ok, v.near_tie_flips) == (ok, flips), v.message
    assert message in v.message and (v.message == "") == ok


class RankedStore(Store):
    """A golden (a store built since 2026-12-07) that ranks its picks and entries 8..11 after them; at step 2 the
    k-th pick, entry 8 and entry 9 tie within the tie margin (a three-way near-tie), entries 10 and 11 trail."""

    def selections(self, name: str) -> dict:
        ranked = torch.cat([self.picks, torch.tensor([[8, 9, 10, 11]] * T)], 1)
        scores = torch.tensor([[1.0, 0.9, 0.4, 0.3, 0.2, 0.1]] * T)
        scores[2] = torch.tensor([1.0, 0.5, 0.5 - 1e-5, 0.5 - 2e-4, 0.2, 0.1])
        return {(0, "router"): Selection(self.picks, MARGINS, ranked, scores)}


class SwapEngine(Engine):
    """trace: the golden's picks with pick `col` at step 2 replaced by entry `came`."""

    def __init__(self, store: Store, col: int, came: int) -> None:
        super().__init__(store, 2.0, None, 0.0)
        self.col, self.came = col, came

    def trace(self, ids: torch.Tensor, selections: dict) -> SimpleNamespace:
        out = super().trace(ids, selections)
        out.selections[(0, "router")].indices[0, 2, self.col] = self.came
        return out


@pytest.mark.parametrize("col, came, ok", [
    (1, 8, True),  # the runner-up in place of the k-th pick: rounding
    (1, 9, True),  # the (k+2)-th, tied with both within the margin: rounding at a three-way tie
    (1, 10, False),  # an entry scored far below: a bug
    (0, 8, False),  # the runner-up in place of the clear winner: a bug (a review's mutation, passed by a rule
    #                that only looked at the entry that came in)
    (1, 12, False),  # an entry the golden does not rank at all
])
def test_a_near_tie_flip_must_stay_inside_the_golden_band(col, came, ok):
    """At the golden's near-tie, the picks must still be a top-k of its scores moved by less than half the tie
    margin each: any other swap is a bug, whatever the margin."""
    store = RankedStore()
    v = judge_prompt(SwapEngine(store, col, came), store, "p", LIMITS)
    assert (v.ok, v.near_tie_flips) == (ok, int(ok)), v.message
    assert ok or "1 selections differ outside the near-tie band (first: layer 0 router at step 2)" in v.message


def test_an_engine_refusing_the_golden_selections_fails_the_prompt_in_one_line():
    """A failing prompt whose golden selections the engine refuses (another model's store) is a verdict with the
    engine's reason, not a traceback out of the token tier."""
    store = Store()
    engine = Engine(store, 2.0, 2, 0.0)

    def refuse(ids, selections):
        raise ValueError("selections[(0, 'router')] holds ids 0..9, outside 0..7")

    engine.trace = refuse
    v = judge_prompt(engine, store, "p", LIMITS)
    assert not v.ok and "prompt p: the engine refuses the golden's selections: selections[(0, 'router')]" in v.message


class Causal:
    """A causal fake model: position t's logits depend on tokens 0..t of its own row only (a running sum of
    embeddings). batch_leak: every row also sees the batch's mean (a kernel that mixes rows); stale: decode
    steps read a cache one token behind; decode_mix: decode steps read row 0's generated tokens in every row (a
    cache write that takes one row's key for all), while a prefill keeps rows apart."""

    device = "cpu"
    config = SimpleNamespace(vocab_size=V)

    def __init__(self, batch_leak: bool = False, stale: bool = False, decode_mix: bool = False) -> None:
        self.emb = torch.randn(V, V, generator=torch.Generator().manual_seed(3))
        self.batch_leak, self.stale, self.decode_mix = batch_leak, stale, decode_mix

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.emb[ids].cumsum(1)
        return out + out.mean(0, keepdim=True) if self.batch_leak else out

    def generate(self, ids: torch.Tensor, steps: int) -> SimpleNamespace:
        tokens, logits = ids, []
        for _ in range(steps):
            seen = tokens[:, :-1] if self.stale and tokens.shape[1] > ids.shape[1] else tokens
            if self.decode_mix:
                seen = torch.cat([seen[:, :ids.shape[1]], seen[:1, ids.shape[1]:].expand(len(seen), -1)], 1)
            row = self.forward(seen)[:, -1]
            logits.append(row)
            tokens = torch.cat([tokens, row.argmax(-1, keepdim=True)], 1)
        return SimpleNamespace(tokens=tokens[:, ids.shape[1]:], logits=torch.stack(logits, 1))


def spread(engine, steps: int = 40) -> float:
    """The decode-vs-prefill difference itself, picks left to each path (no limit: the first comparison)."""
    return judge_incremental(engine, math.inf, 0.0, steps).diff


def test_determinism_probes_see_rows_mixed_and_stale_decode():
    """The determinism tier's probes are 0 for a model that keeps rows apart and decodes what it prefills, and
    well above any limit for one that mixes the batch's rows or decodes from a stale cache."""
    assert max(batch_spread(Causal())) == 0.0 and spread(Causal(), steps=8) == 0.0
    assert min(batch_spread(Causal(batch_leak=True))) > 1.0
    assert spread(Causal(stale=True), steps=8) > 1.0
    assert spread(Causal(decode_mix=True), steps=8) > 1.0  # its second row decodes the first's tokens
    # an engine without generate(selections=) is judged on its unforced spread, and the failure says why
    r = judge_incremental(Causal(stale=True), 0.5, 1e-4, steps=8)
    assert r.diff > 1.0 and "generate has no selections parameter" in r.message


@pytest.fixture(scope="module")
def tiny_model():
    from pytest_cdna2.plugin import DEFAULT_MODEL

    return cdna2_engine.load_model(DEFAULT_MODEL, dtype=torch.float32)


def off_decode_router(monkeypatch, model, bias: float = 0.0, weight: float = 1.0, last_only: bool = False) -> None:
    """A decode whose router differs from the prefill's (inside Model.decode only): a fixed per-expert bias on
    its logits of up to `bias` (a kernel that rounds them otherwise: flips where the prefill's margin is small),
    its routing weights times `weight` (a bug that changes no pick; `last_only`: in the last layer alone, so no
    later pick sees it)."""
    route, calls = model.ops.route, []  # calls: route calls in this decode step

    def off(logits, *args):
        if not calls:
            return route(logits, *args)
        calls[0] += args[1] == model.cfg.num_experts_per_tok  # not a recording's runner-up call (k + 1)
        idx, w, margin = route(logits + bias * torch.cos(torch.arange(logits.shape[-1]) * 1.7), *args)
        last = calls[0] == model.cfg.num_hidden_layers  # every layer routes once a step (a hash layer by id)
        return idx, (w * weight if last or not last_only else w), margin

    monkeypatch.setattr(model.ops, "route", off)
    mark_decoding(monkeypatch, model, calls)


def mark_decoding(monkeypatch, model, marks: list) -> None:
    """`marks` holds one 0 while Model.decode runs (a decode step), none otherwise."""
    decode = model.decode

    def marked(*args, **kwargs):
        marks.append(0)
        try:
            return decode(*args, **kwargs)
        finally:
            marks.pop()

    monkeypatch.setattr(model, "decode", marked)


BF16_TIE = load_profile(dtype="bfloat16").token.tie_margins  # per kind: rounding flips seen in bfloat16


def test_incremental_near_tie_flips_are_judged_forced(tiny_model, monkeypatch):
    """Router logits off by <= 0.01 in decode flip 2 picks at near-ties: 1.85 unforced, within bf16's 0.5 once the
    prefill's picks are forced (what a bf16 decode kernel does on the H200: 1.8, run 247)."""
    off_decode_router(monkeypatch, tiny_model, bias=0.01)
    assert spread(tiny_model) > 1.0
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert not r.message and r.near_tie_flips > 0 and r.diff < 0.1


def test_incremental_flips_away_from_near_ties_fail(tiny_model, monkeypatch):
    off_decode_router(monkeypatch, tiny_model, bias=0.3)  # flips where the prefill's margin is up to ~0.6
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert "decode picks differ from the prefill's outside its near-tie band (first: layer" in r.message
    monkeypatch.undo()
    off_decode_router(monkeypatch, tiny_model, bias=0.01)
    assert "near-tie band" in judge_incremental(tiny_model, 0.5, 0.0).message  # no tie forgiven


def test_incremental_drift_without_a_flip_fails(tiny_model, monkeypatch):
    """A decode bug that moves no pick is not forgiven: no pick differs, so the unforced verdict stands."""
    off_decode_router(monkeypatch, tiny_model, weight=1.5, last_only=True)  # the last layer: no later pick moves
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert r.message.startswith("incremental decode differs from prefill by") and r.near_tie_flips == 0
    assert r.cause == "limit" and ";" not in r.message and r.diff > 0.5


def test_incremental_wrong_pick_at_a_small_margin_fails(tiny_model, monkeypatch):
    """A decode router that takes its worst expert in place of its k-th wherever its margin is small flips only
    at near-ties by the margin, but not to the runner-up: a bug (a review's mutation, which passed before the
    runner-up was recorded)."""
    route, decoding = tiny_model.ops.route, []

    def worst(logits, bias, k, *args):
        idx, w, margin = route(logits, bias, k, *args)
        if decoding and k == tiny_model.cfg.num_experts_per_tok and not (len(args) > 2 and args[2] is not None):
            rows = (margin < 0.04) & ~(idx == logits.argmin(-1, keepdim=True)).any(-1)
            idx = torch.where(rows[:, None] & (torch.arange(k) == k - 1), logits.argmin(-1, keepdim=True), idx)
        return idx, w, margin

    monkeypatch.setattr(tiny_model.ops, "route", worst)
    mark_decoding(monkeypatch, tiny_model, decoding)
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert r.cause == "flips" and "near-tie band" in r.message


def test_incremental_best_pick_dropped_for_the_runner_up_fails(tiny_model, monkeypatch):
    """A decode router that drops its best expert for the (k+1)-th wherever its margin is small brings in the
    runner-up at a near-tie, but evicts a clear winner: a bug (a review's mutation, which passed while the rule
    looked only at the entry that came in)."""
    route, decoding = tiny_model.ops.route, []

    def best_dropped(logits, bias, k, *args):
        idx, w, margin = route(logits, bias, k, *args)
        if decoding and k == tiny_model.cfg.num_experts_per_tok and not (len(args) > 2 and args[2] is not None):
            nxt = route(logits, bias, k + 1, *args)[0][:, k:]  # picks come best first
            idx = torch.where((margin < 0.04)[:, None] & (torch.arange(k) == 0), nxt, idx)
            _, w, _ = route(logits, bias, k, *args[:2], idx)
        return idx, w, margin

    monkeypatch.setattr(tiny_model.ops, "route", best_dropped)
    mark_decoding(monkeypatch, tiny_model, decoding)
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert r.cause == "flips" and "near-tie band" in r.message


def test_incremental_first_token_from_a_wrong_prefill_fails(tiny_model, monkeypatch):
    """The first token's logits come from a last-position prefill that the recording run does not take: judged
    from the first run even when near-tie flips send the verdict to the prefill given the decode's picks."""
    off_decode_router(monkeypatch, tiny_model, bias=0.01)  # near-tie flips
    step = tiny_model.step
    monkeypatch.setattr(tiny_model, "step", lambda *a, last_only=False, **kw:
                        step(*a, last_only=last_only, **kw) + (1.0 if last_only else 0.0))
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert r.near_tie_flips > 0 and r.cause == "limit" and 0.9 < r.diff < 1.1


def test_incremental_bug_beside_near_tie_flips_fails(tiny_model, monkeypatch):
    """Near-tie flips do not excuse a bug in the decode's own routing weights (a review's hole: forcing the
    prefill's picks on the decode took the weights' path the bug was not on): the decode judged is the one
    that ran, against a prefill given its picks."""
    off_decode_router(monkeypatch, tiny_model, bias=0.01, weight=3.0, last_only=True)  # no later pick sees it
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert "from a prefill given its selections" in r.message and r.near_tie_flips > 0 and r.diff > 0.5
    monkeypatch.undo()
    off_decode_router(monkeypatch, tiny_model, bias=0.01, weight=1.2)  # every layer: later picks move
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert "decode picks differ from the prefill's outside its near-tie band" in r.message


def test_incremental_decode_that_does_not_repeat_fails(tiny_model, monkeypatch):
    """The recording rerun must repeat the decode steps bit for bit: a decode with noise (a race, a stale graph
    buffer) is not judged on a second run that happened to go otherwise."""
    decode, g = tiny_model.decode, torch.Generator().manual_seed(5)
    monkeypatch.setattr(tiny_model, "decode", lambda *a, **k: decode(*a, **k) + torch.rand(1, generator=g).item())
    r = judge_incremental(tiny_model, 0.5, BF16_TIE)
    assert "a second decode recording its selections differs from the first" in r.message


@pytest.mark.parametrize("fault", ["best dropped", "hidden kept"])
def test_a_faulty_mask_kernel_fails_the_token_tier_on_its_picks(tiny_model, monkeypatch, fault):
    """The indexer attends with `topk_mask`, not `topk`: a mask that swaps each position's best entry for the
    (k+1)-th, or one that keeps entries not yet closed (scored -inf), fails the teacher-forced prompt on the
    indexer's picks even down the forced path, which records the picks of the mask the engine attends with (a
    review's mutation passed 15 of 16 prompts while the picks came from `topk`; a hidden entry recorded as
    "none" failed on logits alone)."""
    from cdna2_engine.ops import reference
    from pytest_cdna2.goldens import BUNDLED_GOLDENS, GoldenStore

    real = tiny_model.ops.topk_mask

    def faulty(scores, k, out=None):
        if fault == "best dropped":
            mask = real(scores, k + 1)
            mask.scatter_(-1, scores.argmax(-1, keepdim=True), False)
            mask &= scores != float("-inf")
        else:  # the top-k by index order among ties, hidden entries included
            mask = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, reference.topk(scores, k)[0], True)
        return mask if out is None else out.copy_(mask)

    monkeypatch.setattr(tiny_model.ops, "topk_mask", faulty)
    store = GoldenStore.open(BUNDLED_GOLDENS)
    verdicts = [judge_prompt(tiny_model, store, p.name, load_profile().token) for p in store.prompts[:4]]
    assert not any(v.ok for v in verdicts), [v.message for v in verdicts]
    assert any("differ outside the near-tie band" in v.message and "indexer" in v.message for v in verdicts)
