"""The MXFP4 MoE at prefill sizes (tokens grouped by expert into tl.dot blocks): V4-Flash experts (256 x 2048 x
4096, 6 a token, random routing), gate/up and down timed apart with events for each MOE_DOT tile and row block
given (a tile serves gate/up and down alike: MOE_DOT_DOWN is cleared for it), each variant's output checked
against the first's (bf16 rounding). Each call reads every expert, 3.2 GB, far beyond the L2, so no input
rotation is needed; the floors are the experts' bytes at the copy rate measured in the same run.

    python bench/probe_moe_prefill.py [--tokens 256 1024] [--tiles BM,BN,G,WARPS,STAGES ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from cdna2_engine.ops import QWeight
from cdna2_engine.ops import triton as tri

E, I, D, K = 256, 2048, 4096, 6


def mxfp4(rows: int, cols: int, g: torch.Generator) -> QWeight:
    codes = torch.randint(-128, 128, (E, rows, cols // 2), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.randint(118, 126, (E, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return QWeight(codes.cuda(), scale.view(torch.float8_e8m0fnu).cuda(), "mxfp4")


def time_ms(fn, reps: int = 7) -> float:
    fn()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def copy_rate() -> float:
    """TB/s of a 1 GiB device-to-device copy, bytes read + written."""
    buf = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    return buf.numel() / (time_ms(lambda: buf[: 1 << 30].copy_(buf[1 << 30 :])) * 1e-3) / 1e12


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--tiles", nargs="*", default=["0,64,2,4,4", "0,128,2,8,3", "32,64,2,4,4", "0,64,4,4,3",
                                                    "0,128,2,4,3", "0,64,2,8,4"],
                    help="BM (0: the engine's choice),BLOCK_N,GROUPS,num_warps,num_stages")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = mxfp4(I, D, g), mxfp4(I, D, g), mxfp4(D, I, g)
    expert_bytes = sum(w.data.numel() + w.scale.numel() for w in (w1, w3, w2)) // E
    copy_tbps = copy_rate()
    rows, default, default_down = [], dict(tri.MOE_DOT), dict(tri.MOE_DOT_DOWN)
    for t in a.tokens:
        x = (torch.randn(t, D, device="cuda") * 0.5).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(t)])
        wts = torch.rand(t, K, device="cuda")
        used = int(idx.unique().numel())
        floor_up = used * expert_bytes * 2 / 3 / copy_tbps / 1e9
        floor_down = used * expert_bytes / 3 / copy_tbps / 1e9
        base = None
        for tile in a.tiles:
            bm, bn, grp, nw, st = (int(v) for v in tile.split(","))
            tri.MOE_DOT.update(BLOCK_N=bn, GROUPS=grp, num_warps=nw, num_stages=st)
            tri.MOE_DOT_DOWN.clear()  # the tile is down's too
            try:
                plan = tri.moe_prepare(x, idx, E)
                if bm:
                    plan = (bm, *tri.moe_blocks(idx, E, bm), K)
                h = tri.moe_gate_up(x, w1, w3, plan, 10.0)
                c = tri.moe_down(h, w2, wts, plan, x.dtype)
                up_ms = time_ms(lambda x=x, plan=plan: tri.moe_gate_up(x, w1, w3, plan, 10.0))
                down_ms = time_ms(lambda h=h, w=wts, plan=plan: tri.moe_down(h, w2, w, plan, torch.bfloat16))
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
            print(row, flush=True)
            rows.append(row)
    with open(os.path.join(a.out, "probe_moe_prefill.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_TBps": copy_tbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
