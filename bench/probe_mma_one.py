"""The one-token MXFP4 MoE split by channels (MOE_MMA_ONE, kernels/mma.py `moe_mma_one_kernel`) against the per-phase
pair (gate/up, then down) it would replace, at V4-Flash shapes: both checked against the float64 reference, then
timed in CUDA graphs over 24 routings (beyond the L2), rounds interleaving the forms; bytes as mma_splits.py's.

    python bench/probe_mma_one.py [--forms 4x1,4x2,4x4,8x1,8x2] [--rounds 5] [--out DIR]   # on the GPU
    (a form CTxKS: 16 CT channels a program, KS K parts of gate/up over its warps)
"""

from __future__ import annotations

import argparse
import os
import statistics

import bench_kernels as B
import mma_splits as S

tri, ref = B.tri, B.ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="4x1,4x2,4x4,8x1,8x2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    w1, w3, w2 = B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID), \
        B.fp4_weight(B.N_EXP, B.HID, B.INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    copy = B.copy_tbps()
    sets = S.routings(1)
    # bench_kernels.py moe_bench's count (mxfp4_gemv_m1_frac's): experts + the pair's activations
    nbytes = statistics.mean(s[3] for s in sets) * per_expert + B.HID * 2 + B.TOPK * B.INTER * 8 + B.TOPK * B.HID * 4
    forms = {"pair": None, **{f"one {f}": tuple(int(v) for v in f.split("x")) for f in a.forms.split(",")}}
    results, times = {"checks": {}}, {}
    x, idx, wt, _ = sets[0]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)

    def use(form: tuple[int, int] | None) -> None:
        ct, ks = form or (4, 2)
        tri.MOE_MMA_ONE.update(on=form is not None, CT=ct, KS=ks)

    for name, form in forms.items():
        use(form)
        err = B.rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want)
        B.check(results, f"moe T=1 {name}", err)
        if err <= 1e-2:
            times[name] = []
    fn = lambda x, idx, wt, _: tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)  # noqa: E731
    for _ in range(a.rounds):
        for name in times:
            use(forms[name])
            times[name].append(B.time_graph_ms(fn, sets))
    rows = []
    for name, ms in times.items():
        frac = nbytes / (statistics.median(ms) * 1e-3) / 1e12 / copy
        rows.append({"form": name, "us": [round(v * 1e3, 2) for v in ms], "frac_of_copy": round(frac, 4)})
        print(f"{name:10s} {' / '.join(f'{v * 1e3:6.1f}' for v in ms)} us  median {frac:.3f} of copy "
              f"({copy:.2f} TB/s, {nbytes / 1e6:.1f} MB)", flush=True)
    B.probe_done(a.out, "probe_mma_one", rows, results, copy_TBps=copy, bytes=nbytes)


if __name__ == "__main__":
    main()
