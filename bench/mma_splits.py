"""Time the per-pair tensor-core MoE (gate/up + down) at V4-Flash shapes for several K splits and token counts,
after a check against the float64 reference; the same volume and byte count as bench_kernels.py's moe_bench.

    python bench/mma_splits.py [--tokens 1,4,16,64] [UP,DOWN[,PDL][:KEY=N] | table[:KEY=N] ...]   # on the GPU
    default: table 4,2 2,1 1,1 (table: MOE_MMA's own SPLITS by token count; PDL 1: on); rounds interleave the
    configurations; --small runs it in the CPU interpreter at tiny shapes
"""

from __future__ import annotations

import argparse
import statistics

import bench_kernels as B
import torch

tri, ref = B.tri, B.ref


def routings(t: int, n: int = 24) -> list:
    """n routings of t tokens (n x 6 experts each: far beyond the L2), each (x, idx, weights, distinct experts)."""
    sets = []
    for _ in range(n):
        x = torch.randn(t, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
        idx = torch.stack([torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK] for _ in range(t)])
        wt = torch.rand(t, B.TOPK, device=B.DEV, generator=B.GEN)
        sets.append((x, idx, wt, torch.unique(idx).numel()))
    return sets


def split_rows(arg: str, table: tuple) -> tuple[tuple, bool, dict]:
    """A command-line configuration as (MOE_MMA SPLITS rows, PDL, other MOE_MMA items): "table" the engine's own,
    "UP,DOWN[,PDL]" one row for every token count; either may end in ":KEY=VALUE" (e.g. table:TWO_MIN_T=1073741824)."""
    arg, _, item = arg.partition(":")
    key, _, value = item.partition("=")
    if key and (key not in tri.MOE_MMA or not value.lstrip("-").isdigit()):
        raise SystemExit(f"{arg}:{item}: KEY=N takes an integer N for one of MOE_MMA's keys "
                         f"({', '.join(k for k in tri.MOE_MMA if k not in ('on', 'SPLITS'))})")
    extra = {key: int(value)} if key else {}
    if arg == "table":
        return table, True, extra
    up, down, pdl = (*(int(v) for v in arg.split(",")), 1)[:3]
    return ((1, up, down),), bool(pdl), extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("splits", nargs="*")
    a = ap.parse_args()
    table, saved = tri.MOE_MMA["SPLITS"], dict(tri.MOE_MMA)
    configs = {s: split_rows(s, table) for s in a.splits or ["table", "4,2", "2,1", "1,1"]}
    w1, w3 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID)
    w2 = B.fp4_weight(B.N_EXP, B.HID, B.INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    copy = B.copy_tbps()
    tri.MOE_PAIRS_MAX_T.update(mma=64)
    results = {"checks": {}}
    for t in (int(v) for v in a.tokens.split(",")):
        sets = routings(t)
        nbytes = (statistics.mean(s[3] for s in sets) * per_expert
                  + t * B.HID * 2 + t * B.TOPK * B.INTER * 4 * 2 + t * B.TOPK * B.HID * 4)
        x, idx, wt, _ = sets[0]
        want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
        planned = [(x, idx, wt, tri.moe_prepare(x, idx, B.N_EXP)) for x, idx, wt, _ in sets]
        pair = B.moe_pair(w1, w3, w2)
        times = {}
        for name, (rows, pdl, extra) in configs.items():
            tri.MOE_MMA.update(saved, on=True, SPLITS=rows, PDL=pdl, **extra)
            err = B.rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want)
            B.check(results, f"moe T={t} splits {name}", err)
            if err <= 1e-2:  # timings count only for right outputs
                times[name] = []
        for _ in range(3):  # rounds: each configuration once a round
            for name in times:
                rows, pdl, extra = configs[name]
                tri.MOE_MMA.update(saved, on=True, SPLITS=rows, PDL=pdl, **extra)
                times[name].append(B.time_graph_ms(pair, planned))
        for name, ms in times.items():
            tri.MOE_MMA.update(SPLITS=configs[name][0])
            print(f"T={t:3d} splits {name:>5} {tri._mma_splits(t)}: "
                  f"{' / '.join(f'{v * 1e3:7.1f}' for v in ms)} us  "
                  f"{nbytes / (min(ms) * 1e-3) / 1e12 / copy:.3f} of copy ({copy:.2f} TB/s)", flush=True)
    failed = [k for k, c in results["checks"].items() if not c["ok"]]
    if failed:
        raise SystemExit(f"{len(failed)} check(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
