"""How one golden prompt is judged, shared by the token tier, `cdna2 bisect` and the kernel search.

Sparse selections are discontinuous: where the golden's k-th and (k+1)-th scores nearly tie, a correct
engine in lower precision may pick the other entry, and that flip moves the logits far more than rounding.
So when the teacher-forced logits fail, the prompt is run again with the golden's selections forced in;
the engine then records, at every layer, its own pick given the golden's upstream (a flip there is that
layer's rounding, not the echo of an earlier flip). If every such flip stays in the golden's near-tie band (its
picks a top-k of the golden's scores moved by < tie_margin / 2 each; old stores: golden margin < tie_margin), the
forced logits are judged; any other flip is a bug and fails.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pytest_cdna2.compare import LogitMetrics, assert_logits_close, logit_metrics, selection_diff


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str  # the failure, one line ("" when ok)
    metrics: LogitMetrics | None  # of the logits that were judged (None: another shape, not comparable)
    near_tie_flips: int  # > 0: judged with the golden's selections forced


def forced_selections(store: Any, name: str, device: Any) -> dict:
    return {k: s.indices.unsqueeze(0).to(device) for k, s in store.selections(name).items()}


def has_trace(engine: Any) -> bool:
    """Whether the engine offers the Model API's optional trace (the near-tie rule and drift location need it)."""
    return callable(getattr(engine, "trace", None))


def judge_prompt(engine: Any, store: Any, name: str, limits: Any) -> Verdict:
    """Teacher-forced logits of prompt `name` against the golden, with the near-tie rule above."""
    dev = torch.device(engine.device)
    ids = store.input_ids(name).unsqueeze(0).to(dev)
    expected = store.teacher_logits(name)
    what = f"prompt {name}"
    out = engine.forward(ids)[0].cpu()
    try:
        return Verdict(True, "", assert_logits_close(out, expected, limits=limits, what=what), 0)
    except AssertionError as e:
        failure = str(e)
    try:
        metrics = logit_metrics(out, expected)
    except ValueError as e:  # logits of another shape (a vocabulary entry short): a wrong output, a failed check
        return Verdict(False, f"{what}: {e}", None, 0)
    golden = store.selections(name)
    if not golden or not has_trace(engine):
        return Verdict(False, failure, metrics, 0)
    try:
        tr = engine.trace(ids, selections=forced_selections(store, name, dev))
    except ValueError as e:  # the engine refuses the golden's selections (another model's, or a form it has not)
        return Verdict(False, f"{what}: the engine refuses the golden's selections: {e}", metrics, 0)
    try:
        diff = selection_diff(tr.selections, golden, tie_margin=limits.tie_margins)
    except ValueError as e:
        return Verdict(False, f"{what}: the engine's recorded selections do not match the golden's: {e}", metrics, 0)
    if diff.real:
        layer, kind, pos = diff.first_real
        return Verdict(False, f"{failure}; {len(diff.real)} selections differ outside the near-tie band (first: "
                       f"layer {layer} {kind} at step {pos})", metrics, 0)
    if not diff.near_tie:
        return Verdict(False, failure, metrics, 0)
    n = len(diff.near_tie)
    forced = tr.logits[0].cpu()
    try:
        metrics = logit_metrics(forced, expected)
    except ValueError as e:
        return Verdict(False, f"{what} with the golden's selections forced: {e}", None, 0)
    try:
        assert_logits_close(forced, expected, limits=limits, what=f"{what} with the golden's selections forced "
                                                                   f"({n} near-tie flips)")
    except AssertionError as e:
        return Verdict(False, str(e), metrics, n)
    return Verdict(True, "", metrics, n)


PROBE = b"def find(self, key):\n    for i, item in enumerate(self.items):\n        if item == key:\n"


def probe_ids(engine: Any, repeat: int = 1) -> torch.Tensor:
    """A fixed byte-level prompt (mod the vocabulary), [1, T] on the engine's device."""
    vocab = engine.config.vocab_size
    return torch.tensor([[b % vocab for b in PROBE * repeat]], device=engine.device)


def batch_spread(engine: Any) -> list[float]:
    """Max |logit difference| of the probe alone vs at each row of a batch of 4 (other rows random)."""
    ids = probe_ids(engine, repeat=2)
    g = torch.Generator().manual_seed(0)
    others = torch.randint(0, engine.config.vocab_size, (3, ids.shape[1]), generator=g).to(ids.device)
    alone = engine.forward(ids)
    out = []
    for row in range(4):
        batch = torch.cat([others[:row], ids, others[row:]], 0)
        out.append((alone - engine.forward(batch)[row:row + 1]).abs().max().item())
    return out


INCREMENTAL_PROMPT = 100  # tokens: a decode of 40 from here crosses position 127, where V4's ratio-128 (HCA) window
# closes, besides wrapping a sliding window of up to 128 and closing ratio-4 windows (a probe of 174 tokens decoded
# 174-213 and never closed an HCA window in decode: a wrong rotation there went unseen)


def _incremental_batch(engine: Any) -> torch.Tensor:
    """Two different prompts decoded together (a decode that mixes batch rows, e.g. writes one row's key into
    every row's cache, shows in the second row; the suite decodes at batch 1 nowhere else)."""
    ids = probe_ids(engine, repeat=2)[:, :INCREMENTAL_PROMPT]
    return torch.cat([ids, (ids + 1) % engine.config.vocab_size])  # the probe and another prompt of its length


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def takes_selections(engine: Any) -> bool:
    """Whether the engine has trace and its generate names the Model API's optional `selections` parameter."""
    try:
        params = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False
    return has_trace(engine) and "selections" in params


@dataclass(frozen=True)
class Incremental:
    diff: float  # max |logit difference| judged
    near_tie_flips: int  # > 0: judged against a prefill given the decode's own selections
    message: str  # the failure, one line ("" when within the limit)
    cause: str = ""  # "limit": only the diff is over it; "flips", "repeat", "selections": a failure beside it


def judge_incremental(engine: Any, limit: float, tie_margin: float | Mapping[str, float],
                      steps: int = 40) -> Incremental:
    """Greedy decode against one prefill of the same tokens, with the near-tie rule of the module docstring
    turned round: over the limit, the decode runs again recording its own selections (`generate(...,
    selections={})`: eager, its steps bit-identical to the first run's or it fails) and the prefill is run with
    those forced in. The prefill's own picks given that upstream must differ from the decode's only inside
    the prefill's near-tie band (`compare.selection_diff`; a decode's kernels round otherwise than a
    prefill's: in bfloat16 a flip somewhere in 80 positions is the rule), and then the first run's logits are
    judged against that prefill's. The decode judged is the one the engine ran, on its own tokens and picks: a
    bug in its picking or weighting is not forced away."""
    batch = _incremental_batch(engine)
    T = batch.shape[1]
    gen = engine.generate(batch, steps)
    seq = torch.cat([batch, gen.tokens], 1)[:, :-1]
    diff = _max_abs(gen.logits, engine.forward(seq)[:, T - 1:])
    if diff <= limit:
        return Incremental(diff, 0, "")
    failure = f"incremental decode differs from prefill by {diff:.3e} (limit {limit:.1e})"
    if not takes_selections(engine):
        return Incremental(diff, 0, failure + " (the engine's generate has no selections parameter: a near-tie "
                                              "flip cannot be told from a bug)", "limit")
    try:
        rec = engine.generate(batch, steps, selections={})
        # the decode steps repeat bit for bit (a CUDA graph's replay and an eager step alike); the first token's
        # logits may round otherwise: recording runs the prefill's last layer on every position, not the last
        if not (torch.equal(rec.tokens, gen.tokens) and torch.equal(rec.logits[:, 1:], gen.logits[:, 1:])):
            return Incremental(diff, 0, f"{failure}; a second decode recording its selections differs from the "
                                        f"first by {_max_abs(rec.logits, gen.logits):.3e} (decode steps must repeat "
                                        "bit for bit, a CUDA graph's replay and an eager step alike)", "repeat")
        tr = engine.trace(seq, selections=rec.selections)
        sel = selection_diff(rec.selections, tr.selections, tie_margin=tie_margin)
    except (ValueError, AttributeError) as e:  # an engine that records no selections, or another form of them
        return Incremental(diff, 0, f"{failure}; the decode's selections cannot be judged: {e}", "selections")
    if sel.real:
        layer, kind, flat = sel.first_real
        row, pos = divmod(flat, seq.shape[1])
        return Incremental(diff, 0, f"{failure}; {len(sel.real)} decode picks differ from the prefill's outside its "
                                    f"near-tie band (first: layer {layer} {kind}, row {row} position {pos})", "flips")
    if not sel.near_tie:
        return Incremental(diff, 0, failure, "limit")
    n = len(sel.near_tie)
    diff = _max_abs(gen.logits, tr.logits[:, T - 1:])  # the first run's: its first token from its own prefill
    return Incremental(diff, n, "" if diff <= limit else
                       f"incremental decode differs by {diff:.3e} (limit {limit:.1e}) from a prefill given its "
                       f"selections ({n} near-tie flips)", "" if diff <= limit else "limit")
