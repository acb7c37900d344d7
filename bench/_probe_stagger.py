"""Temporary probe: the one-token MXFP4 mma pair with each program's K tiles started at a staggered tile
(MOE_MMA STAGGER) against in order, interleaved rounds."""
import statistics, sys
sys.path.insert(0, "bench")
import bench_kernels as B
import torch
tri, ref = B.tri, B.ref
w1, w3 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID)
w2 = B.fp4_weight(B.N_EXP, B.HID, B.INTER)
per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
sets = []
for _ in range(24):
    x = torch.randn(1, B.HID, device=B.DEV, dtype=B.ACT, generator=B.GEN)
    idx = torch.randperm(B.N_EXP, device=B.DEV, generator=B.GEN)[:B.TOPK][None]
    wt = torch.rand(1, B.TOPK, device=B.DEV, generator=B.GEN)
    sets.append((x, idx, wt, tri.moe_prepare(x, idx, B.N_EXP)))
nbytes = B.TOPK * per_expert + B.HID * 2 + B.TOPK * B.INTER * 4 * 2 + B.TOPK * B.HID * 4
copy = B.copy_tbps()
x, idx, wt, _ = sets[0]
want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
def pair(x, idx, wt, plan):
    return tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 10.0), w2, wt, plan)
def up_only(x, idx, wt, plan):
    return tri.moe_gate_up(x, w1, w3, plan, 10.0)
for rnd in range(3):
    for st in (False, True):
        tri.MOE_MMA["STAGGER"] = st
        err = B.rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want)
        ms = statistics.median(B.time_graph_ms(pair, sets) for _ in range(3))
        up = statistics.median(B.time_graph_ms(up_only, sets) for _ in range(3))
        print(f"round {rnd} stagger={int(st)}: pair {ms*1e3:6.2f} us  gate/up alone {up*1e3:6.2f} us  "
              f"{nbytes/(ms*1e-3)/1e12/copy:.3f} of copy ({copy:.2f} TB/s)  rel err {err:.1e}", flush=True)
tri.MOE_MMA["STAGGER"] = False
