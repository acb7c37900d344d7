"""One-token FP8 stream tiles at every FP8 weight shape of a V4-Flash decode step (the slice's 26 FP8 launches a
token come in these 7 shapes), each timed in a CUDA graph over weights rotated beyond the 60 MB L2, against the
copy bandwidth measured in the same run (FP8_STREAM_LONG off, so each tile runs as listed; `rows_launched` is
the row tile after the launch's narrowing). The MXFP4 probes (probe_mxfp4.py, runs 30-32) found that a one-token
stream reads faster the longer each row's contiguous run per step is (a loads-only skeleton: 0.55 of copy at 256 B
per row per step, 0.80 at a whole 2 KB row), so the FP8 tiles here go up to BLOCK_K = 1024 (a whole wq_b row).

The tensor-core form (fp8_mma_kernel, FP8_MMA) is off for the stream tiles; `--mma` times instead, per shape,
the engine's stream launch (FP8_STREAM with FP8_STREAM_LONG, FP8_MMA off) against the tensor-core kernel at each
K-split target (FP8_MMA["min_warps"]) and load form (NL, DEPTH).

    python bench/probe_fp8.py [--out DIR]      # on the GPU machine (~1 min)
    python bench/probe_fp8.py --mma            # stream vs tensor cores (~30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

# (name, K, output rows per group, groups) of the slice's FP8 weights (bench_slice.FLASH).
SHAPES = [("wq_a|wkv", 4096, 1024 + 512, 1), ("wq_b", 1024, 64 * 512, 1), ("wo_a", 4096, 1024, 8),
          ("wo_b", 8192, 4096, 1), ("shared w1|w3", 4096, 4096, 1), ("shared w2", 2048, 4096, 1),
          ("indexer wq_b", 1024, 64 * 128, 1)]
TILES = [(64, 256, 8, False), (64, 256, 8, True), (8, 1024, 4, False), (16, 1024, 8, False), (4, 1024, 2, False),
         (16, 512, 4, False), (8, 512, 2, False), (32, 512, 8, False), (8, 1024, 4, True), (16, 512, 4, True)]


def launched(bn: int, r: int, g: int) -> int:
    """The row tile the launch uses: _fp8_grouped halves BLOCK_N (down to 16) while the grid has fewer than
    MIN_PROGRAMS programs (run 35's "64 x 256" ran as 16 x 256 on every shape but wq_b)."""
    while bn > 16 and -(-r // bn) * g < B.tri.MIN_PROGRAMS:
        bn //= 2
    return bn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mma", action="store_true", help="the engine's stream launch vs the tensor-core kernel")
    a = ap.parse_args()
    tri = B.tri
    copy = B.copy_tbps()
    saved, saved_m, saved_long = dict(tri.FP8_STREAM), tri.FP8_STREAM_MAX_M, tri.FP8_STREAM_LONG["min_k"]
    saved_mma = dict(tri.FP8_MMA)
    tri.FP8_STREAM_MAX_M = 1
    if a.mma:  # (mma on?, min_warps, stream tile): the engine's stream launch, then the tensor-core splits
        forms = [(False, 0, None)] + [(True, mw, (nl, depth)) for nl, depth in ((2, 1), (2, 2), (4, 1), (4, 2))
                                      for mw in (1024, 2048, 4096)]
    else:
        tri.FP8_STREAM_LONG["min_k"] = 1 << 62  # each tile below as given (FP8_STREAM_LONG replaces it at K >= 2048)
        forms = [(False, 0, tile) for tile in TILES]
    runs = []
    for name, k, r, g in SHAPES:
        n = r * g
        copies = max(2, -(-240_000_000 // (n * k)))  # rotate over > 240 MB: four times the L2
        ws = [B.fp8_weight(n, k) for _ in range(copies)]
        xs = [torch.randn(1, g * k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = ws[0].nbytes() + g * k * 2 + n * 2
        want = B.ref.dequantize(ws[0], torch.float64)
        for mma, min_warps, tile in forms:
            tri.FP8_MMA.update(on=mma, min_warps=min_warps or saved_mma["min_warps"])
            if mma:
                tri.FP8_MMA.update(NL=tile[0], DEPTH=tile[1])
            elif tile:
                bn, bk, nw, pf = tile
                tri.FP8_STREAM.update(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, PREFETCH=pf)
            if g == 1:
                fn = tri.linear
                ref = (xs[0].double() @ want.T).flatten()
            else:
                fn = lambda x, w, g=g: tri.grouped_linear(x.view(1, g, -1), w, g)  # noqa: E731
                ref = torch.einsum("gk,grk->gr", xs[0].double().view(g, k), want.view(g, r, k)).flatten()
            y = fn(xs[0], ws[0]).double().flatten()
            err = ((y - ref).norm() / ref.norm()).item()
            y32 = tri._fp8_grouped(xs[0].view(1, g, k), ws[0], g, torch.float32).double().flatten()
            err32 = ((y32 - ref).norm() / ref.norm()).item()  # fp32 output: only the fp32 sums' rounding
            ms = B.time_graph_ms(fn, list(zip(xs, ws, strict=True)))
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            if mma:
                cfg = {"mma": True, "min_warps": min_warps, "NL": tile[0], "DEPTH": tile[1]}
            elif tile:
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "PREFETCH": pf,
                       "rows_launched": launched(bn, r, g)}
            else:
                cfg = {"stream": "engine"}
            runs.append({"shape": name, "cfg": cfg, "us": ms * 1e3, "frac": frac, "rel_err": err,
                         "rel_err_fp32_out": err32})
            print(f"{name:13s} {cfg}  {ms * 1e3:7.2f} us  {frac:.3f} of copy  err {err:.1e} (fp32 out {err32:.1e})",
                  flush=True)
    tri.FP8_STREAM.clear()
    tri.FP8_STREAM.update(saved)
    tri.FP8_STREAM_MAX_M = saved_m
    tri.FP8_STREAM_LONG["min_k"] = saved_long
    tri.FP8_MMA.update(saved_mma)
    with open(os.path.join(a.out, "probe_fp8_mma.json" if a.mma else "probe_fp8.json"), "w") as f:
        json.dump({"copy_TBps": copy, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
