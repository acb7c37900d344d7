"""The one-token weight streams at V4-Flash shapes, once each after two warm-up rounds, for Nsight Compute:
MXFP4 gate_up + down over 6 of 256 experts (--tokens: over T tokens' experts), and the FP8 wq_b (1024 -> 32768).
Reads counters, not time:

    ncu --clock-control none --kernel-name regex:'moe_|fp8_stream' --launch-skip 6 --launch-count 3 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats python3 bench/ncu_streams.py
    python3 bench/ncu_streams.py --set MOE_STREAM.PREFETCH=True   # a launch-table variant (bench_slice's --set)
    python3 bench/ncu_streams.py --tokens 64 --set MOE_MMA.TWO_MIN_T=1073741824  # the MoE at 64 tokens, one pair a row
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_slice import apply_overrides  # noqa: E402

from cdna2_engine.ops import QWeight  # noqa: E402
from cdna2_engine.ops import triton as tri  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--tokens", type=int, default=1, help="the MoE's tokens (random routing, seeded)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_streams.py needs a GPU (CUDA or ROCm): run it on the GPU machine")
    apply_overrides(args.set)
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    e, d, inter = 256, 4096, 2048

    def fp4(n, k):
        codes = torch.randint(-128, 128, (e, n, k // 2), generator=g, device=dev, dtype=torch.int32).to(torch.int8)
        return QWeight(codes, torch.full((e, n, k // 32), 123, dtype=torch.uint8, device=dev)
                       .view(torch.float8_e8m0fnu), "mxfp4")

    w1, w3, w2 = fp4(inter, d), fp4(inter, d), fp4(d, inter)
    wq = QWeight(torch.randint(0, 120, (32768, 1024), generator=g, device=dev, dtype=torch.int32).to(torch.uint8)
                 .view(torch.float8_e4m3fn), torch.full((256, 8), 118, dtype=torch.uint8, device=dev)
                 .view(torch.float8_e8m0fnu), "fp8")
    t = args.tokens
    x = torch.randn(t, d, generator=g, device=dev).to(torch.bfloat16)
    xq = torch.randn(1, 1024, generator=g, device=dev).to(torch.bfloat16)
    idx = (torch.tensor([[3, 77, 140, 199, 250, 31]], device=dev) if t == 1 else
           torch.stack([torch.randperm(e, generator=g, device=dev)[:6] for _ in range(t)]))
    wts = torch.rand(t, 6, generator=g, device=dev)
    for _ in range(3):
        tri.moe_experts(x, w1, w3, w2, idx, wts, 10.0)
        tri.linear(xq, wq)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
