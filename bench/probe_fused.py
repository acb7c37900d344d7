"""Experiment: the one-token tensor-core MoE pair in one launch (`MOE_MMA_FUSED`, kernels.py
`moe_mma_fused_kernel`) against the two launches, at V4-Flash shapes, after a check against the float64 reference.

    python bench/probe_fused.py [KQ,RB,LAG,WARPS_PER_SM ...]   # on the GPU machine
"""

from __future__ import annotations

import sys

import bench_kernels as B
import torch

tri, ref = B.tri, B.ref


def main() -> None:
    cfgs = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [(2, 4, 2, 16)]
    w1, w3 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID)
    w2 = B.fp4_weight(B.N_EXP, B.HID, B.INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    sets = []
    for _ in range(24):  # 24 routings x 6 experts: far beyond the L2
        x = torch.randn(1, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
        idx = torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK][None]
        wt = torch.rand(1, B.TOPK, device=B.DEV, generator=B.GEN)
        sets.append((x, idx, wt))
    nbytes = B.TOPK * per_expert + B.HID * 2 + B.TOPK * B.INTER * 4 * 2 + B.TOPK * B.HID * 4
    copy = B.copy_tbps()
    x, idx, wt = sets[0]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)

    def run(x, idx, wt):
        return tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)

    for cfg in [None, *cfgs]:
        tri.MOE_MMA_FUSED["on"] = cfg is not None
        if cfg:
            tri.MOE_MMA_FUSED.update(KQ=cfg[0], RB=cfg[1], LAG=cfg[2], WARPS_PER_SM=cfg[3])
        try:
            got = run(x, idx, wt)
            again = [run(x, idx, wt) for _ in range(3)]
            torch.cuda.synchronize()
            ms = min(B.time_graph_ms(run, sets) for _ in range(3))
        except Exception as exc:
            print(f"fused {cfg} failed: {exc!r}"[:400], flush=True)
            continue
        print(f"fused {cfg}: {ms * 1e3:6.1f} us  {nbytes / (ms * 1e-3) / 1e12 / copy:.3f} of copy ({copy:.2f} TB/s)"
              f"  rel err {B.rel(got, want):.1e}  repeats same bits {all(torch.equal(a, got) for a in again)}",
              flush=True)


if __name__ == "__main__":
    main()
