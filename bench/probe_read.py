"""The read ceiling by size: how fast one launch can only read N bytes (no decode, no math beyond an integer sum),
timed as the kernel benchmarks are (a CUDA graph of one launch per buffer, buffers rotated beyond the 60 MB L2),
against the copy bandwidth of the same run. A one-token GEMV that streams N weight bytes once in one launch,
serialized with its neighbours, is not expected to beat the best of these (a measured ceiling, not a proof), so its
fraction of copy at N is what the per-kernel goals are judged against (wq_b reads 33.6 MB, the MoE gate/up 53.6 MB
and down 26.8 MB). Each size takes the best of a few tiles: programs reading contiguous chunks (CHUNK bytes each, in
BLOCK-byte steps) and a grid of one program per chunk.

    python bench/probe_read.py [--out DIR]      # on the GPU machine (~30 s)
    python bench/probe_read.py --sweep 33.6,53.6 --out DIR   # more tiles at a few sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

SIZES_MB = [8, 16, 26.8, 33.6, 53.6, 80.4, 256, 1024]
# (chunk, block, warps): the first five since run 62; the last three won the run-81 sweep at 26.8 / 33.6 / 53.6 MB
TILES = [(16384, 4096, 4), (65536, 4096, 8), (65536, 8192, 8), (262144, 8192, 8), (32768, 2048, 2),
         (8192, 2048, 1), (8192, 4096, 4), (16384, 8192, 8)]


@triton.jit
def read_kernel(src, out, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the int32 words of bytes [p CHUNK, (p + 1) CHUNK) in BLOCK-byte steps."""
    p = tl.program_id(0)
    base = src + p.to(tl.int64) * (CHUNK // 4)
    acc = tl.zeros((BLOCK // 4,), dtype=tl.int32)
    for k in range(0, CHUNK // 4, BLOCK // 4):
        off = k + tl.arange(0, BLOCK // 4)
        acc += tl.load(base + off, mask=p.to(tl.int64) * (CHUNK // 4) + off < n, other=0)
    tl.store(out + p, tl.sum(acc, axis=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", help="comma-separated sizes in MB: try every tile of 8-64 KB a program, 2-16 KB a "
                                    "step, 16-128 bytes a thread a step, 1-8 warps (instead of TILES)")
    a = ap.parse_args()
    sizes, tiles = SIZES_MB, TILES
    if a.sweep:
        sizes = [float(v) for v in a.sweep.split(",")]
        tiles = [(c, b, w) for c in (8192, 16384, 32768, 65536) for b in (2048, 4096, 8192, 16384)
                 for w in (1, 2, 4, 8) if b <= c and 16 <= b // (w * 32) <= 128]
    copy = B.copy_tbps()
    rows = []
    for mb in sizes:
        nbytes = int(mb * 1e6) // 64 * 64  # whole 16-word vectors
        copies = max(2, -(-240_000_000 // nbytes))
        bufs = [torch.randint(-1000, 1000, (nbytes // 4,), device="cuda", dtype=torch.int32) for _ in range(copies)]
        best = None
        for chunk, block, warps in tiles:
            grid = -(-nbytes // chunk)
            out = torch.empty(grid, device="cuda", dtype=torch.int32)

            def fn(buf, chunk=chunk, block=block, warps=warps, grid=grid, out=out):
                read_kernel[(grid,)](buf, out, buf.numel(), CHUNK=chunk, BLOCK=block, num_warps=warps)

            fn(bufs[0])
            torch.cuda.synchronize()
            assert out.sum().item() == bufs[0].sum().item()  # it read every word
            ms = B.time_graph_ms(fn, [(b,) for b in bufs])
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            print(f"{mb:7.1f} MB chunk {chunk:6d} block {block:5d} warps {warps}  {ms * 1e3:8.2f} us  "
                  f"{frac:.3f} of copy", flush=True)
            if best is None or frac > best["frac"]:
                best = {"MB": mb, "us": ms * 1e3, "frac": frac, "chunk": chunk, "block": block, "warps": warps}
        rows.append(best)
        del bufs
    print("best by size:", ", ".join(f"{r['MB']} MB {r['frac']:.3f}" for r in rows))
    with open(os.path.join(a.out, "probe_read.json"), "w") as f:
        json.dump({"copy_TBps": copy, "best": rows}, f, indent=1)


if __name__ == "__main__":
    main()
