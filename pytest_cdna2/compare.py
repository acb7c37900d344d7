"""Metrics and assertions for tensors and logits, usable from any test (not only this suite's).

Metrics are plain functions returning frozen dataclasses, computed in float64 so the comparison adds no
rounding of its own; the ``assert_*`` functions raise an ``AssertionError`` whose single line says what was
compared (prompt, step, layer: the caller's ``what``), which metric failed, its value and its limit.

    from pytest_cdna2.compare import assert_tensors_close, assert_logits_close
    assert_tensors_close(out, ref, rtol_fro=1e-5, what="fp8 linear 3x4096x512")
    assert_logits_close(logits, golden, limits={"kl_max": 1e-3, "top1_min": 1.0}, what="prompt p03")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TensorMetrics",
    "LogitMetrics",
    "tensor_metrics",
    "logit_metrics",
    "assert_tensors_close",
    "assert_logits_close",
    "token_divergence",
    "SelectionDiff",
    "selection_diff",
    "flip_width",
    "LOGIT_LIMIT_KEYS",
]

# The limit names assert_logits_close understands (the [token] section of a tolerance profile).
LOGIT_LIMIT_KEYS = ("kl_max", "cosine_min", "max_abs", "top1_min", "topk")


def _f64(t: Any) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t.detach().to(device="cpu", dtype=torch.float64)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


def _nonfinite_mismatch(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Positions where a non-finite value appears in one tensor and not identically in the other."""
    fa, fe = torch.isfinite(a), torch.isfinite(e)
    same_special = (~fa & ~fe) & ((a == e) | (torch.isnan(a) & torch.isnan(e)))
    return (~fa | ~fe) & ~same_special


@dataclass(frozen=True)
class TensorMetrics:
    """How far ``actual`` is from ``expected``; the error metrics cover positions finite in both."""

    shape: tuple[int, ...]
    rel_fro: float  # ||a - e||_F / ||e||_F
    max_abs: float  # max |a - e|
    max_abs_index: tuple[int, ...] | None
    cosine: float  # <a, e> / (|a| |e|)
    mismatches: int  # elements with |a - e| > mismatch_tol
    mismatch_tol: float  # rtol_fro * rms(e): the per-element error that alone would reach rtol_fro
    nonfinite: int  # positions where NaN/Inf differ between the two
    nonfinite_index: tuple[int, ...] | None


def tensor_metrics(actual: Any, expected: Any, *, rtol_fro: float | None = None) -> TensorMetrics:
    """Relative Frobenius error, max-abs with its index, cosine, mismatch and NaN counts, in float64.

    ``mismatches`` counts elements whose error exceeds ``rtol_fro`` times the RMS of ``expected`` (if every
    element erred by that much the relative Frobenius error would equal ``rtol_fro``); without ``rtol_fro``
    it counts elements that differ at all.
    """
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: actual {tuple(a.shape)} vs expected {tuple(e.shape)}")
    shape = tuple(a.shape)
    bad = _nonfinite_mismatch(a, e)
    nonfinite = int(bad.sum())
    nonfinite_index = _unravel(int(bad.flatten().nonzero()[0]), shape) if nonfinite else None
    ok = torch.isfinite(a) & torch.isfinite(e)
    a, e = torch.where(ok, a, 0.0), torch.where(ok, e, 0.0)
    diff = a - e
    dn, en, an = diff.norm().item(), e.norm().item(), a.norm().item()
    rel = (0.0 if dn == 0 else float("inf")) if en == 0 else dn / en
    if an == 0 and en == 0:
        cos = 1.0
    elif an == 0 or en == 0:
        cos = 0.0
    else:
        cos = (a.flatten() @ e.flatten()).item() / (an * en)
    absd = diff.abs().flatten()
    if absd.numel():
        i = int(absd.argmax())
        max_abs, max_index = absd[i].item(), _unravel(i, shape)
    else:
        max_abs, max_index = 0.0, None
    n_ok = int(ok.sum())
    tol = (rtol_fro * en / n_ok**0.5) if (rtol_fro is not None and n_ok) else 0.0
    mismatches = int((absd > tol).sum())
    return TensorMetrics(shape, rel, max_abs, max_index, cos, mismatches, tol, nonfinite, nonfinite_index)


def assert_tensors_close(actual: Any, expected: Any, *, rtol_fro: float, what: str = "") -> TensorMetrics:
    """Fail unless shapes match, NaN/Inf agree and the relative Frobenius error is <= ``rtol_fro``."""
    p = _prefix(what)
    sa, se = tuple(torch.as_tensor(actual).shape), tuple(torch.as_tensor(expected).shape)
    if sa != se:
        raise AssertionError(f"{p}shape {sa} != expected {se}")
    m = tensor_metrics(actual, expected, rtol_fro=rtol_fro)
    if m.nonfinite:
        raise AssertionError(
            f"{p}nonfinite: {m.nonfinite} NaN/Inf value(s) not in expected, first at index "
            f"{m.nonfinite_index} (limit 0)"
        )
    if not m.rel_fro <= rtol_fro:
        raise AssertionError(
            f"{p}rel_fro {m.rel_fro:.3e} > limit {rtol_fro:.3e} (max_abs {m.max_abs:.3e} at index "
            f"{m.max_abs_index}, cosine {m.cosine:.9f}, {m.mismatches}/{_numel(m.shape)} elements beyond "
            f"{m.mismatch_tol:.3e})"
        )
    return m


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class LogitMetrics:
    """Per-position comparison of logits ``[B, T, V]`` (a ``[T, V]`` input counts as B = 1).

    Positions are ``(batch, step)``. ``kl`` is KL(expected || actual) in nats, ``first_divergence`` the
    earliest step whose argmax differs (None when all agree) and ``topk_rank`` the rank of the expected
    argmax in the actual's logits there (0 = the top; vLLM's check is ``topk_rank < k``).
    """

    positions: int
    kl: torch.Tensor  # [B, T] float64
    kl_max: float
    kl_max_at: tuple[int, int]
    kl_mean: float
    cosine_min: float
    cosine_min_at: tuple[int, int]
    max_abs: float
    max_abs_at: tuple[int, int, int]
    top1_agreement: float
    first_divergence: tuple[int, int] | None
    topk_rank: int | None
    nonfinite: int
    nonfinite_at: tuple[int, int, int] | None


def _as_3d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"{name} logits must be [T, V] or [B, T, V], got shape {tuple(t.shape)}")
    return t


LOGIT_ROWS = 64  # positions a chunk: at V4-Flash's 129,280-entry vocabulary a float64 row is ~1 MB. 256 float32
# positions there: 0.75 GB above the inputs in 4.4 s, where the whole [T, V] at once took 2.84 GB in 8.0 s (this
# 2-core CPU, 2026-12-05)


def _row_metrics(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of [N, V] float64 logits: KL(e || a), cosine, max |a - e| (inf where a non-finite value is
    not matched) and its column, the non-finite mismatch mask, argmax of each."""
    bad = _nonfinite_mismatch(a, e)
    lp_e, lp_a = torch.log_softmax(e, -1), torch.log_softmax(a, -1)
    p_e = lp_e.exp()
    terms = torch.where(p_e > 0, p_e * (lp_e - lp_a), torch.zeros_like(p_e))
    kl = terms.sum(-1).clamp_min(0.0)  # tiny negative sums are rounding
    kl = torch.where(torch.isnan(kl), torch.full_like(kl, float("inf")), kl)
    fa, fe = a.nan_to_num(0.0, 0.0, 0.0), e.nan_to_num(0.0, 0.0, 0.0)
    na, ne = fa.norm(dim=-1), fe.norm(dim=-1)
    cos = (fa * fe).sum(-1) / (na * ne).clamp_min(torch.finfo(torch.float64).tiny)
    cos = torch.where((na == 0) & (ne == 0), torch.ones_like(cos), cos)
    absd = torch.where(bad, torch.full_like(a, float("inf")), (a - e).abs().nan_to_num(0.0))
    return kl, cos, *absd.max(-1), bad, a.argmax(-1), e.argmax(-1)


def logit_metrics(actual: Any, expected: Any) -> LogitMetrics:
    """KL, cosine, max-abs, top-1 agreement and first divergence of two logit tensors, in float64 (a chunk of
    LOGIT_ROWS positions at a time: a vocabulary of V4-Flash's size held whole in float64 takes gigabytes)."""
    a, e = (_as_3d(torch.as_tensor(t).detach().cpu(), n) for t, n in ((actual, "actual"), (expected, "expected")))
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: actual {tuple(a.shape)} vs expected {tuple(e.shape)}")
    B, T, V = a.shape
    if B * T == 0 or V == 0:
        raise ValueError(f"empty logits: shape {tuple(a.shape)}")
    a2, e2 = a.reshape(B * T, V), e.reshape(B * T, V)
    parts = [_row_metrics(a2[s:s + LOGIT_ROWS].double(), e2[s:s + LOGIT_ROWS].double())
             for s in range(0, B * T, LOGIT_ROWS)]
    kl, cos, absmax, abscol = (torch.cat([p[i] for p in parts]) for i in range(4))
    bad_rows = [p[4] for p in parts]
    top_a, top_e = (torch.cat([p[i] for p in parts]).view(B, T) for i in (5, 6))  # ties -> lowest index in both
    nonfinite = sum(int(b.sum()) for b in bad_rows)
    nonfinite_at = None
    if nonfinite:
        s, b = next((i * LOGIT_ROWS, b) for i, b in enumerate(bad_rows) if bool(b.any()))
        nonfinite_at = _unravel(s * V + int(b.flatten().nonzero()[0]), (B, T, V))
    kl = kl.view(B, T)
    ki, ci, mr = int(kl.flatten().argmax()), int(cos.argmin()), int(absmax.argmax())
    cos = cos.view(B, T)
    mi = mr * V + int(abscol[mr])  # the first largest row, its first largest column: the flat argmax
    agree = top_a == top_e
    first, rank = None, None
    if not bool(agree.all()):
        steps = [int((~agree[b]).nonzero()[0]) if not bool(agree[b].all()) else T for b in range(B)]
        t0 = min(steps)
        b0 = steps.index(t0)
        first = (b0, t0)
        ranks = []
        for b, t in enumerate(steps):
            if t < T:
                row = a[b, t].double()
                ranks.append(int((row > row[top_e[b, t]]).sum()))
        rank = max(ranks)
    return LogitMetrics(
        positions=B * T,
        kl=kl,
        kl_max=kl.flatten()[ki].item(),
        kl_max_at=_unravel(ki, (B, T)),
        kl_mean=kl.mean().item(),
        cosine_min=cos.flatten()[ci].item(),
        cosine_min_at=_unravel(ci, (B, T)),
        max_abs=absmax[mr].item(),
        max_abs_at=_unravel(mi, (B, T, V)),
        top1_agreement=agree.double().mean().item(),
        first_divergence=first,
        topk_rank=rank,
        nonfinite=nonfinite,
        nonfinite_at=nonfinite_at,
    )


def _limits_dict(limits: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(limits) and not isinstance(limits, type):
        limits = dataclasses.asdict(limits)
    if not isinstance(limits, Mapping):
        raise TypeError(f"limits must be a mapping or a limits dataclass, got {type(limits).__name__}")
    return {k: v for k, v in limits.items() if k in LOGIT_LIMIT_KEYS and v is not None}


def _pos(at: tuple[int, ...], batched: bool) -> str:
    return f"batch {at[0]} step {at[1]}" if batched else f"step {at[1]}"


def assert_logits_close(actual: Any, expected: Any, *, limits: Any, what: str = "") -> LogitMetrics:
    """Fail when any metric named in ``limits`` is beyond its limit; a missing key is not checked.

    ``limits`` is a mapping or a :class:`~pytest_cdna2.tolerance.TokenLimits`: ``kl_max``, ``cosine_min``,
    ``max_abs``, ``top1_min`` (fraction of positions whose argmax agrees) and ``topk`` (at the first
    divergence the expected argmax must be within the actual's top-k). NaN/Inf in only one tensor always
    fails. All failures go on one line, each naming the step.
    """
    lim = _limits_dict(limits)
    a = torch.as_tensor(actual)
    if tuple(a.shape) != tuple(torch.as_tensor(expected).shape):
        raise AssertionError(
            f"{_prefix(what)}shape {tuple(a.shape)} != expected {tuple(torch.as_tensor(expected).shape)}"
        )
    m = logit_metrics(actual, expected)
    batched = a.dim() == 3
    fails = []
    if m.nonfinite:
        fails.append(f"nonfinite {m.nonfinite} at {_pos(m.nonfinite_at, batched)} (limit 0)")
    if "kl_max" in lim and not m.kl_max <= lim["kl_max"]:
        fails.append(f"{_pos(m.kl_max_at, batched)}: kl {m.kl_max:.3e} > limit {lim['kl_max']:.3e}")
    if "cosine_min" in lim and not m.cosine_min >= lim["cosine_min"]:
        fails.append(
            f"{_pos(m.cosine_min_at, batched)}: cosine {m.cosine_min:.9f} < limit {lim['cosine_min']}"
        )
    if "max_abs" in lim and not m.max_abs <= lim["max_abs"]:
        fails.append(
            f"{_pos(m.max_abs_at, batched)}: max_abs {m.max_abs:.3e} at token {m.max_abs_at[2]} "
            f"> limit {lim['max_abs']:.3e}"
        )
    if "top1_min" in lim and not m.top1_agreement >= lim["top1_min"]:
        fails.append(
            f"top1 {m.top1_agreement:.4f} < limit {lim['top1_min']} (first divergence at "
            f"{_pos(m.first_divergence, batched)})"
        )
    if "topk" in lim and m.topk_rank is not None and not m.topk_rank < lim["topk"]:
        fails.append(
            f"{_pos(m.first_divergence, batched)}: topk containment: expected token is rank "
            f"{m.topk_rank} in actual, limit top-{lim['topk']}"
        )
    if fails:
        raise AssertionError(_prefix(what) + "; ".join(fails))
    return m


def token_divergence(actual_tokens: Any, expected_tokens: Any) -> int | None:
    """The first index where two 1-D token sequences differ (or where the shorter ends), None if equal."""
    a = torch.as_tensor(actual_tokens).flatten().tolist()
    e = torch.as_tensor(expected_tokens).flatten().tolist()
    for i, (x, y) in enumerate(zip(a, e, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(e) else min(len(a), len(e))


@dataclass(frozen=True)
class SelectionDiff:
    """Where sparse top-k selections differ, as ``(layer, kind, position)``, split by the golden's margin.

    A flip within the golden's near-tie band (see :func:`selection_diff`) is rounding (judge that step again
    with the golden's selections forced in); any other flip is a real difference.
    """

    near_tie: tuple[tuple[int, str, int], ...]
    real: tuple[tuple[int, str, int], ...]
    compared: int  # positions compared over all (layer, kind)

    @property
    def first_real(self) -> tuple[int, str, int] | None:
        """The real flip at the earliest position (then lowest layer): where to start looking."""
        return min(self.real, key=lambda f: (f[2], f[0], f[1])) if self.real else None


def _rows(t: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(t).detach().cpu()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"{name} indices must be [T, k] or [B, T, k], got shape {tuple(t.shape)}")
    return t.long().sort(-1).values  # a selection is a set: order within the top-k does not matter


def _flat(t: Any, rows: int, key: Any, part: str, cols: bool) -> torch.Tensor:
    """A selection's per-position part as [rows] (margin) or [rows, r] (ranked, scores); a shape that does not
    cover every position is an error naming it (not an IndexError, nor entries read from the wrong position)."""
    t = torch.as_tensor(t).detach().cpu()
    if cols and t.dim() >= 2 and math.prod(t.shape[:-1]) == rows:
        return t.reshape(rows, t.shape[-1])
    if not cols and t.numel() == rows:
        return t.flatten()
    raise ValueError(f"selection {key}: {part} of shape {tuple(t.shape)} does not give one "
                     f"{'row' if cols else 'value'} per position ({rows})")


def flip_width(actual: list[int], expected: list[int], ranked: list[int], scores: list[float]) -> float:
    """The smallest tie margin whose near-tie band holds picks `actual` in place of `expected`: the best ranked
    score left out minus the worst picked (a top-k of `scores` moved by less than half of it each). inf when the
    picks are not all ranked, not as many, or repeated (-1 is "none", any other negative id a bug): no rounding
    explains them. Only entries at the k-th/(k+1)-th boundary trade places within a small width; evicting a
    clear winner needs a wide one."""
    picks, want = [i for i in actual if i >= 0], [i for i in expected if i >= 0]
    chosen = set(picks)
    known = {i: s for i, s in zip(ranked, scores, strict=True) if i >= 0}
    if (len(picks) != len(want) or len(chosen) != len(picks) or min(actual, default=0) < -1
            or not chosen <= known.keys()):  # a pick repeated, an odd id, a pick short or unranked
        return math.inf
    left_out = [s for i, s in known.items() if i not in chosen]
    return max(left_out, default=-math.inf) - min((known[i] for i in chosen), default=math.inf)


def selection_diff(actual: Mapping[Any, Any], expected: Mapping[Any, Any], *,
                   tie_margin: float | Mapping[str, float]) -> SelectionDiff:
    """Compare ``{(layer, kind): selection}`` maps (``.indices`` [T, k] or [B, T, k]; expected also ``.margin``
    [T] or [B, T]; a position is then b * T + t). Where expected also has ``.ranked`` and ``.scores``
    ([.., r]: its best entries and their selection scores), a flip is a near-tie only if the actual picks are a
    top-k of those scores moved by less than tie_margin / 2 each (three-way ties included, a wrong pick or an
    evicted clear winner not); without them, if the expected margin is below tie_margin. `tie_margin`: one for
    every kind, or {kind: margin} ("router", "indexer").

    Keys only in one map are an error: the engines disagree about which layers select at all.
    """
    if set(actual) != set(expected):
        raise ValueError(f"selection keys differ: actual only {sorted(set(actual) - set(expected))}, "
                         f"expected only {sorted(set(expected) - set(actual))}")
    near, real, compared = [], [], 0
    for key in sorted(expected):
        if isinstance(tie_margin, Mapping) and key[1] not in tie_margin:
            raise ValueError(f"selection {key}: no tie margin for kind {key[1]!r} (have {sorted(tie_margin)})")
        tie_at = tie_margin[key[1]] if isinstance(tie_margin, Mapping) else tie_margin
        a, e = _rows(actual[key].indices, "actual"), _rows(expected[key].indices, "expected")
        if a.shape != e.shape:
            raise ValueError(f"selection {key}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
        rows = e[..., 0].numel()  # flat: row b's position t is b * T + t
        margin = expected[key].margin
        margin = torch.full((rows,), math.inf) if margin is None else _flat(margin, rows, key, "margin", False)
        ranked, scores = getattr(expected[key], "ranked", None), getattr(expected[key], "scores", None)
        band = ranked is not None and scores is not None
        if band:
            ranked = _flat(ranked, rows, key, "ranked", True).long()
            scores = _flat(scores, rows, key, "scores", True).double()
            if ranked.shape != scores.shape or ranked.shape[1] < e.shape[-1]:
                raise ValueError(f"selection {key}: ranked {tuple(ranked.shape)} and scores {tuple(scores.shape)}: "
                                 f"expected the same shape, at least the {e.shape[-1]} picks wide")
        compared += rows
        a2, e2 = a.reshape(rows, -1), e.reshape(rows, -1)
        for t in (a != e).any(-1).flatten().nonzero().flatten().tolist():
            if band:
                tie = flip_width(a2[t].tolist(), e2[t].tolist(), ranked[t].tolist(), scores[t].tolist()) < tie_at
            else:
                tie = float(margin[t]) < tie_at
            (near if tie else real).append((key[0], key[1], t))
    return SelectionDiff(tuple(near), tuple(real), compared)
