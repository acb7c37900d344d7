"""Ops interface: the V4 forward calls only these functions, so a backend is a module with the same names.

`reference` is plain torch (the engine's inner oracle); `triton` holds the kernels. `get_ops` builds the
table for a backend; `CDNA2_REFERENCE_OPS` (comma list, or the `reference_ops` argument) switches single
ops of the triton backend back to their reference so a failure can be narrowed to one kernel.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

OP_NAMES = (
    "linear",
    "grouped_linear",
    "rms_norm",
    "hc_pre",
    "hc_post",
    "hc_post_pre",
    "hc_weights",
    "hc_head",
    "compress_step",
    "rope",
    "norm_rope",
    "rope_cos_sin",
    "attention",
    "index_scores",
    "topk",
    "topk_mask",
    "route",
    "swiglu",
    "moe_experts",
)


@dataclass
class QWeight:
    """A linear weight as stored: `fp8` (e4m3 + UE8M0 128x128 scales), `mxfp4` (packed E2M1 + UE8M0 per 32
    along K) or `dense` (bf16/fp32, scale None). Packed weights stay packed; ops decode them on the fly."""

    data: torch.Tensor
    scale: torch.Tensor | None
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        """Logical [..., N, K] of the unpacked weight."""
        *lead, n, k = self.data.shape
        return (*lead, n, k * 2 if self.kind == "mxfp4" else k)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (
            0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        )

    def to(self, device: torch.device | str) -> QWeight:
        return QWeight(self.data.to(device), None if self.scale is None else self.scale.to(device), self.kind)


MIN_TRITON = (3, 5)  # the oldest Triton every kernel compiles with, for gfx90a and sm_90 (checked 2026-11-30 with
# tools/isa_versions.py: 3.5.1, 3.6.0, 3.9.0 clean; 3.4.0's own griddepcontrol helpers do not compile, 3.3.1's
# ahead-of-time compile refuses the kernels' None arguments, 3.2.0 cannot index a tuple by a static_range index)


def version_tuple(v: str) -> tuple[int, ...]:
    """'3.6.0+rocm' -> (3, 6, 0): the leading release numbers; (0,) when there are none ('unknown')."""
    m = re.match(r"\d+(?:\.\d+)*", v)
    return tuple(int(p) for p in m.group(0).split(".")) if m else (0,)


def triton_check(triton_version: str | None) -> None:
    """Refuse, in one line, a missing Triton (None) or one older than MIN_TRITON, before any kernel fails to
    compile with it."""
    need = ".".join(map(str, MIN_TRITON))
    if triton_version is None or version_tuple(triton_version) < MIN_TRITON:
        found = "which is not installed" if triton_version is None else \
            f"found {triton_version} (its kernels do not compile with it)"
        raise RuntimeError(f"the triton backend needs Triton >= {need}, {found}: pip install 'triton>={need}', or "
                           "use the reference backend")


def split_names(names: str | Iterable[str]) -> list[str]:
    """Names as a list, from a list or a comma list ("linear,rope"; one name alone): a str argument must not
    be taken apart into its characters."""
    if isinstance(names, str):
        return [s.strip() for s in names.split(",") if s.strip()]
    return list(names)


def get_ops(backend: str = "reference", reference_ops: str | Iterable[str] | None = None) -> SimpleNamespace:
    """The op table for `backend`, with `reference_ops` (or env CDNA2_REFERENCE_OPS) taken from reference."""
    from . import reference

    source = "reference_ops"
    if reference_ops is None:
        reference_ops, source = os.environ.get("CDNA2_REFERENCE_OPS", ""), "env CDNA2_REFERENCE_OPS"
    reference_ops = split_names(reference_ops)
    unknown = sorted(set(reference_ops) - set(OP_NAMES))
    if unknown:  # checked for either backend: a typo should not pass silently where it does nothing
        raise ValueError(f"unknown op(s) {unknown} in {source}: choose from {list(OP_NAMES)}")
    if backend == "reference":
        return SimpleNamespace(**{n: getattr(reference, n) for n in OP_NAMES}, backend="reference",
                               reference_ops=tuple(OP_NAMES))
    if backend != "triton":
        raise ValueError(f"unknown backend {backend!r}: use 'reference' or 'triton'")
    try:
        import triton
    except ImportError:
        triton = None
    triton_check(getattr(triton, "__version__", None))
    from . import triton as tri

    table = {n: getattr(reference if n in reference_ops else tri, n, getattr(reference, n)) for n in OP_NAMES}
    return SimpleNamespace(**table, backend="triton", reference_ops=tuple(sorted(reference_ops)))
