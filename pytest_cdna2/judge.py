"""How one golden prompt is judged, shared by the token tier, `cdna2 bisect` and the kernel search.

Sparse selections are discontinuous: where the golden's k-th and (k+1)-th scores nearly tie, a correct
engine in lower precision may pick the other entry, and that flip moves the logits far more than rounding.
So when the teacher-forced logits fail, the prompt is run again with the golden's selections forced in;
the engine then records, at every layer, its own pick given the golden's upstream (a flip there is that
layer's rounding, not the echo of an earlier flip). If every such flip sits at a near-tie (golden margin <
tie_margin), the forced logits are judged; a flip away from a near-tie is a bug and fails.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from pytest_cdna2.compare import LogitMetrics, assert_logits_close, logit_metrics, selection_diff


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str  # the failure, one line ("" when ok)
    metrics: LogitMetrics  # of the logits that were judged
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
        failure, metrics = str(e), logit_metrics(out, expected)
    golden = store.selections(name)
    if not golden or not has_trace(engine):
        return Verdict(False, failure, metrics, 0)
    try:
        tr = engine.trace(ids, selections=forced_selections(store, name, dev))
    except ValueError as e:  # the engine refuses the golden's selections (another model's, or a form it has not)
        return Verdict(False, f"{what}: the engine refuses the golden's selections: {e}", metrics, 0)
    try:
        diff = selection_diff(tr.selections, golden, tie_margin=limits.tie_margin)
    except ValueError as e:
        return Verdict(False, f"{what}: the engine's recorded selections do not match the golden's: {e}", metrics, 0)
    if diff.real:
        layer, kind, pos = diff.first_real
        return Verdict(False, f"{failure}; {len(diff.real)} selections differ away from near-ties (first: "
                       f"layer {layer} {kind} at step {pos})", metrics, 0)
    if not diff.near_tie:
        return Verdict(False, failure, metrics, 0)
    n = len(diff.near_tie)
    forced = tr.logits[0].cpu()
    metrics = logit_metrics(forced, expected)
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


def _incremental_run(engine: Any, steps: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Two different prompts decoded together (a decode that mixes batch rows, e.g. writes one row's key into
    every row's cache, shows in the second row; the suite decodes at batch 1 nowhere else): the prompts, the
    generation, and the tokens a prefill must see to give the same logits."""
    ids = probe_ids(engine, repeat=2)[:, :INCREMENTAL_PROMPT]
    batch = torch.cat([ids, (ids + 1) % engine.config.vocab_size])  # the probe and another prompt of its length
    gen = engine.generate(batch, steps)
    return batch, gen, torch.cat([batch, gen.tokens], 1)[:, :-1]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def incremental_spread(engine: Any, steps: int = 40) -> float:
    """Max |logit difference| of greedy decode (prefill + one step per token) vs one prefill of the same tokens
    (`_incremental_run`), sparse picks left to each path."""
    batch, gen, seq = _incremental_run(engine, steps)
    return _max_abs(gen.logits, engine.forward(seq)[:, batch.shape[1] - 1:])


def takes_selections(engine: Any) -> bool:
    """Whether the engine has trace and its generate takes the Model API's optional `selections`."""
    try:
        params = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False
    return has_trace(engine) and "selections" in params


@dataclass(frozen=True)
class Incremental:
    diff: float  # max |logit difference| judged
    near_tie_flips: int  # > 0: judged with the prefill's selections forced on the decode
    message: str  # the failure, one line ("" when within the limit)


def judge_incremental(engine: Any, limit: float, tie_margin: float, steps: int = 40) -> Incremental:
    """Greedy decode against one prefill of the same tokens, with the near-tie rule of the module docstring:
    over the limit, the decode runs again with the prefill's selections forced; its own picks must differ
    from the prefill's only at near-ties (a decode path's kernels round differently from a prefill's: in
    bfloat16 a flip somewhere in 80 positions is the rule), and then its forced logits are judged."""
    batch, gen, seq = _incremental_run(engine, steps)
    T, S = batch.shape[1], seq.shape[1]
    diff = _max_abs(gen.logits, engine.forward(seq)[:, T - 1:])
    if diff <= limit:
        return Incremental(diff, 0, "")
    failure = f"incremental decode differs from prefill by {diff:.3e} (limit {limit:.1e})"
    if not takes_selections(engine):
        return Incremental(diff, 0, failure + " (the engine's generate takes no selections: a near-tie flip "
                                              "cannot be told from a bug)")
    tr = engine.trace(seq)
    forced = engine.generate(batch, steps, selections=tr.selections)
    sel = selection_diff(forced.selections, tr.selections, tie_margin=tie_margin)
    if sel.real:
        layer, kind, flat = sel.first_real
        row, pos = divmod(flat, S)
        return Incremental(diff, 0, f"{failure}; {len(sel.real)} decode picks differ from the prefill's away from "
                                    f"near-ties (first: layer {layer} {kind}, row {row} position {pos})")
    if not sel.near_tie:
        return Incremental(diff, 0, failure)
    n = len(sel.near_tie)
    diff = _max_abs(forced.logits, tr.logits[:, T - 1:])
    return Incremental(diff, n, "" if diff <= limit else
                       f"incremental decode with the prefill's selections forced ({n} near-tie flips) differs from "
                       f"prefill by {diff:.3e} (limit {limit:.1e})")
