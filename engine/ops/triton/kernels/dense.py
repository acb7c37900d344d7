"""Unquantized (bf16 / fp32) linear at decode sizes: the weight stream and the tensor-core form for a few rows."""

from __future__ import annotations

import triton
import triton.language as tl

from .base import _split_sum


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, K_CHUNK, n_split, stride_xm, stride_wn,
                      stride_ym, stride_ps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLITP: tl.constexpr):
    """y = x @ W^T for an unquantized W (bf16/fp16/fp32), BLOCK_M rows of x a program: W streamed at its stored
    width and widened to fp32 in registers, fp32 products and sums (the reference's numerics; only the summation
    order differs). The reference would first write a float32 copy of W. Program (n * row blocks + r, s): rows
    r BLOCK_M .., W rows n BLOCK_N ..; r varies fastest, so a W tile's row blocks run together.
    SPLITP > 0: program (., s) covers K from s * K_CHUNK (W with too few rows to fill the GPU still spreads
    over the SMs) and the n_split (<= SPLITP) partials are added by the last split to finish (`_split_sum`)."""
    mb = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % mb
    pid = tl.program_id(0) // mb
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K_CHUNK, BLOCK_K):
        rk = split * K_CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_row + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    ok = m_ok[:, None] & n_ok[None, :]
    out_at = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLITP > 0:
        flat: tl.constexpr = BLOCK_M * BLOCK_N
        _split_sum(tl.reshape(y, (flat,)), tl.reshape(part_ptr + rm[:, None] * N + rn[None, :], (flat,)),
                   tl.reshape(out_at, (flat,)), tl.reshape(ok, (flat,)), split, n_split, stride_ps,
                   lock_ptr + tl.program_id(0), y_ptr, False, SPLITP)
    else:
        tl.store(out_at, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def dense_mma_kernel(xp_ptr, w_ptr, y_ptr, M, N, K, stride_xc, stride_wn, stride_ym, PARTS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """y = x @ W^T for an unquantized W at a few rows of x, on the tensor cores (MFMA on gfx90a) with fp32
    accuracy: x arrives as PARTS columns of W's dtype per row (xp [M * PARTS, K], row m's parts at m * PARTS ..)
    whose sum is x exactly, so each product is exact and only the fp32 accumulation rounds (in the tensor cores'
    order and rounding: not dense_gemv's bits, the same error bound). A program owns
    BLOCK_N rows of W and every x column (BLOCK_C >= M * PARTS): W is read once whatever the rows, where
    dense_gemv's fp32 products grow with them. A row's parts are added after the K loop."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    n_ok, c_ok = rn < N, rc < M * PARTS
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_row + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xp = tl.load(xp_ptr + rc[None, :] * stride_xc + rk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(w, xp, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xp, acc)
    y = tl.sum(tl.reshape(acc, (BLOCK_N, BLOCK_C // PARTS, PARTS)), axis=2)  # [BN, rows of x]
    rm = tl.arange(0, BLOCK_C // PARTS)
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], y.to(y_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rm < M)[None, :])
