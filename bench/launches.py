"""Kernel launches of one decode step, counted on the CPU (no GPU needed; cdna2_engine.launches): every
Triton kernel and every torch op the step issues. A CUDA-graph decode step costs about 1.5-2 us of GPU
time per launch on the H200 however small the kernel, so this count is the glue budget.

    python bench/launches.py            # SMALL slice config (4 layers: sliding, CSA, HCA, CSA), float32
    python bench/launches.py --by-line  # grouped by the engine source line that issued them
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_slice import SMALL, random_packed  # noqa: E402

from cdna2_engine.config import Config  # noqa: E402
from cdna2_engine.launches import count_launches  # noqa: E402
from cdna2_engine.model import Model  # noqa: E402
from cdna2_engine.ops import get_ops  # noqa: E402


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
    model.decode(tok, sc)  # warm: cached tables
    calls = count_launches(lambda: model.decode(tok, sc))
    for k, n in collections.Counter(c[1] if a.by_line else c[0] for c in calls).most_common():
        print(f"{n:5d}  {k}")
    print(f"{len(calls)} launches per decode step ({sum(c[0].startswith('aten.') for c in calls)} torch ops)")


if __name__ == "__main__":
    main()
