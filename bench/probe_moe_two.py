"""Two pairs of one expert a program row (MOE_MMA TWO_MIN_T) against one pair a row, at V4-Flash shapes: bits
equal first, then the gate/up + down launches timed in CUDA graphs with the pair-rows table built inside each call.
Bytes as bench_kernels.py's moe_bench (the distinct selected experts' weights and scales + activations).

    python bench/probe_moe_two.py [--out DIR] [T ...]   # on the GPU machine; default T: 4 6 8 12 16 24 32 48 64
"""

from __future__ import annotations

import argparse
import statistics

import bench_kernels as B
import torch

tri, ref = B.tri, B.ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--small", action="store_true", help="CPU smoke run (read at import by bench_kernels)")
    ap.add_argument("tokens", nargs="*", type=int, default=[4, 6, 8, 12, 16, 24, 32, 48, 64])
    args = ap.parse_args()
    tri.MOE_PAIRS_MAX_T.update(mma=64)
    w1, w3 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID)
    w2 = B.fp4_weight(B.N_EXP, B.HID, B.INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    copy = B.copy_tbps()
    rows, results = [], {"checks": {}}
    for t in args.tokens:
        sets = []
        for _ in range(24):  # 24 routings: far beyond the L2
            x = torch.randn(t, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
            idx = torch.stack([torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK] for _ in range(t)])
            wt = torch.rand(t, B.TOPK, device=B.DEV, generator=B.GEN)
            sets.append((x, idx, wt))
        n_unique = statistics.mean(torch.unique(s[1]).numel() for s in sets)
        counts = [torch.bincount(s[1].reshape(-1), minlength=B.N_EXP) for s in sets]
        n_rows = statistics.mean(((c + 1) // 2).sum().item() for c in counts)
        nbytes = n_unique * per_expert + t * B.HID * 2 + t * B.TOPK * B.INTER * 4 * 2 + t * B.TOPK * B.HID * 4
        x, idx, wt = sets[0]
        want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
        row = {"tokens": t, "unique_experts": n_unique, "two_rows": n_rows, "pairs": t * B.TOPK,
               "bytes_MB": nbytes / 1e6}
        outs = {}
        for name, two_min_t in (("one", 1 << 30), ("two", 1)):
            tri.MOE_MMA["TWO_MIN_T"] = two_min_t
            outs[name] = tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)
            B.check(results, f"moe T={t} {name} pair(s) a row", B.rel(outs[name], want))

            def run(x, idx, wt):
                plan = tri.moe_prepare(x, idx, B.N_EXP)  # (the tables are device ops; in the graph)
                return tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 10.0), w2, wt, plan)

            ms = [B.time_graph_ms(run, sets) for _ in range(3)]
            row[f"{name}_us"] = [round(m * 1e3, 1) for m in ms]
            row[f"{name}_frac"] = round(nbytes / (min(ms) * 1e-3) / 1e12 / copy, 3)
        B.check(results, f"moe T={t} two pairs a row = one, bit for bit", 0.0 if torch.equal(outs["one"], outs["two"])
                else float("inf"), tol=0.0)
        print(row, flush=True)
        rows.append(row)
    B.probe_done(args.out, "probe_moe_two", rows, results, copy_TBps=copy)


if __name__ == "__main__":
    main()
