"""Kernel launches of one decode step, counted on the CPU (no GPU needed): every Triton kernel and every
torch compute op the step issues, with the model line that issued it. A CUDA-graph decode step costs
roughly 1.5-2 us per launch on the H200 however small the kernel, so this count is the glue budget.

    python bench/launches.py            # SMALL slice config, float32, triton backend (interpreter)
    python bench/launches.py --by-line  # grouped by the engine source line that issued them
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_slice import SMALL, random_packed  # noqa: E402

import cdna2_engine.ops.triton as tri  # noqa: E402
from cdna2_engine.config import Config  # noqa: E402
from cdna2_engine.model import Model  # noqa: E402
from cdna2_engine.ops import get_ops  # noqa: E402

# aten ops that move no data on a GPU (views, metadata, allocation without fill)
FREE = {"view", "_unsafe_view", "reshape", "expand", "split", "split_with_sizes", "slice", "select", "unsqueeze",
        "squeeze", "t", "transpose", "permute", "as_strided", "detach", "alias", "empty", "empty_like",
        "empty_strided", "unbind", "flatten", "unflatten", "lift_fresh", "_to_copy_noop", "is_same_size"}


def _caller() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/engine/" in fr.filename and "/ops/triton/" not in fr.filename:
            return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {fr.line.strip()[:70]}"
    return "?"


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if not self.inside and name not in FREE:
            if not (name == "_to_copy" and args[0].dtype == kwargs.get("dtype", args[0].dtype)):
                self.calls.append((f"aten.{name}", _caller()))
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--by-line", action="store_true")
    a = ap.parse_args()
    cfg = Config(**SMALL)
    weights, _, _ = random_packed(cfg, torch.device("cpu"))
    model = Model(cfg, weights, device=torch.device("cpu"), dtype=torch.float32, ops=get_ops("triton"))
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    cache = model.new_cache()
    tok = model.step(ids, cache)[:, -1:].argmax(-1)
    sc = model.static_cache(cache, 64)
    model.decode(tok, sc)  # warm: JIT, cached tables
    counter = Count()
    launch_call = tri._Launch.__call__

    def counted(self, name, grid, *args, **kw):
        counter.calls.append((name, _caller()))
        counter.inside += 1
        try:
            return launch_call(self, name, grid, *args, **kw)
        finally:
            counter.inside -= 1

    tri._Launch.__call__ = counted
    try:
        with counter:
            model.decode(tok, sc)
    finally:
        tri._Launch.__call__ = launch_call
    key = (lambda c: c[1]) if a.by_line else (lambda c: c[0])
    for k, n in collections.Counter(map(key, counter.calls)).most_common():
        print(f"{n:5d}  {k}")
    print(f"{len(counter.calls)} launches per decode step "
          f"({sum(c[0].startswith('aten.') for c in counter.calls)} torch ops)")


if __name__ == "__main__":
    main()
