"""Side CUDA streams for decode work that does not wait on the work beside it: the shared expert next to the
router and routed experts; a compressed layer's compressor, and its indexer on a second side stream, next to
its q projection; each block's mHC post and comb (Sinkhorn) on a third, beside the block. In a captured decode
graph the branches run in parallel, so small latency-bound kernels
overlap instead of queueing one after another (each costs ~2-5 us however few bytes it reads).

Safety rests on the fork/join discipline: `beside()` first makes the side stream wait for everything issued
so far on the current stream (or, `beside(after=mark)`, for everything issued before `mark()`: the current
stream's critical kernels issued in between are captured, and so dispatched, first; the caller must not free
between the mark and the fork anything the side stream could still read), `join()` makes the current stream
wait for the side stream, and every `beside()` is joined before the caller returns. A tensor of the main
branch that the side branch reads is kept alive until the join (`hold`, or by the caller's own references);
one the side branch allocates and the main branch reads is freed after the join, and the side stream's next
fork waits for the main stream's work (up to its mark): so the caching allocator never hands out memory a
branch may still read. Off CUDA (CPU, the interpreter) it is a no-op: the
same work runs inline in program order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

BRANCHES = 4  # the main branch (0) and the side branches a step uses (1, 2; 3 for mHC's post and comb)
_BRANCH = contextvars.ContextVar("cdna2_branch", default=0)  # the branch whose work is being issued now


class SideStream:
    """One side branch: a CUDA stream of its own (None off CUDA) and its branch number (1 .. BRANCHES - 1).
    The number, not the stream handle, keys per-branch scratch: torch.cuda.Stream() hands out streams from a
    small per-device pool, so a handle can come back as another branch's, or as the main branch's."""

    def __init__(self, device: torch.device | str, branch: int = 1):
        if not 0 < branch < BRANCHES:
            raise ValueError(f"side stream branch {branch}: use 1 .. {BRANCHES - 1}")
        device = torch.device(device)
        self.branch = branch
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.forked = False  # work issued beside since the last join (a join without one would, in a graph
        # capture, wait on work outside the capture: CUDA refuses that)
        self.held: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget an unjoined fork (an exception mid-step): the next step starts with nothing beside."""
        self.forked = False
        self.held.clear()

    def mark(self) -> torch.cuda.Event | None:
        """A point on the current stream that a later `beside(after=...)` can start from (None off CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    @contextlib.contextmanager
    def beside(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Issue the block's work on the side stream, after everything issued so far on the current one, or
        only after the `mark` `after`: the current stream's work issued since then (its critical path, issued
        first so its kernels are dispatched ahead of the side branch's) is not waited for."""
        if self.stream is None:
            yield
            return
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        else:
            self.stream.wait_event(after)
        self.forked = True
        token = _BRANCH.set(self.branch)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            _BRANCH.reset(token)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep tensors the side stream reads alive until the join: freed earlier, their memory could go to a
        new tensor of the current stream while the side stream still reads it."""
        if self.stream is not None:
            self.held.extend(tensors)

    def join(self) -> None:
        """The current stream waits for everything issued on the side stream (nothing to do if nothing was)."""
        if self.stream is not None and self.forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.forked = False
        self.held.clear()


def stream_key(device: torch.device) -> int:
    """Which branch work on `device` is issued to now: inside a SideStream's `beside()` its branch number,
    else 0 (the main branch, whatever stream carries it: eager, or a graph's capture stream); 0 off CUDA.
    Device scratch shared across launches (the split-sum counters, memoized per-step values) is kept per
    branch: branches may run at once."""
    return _BRANCH.get() if device.type == "cuda" else 0
