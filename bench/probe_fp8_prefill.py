"""FP8 block-scaled GEMMs at prefill sizes (`matmul_kernel`, tokens x the slice's FP8 weights, bf16 x): GPU
time per FP8_DOT tile (BLOCK_M on CUDA, BLOCK_N, BLOCK_K, warps, stages), every output checked against float64 on
every 37th row and the last (each 128-row block and a ragged tail; rel. Frobenius <= 1e-2, bench_kernels.check:
the bf16 output's rounding is ~3e-3), TFLOP/s against the ~790 of bf16 dots (KINDS.md). One input set: at these
sizes the dots, not the weights' bytes, bind. Exits non-zero when a check fails.

    python bench/probe_fp8_prefill.py [--tokens 1024 4096] [--tiles BM,BN,BK,WARPS,STAGES ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402
from probe_fp8 import SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1000, 1024, 4096])  # 1000: a ragged last row block
    ap.add_argument("--tiles", nargs="*", default=["64,128,128,8,3", "128,128,128,8,3", "128,128,64,8,3",
                                                    "128,128,64,8,4", "128,64,128,4,3"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    saved = dict(B.tri.FP8_DOT)
    rows, results = [], {"checks": {}}
    for t in a.tokens:
        for name, k, r, g in SHAPES:
            w = B.fp8_weight(g * r, k)
            x = torch.randn(t, g * k, device="cuda", dtype=torch.bfloat16)
            fn = B.tri.linear if g == 1 else (lambda x, w, g=g: B.tri.grouped_linear(x.view(-1, g, x.shape[-1] // g),
                                                                                     w, g))
            want = B.ref.dequantize(w, torch.float64)
            rows_at = torch.cat([torch.arange(0, t - 1, 37), torch.tensor([t - 1])]).to(x.device)
            x64 = x[rows_at].double()
            ref = x64 @ want.T if g == 1 else torch.einsum("mgk,grk->mgr", x64.view(-1, g, k), want.view(g, r, k))
            ref = ref.reshape(len(rows_at), -1)
            for tile in a.tiles:
                bm, bn, bk, nw, st = (int(v) for v in tile.split(","))
                B.tri.FP8_DOT.update(BLOCK_M_CUDA=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st)
                try:
                    y = fn(x, w).reshape(t, -1)[rows_at].double()
                    err = float((y - ref).norm() / ref.norm())
                    B.check(results, f"{t} {name} {tile}", err)
                    ms = B.time_graph_ms(fn, [(x, w)], replays=10)
                finally:
                    B.tri.FP8_DOT.clear()
                    B.tri.FP8_DOT.update(saved)
                row = {"tokens": t, "shape": name, "tile": tile, "us": round(ms * 1e3, 1),
                       "TFLOPs": round(2 * t * g * r * k / (ms * 1e-3) / 1e12, 1), "rel_err": err}
                print(row, flush=True)
                rows.append(row)
    B.probe_done(a.out, "probe_fp8_prefill", rows, results)


if __name__ == "__main__":
    main()
