"""Time mHC's launches at V4-Flash decode (one token, 4 streams x 4096, the partials of hc_post's 128 D blocks):
hc_post with the next mix's partials and the collapse (on the step's chain), and hc_weights (post and comb,
beside the block), with variants that remove part of the work (fewer splits, one Sinkhorn iteration).

    python bench/probe_hc.py     # on the GPU machine (~20 s)
"""

from __future__ import annotations

import bench_kernels as B
import torch

tri = B.tri


def main() -> None:
    n, d, iters, eps = 4, 4096, 20, 1e-6
    mix = (2 + n) * n
    g = B.GEN
    sets = []
    for _ in range(8):
        out = torch.randn(1, 1, d, device=B.DEV, dtype=B.ACT, generator=g)
        h = torch.randn(1, 1, n, d, device=B.DEV, dtype=B.ACT, generator=g)
        post = torch.rand(1, 1, n, device=B.DEV, generator=g)
        comb = torch.rand(1, 1, n, n, device=B.DEV, generator=g)
        fn = torch.randn(mix, n * d, device=B.DEV, generator=g) * 0.01
        sets.append((out, h, post, comb, fn))
    base = torch.randn(mix, device=B.DEV, generator=g) * 0.1
    scale = torch.ones(3, device=B.DEV)
    nw = torch.ones(d, device=B.DEV, dtype=B.ACT)
    parts = [tri._hc_post(o, h, p, c, f) for o, h, p, c, f in sets]

    def collapse(y, part, split=None):
        tri._hc_collapse(part[:, :split] if split else part, split or part.shape[1], y.view(-1, n, d), base, scale,
                         n, eps, eps, False, (nw, eps))

    rows = [("hc_post + next mix partials", lambda o, h, p, c, f: tri._hc_post(o, h, p, c, f), sets)]
    rows += [(f"collapse (hc_pre's second launch), {sp or 128} splits", lambda y, part, sp=sp: collapse(y, part, sp),
              parts) for sp in (None, 16)]
    rows += [(f"hc_weights (beside the block), {it} Sinkhorn iterations", lambda y, part, it=it:
              tri.hc_weights(part, base, scale, n, d, it, eps, eps, B.ACT), parts) for it in (iters, 1)]
    for name, fn, args in rows:
        print(f"{name:45s} {B.time_graph_ms(fn, args) * 1e3:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
