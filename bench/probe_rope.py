"""The prefill RoPE tile cap (ROPE_TILE, NOTES entry 137) on the GPU: norm_rope of a V4-Flash prefill's q
([1, 256, 64, 512] bf16) with all 64 heads in one program against capped tiles, each checked against the
float64 reference and timed in a CUDA graph over 8 inputs (48 MB, about the L2).

    python bench/probe_rope.py      # on the GPU machine (seconds)
"""

from __future__ import annotations

import statistics

import torch

from cdna2_engine.ops import reference as ref
from cdna2_engine.ops import triton as tri


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_rope.py needs a GPU (CUDA or ROCm): run it on the GPU machine")
    torch.manual_seed(0)
    x = torch.randn(1, 256, 64, 512, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(1, 256, 32, device="cuda", dtype=torch.float64) * 6
    cos, sin = ang.cos(), ang.sin()
    want = ref.norm_rope(x.double(), None, 1e-6, cos, sin)
    xs = [torch.randn_like(x) for _ in range(8)]
    out, saved = {}, tri.ROPE_TILE
    for tile in (1 << 30, 16384, 8192, 4096, 2048, 1024, 512):
        tri.ROPE_TILE = tile
        y = tri.norm_rope(x, None, 1e-6, cos, sin)
        err = ((y.double() - want).norm() / want.norm()).item()
        for xi in xs[:2]:
            tri.norm_rope(xi, None, 1e-6, cos, sin)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for xi in xs:
                tri.norm_rope(xi, None, 1e-6, cos, sin)
        ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / len(xs) * 1e3)
        out[tile] = y
        print(f"ROPE_TILE {tile}: {statistics.median(ts):.1f} us a call, rel err vs float64 {err:.2e}")
    tri.ROPE_TILE = saved
    print("outputs bit-identical to the uncapped tile:", [torch.equal(out[1 << 30], y) for y in out.values()])


if __name__ == "__main__":
    main()
