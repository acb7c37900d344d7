"""What does the RMSNorm fused into a one-token FP8 stream cost (q's norm before wq_b, the indexer's wq_b)?

In the slice, wq_b with its fused q norm took 13.0-14.1 us a step (run 229's profile) against 10.5 us for wq_b
alone (bench_kernels). Each program reads the whole x row for its inverse RMS before the stream's first loads.
Timed in CUDA graphs over 8 weight sets (beyond the 60 MB L2), rounds interleaved:
  plain   linear(x, W)
  early   linear(x, W, x_norm) with FP8_STREAM["NORM_EARLY"] (the first tile's loads go out beside x's)
  late    the same, NORM_EARLY off (the norm's sum first, then the stream)
  apart   rms_norm(x) then linear (two launches)
Every variant is checked against the float64 reference before its time counts.

    python bench/probe_fp8_norm.py [--out DIR]      # on the GPU machine (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

# (name, K, rows) of the slice's normed FP8 streams (bench_slice.FLASH)
SHAPES = [("wq_b", 1024, 64 * 512), ("indexer wq_b", 1024, 64 * 128)]
SETS = 8


def probe_shape(name: str, k: int, r: int, rounds: int, copy: float) -> dict:
    """One shape's variants: checked against float64, then timed in interleaved rounds."""
    tri, ref = B.tri, B.ref
    ws = [B.fp8_weight(r, k) for _ in range(SETS)]
    xs = [torch.randn(1, k, device="cuda", generator=B.GEN).to(torch.bfloat16) * 3 for _ in range(SETS)]
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=B.GEN)).to(torch.bfloat16)
    nbytes = ws[0].data.numel() + ws[0].scale.numel() + 2 * k

    def early(i: int, on: bool = True) -> torch.Tensor:
        tri.FP8_STREAM["NORM_EARLY"] = on
        return tri.linear(xs[i], ws[i], x_norm=(nw, 1e-6))

    variants = {"plain": lambda i: tri.linear(xs[i], ws[i]), "early": early,
                "late": lambda i: early(i, False),
                "apart": lambda i: tri.linear(tri.rms_norm(xs[i], nw, 1e-6), ws[i])}
    row = {"shape": name, "K": k, "rows": r, "bytes": nbytes}
    for v, fn in variants.items():
        want = ref.linear(xs[0].double(), ws[0], x_norm=None if v == "plain" else (nw.double(), 1e-6))
        row[v + "_rel"] = B.rel(fn(0), want)
        if not row[v + "_rel"] <= 1e-2:
            raise SystemExit(f"{name} {v}: rel {row[v + '_rel']:.2e} against float64 (bf16 tolerance 1e-2)")
    row["early_equals_late"] = bool(torch.equal(early(0), early(0, False)))
    for _ in range(rounds):
        for v, fn in variants.items():
            row.setdefault(v + "_us", []).append(B.time_graph_ms(fn, [(i,) for i in range(SETS)]) * 1e3)
    tri.FP8_STREAM["NORM_EARLY"] = True
    for v in variants:
        us = min(row[v + "_us"])
        row[v + "_best_us"], row[v + "_frac"] = us, nbytes / us / 1e6 / copy
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    copy = B.copy_tbps()
    res = {"copy_TBps": copy, "shapes": []}
    for name, k, r in SHAPES:
        row = probe_shape(name, k, r, a.rounds, copy)
        res["shapes"].append(row)
        print(json.dumps({kk: ([round(x, 2) for x in vv] if isinstance(vv, list) else
                               round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in row.items()}), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_fp8_norm.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
