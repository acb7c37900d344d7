"""FP8 (E4M3 with UE8M0 128x128 block scales) linear: the tl.dot GEMM for prefill (also the unquantized prefill
path: SCALED=False, fp32 x in PARTS exact bf16 parts) and the one-token weight stream."""

from __future__ import annotations

import triton
import triton.language as tl

from .base import _e4m3_f32, _e8m0, _split_sum

# FP8 (E4M3, UE8M0 per 128x128 block) linear / grouped linear.
# y[m, g, r] = sum_k x[m, g, k] * W[g*R + r, k]; plain linear is G = 1.


@triton.jit
def matmul_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, R, K,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    SCALED: tl.constexpr = True, FOLD: tl.constexpr = True, PARTS: tl.constexpr = 1,
):
    """Prefill path, tiles on tl.dot (MFMA / tensor cores). SCALED: W is E4M3 bytes, decoded in registers; FOLD
    (bf16 x): each row's block scale (a power of two) applied in the decode, exact in bf16 for scales from 2^-124 up
    (below, E4M3's smallest values fall under bf16's subnormals; past 448 x 2^127 the reference's fp32 overflows
    too), so the dot accumulates over all of K in place (scaling each step's partial instead took 40% longer on the
    H200, NOTES run 169). Without FOLD each step's dot starts from zero and its partial is scaled before it is
    added, a two-level sum: fp16 x (E4M3 values are exact in fp16, times a scale below 2^-15 they are not) and fp32
    x (folded, its IEEE dot is one FMA chain over all of K: 1.2-1.7e-6 from float64 per row against 2.2-2.6e-7 at K
    4096-8192 on the H200, which took the slice's float32 prefill from 4.3e-6 to 1.3e-5: NOTES runs 175-181).
    Else W is unquantized, in a dtype x's dot holds exactly. PARTS 3: fp32 x against W of a narrower dtype, each x
    tile cut into three parts of W's dtype whose sum is x, one dot each, so every product is exact (dense_mma's
    form, at prefill rows); each step's dots start from zero, smallest part first, and are added to acc on the FMA
    units (the sm_90 tensor cores' fp32 sums are not IEEE: carried over all of K, rows came 1.5e-5 from float64 at
    K 4096, NOTES run 171; largest part first 5e-7, smallest first 1.7e-7, run 176).
    Triton rewrites `acc += tl.dot(a, b)` (a dot from zero, then added) into `tl.dot(a, b, acc)`: a two-level sum
    needs something between the dot and the add (the scale; the parts' third dot carries `step`, not zero)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = g * R + offs_r
    m_ok = offs_m < M
    r_ok = offs_r < R
    m64 = offs_m.to(tl.int64)[:, None]  # every position's logits pass 2^31 elements from 16.6K rows
    x_base = x_ptr + g * stride_xg + m64 * stride_xm
    w_base = w_ptr + rows.to(tl.int64)[None, :] * stride_wn  # [1, BN]: tile loaded as [BK, BN]
    s_base = s_ptr + (rows // 128) * stride_sn
    tl.static_assert(PARTS == 1 or PARTS == 3)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_base + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_base + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0)
        if SCALED:
            sc = _e8m0(tl.load(s_base + k0 // 128, mask=r_ok, other=127), 0)
            if FOLD:  # the dequantized weight, as the reference's (two exact multiplies: 2^120 * sc may overflow)
                w = (_e4m3_f32(wb) * sc[None, :]).to(x.dtype)
            else:
                w = _e4m3_f32(wb).to(x.dtype)
        else:
            w = wb  # unquantized: x's dtype, or with PARTS the narrower dtype x's parts take
        if SCALED and not FOLD:
            acc += tl.dot(x, w, input_precision="ieee" if IEEE else None) * sc[None, :]
        elif PARTS == 3:  # smallest part first: this step's sum is near its final size only for the last dot
            x0 = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
            x1 = ((x - x0).to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
            step = tl.dot((x - x0 - x1).to(w.dtype), w, input_precision="ieee" if IEEE else None)
            step = tl.dot(x1.to(w.dtype), w, step, input_precision="ieee" if IEEE else None)
            acc += tl.dot(x0.to(w.dtype), w, step, input_precision="ieee" if IEEE else None)
        else:
            acc = tl.dot(x, w, acc, input_precision="ieee" if IEEE else None)
    y_ptrs = y_ptr + m64 * stride_ym + g * stride_yg + offs_r[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])




@triton.jit
def _fp8_stream_load(w_base, x_base, s_tile, s_rows, k0, k_end, r_ok, BLOCK_K: tl.constexpr, UNIFORM: tl.constexpr,
                     WORDS: tl.constexpr, nw_base=None, xr=1.0, X_NORM: tl.constexpr = False, K=0, glu_limit=0.0,
                     X_GLU: tl.constexpr = 0):
    """Raw loads of one [BLOCK_N, BLOCK_K] step at column k0 (columns from k_end on read nothing): E4M3 bytes
    (WORDS: w_base addresses uint32 words, loaded as [BN, BK / 4]), x in its own dtype (X_NORM: RMS-normed, times
    xr and the norm weight at nw_base, rounded to x's dtype as rms_norm's output is; X_GLU: the row is [gate | up],
    2K wide, and x is swiglu's output silu(gate) * up, clamped by glu_limit when X_GLU == 2, rounded as swiglu's
    is), and the UE8M0 scale bytes (UNIFORM: one per column of the tile's scale row; else per (row, column))."""
    kk = k0 + tl.arange(0, BLOCK_K)
    k_ok = kk < k_end
    if WORDS:
        kw = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # (k_end: a multiple of 4)
        wb = tl.load(w_base + k0 // 4, mask=r_ok[:, None] & (kw < k_end // 4)[None, :], other=0)
    else:
        wb = tl.load(w_base + k0, mask=r_ok[:, None] & k_ok[None, :], other=0)
    x = tl.load(x_base + k0, mask=k_ok, other=0.0)
    if X_GLU:
        gt = x.to(tl.float32)
        up = tl.load(x_base + K + k0, mask=k_ok, other=0.0).to(tl.float32)
        if X_GLU == 2:
            gt = tl.minimum(gt, glu_limit)
            up = tl.minimum(tl.maximum(up, -glu_limit), glu_limit)
        x = (gt / (1.0 + tl.exp(-gt)) * up).to(x.dtype)
    if X_NORM:
        nw = tl.load(nw_base + k0, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * xr * nw).to(x.dtype)
    if UNIFORM:
        s = tl.load(s_tile + kk // 128, mask=k_ok, other=0)
    else:
        s = tl.load(s_rows[:, None] + kk[None, :] // 128, mask=r_ok[:, None] & k_ok[None, :], other=0)
    return wb, x, s


@triton.jit
def _e4m3_word_cvt(w):
    """sm_89+ only (PTX): the 4 E4M3 bytes of each uint32 word -> 4 fp32, by the hardware conversion of each
    half-word (cvt.rn.f16x2.e4m3x2, low byte to low half) and two exact fp16 -> fp32 widenings. (Triton's own fp8
    cast of bytes unpacked from a word re-packs the high byte pair with 3-4 integer ops.)"""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi, h0, h1, h2, h3;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {h0, h1}, a;
        mov.b32 {h2, h3}, b;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _split4(t):
    """[..., n, 2, 2] (element 4i + 2a + b at [..., i, a, b]) -> its 4 planes [..., n]: elements 4i, 4i+1, 4i+2,
    4i+3."""
    e, o = tl.split(t)  # b
    p0, p2 = tl.split(e)  # a
    p1, p3 = tl.split(o)
    return p0, p1, p2, p3


@triton.jit
def _fp8_stream_fma_words(acc, w, x, s, HW: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, LOCAL: tl.constexpr = 1):
    """acc[BN, BK / 4] += sum over the 4 bytes of each uint32 word of W * (x * block scale): four FMAs per word
    into one accumulator (a quarter of _fp8_stream_fma's registers); LOCAL > 4: each word's four products and then
    LOCAL / 4 adjacent words summed first, into acc[BN, BK / LOCAL]. HW: _e4m3_word_cvt (GPU only: inline PTX);
    else the bit decode of each byte."""
    w = w.to(tl.uint32, bitcast=True)
    if UNIFORM:
        xs = _split4(tl.reshape(x.to(tl.float32) * _e8m0(s, 0), (BLOCK_K // 4, 2, 2)))
    else:
        xs = _split4(tl.reshape(x.to(tl.float32)[None, :] * _e8m0(s, 0), (BLOCK_N, BLOCK_K // 4, 2, 2)))
    if HW:
        v = _e4m3_word_cvt(w)
    else:
        v = (_e4m3_f32(w & 0xFF), _e4m3_f32((w >> 8) & 0xFF), _e4m3_f32((w >> 16) & 0xFF), _e4m3_f32(w >> 24))
    if LOCAL > 4:  # the word's four products, then LOCAL / 4 adjacent words, summed in the thread
        if UNIFORM:
            t = v[0] * xs[0][None, :] + v[1] * xs[1][None, :] + v[2] * xs[2][None, :] + v[3] * xs[3][None, :]
        else:
            t = v[0] * xs[0] + v[1] * xs[1] + v[2] * xs[2] + v[3] * xs[3]
        acc += tl.sum(tl.reshape(t, (BLOCK_N, BLOCK_K // LOCAL, LOCAL // 4)), axis=2)
    else:
        for j in tl.static_range(4):
            if UNIFORM:
                acc += v[j] * xs[j][None, :]
            else:
                acc += v[j] * xs[j]
    return acc


@triton.jit
def _fp8_stream_fma(acc, wb, x, s, HW: tl.constexpr, UNIFORM: tl.constexpr, LOCAL: tl.constexpr = 1):
    """acc[BN, BK / LOCAL] += W * (x * block scale), each LOCAL adjacent columns summed (wb: E4M3 bytes [BN, BK])."""
    x = x.to(tl.float32)
    if UNIFORM:
        xs = (x * _e8m0(s, 0))[None, :]
    else:
        xs = x[None, :] * _e8m0(s, 0)
    if HW:
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        w = _e4m3_f32(wb)
    if LOCAL > 1:
        acc += tl.sum(tl.reshape(w * xs, (wb.shape[0], wb.shape[1] // LOCAL, LOCAL)), axis=2)
    else:
        acc += w * xs
    return acc


@triton.jit
def fp8_stream_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, R, K,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg, K_CHUNK, part_ptr, lock_ptr, stride_ps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr, UNIFORM: tl.constexpr,
    UNROLL: tl.constexpr = 1, SPLIT: tl.constexpr = 1, PREFETCH: tl.constexpr = False, SPLITP: tl.constexpr = 1,
    nw_ptr=None, x_eps=0.0, X_NORM: tl.constexpr = False, XP: tl.constexpr = 1, glu_limit=0.0,
    X_GLU: tl.constexpr = 0, LOCAL: tl.constexpr = 1,
):
    """Decode (one x row per program row) weight-streaming GEMV, no tl.dot: y[m, g, r] = sum_k x W.

    Each program streams a [BLOCK_N, K] slab of W in [BLOCK_N, BLOCK_K] tiles into a [BLOCK_N, BLOCK_K / LOCAL]
    fp32 accumulator: LOCAL adjacent products of a step are summed first (within a thread where its 16-byte loads
    hold them, as on sm_90; LOCAL = 1: one FMA per weight into a [BLOCK_N, BLOCK_K] accumulator), which frees the
    registers that let a launch fit the SMs in one wave; the rows are summed across threads once at the end.
    The block scale multiplies x, not the weights: UNIFORM (every row of the tile in one 128-row scale block,
    set by the host) loads one scale per 128 columns; otherwise a per-(row, column) scale is applied.
    HW (sm_90): E4M3 -> fp32 by the hardware conversion (cvt.rn.f16x2.e4m3x2); else the exact bit decode
    (gfx90a has no FP8 hardware). UNROLL = 2: two tiles per iteration, both loads issued before either is used.
    SPLIT > 1 (narrow W: too few row tiles to fill the GPU): program (n, m * SPLIT + s, g) covers K from
    s * K_CHUNK; the partials ([SPLIT, M, G, R] fp32 at part_ptr, y's strides) are added by the last split to
    finish (`_split_sum`, SPLITP: SPLIT rounded up to a power of two), in the same launch.
    PREFETCH: register double buffering (Triton pipelines only loads that feed a tl.dot): the next tile's
    weights, x and scales are loaded before the current tile's FMAs and carried into the next step; w_ptr is then
    a uint32 view of W (K a multiple of 4) and stride_wn counts words; its accumulator is [BLOCK_N, BLOCK_K / 4]
    for LOCAL <= 4.
    X_NORM (one group): x is first RMS-normed with the weight at nw_ptr (rms_norm's numerics): every program
    reads the whole row of x (XP: K rounded up to a power of two) for its inverse RMS, so the norm needs no
    launch of its own (q's norm before wq_b and the indexer's wq_b).
    X_GLU (one group; 1, or 2 with glu_limit): x rows are [gate | up] (2K wide) and W reads swiglu(gate, up) as
    the stream loads it (the shared expert's w2 after its joined w1|w3: no swiglu launch).
    """
    pid_n = tl.program_id(0)
    m = tl.program_id(1) // SPLIT
    split = tl.program_id(1) % SPLIT
    g = tl.program_id(2)
    offs_r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = g * R + offs_r
    r_ok = offs_r < R
    if PREFETCH:  # w_ptr and stride_wn in uint32 words: the carried tile stays packed (a uint8 one would not)
        w_base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // 4)[None, :]
    else:
        w_base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    x_base = x_ptr + m * stride_xm + g * stride_xg + tl.arange(0, BLOCK_K)
    s_tile = s_ptr + ((g * R + pid_n * BLOCK_N) // 128) * stride_sn  # UNIFORM: the tile's scale row
    s_rows = s_ptr + (rows // 128) * stride_sn
    if PREFETCH and LOCAL > 4:
        acc = tl.zeros((BLOCK_N, BLOCK_K // LOCAL), dtype=tl.float32)
    elif PREFETCH:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // LOCAL), dtype=tl.float32)
    k_lo = split * K_CHUNK
    k_end = K
    nw_base = nw_ptr
    xr = 1.0
    if X_NORM:
        nw_base = nw_ptr + tl.arange(0, BLOCK_K)
        kx = tl.arange(0, XP)
        xf = tl.load(x_ptr + m * stride_xm + kx, mask=kx < K, other=0.0).to(tl.float32)
        xr = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + x_eps)
    if PREFETCH:
        k_end = tl.minimum(K, k_lo + K_CHUNK)  # the prefetch past this split's last tile reads nothing
        wb, x, s = _fp8_stream_load(w_base, x_base, s_tile, s_rows, k_lo, k_end, r_ok, BLOCK_K, UNIFORM, True,
                                    nw_base, xr, X_NORM, K, glu_limit, X_GLU)
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K * UNROLL):  # K_CHUNK: a multiple of BLOCK_K * UNROLL
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K
            if PREFETCH:
                nwb, nx, ns = _fp8_stream_load(w_base, x_base, s_tile, s_rows, k + BLOCK_K, k_end, r_ok, BLOCK_K,
                                               UNIFORM, True, nw_base, xr, X_NORM, K, glu_limit, X_GLU)
                acc = _fp8_stream_fma_words(acc, wb, x, s, HW, UNIFORM, BLOCK_N, BLOCK_K, LOCAL)
                wb, x, s = nwb, nx, ns
            else:
                wb, x, s = _fp8_stream_load(w_base, x_base, s_tile, s_rows, k, k_end, r_ok, BLOCK_K, UNIFORM, False,
                                            nw_base, xr, X_NORM, K, glu_limit, X_GLU)
                acc = _fp8_stream_fma(acc, wb, x, s, HW, UNIFORM, LOCAL)
    y = tl.sum(acc, axis=1)
    at = m * stride_ym + g * stride_yg + offs_r
    if SPLIT > 1:
        tile = pid_n + tl.num_programs(0) * (m + M * g)
        _split_sum(y, part_ptr + at, y_ptr + at, r_ok, split, SPLIT, stride_ps, lock_ptr + tile, y_ptr, False,
                   SPLITP)
    else:
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=r_ok)
