"""Where did it go wrong: the first layer and sub-block whose hidden state drifts past its limit, and on
the triton backend the first kernel whose switch back to its reference removes the error.

Taps are compared in forward order (engine.model.tap_names): per layer the mHC pre-mix (attention input),
the attention output, the mHC post-mix, then the same for the MoE. The first tap over the limit names the
sub-block that introduced the error, since everything before it was still within limits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BLOCKS = {
    "attn_in": "hyper-connection (pre-attention mix)",
    "attn_out": "attention",
    "attn": "hyper-connection (post-attention mix)",
    "ffn_in": "hyper-connection (pre-MoE mix)",
    "ffn_out": "MoE",
    "ffn": "hyper-connection (post-MoE mix)",
}
_ORDER = {k: i for i, k in enumerate(BLOCKS)}


@dataclass(frozen=True)
class Drift:
    tap: str
    layer: int
    block: str
    rel: float
    limit: float

    def __str__(self) -> str:
        return (f"first drift at layer {self.layer} {self.block} (tap {self.tap}: rel. Frobenius error "
                f"{self.rel:.2e} > {self.limit:.1e})")


def tap_order(names) -> list[str]:
    """Tap names sorted in forward order; names that are not 'L.kind' are dropped."""
    parsed = [(int(m[1]), _ORDER[m[2]], n) for n in names if (m := re.fullmatch(r"(\d+)\.(\w+)", n))
              and m[2] in _ORDER]
    return [n for *_, n in sorted(parsed)]


def rel_fro(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


def first_drift(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], limit: float) -> Drift | None:
    """The earliest tap (forward order) whose relative Frobenius error exceeds `limit`, or None."""
    for name in tap_order(expected):
        if name not in actual:
            continue
        r = rel_fro(actual[name].reshape(expected[name].shape), expected[name])
        if r > limit:
            layer, kind = name.split(".")
            return Drift(name, int(layer), BLOCKS[kind], r, limit)
    return None


def taps_for(store, prompt: str) -> tuple[str, dict[str, torch.Tensor]]:
    """(prompt, taps): this prompt's taps, or the first prompt's that has them (goldens may record taps for
    a few prompts only, to stay small); ("", {}) when none has."""
    for name in [prompt] + [p.name for p in store.prompts if p.name != prompt]:
        taps = store.taps(name)
        if taps:
            return name, taps
    return "", {}


def locate(engine, input_ids: torch.Tensor, golden_taps: dict[str, torch.Tensor], limit: float,
           selections: dict | None = None) -> Drift | None:
    """Rerun `engine` (Model API with `trace`) on one prompt and name its first drifting tap."""
    names = tap_order(golden_taps)
    tr = engine.trace(input_ids, taps=names, selections=selections)
    return first_drift({k: v[0] for k, v in tr.taps.items()}, golden_taps, limit)


def kernel_culprit(model: Any, passes: Callable[[object], bool], op_names: tuple[str, ...] | None = None) -> str | None:
    """The first op whose switch back to the reference makes `passes(model)` true, on the bundled engine's
    triton backend (`Model.reference_ops`: the one model in memory). None when no single op explains it."""
    if op_names is None:
        from cdna2_engine.ops import OP_NAMES as op_names
    for op in op_names:
        with model.reference_ops([op]) as m:
            if passes(m):
                return op
    return None


def bisect_run(model_dir, goldens_dir, *, backend: str = "reference", dtype: str = "float32",
               device: str = "cpu", engine: str = "bundled", prompts: list[str] | None = None,
               tolerance: str | None = None) -> list[str]:
    """`cdna2 bisect`: judge every golden prompt as the token tier does (pytest_cdna2.judge), and for the
    first that fails name its first drifting tap (golden selections forced, so near-tie flips do not move
    the taps) and, on the bundled triton backend, the first op whose reference twin makes it pass."""
    from pytest_cdna2.engines import load_engine
    from pytest_cdna2.goldens import GoldenStore, model_identity
    from pytest_cdna2.judge import forced_selections, has_trace, judge_prompt
    from pytest_cdna2.tolerance import load_profile

    lim = load_profile(tolerance, dtype=dtype).token

    model = load_engine(engine, model_dir, device=device, backend=backend, dtype=dtype)
    sha, config = model_identity(model, model_dir)
    store = GoldenStore.open(goldens_dir, expected_model_sha256=sha, config=config)
    lines = []
    for name in [store.prompt(n).name for n in prompts] if prompts else [p.name for p in store.prompts]:
        verdict = judge_prompt(model, store, name, lim)
        lines.append(f"{name}: {'ok' if verdict.ok else 'FAIL ' + verdict.message}")
        if verdict.ok:
            continue
        tap_prompt, taps = taps_for(store, name)
        if not has_trace(model):
            lines.append("  no drift location: the engine has no trace(ids, taps=, selections=) (the README's Model "
                         "API)")
        elif taps:
            ids = store.input_ids(tap_prompt).unsqueeze(0).to(model.device)
            drift = locate(model, ids, taps, lim.tap_rtol_fro,
                           selections=forced_selections(store, tap_prompt, model.device))
            lines.append(f"  {drift or 'every tap within limits'} (taps of prompt {tap_prompt}, the golden's "
                         "selections forced)")
        if backend == "triton" and engine == "bundled":
            op = kernel_culprit(model, lambda m, name=name: judge_prompt(m, store, name, lim).ok)
            lines.append(f"  kernel: {op} (switching it back to the reference removes the failure)" if op else
                         "  kernel: no single op's reference twin removes the failure")
        break
    return lines
