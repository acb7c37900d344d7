"""What vendor code reaches at the per-kernel goals' byte counts, timed as the kernel benchmarks are (a CUDA graph
of one call per input set, sets rotated beyond the 60 MB L2, against the copy bandwidth of the same run): a
device-to-device copy of N bytes (the copy ceiling by size; bytes read + written, as copy_TBps counts them), and
cuBLAS(Lt) on wq_b's shape (1024 -> 32768): the FP8 GEMM on the Hopper FP8 units (torch._scaled_mm, E4M3
weights; M = 16, its smallest M, reads the same weight bytes as M = 1) with one scale a tensor and, where this
torch has it, with DeepSeek's 1x128 / 128x128 block scales; the bf16 GEMV at M = 1 (twice the bytes), and at
4096 x 4096. A reference for the goals, not a ceiling: the engine's kernels decode FP8 in registers instead
(gfx90a has no FP8 units).

    python bench/probe_vendor.py [--out DIR]      # on the GPU machine (~30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

COPY_MB = [8, 16, 26.8, 33.6, 53.6, 80.4, 256]
N, K = 64 * 512, 1024  # wq_b


def sets(nbytes: float) -> int:
    """Input sets to rotate over: more than four times the L2 in all."""
    return max(2, -(-240_000_000 // int(nbytes)))


def timed(name: str, fn, args_list, nbytes: float, copy: float, rows: list, **extra) -> None:
    ms = B.time_graph_ms(fn, args_list)
    frac = nbytes / (ms * 1e-3) / 1e12 / copy
    rows.append({"what": name, "MB": nbytes / 1e6, "us": ms * 1e3, "frac": frac, **extra})
    print(f"{name:44s} {nbytes / 1e6:7.1f} MB  {ms * 1e3:8.2f} us  {frac:.3f} of copy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    copy = B.copy_tbps()
    rows: list[dict] = []
    for mb in COPY_MB:
        n = int(mb * 1e6) // 16 * 16
        bufs = [(torch.empty(n, dtype=torch.uint8, device="cuda").random_(), torch.empty(n, dtype=torch.uint8,
                                                                                          device="cuda"))
                for _ in range(sets(2 * n))]
        timed(f"copy {mb} MB (read + write)", lambda s, d: d.copy_(s), bufs, 2 * n, copy, rows)
        src, dst = bufs[0]
        assert torch.equal(src, dst)  # it copied
        del bufs

    e4m3 = torch.float8_e4m3fn
    ws = [(torch.randn(N, K, device="cuda") / 4).to(e4m3) for _ in range(sets(N * K))]
    x = (torch.randn(16, K, device="cuda") / 4).to(e4m3)
    one = torch.ones((), device="cuda")
    want = x.float() @ ws[0].float().T
    got = torch._scaled_mm(x, ws[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err  # bf16 output rounding: ~2e-3
    timed("cuBLASLt FP8 wq_b M=16, tensor scales", lambda w: torch._scaled_mm(
        x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), [(w,) for w in ws], N * K + 16 * K, copy,
        rows, rel_err=err)
    sa = torch.ones(16, K // 128, device="cuda")  # 1 x 128 activation blocks
    sb = torch.ones(N // 128, K // 128, device="cuda")  # 128 x 128 weight blocks
    try:
        got = torch._scaled_mm(x, ws[0].t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, err
        timed("cuBLASLt FP8 wq_b M=16, 128x128 block scales", lambda w: torch._scaled_mm(
            x, w.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16), [(w,) for w in ws],
            N * K + 16 * K + sb.numel() * 4, copy, rows, rel_err=err)
    except (RuntimeError, NotImplementedError) as exc:  # older torch or cuBLAS: no block-scaled FP8 GEMM
        print(f"block-scaled FP8 GEMM not available here: {str(exc).splitlines()[0]}")
        rows.append({"what": "cuBLASLt FP8 wq_b M=16, 128x128 block scales", "error": str(exc).splitlines()[0]})
    del ws

    wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets(2 * N * K))]
    xb = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    timed("cuBLAS bf16 GEMV wq_b M=1", lambda w: torch.nn.functional.linear(xb, w), [(w,) for w in wb],
          2 * N * K + 2 * K, copy, rows)
    del wb
    wb = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(sets(2 * 4096 * 4096))]
    xb = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    timed("cuBLAS bf16 GEMV 4096x4096 M=1 (the issue's 28%)", lambda w: torch.nn.functional.linear(xb, w),
          [(w,) for w in wb], 2 * 4096 * 4096 + 2 * 4096, copy, rows)
    del wb
    with open(os.path.join(a.out, "probe_vendor.json"), "w") as f:
        json.dump({"copy_TBps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
