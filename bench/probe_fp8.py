"""One-token FP8 stream tiles at every FP8 weight shape of a V4-Flash decode step (the slice's 26 FP8 launches a
token come in these 7 shapes), each timed in a CUDA graph over weights rotated beyond the 60 MB L2, against the
copy bandwidth measured in the same run (FP8_STREAM_LONG off, so each tile runs as listed; `rows_launched` is
the row tile after the launch's narrowing). The MXFP4 probes (probe_mxfp4.py, runs 30-32) found that a one-token
stream reads faster the longer each row's contiguous run per step is (a loads-only skeleton: 0.55 of copy at 256 B
per row per step, 0.80 at a whole 2 KB row), so the FP8 tiles here go up to BLOCK_K = 1024 (a whole wq_b row).

    python bench/probe_fp8.py [--out DIR]      # on the GPU machine (~1 min)
    python bench/probe_fp8.py --shapes wq_b,wo_a --tiles 64,256,8,0,16,2 8,1024,4,0,16,1   # chosen shapes and tiles
    python bench/probe_fp8.py --shapes "wo_a,wo_a flat,wq_b,wq_b grouped"  # CONTROLS too: grouping or row length
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
# Same bytes, other grouping (only by --shapes): does wo_a lose to wq_b by its 8 groups or by its 4 KB rows?
CONTROLS = [("wo_a flat", 4096, 8 * 1024, 1), ("wq_b grouped", 1024, 64 * 512 // 8, 8)]
# (BLOCK_N, BLOCK_K, warps, PREFETCH, LOCAL[, UNROLL]): LOCAL > 1 sums each LOCAL adjacent products in the thread
# each step
TILES = [(64, 256, 8, False, 1), (64, 256, 8, True, 1), (8, 1024, 4, False, 1), (16, 1024, 8, False, 1),
         (4, 1024, 2, False, 1), (16, 512, 4, False, 1), (8, 512, 2, False, 1), (32, 512, 8, False, 1),
         (8, 1024, 4, True, 1), (16, 512, 4, True, 1)]
TILES += [(bn, bk, nw, False, 16) for bn, bk, nw, pf, _ in TILES if not pf] + [(64, 256, 8, False, 4),
                                                                            (128, 256, 8, False, 16)]


def launched(bn: int, r: int, g: int) -> int:
    """The row tile the launch uses: _fp8_grouped halves BLOCK_N (down to 16) while the grid has fewer than
    MIN_PROGRAMS programs (run 35's "64 x 256" ran as 16 x 256 on every shape but wq_b)."""
    while bn > 16 and -(-r // bn) * g < B.tri.MIN_PROGRAMS:
        bn //= 2
    return bn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", help="comma-separated shape names (default: all)")
    ap.add_argument("--tiles", nargs="*", help="BLOCK_N,BLOCK_K,warps,PREFETCH,LOCAL[,UNROLL[,SPLIT]] each (default: "
                                               "TILES; SPLIT forces that K split, with no row narrowing)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles] if a.tiles else TILES
    tri = B.tri
    copy = B.copy_tbps()
    saved, saved_m, saved_long = dict(tri.FP8_STREAM), tri.FP8_STREAM_MAX_M, tri.FP8_STREAM_LONG["min_k"]
    saved_min, k_chunk = tri.MIN_PROGRAMS, tri._k_chunk
    tri.FP8_STREAM_MAX_M = 1
    tri.FP8_STREAM_LONG["min_k"] = 1 << 62  # each tile below as given (FP8_STREAM_LONG would replace it at K >= 2048)
    runs = []
    chosen = [s for s in SHAPES + CONTROLS if s[0] in a.shapes.split(",")] if a.shapes else SHAPES
    for name, k, r, g in chosen:
        n = r * g
        copies = max(2, -(-240_000_000 // (n * k)))  # rotate over > 240 MB: four times the L2
        ws = [B.fp8_weight(n, k) for _ in range(copies)]
        xs = [torch.randn(1, g * k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = ws[0].nbytes() + g * k * 2 + n * 2
        want = B.ref.dequantize(ws[0], torch.float64)
        for bn, bk, nw, pf, local, *more in tiles:
            unroll = more[0] if more else 1
            force = more[1] if len(more) > 1 else 0  # a K split forced on the launch (and no row narrowing)
            tri.MIN_PROGRAMS = 1 if force else saved_min
            tri._k_chunk = (lambda k, _, step, f=force: k_chunk(k, f, step)) if force else k_chunk
            tri.FP8_STREAM.update(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, PREFETCH=bool(pf), LOCAL=local, UNROLL=unroll)
            if g == 1:
                fn = tri.linear
                ref = (xs[0].double() @ want.T).flatten()
            else:
                fn = lambda x, w, g=g: tri.grouped_linear(x.view(1, g, -1), w, g)  # noqa: E731
                ref = torch.einsum("gk,grk->gr", xs[0].double().view(g, k), want.view(g, r, k)).flatten()
            y = fn(xs[0], ws[0]).double().flatten()
            err = ((y - ref).norm() / ref.norm()).item()
            ms = B.time_graph_ms(fn, list(zip(xs, ws, strict=True)))
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "PREFETCH": bool(pf), "LOCAL": local,
                   "UNROLL": unroll, "SPLIT": force or "auto", "rows_launched": launched(bn, r, g)}
            runs.append({"shape": name, "cfg": cfg, "us": ms * 1e3, "frac": frac, "rel_err": err})
            print(f"{name:13s} {cfg}  {ms * 1e3:7.2f} us  {frac:.3f} of copy  err {err:.1e}", flush=True)
    tri.FP8_STREAM.clear()
    tri.FP8_STREAM.update(saved)
    tri.FP8_STREAM_MAX_M = saved_m
    tri.FP8_STREAM_LONG["min_k"] = saved_long
    tri.MIN_PROGRAMS, tri._k_chunk = saved_min, k_chunk
    with open(os.path.join(a.out, "probe_fp8.json"), "w") as f:
        json.dump({"copy_TBps": copy, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
