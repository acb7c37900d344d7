"""The MXFP4 MoE at prefill sizes (tokens grouped by expert into tl.dot blocks): V4-Flash experts (256 x 2048 x
4096, 6 a token, random routing), gate/up and down timed apart (CUDA graphs, events) for each MOE_DOT tile and row block
given (a tile serves gate/up and down alike: MOE_DOT_DOWN is cleared for it), each variant's output checked
against the first's (rel. Frobenius <= 1e-2, bench_kernels.check: bf16 rounding; the engine's default against
float64 is the suite's and bench_kernels.py's; a non-zero exit names a failed variant). Each call reads every
expert, 3.2 GB, far beyond the L2, so no input rotation is needed; the floors are the experts' bytes at the copy
rate measured in the same run.

    python bench/probe_moe_prefill.py [--tokens 256 1024] [--tiles BM,BN,G,WARPS,STAGES ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

tri = B.tri

E, I, D, K = 256, 2048, 4096, 6


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--tiles", nargs="*", default=["0,64,2,4,3", "0,128,2,4,3", "0,64,2,4,4", "0,128,4,4,3",
                                                    "32,64,2,4,3"],
                    help="BM (0: the engine's choice),BLOCK_N,GROUPS,num_warps,num_stages[,SWAP 0/1]")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    w1, w3, w2 = B.fp4_weight(E, I, D), B.fp4_weight(E, I, D), B.fp4_weight(E, D, I)
    expert_bytes = sum(w.data.numel() + w.scale.numel() for w in (w1, w3, w2)) // E
    copy_tbps = B.copy_tbps()
    rows, default, default_down = [], dict(tri.MOE_DOT), dict(tri.MOE_DOT_DOWN)
    results = {"checks": {}}
    for t in a.tokens:
        x = (torch.randn(t, D, device="cuda") * 0.5).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(t)])
        wts = torch.rand(t, K, device="cuda")
        used = int(idx.unique().numel())
        floor_up = used * expert_bytes * 2 / 3 / copy_tbps / 1e9
        floor_down = used * expert_bytes / 3 / copy_tbps / 1e9
        base = None
        for tile in a.tiles:
            bm, bn, grp, nw, st, *swap = (int(v) for v in tile.split(","))
            tri.MOE_DOT.update(BLOCK_N=bn, GROUPS=grp, num_warps=nw, num_stages=st,
                               SWAP=bool(swap[0]) if swap else default.get("SWAP", False))
            tri.MOE_DOT_DOWN.clear()  # the tile is down's too
            try:
                plan = tri.moe_prepare(x, idx, E)
                if bm:
                    plan = (bm, *tri.moe_blocks(idx, E, bm), K)
                h = tri.moe_gate_up(x, w1, w3, plan, 10.0)
                c = tri.moe_down(h, w2, wts, plan, x.dtype)
                up_ms = B.time_graph_ms(lambda x, p: tri.moe_gate_up(x, w1, w3, p, 10.0), [(x, plan)], 10)
                down_ms = B.time_graph_ms(lambda h, w, p: tri.moe_down(h, w2, w, p, torch.bfloat16), [(h, wts, plan)],
                                          10)
            finally:
                tri.MOE_DOT.clear()
                tri.MOE_DOT.update(default)
                tri.MOE_DOT_DOWN.clear()
                tri.MOE_DOT_DOWN.update(default_down)
            if base is None:
                base = c
            row = {"tokens": t, "tile": tile, "bm": plan[0], "gate_up_ms": round(up_ms, 3),
                   "down_ms": round(down_ms, 3), "gate_up_frac": round(floor_up / up_ms, 3),
                   "down_frac": round(floor_down / down_ms, 3),
                   "rel_vs_first": float((c - base).norm() / base.norm())}
            B.check(results, f"{t} {tile}", row["rel_vs_first"])
            print(row, flush=True)
            rows.append(row)
    B.probe_done(a.out, "probe_moe_prefill", rows, results, copy_TBps=copy_tbps)


if __name__ == "__main__":
    main()
