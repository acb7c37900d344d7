"""RMSNorm (fp32 statistics) and RoPE / inverse RoPE (partial, YaRN tables), with their cos/sin tables."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, stride_x, stride_y,
                    HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row per program; mean of squares in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(x0, x1, c, s):
    """One interleaved RoPE pair (x0, x1) rotated by the angle whose cos and sin are c and s (fp32): the one
    formula of every RoPE of the kernels package (rope_kernel's here, attention.py's compressor and attention kernels'
    on their output)."""
    return x0 * c - x1 * s, x0 * s + x1 * c


@triton.jit
def _rope_cs(cos_row, sin_row, d0, nope, HALF, SIGN, BLOCK_D: tl.constexpr):
    """cos and sin (fp32, sin times SIGN: -1 for the inverse) of the BLOCK_D / 2 interleaved pairs of columns
    d0 + arange(BLOCK_D) (d0 even) of head rows whose last 2 HALF dims (from nope on) carry RoPE, from float64 rows
    of HALF as rope_kernel reads them, and which pairs are RoPE pairs (loaded apart from _rope_tile so a kernel
    can issue the loads before they are needed)."""
    r = (d0 - nope) // 2 + tl.arange(0, BLOCK_D // 2)  # each pair's index in the RoPE part (< 0: before it)
    ok = (r >= 0) & (r < HALF)
    c = tl.load(cos_row + r, mask=ok, other=1.0).to(tl.float32)
    s = tl.load(sin_row + r, mask=ok, other=0.0).to(tl.float32) * SIGN
    return c, s, ok


@triton.jit
def _rope_tile(x, c, s, ok, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 with its RoPE pairs (`_rope_cs`'s ok) rotated by c and s, the other columns as
    they are."""
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
    y0, y1 = _rotate(x0, x1, c[None, :], s[None, :])
    y0 = tl.where(ok[None, :], y0, x0)
    y1 = tl.where(ok[None, :], y1, x1)
    return tl.reshape(tl.join(y0, y1), (BLOCK_H, BLOCK_D))


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, w_ptr, H, D, HALF, SIGN, EPS,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr = False,
                HAS_W: tl.constexpr = False, ring_ptr=None, ok_ptr=None, pos_ptr=None, W=1, stride_rb=0,
                stride_rs=0, stride_ob=0, RING: tl.constexpr = False):
    """Program (b, s position, head block): copy the non-RoPE dims, rotate interleaved pairs. Heads are split
    over programs so one decode token's 64 heads spread over the GPU (one program per position held them all).
    NORM (the op norm_rope): each head row is first RMS-normalized (fp32 statistics, times w if HAS_W) and
    rounded to y's dtype, as rms_norm would hand it to rope, in the same launch.

    x, y contiguous [B*S, H, D]; cos/sin contiguous [B*S, HALF]; SIGN = -1 for the inverse rotation.
    RING (one decode token's K=V row, H = 1): the row is also written into the sliding window's ring at slot
    pos % W (ring [B, W, D] with strides stride_rb, stride_rs) and that slot's flag in ok [B, W] set: the
    decode step's window update without its three torch launches.
    """
    p = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    row = p * H * D + offs_h[:, None] * D
    nope = D - 2 * HALF
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = h_ok[:, None] & (offs_d[None, :] < nope)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < HALF
    m = h_ok[:, None] & r_ok[None, :]
    even = row + nope + 2 * offs_r[None, :]
    xn = tl.load(x_ptr + row + offs_d[None, :], mask=d_ok, other=0.0)
    x0 = tl.load(x_ptr + even, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + even + 1, mask=m, other=0.0).to(tl.float32)
    if NORM:
        xf = xn.to(tl.float32)
        ss = tl.sum(xf * xf, axis=1) + tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1)
        r = (1.0 / tl.sqrt(ss / D + EPS))[:, None]
        xf, x0, x1 = xf * r, x0 * r, x1 * r
        if HAS_W:
            xf *= tl.load(w_ptr + offs_d, mask=offs_d < nope, other=0.0).to(tl.float32)[None, :]
            x0 *= tl.load(w_ptr + nope + 2 * offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
            x1 *= tl.load(w_ptr + nope + 2 * offs_r + 1, mask=r_ok, other=0.0).to(tl.float32)[None, :]
        xn = xf.to(y_ptr.dtype.element_ty)
        x0 = x0.to(y_ptr.dtype.element_ty).to(tl.float32)
        x1 = x1.to(y_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + p * HALF + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + p * HALF + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :] * SIGN
    y0, y1 = _rotate(x0, x1, c, s)
    y0 = y0.to(y_ptr.dtype.element_ty)
    y1 = y1.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row + offs_d[None, :], xn, mask=d_ok)
    tl.store(y_ptr + even, y0, mask=m)
    tl.store(y_ptr + even + 1, y1, mask=m)
    if RING:
        slot = tl.load(pos_ptr) % W
        rrow = ring_ptr + p * stride_rb + slot * stride_rs + offs_h[:, None] * D
        tl.store(rrow + offs_d[None, :], xn, mask=d_ok)
        tl.store(rrow + nope + 2 * offs_r[None, :], y0, mask=m)
        tl.store(rrow + nope + 2 * offs_r[None, :] + 1, y1, mask=m)
        tl.store(ok_ptr + p * stride_ob + slot, 1)


@triton.jit
def rope_cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, HALF, ALIGN,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """cos/sin [N, HALF] of angle = position (rounded down to a multiple of ALIGN) x inverse frequency, all in
    float64 (positions reach 1M: an fp32 angle would be off by radians); one launch for what took a cast, a
    product and two functions (and the rounding's two)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    ok = (n < N)[:, None] & (r < HALF)[None, :]
    p = tl.load(pos_ptr + n, mask=n < N, other=0)
    p = p // ALIGN * ALIGN
    ang = p.to(tl.float64)[:, None] * tl.load(inv_ptr + r, mask=r < HALF, other=0.0)[None, :]
    at = n.to(tl.int64)[:, None] * HALF + r[None, :]
    tl.store(cos_ptr + at, tl.cos(ang), mask=ok)
    tl.store(sin_ptr + at, tl.sin(ang), mask=ok)
