"""Temporary probe: the one-token MXFP4 mma pair with its K parts as warps of one program (MOE_MMA CTA) against
one-warp programs, and the old form's split-sum finish skipped (NOFIN: a bound on what the finish costs)."""
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
variants = [("old", (False, False), {}, {}), ("cta up", (True, False), {}, {}), ("cta both", (True, True), {}, {})]
for su, sd in [(4, 2)] + [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]]:
    tri.MOE_MMA.update(SPLIT_UP=su, SPLIT_DOWN=sd)
    for rnd in range(2):
        for name, cta, pu, pd in variants:
            tri.MOE_MMA["CTA_UP"], tri.MOE_MMA["CTA_DOWN"] = cta
            tri.PROBE_UP.clear(); tri.PROBE_UP.update(pu); tri.PROBE_DOWN.clear(); tri.PROBE_DOWN.update(pd)
            err = B.rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want) if not (pu or pd) else float("nan")
            ms = statistics.median(B.time_graph_ms(pair, sets) for _ in range(3))
            up = statistics.median(B.time_graph_ms(up_only, sets) for _ in range(3))
            print(f"splits {su},{sd} round {rnd} {name:15s}: pair {ms*1e3:6.2f} us  gate/up alone {up*1e3:6.2f} us  "
                  f"{nbytes/(ms*1e-3)/1e12/copy:.3f} of copy ({copy:.2f} TB/s)  rel err {err:.1e}", flush=True)
tri.PROBE_UP.clear(); tri.PROBE_DOWN.clear()
