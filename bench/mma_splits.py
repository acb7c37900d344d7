"""Time the one-token tensor-core MoE (gate/up + down) at V4-Flash shapes for several K splits, after a check
against the float64 reference; the same volume and byte count as bench_kernels.py's moe_bench at T = 1.

    python bench/mma_splits.py [UP,DOWN[,PDL] ...]   # on the GPU machine; default: 4,2 2,2 8,2 4,4 (PDL 1: on)
"""

from __future__ import annotations

import statistics
import sys

import bench_kernels as B
import torch

tri, ref = B.tri, B.ref


def main() -> None:
    splits = [(*(int(v) for v in a.split(",")), 1)[:3] for a in sys.argv[1:]] or [(4, 2, 1), (2, 2, 1), (8, 2, 1),
                                                                                (4, 4, 1)]
    w1, w3 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID)
    w2 = B.fp4_weight(B.N_EXP, B.HID, B.INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    sets = []
    for _ in range(24):  # 24 routings x 6 experts: far beyond the L2
        x = torch.randn(1, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
        idx = torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK][None]
        wt = torch.rand(1, B.TOPK, device=B.DEV, generator=B.GEN)
        sets.append((x, idx, wt, tri.moe_prepare(x, idx, B.N_EXP)))
    nbytes = B.TOPK * per_expert + B.HID * 2 + B.TOPK * B.INTER * 4 * 2 + B.TOPK * B.HID * 4
    copy = B.copy_tbps()
    x, idx, wt, _ = sets[0]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
    for up, down, pdl in splits:
        tri.MOE_MMA.update(on=True, SPLIT_UP=up, SPLIT_DOWN=down, PDL=bool(pdl))
        err = B.rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want)

        def pair(x, idx, wt, plan):
            return tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 10.0), w2, wt, plan)

        def up_only(x, idx, wt, plan):
            return tri.moe_gate_up(x, w1, w3, plan, 10.0)

        ms = B.time_graph_ms(pair, sets)
        ms2 = statistics.median(B.time_graph_ms(pair, sets) for _ in range(2))
        print(f"splits up={up} down={down} pdl={pdl}: {ms * 1e3:6.1f} / {ms2 * 1e3:6.1f} us "
              f"(gate/up alone {B.time_graph_ms(up_only, sets) * 1e3:5.1f})  "
              f"{nbytes / (min(ms, ms2) * 1e-3) / 1e12 / copy:.3f} of copy ({copy:.2f} TB/s)  rel err {err:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
