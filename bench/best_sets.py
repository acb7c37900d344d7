"""The best one-token stream configs of a `bench_kernels.py --stream-sweep` run as bench_slice `--set` options:

    python bench/bench_slice.py $(python bench/best_sets.py bench/results/stream_sweep.json)
"""

from __future__ import annotations

import json
import sys

KEYS = {"MOE_STREAM": ("mxfp4 gate_up+down M=1", ("BLOCK_N", "GROUPS", "num_warps", "PREFETCH", "PRMT")),
        "FP8_STREAM": ("fp8 wq_b M=1", ("BLOCK_N", "BLOCK_K", "num_warps", "PREFETCH", "UNROLL"))}


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/best_sets.py RESULTS.json (a bench_kernels.py --stream-sweep run's)")
    table = json.load(open(sys.argv[1]))["stream_sweep"]
    out = []
    for name, (kind, keys) in KEYS.items():
        best = max((r for r in table if r["kernel"] == kind), key=lambda r: r["frac"])["cfg"]
        out += [f"--set {name}.{k}={best[k]!r}" for k in keys if k in best]
    print(" ".join(out))


if __name__ == "__main__":
    main()
