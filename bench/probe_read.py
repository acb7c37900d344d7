"""The read ceiling by size: how fast one launch can only read N bytes (no decode, no math beyond an integer sum),
timed as the kernel benchmarks are (a CUDA graph of one launch per buffer, buffers rotated beyond the 60 MB L2),
against the copy bandwidth of the same run. A one-token GEMV that streams N weight bytes once in one launch,
serialized with its neighbours, is not expected to beat the best of these (a measured ceiling, not a proof), so its
fraction of copy at N is what the per-kernel goals are judged against (wq_b reads 33.6 MB, the MoE gate/up 53.6 MB
and down 26.8 MB). Each size takes the best of a few tiles: programs reading contiguous chunks (CHUNK bytes each, in
BLOCK-byte steps) and a grid of one program per chunk.

    python bench/probe_read.py [--out DIR]      # on the GPU machine (~30 s)
    python bench/probe_read.py --sweep 33.6,53.6 --out DIR   # more tiles at a few sizes
    python bench/probe_read.py --tma 33.6,53.6,80.4 --out DIR   # Hopper's tensor memory accelerator beside them
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


@triton.jit
def tma_read_kernel(desc, out, ROWS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums rows [p ROWS, (p + 1) ROWS) of an int32 [R, BC] view, BR rows a step, through TMA tensor
    loads into shared memory that Triton's pipeliner keeps STAGES deep (sm_90)."""
    p = tl.program_id(0)
    acc = tl.zeros((BR, BC), dtype=tl.int32)
    for i in tl.range(0, ROWS, BR, num_stages=STAGES):
        acc += desc.load([p * ROWS + i, 0])
    tl.store(out + p, tl.sum(acc))


def tma_tiles(copy: float, sizes: list[float]) -> list[dict]:
    """The best TMA read at each size against the LDG tiles' (TILES), in the same run."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = []
    for mb in sizes:
        for name, tiles in (("ldg", [(c, b, w, None) for c, b, w in TILES]),
                            ("tma", [(rows_, br, w, st) for rows_ in (32, 64, 128, 256) for br in (8, 16, 32)
                                     for w in (4,) for st in (2, 3, 4) if br < rows_])):
            best = None
            for a, b, warps, stages in tiles:
                unit = a * 1024 if name == "tma" else 64
                nbytes = int(mb * 1e6) // unit * unit
                copies = max(2, -(-240_000_000 // nbytes))
                bufs = [torch.randint(-1000, 1000, (nbytes // 4,), device="cuda", dtype=torch.int32)
                        for _ in range(copies)]
                if name == "tma":
                    grid = nbytes // (a * 1024)
                    args = [(TensorDescriptor.from_tensor(x.view(-1, 256), [b, 256]),) for x in bufs]
                else:
                    grid = -(-nbytes // a)
                    args = [(x,) for x in bufs]
                out = torch.empty(grid, device="cuda", dtype=torch.int32)

                def fn(src, a=a, b=b, warps=warps, stages=stages, grid=grid, out=out, n=nbytes // 4, name=name):
                    if name == "tma":
                        tma_read_kernel[(grid,)](src, out, ROWS=a, BR=b, BC=256, STAGES=stages, num_warps=warps)
                    else:
                        read_kernel[(grid,)](src, out, n, CHUNK=a, BLOCK=b, num_warps=warps)

                try:
                    fn(*args[0])
                    torch.cuda.synchronize()
                    assert out.sum().item() == bufs[0].sum().item()  # it read every word
                    ms = B.time_graph_ms(fn, args)
                except Exception as exc:  # a tile that does not compile or fit is reported, not fatal
                    print(f"{mb} MB {name} {a} {b} {warps} {stages} failed: {exc!r}"[:200], flush=True)
                    continue
                frac = nbytes / (ms * 1e-3) / 1e12 / copy
                print(f"{mb:7.1f} MB {name} {a:6d} {b:5d} warps {warps} stages {stages}  {ms * 1e3:8.2f} us  "
                      f"{frac:.3f} of copy", flush=True)
                if best is None or frac > best["frac"]:
                    best = {"MB": mb, "kind": name, "us": ms * 1e3, "frac": frac, "tile": [a, b, warps, stages]}
                del bufs, args
            rows.append(best)
    print("best by size:", ", ".join(f"{r['MB']} MB {r['kind']} {r['frac']:.3f}" for r in rows if r))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", help="comma-separated sizes in MB: try every tile of 8-64 KB a program, 2-16 KB a "
                                    "step, 16-128 bytes a thread a step, 1-8 warps (instead of TILES)")
    ap.add_argument("--tma", help="comma-separated sizes in MB: the TMA tiles beside the LDG ones (sm_90)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    if a.tma:
        rows = tma_tiles(B.copy_tbps(), [float(v) for v in a.tma.split(",")])
        with open(os.path.join(a.out, "probe_read_tma.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
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
