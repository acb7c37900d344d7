"""What does the RMSNorm fused into a one-token FP8 stream cost (q's norm before wq_b, the indexer's wq_b)?

In the slice, wq_b with its fused q norm took 13.0-14.1 us a step (run 229's profile) against 10.5 us for wq_b
alone (bench_kernels). Timed in CUDA graphs over 8 weight sets (beyond the 60 MB L2), rounds interleaved:
  plain     linear(x, W)
  norm      linear(x, W, x_norm) as launched (FP8_STREAM["NORM_MAXNREG"]: registers capped on CUDA)
  uncapped  the same without the cap
  apart     rms_norm(x) then linear (two launches)
  uncapped16 / uncapped8w  16-row tiles / 8 warps a program, uncapped (other ways to fit the SMs)
Each variant is checked against the float64 reference before its time counts, and its new compiled kernels are
listed with their registers and spills (the finding: the norm's prologue took wq_b from 63 to 67 registers, 7
programs of 4 warps an SM instead of 8, so its 1024 programs no longer fit one wave).

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


def compiled(fn: object) -> dict:
    """{cache key: compiled kernel} of a JIT function, over Triton 3.6-3.9's cache layouts."""
    out = {}
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        out.update(cache)
    return out


def probe_shape(name: str, k: int, r: int, rounds: int, copy: float) -> dict:
    """One shape's variants: checked against float64, then timed in interleaved rounds."""
    tri, ref = B.tri, B.ref
    ws = [B.fp8_weight(r, k) for _ in range(SETS)]
    xs = [torch.randn(1, k, device="cuda", generator=B.GEN).to(torch.bfloat16) * 3 for _ in range(SETS)]
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=B.GEN)).to(torch.bfloat16)
    nbytes = ws[0].data.numel() + ws[0].scale.numel() + 2 * k

    def normed(i: int, **launch: object) -> torch.Tensor:
        saved = dict(tri.FP8_STREAM)
        tri.FP8_STREAM.update(launch)
        try:
            return tri.linear(xs[i], ws[i], x_norm=(nw, 1e-6))
        finally:
            tri.FP8_STREAM.update(saved)

    variants = {"plain": lambda i: tri.linear(xs[i], ws[i]), "norm": normed,
                "uncapped": lambda i: normed(i, NORM_MAXNREG=None),
                "apart": lambda i: tri.linear(tri.rms_norm(xs[i], nw, 1e-6), ws[i]),
                "uncapped16": lambda i: normed(i, NORM_MAXNREG=None, BLOCK_N=16),
                "uncapped8w": lambda i: normed(i, NORM_MAXNREG=None, num_warps=8)}
    row = {"shape": name, "K": k, "rows": r, "bytes": nbytes}
    kernel = tri._compiled.fp8_stream_kernel
    for v, fn in variants.items():
        want = ref.linear(xs[0].double(), ws[0], x_norm=None if v == "plain" else (nw.double(), 1e-6))
        before = set(compiled(kernel))
        row[v + "_rel"] = B.rel(fn(0), want)
        row[v + "_kernels"] = [f"regs {getattr(kk, 'n_regs', '?')} spills {getattr(kk, 'n_spills', '?')}"
                               for key, kk in compiled(kernel).items() if key not in before]
        if not row[v + "_rel"] <= 1e-2:
            raise SystemExit(f"{name} {v}: rel {row[v + '_rel']:.2e} against float64 (bf16 tolerance 1e-2)")
    row["capped_equals_uncapped"] = bool(torch.equal(normed(0), normed(0, NORM_MAXNREG=None)))
    for _ in range(rounds):
        for v, fn in variants.items():
            row.setdefault(v + "_us", []).append(B.time_graph_ms(fn, [(i,) for i in range(SETS)]) * 1e3)
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
        print(json.dumps({kk: ([round(x, 2) if isinstance(x, float) else x for x in vv] if isinstance(vv, list) else
                               round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in row.items()}), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_fp8_norm.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
