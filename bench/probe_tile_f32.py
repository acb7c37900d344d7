"""fp32 x against FP8 W on the prefill tile: the current matmul_kernel (FOLD on and off) and 1fb2c32's
fp8_matmul_kernel, each against float64, at the slice's FP8 shapes and 64 rows (NOTES run 180)."""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

from cdna2_engine.ops.triton import kernels as K  # noqa: E402
from cdna2_engine.ops.triton.kernels import _e4m3_f32, _e8m0  # noqa: E402,F401


@triton.jit
def fp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, R, K,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Prefill path: decoded tile fed to tl.dot (MFMA / tensor cores); per-block scale on the fp32 partial."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = g * R + offs_r
    m_ok = offs_m < M
    r_ok = offs_r < R
    x_base = x_ptr + g * stride_xg + offs_m[:, None] * stride_xm
    w_base = w_ptr + rows[None, :] * stride_wn  # [1, BN]: tile loaded as [BK, BN]
    s_base = s_ptr + (rows // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_base + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_base + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0)
        w = _e4m3_f32(wb).to(x.dtype)  # exact E4M3 value, a normal number or zero
        if IEEE:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        sc = _e8m0(tl.load(s_base + k0 // 128, mask=r_ok, other=127), 0)
        acc += part * sc[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + g * stride_yg + offs_r[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])



def main():
    out = {}
    for name, k, r in (("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("wq_a|wkv", 4096, 1536)):
        w = B.fp8_weight(r, k)
        x = torch.randn(64, 1, k, device="cuda")
        want = x[:, 0].double() @ B.ref.dequantize(w, torch.float64).T
        wd, sd = w.data.view(torch.uint8), w.scale.view(torch.uint8)
        grid = (r // 128, 1, 1)
        res = {}
        for form in ("linear", "fold", "nofold", "old"):
            y = torch.full((64, 1, r), float("nan"), device="cuda")
            if form == "linear":
                y = B.tri.linear(x[:, 0], w).view(64, 1, r)
            elif form == "old":
                fp8_matmul_kernel[grid](x, wd, sd, y, 64, r, k, x.stride(0), x.stride(1), wd.stride(0), sd.stride(0),
                                        y.stride(0), y.stride(1), BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=True,
                                        num_warps=8, num_stages=3)
            else:
                K.matmul_kernel[grid](x, wd, sd, y, 64, r, k, x.stride(0), x.stride(1), wd.stride(0), sd.stride(0),
                                      y.stride(0), y.stride(1), BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=True,
                                      FOLD=form == "fold", num_warps=8, num_stages=3)
            e = (y[:, 0].double() - want).norm(dim=1) / want.norm(dim=1)
            res[form] = [e.max().item(), e.median().item()]
        y = x[:, 0] @ B.ref.dequantize(w, torch.float32).T
        e = (y.double() - want).norm(dim=1) / want.norm(dim=1)
        res["cublas_f32"] = [e.max().item(), e.median().item()]
        print(name, res, flush=True)
        out[name] = res
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_tile_f32.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
