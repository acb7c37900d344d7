"""MXFP4 MoE at a few tokens: (token, slot) pairs in token-major order against pairs ordered by expert
(`MOE_PAIRS_BY_EXPERT`), at V4-Flash shapes, 24 routings rotated beyond the L2, against the copy ceiling measured in
the same run. With 256 experts and 6 a token, 64 tokens select ~199 distinct experts in 384 pairs: token-major,
an expert's repeats are far apart and read from DRAM again; ordered by expert they run back to back.

Each order is checked against the float64 reference and against the other's bits, then timed in CUDA graphs:
the two launches with the plan made beforehand (bench_kernels.py's `moe_bench` figure), the whole op
(`moe_experts`: the plan's sort, both launches, the in-launch sum), and the plan alone; rounds interleave the orders.

    python bench/probe_moe_order.py [--tokens 1,4,16,64] [--rounds 2] [--out DIR]   # on the GPU machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

ORDERS = {"expert": 2, "token": 10**9}  # MOE_PAIRS_BY_EXPERT for each order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tri, ref = B.tri, B.ref
    tri.MOE_PAIRS_MAX_T.update(mma=64, stream=64)
    copy = B.copy_tbps()
    print(f"copy {copy:.3f} TB/s", flush=True)
    w1, w3, w2 = (B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID),
                  B.fp4_weight(B.N_EXP, B.HID, B.INTER))
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    results, rows = {"checks": {}}, []
    for t in (int(v) for v in a.tokens.split(",")):
        sets = []
        for _ in range(24):
            x = torch.randn(t, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
            idx = torch.stack([torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK] for _ in range(t)])
            sets.append((x, idx, torch.rand(t, B.TOPK, device=B.DEV, generator=B.GEN)))
        unique = statistics.mean(torch.unique(s[1]).numel() for s in sets)
        act = t * B.HID * 2 + t * B.TOPK * B.INTER * 4 * 2 + t * B.TOPK * B.HID * 4  # as moe_bench counts them
        nbytes = unique * per_expert + act
        x, idx, wt = sets[0]
        want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
        outs = {}
        for name, by in ORDERS.items():
            tri.MOE_PAIRS_BY_EXPERT = by
            outs[name] = tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)
            B.check(results, f"moe_experts T={t} pairs by {name}", B.rel(outs[name], want))
        same = torch.equal(outs["expert"], outs["token"])
        results["checks"][f"T={t} orders bit-identical"] = {"ok": same}
        print(f"T={t}: orders bit-identical: {same}", flush=True)
        times: dict[str, dict[str, list[float]]] = {n: {"launches": [], "whole": [], "plan": []} for n in ORDERS}
        for _ in range(a.rounds):
            for name, by in ORDERS.items():
                tri.MOE_PAIRS_BY_EXPERT = by
                planned = [(x, wt, tri.moe_prepare(x, idx, B.N_EXP)) for x, idx, wt in sets]
                times[name]["launches"].append(B.time_graph_ms(
                    lambda x, wt, plan: tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 10.0), w2, wt, plan),
                    planned))
                times[name]["whole"].append(B.time_graph_ms(
                    lambda x, idx, wt: tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), sets))
                times[name]["plan"].append(B.time_graph_ms(lambda x, idx, wt: tri.moe_prepare(x, idx, B.N_EXP), sets))
        for name in ORDERS:
            row = {"T": t, "order": name, "unique_experts": unique, "bytes_MB": nbytes / 1e6,
                   **{f"{k}_us": [round(v * 1e3, 1) for v in vs] for k, vs in times[name].items()}}
            best = min(times[name]["launches"])
            row["launches_frac"] = nbytes / (best * 1e-3) / 1e12 / copy
            rows.append(row)
            print(f"T={t:3d} pairs by {name:6s} launches {row['launches_us']} us (frac {row['launches_frac']:.3f}) "
                  f"whole op {row['whole_us']} us  plan {row['plan_us']} us  ({unique:.1f} experts, "
                  f"{nbytes / 1e6:.0f} MB)", flush=True)
    B.probe_done(a.out, "probe_moe_order", rows, results, copy_TBps=copy)


if __name__ == "__main__":
    main()
