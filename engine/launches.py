"""Count the kernel launches a call issues, on the CPU: every Triton kernel and every torch op that would
launch a kernel on a GPU (views and allocations do not), each with the engine line that issued it.

A CUDA-graph decode step costs about 1.5-2 us of GPU time per launch however small the kernel, so the
launch count of `Model.decode` is its glue budget (bench/launches.py prints it; a test holds it).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing on a GPU: views, metadata, allocation without a fill
FREE = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "split", "split_with_sizes", "slice", "select", "unsqueeze",
    "squeeze", "t", "transpose", "permute", "as_strided", "detach", "alias", "empty", "empty_like", "new_empty",
    "empty_strided", "unbind", "lift_fresh", "is_same_size", "_local_scalar_dense", "scalar_tensor",
})
# The engine's own files, by this package's folder as imported (installed, it is site-packages/cdna2_engine/,
# not engine/): a frame's filename is the path its module was imported from.
_ROOT = os.path.dirname(os.path.abspath(__file__)) + os.sep
_KERNELS = os.path.join(_ROOT, "ops", "triton") + os.sep  # the launching wrappers, not the line that asked
_SELF = os.path.abspath(__file__)


def issuing_line() -> str:
    """"file:line code" of the engine line (outside ops/triton) that issued the launch being made."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(fr.filename)
        if path.startswith(_ROOT) and not path.startswith(_KERNELS) and path != _SELF:
            return f"{os.path.basename(path)}:{fr.lineno} {(fr.line or '').strip()[:70]}"
    return "?"


class _TorchOps(TorchDispatchMode):
    def __init__(self, calls: list[tuple[str, str]]):
        super().__init__()
        self.calls, self.inside = calls, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        same_dtype = name == "_to_copy" and args[0].dtype == kwargs.get("dtype", args[0].dtype)
        if not self.inside and name not in FREE and not same_dtype:
            self.calls.append((f"aten.{name}", issuing_line()))
        return func(*args, **kwargs)


def count_launches(fn: Callable[[], object], run_kernels: bool = True) -> list[tuple[str, str]]:
    """(kernel or aten op, issuing engine line) for every launch `fn()` makes. With run_kernels=False the
    Triton kernels are only counted and their outputs are zeros: for branch-free code such as a decode step,
    in a fraction of the interpreter's time."""
    from .ops import triton as tri

    calls: list[tuple[str, str]] = []
    mode = _TorchOps(calls)
    launch = tri._Launch.__call__

    def counted(self, name, grid, *args, **kw):
        calls.append((name, issuing_line()))
        if run_kernels:
            mode.inside += 1
            try:
                launch(self, name, grid, *args, **kw)
            finally:
                mode.inside -= 1

    empty = tri._empty

    def zeros(*shape, dtype, device):  # not counted: it stands for the kernel that would fill it
        mode.inside += 1
        try:
            return empty(*shape, dtype=dtype, device=device).zero_()
        finally:
            mode.inside -= 1

    tri._Launch.__call__ = counted
    if not run_kernels:
        tri._empty = zeros  # kernel outputs read by torch glue (indices) must be in range
    try:
        with mode:
            fn()
    finally:
        tri._Launch.__call__, tri._empty = launch, empty
    return calls
