"""mHC's hc_post_pre at prefill rows (V4-Flash: 4 streams x 4096, mix 24, bf16 streams): GPU time per call for
the row form (each row's program takes the mix's dots with fn itself) and the dot form (hc_mix_dot_kernel,
BLOCK_M rows a program) at each HC_MIX_DOT tile given, each form's dots (the sums' first MIX entries) checked
against float64 dots of the same stored streams (rel. Frobenius <= 1e-6: fp32 sums of each 128-term step; run
166's 1.3e-7; bench_kernels.check; a non-zero exit names a failed case).

    python bench/probe_hc_prefill.py [--rows 1024 4096] [--tiles BM,BK,WARPS,STAGES ...] [--out DIR]  # GPU, ~30 s
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

tri = B.tri


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--tiles", nargs="*", default=["16,128,4,3", "16,64,4,2", "32,64,4,2", "16,256,4,2",
                                                    "16,128,8,3"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    n, d = 4, 4096
    mix, g, saved = (2 + n) * n, B.GEN, dict(tri.HC_MIX_DOT)
    fn = torch.randn(mix, n * d, device=B.DEV, generator=g) * 0.01
    base, scale = torch.randn(mix, device=B.DEV, generator=g) * 0.1, torch.ones(3, device=B.DEV)
    nw = torch.ones(d, device=B.DEV, dtype=B.ACT)
    rows_out, results = [], {"checks": {}}
    for rows in a.rows:
        sets = [(torch.randn(rows, 1, d, device=B.DEV, dtype=B.ACT, generator=g),
                 torch.randn(rows, 1, n, d, device=B.DEV, dtype=B.ACT, generator=g),
                 torch.rand(rows, 1, n, device=B.DEV, generator=g),
                 torch.rand(rows, 1, n, n, device=B.DEV, generator=g)) for _ in range(3)]  # 3 x 40+ MB: past the L2

        def call(out, h, post, comb):
            return tri.hc_post_pre(out, h, post, comb, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-6))

        want = None
        for tile in ["row form"] + a.tiles:
            if tile == "row form":
                tri.HC_MIX_DOT.update(saved, min_rows=1 << 30)
            else:
                bm, bk, warps, st = (int(v) for v in tile.split(","))
                tri.HC_MIX_DOT.update(min_rows=1, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps, num_stages=st)
            try:
                y, sums = call(*sets[0])[:2]
                us = B.time_graph_ms(call, sets, 20) * 1e3
            finally:
                tri.HC_MIX_DOT.update(saved)
            if want is None:  # the dots in float64 from the streams as stored (what both forms read)
                want = y.double().reshape(rows, -1) @ fn.double().T
            got = sums[..., :mix].double().sum(-2).reshape(rows, mix)
            err = float((got - want).norm() / want.norm())
            name = f"rows {rows} {tile}"
            B.check(results, name, err, 1e-6)  # fp32 sums of 128-term steps, promoted: 1.3e-7 (run 166)
            rows_out.append({"rows": rows, "form": name, "us": round(us, 1), "dots_rel_vs_float64": err})
            print(rows_out[-1], flush=True)
    B.probe_done(a.out, "probe_hc_prefill", rows_out, results)


if __name__ == "__main__":
    main()
