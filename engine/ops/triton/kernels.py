"""Triton kernels for the V4 ops; launchers live in `__init__.py`, ISA compile specs at the bottom.

Portability rules kept here (DESIGN.md sections 4 and 6):
- gfx90a has no FP8/FP4 units: E4M3 and E2M1 are decoded in registers with integer bit ops. A code's
  sign/exponent/mantissa bits are shifted into an fp32 (or, for the uint32-word decode, two fp16) bit
  pattern whose value is the code's value times a power of two (small codes land on subnormals, which
  both targets keep: the ISA tier checks the denormal mode), and one exact multiply restores the value.
  The operand handed to a matrix unit is then a normal number (MI200 MFMA flushes fp16/bf16 subnormals).
- Every dot and reduction accumulates in fp32; fp32 operands use `input_precision="ieee"` (no tf32).
- No lane-count literal: block sizes are constexpr and Triton maps them onto num_warps x 32 (CUDA) or
  num_warps x 64 (gfx90a) lanes.
- Deterministic: no float atomics; split work is combined in a fixed order (`_split_sum` counts arrivals with
  integer atomics, and the last split adds all partials in split order).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90): Triton 3.5+ (3.4's helpers do not compile; the backend refuses < 3.5)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton (the backend refuses it; the ISA audit still compiles the rest)
    gdc_launch_dependents = gdc_wait = None
PDL_AVAILABLE = gdc_wait is not None

# fp32 bits of the UE8M0 scale are (s << 23) (s = 0 maps to 0.0, not 2^-127; s = 255 is NaN in UE8M0).


@triton.jit
def _e8m0(s_u8, EXTRA: tl.constexpr):
    """UE8M0 byte -> fp32 2^(s - 127 + EXTRA) by placing s + EXTRA in the fp32 exponent field."""
    e = s_u8.to(tl.int32) + EXTRA
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f32(b_u8):
    """E4M3 byte -> its exact fp32 value: bits s|eeee|mmm placed at 31|26..23|22..20 give value * 2^-120
    (e = 0 codes land on fp32 subnormals, which both targets keep), times 2^120 (exact)."""
    b = b_u8.to(tl.uint32)
    f = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return f * 1.329227995784916e36  # 2^120


@triton.jit
def _e2m1_f32(c):
    """E2M1 code (low 4 bits of a uint32) -> its exact fp32 value: bits s|ee|m at 31|24..23|22 give
    value * 2^-126 (the +-0.5 codes are fp32 subnormals), times 2^126."""
    f = (((c & 0x7) << 22) | ((c & 0x8) << 28)).to(tl.float32, bitcast=True)
    return f * 8.507059173023462e37  # 2^126


# ----------------------------------------------------------------------------------------------------
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
def _split_sum(y, part_at, out_at, ok, split, n_split, part_stride, lock_at, add_at, HAS_ADD: tl.constexpr,
               SPLITP: tl.constexpr):
    """Split-K without a second launch, still deterministic: every split stores its fp32 partial (y and the
    pointers 1-D), then counts itself in on the tile's lock (integer atomic, acq_rel); the last to arrive,
    whichever it is, loads all n_split (<= SPLITP, a power of two) partials at once and adds them by one fixed
    tree (then add_at's values when HAS_ADD), writes the result and resets the lock for the next launch (or
    replay). One load of every partial, not one per split: summed in a loop, each split's L2 round trip waited
    for the add before it (n_split x ~0.4 us on the H200). The barrier orders all threads' partial stores before
    the release (the usual semaphore pattern)."""
    tl.store(part_at + split * part_stride, y, mask=ok)
    tl.debug_barrier()
    if tl.atomic_add(lock_at, 1, sem="acq_rel") == n_split - 1:
        j = tl.arange(0, SPLITP)
        parts = tl.load(part_at[None, :] + j[:, None] * part_stride, mask=(j < n_split)[:, None] & ok[None, :],
                        other=0.0)
        tot = tl.sum(parts, axis=0)
        if HAS_ADD:
            tot += tl.load(add_at, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_at, tot.to(out_at.dtype.element_ty), mask=ok)
        tl.atomic_xchg(lock_at, 0)


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


# ----------------------------------------------------------------------------------------------------
# MXFP4 MoE. Pairs (token t, slot j) are sorted by expert; block b covers sorted pairs
# [blk_lo[b], blk_hi[b]) of expert blk_e[b] (blk_e = -1: an unused tail block of the launch grid).
# Packed weights: [E, N, K/2] bytes, element 2i in the low nibble; scales [E, N, K/32].


@triton.jit
def _mxfp4_load(w_base, s_base, g0, K, r_ok, GROUPS: tl.constexpr):
    """GROUPS scale groups of a [BLOCK_N] row tile: packed bytes [BN, G, 16] (as uint32) and fp32 scales [BN, G]."""
    gg = g0 + tl.arange(0, GROUPS)
    g_ok = gg < K // 32
    byte = gg[:, None] * 16 + tl.arange(0, 16)[None, :]
    wb = tl.load(w_base[:, None, None] + byte[None, :, :], mask=r_ok[:, None, None] & g_ok[None, :, None], other=0)
    sc = _e8m0(tl.load(s_base[:, None] + gg[None, :], mask=r_ok[:, None] & g_ok[None, :], other=127), 0)
    return wb.to(tl.uint32), sc


@triton.jit
def _mxfp4_dot_step(acc, wb, sc, x, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT: tl.constexpr,
                    SWAP: tl.constexpr = False):
    """acc += x @ (decoded tile * group scales)^T; DOT: 0 fp32 IEEE, 1 bf16, 2 fp16 operands. SWAP: acc is
    [BLOCK_N, BLOCK_M] += tile @ x^T (the decoded tile the dot's register operand A, x the shared-memory B)."""
    w = tl.join(_e2m1_f32(wb), _e2m1_f32(wb >> 4))  # [BN, G, 16, 2]: elements 2j, 2j+1
    w = tl.reshape(w, (BLOCK_N, GROUPS, 32)) * sc[:, :, None]
    w = tl.reshape(w, (BLOCK_N, GROUPS * 32))
    if SWAP:
        if DOT == 0:
            acc += tl.dot(w, tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif DOT == 1:
            acc += tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))
        else:
            acc += tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)))
    elif DOT == 0:
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    elif DOT == 1:
        acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    return acc


@triton.jit
def _mxfp4_tile_dot(w_base, s_base, x_base, K, r_ok, m_ok,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT: tl.constexpr,
                    SWAP: tl.constexpr = False):
    """Tensor-core / MFMA form: the decoded tile times its group scales, cast to the dot dtype, fed to tl.dot
    against BLOCK_M (>= 16) gathered rows; fp32 accumulator."""
    offs_k = tl.arange(0, GROUPS * 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        wb, sc = _mxfp4_load(w_base, s_base, g0, K, r_ok, GROUPS)
        kk = g0 * 32 + offs_k
        x = tl.load(x_base[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc = _mxfp4_dot_step(acc, wb, sc, x, BLOCK_N, GROUPS, DOT, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _mxfp4_pair_dot(w1_base, s1_base, w3_base, s3_base, x_base, K, r_ok, m_ok,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT: tl.constexpr,
                    SWAP: tl.constexpr = False):
    """W1 x and W3 x in one K loop: both tiles' loads are issued together (twice the bytes in flight)."""
    offs_k = tl.arange(0, GROUPS * 32)
    g = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        wb1, sc1 = _mxfp4_load(w1_base, s1_base, g0, K, r_ok, GROUPS)
        wb3, sc3 = _mxfp4_load(w3_base, s3_base, g0, K, r_ok, GROUPS)
        kk = g0 * 32 + offs_k
        x = tl.load(x_base[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        g = _mxfp4_dot_step(g, wb1, sc1, x, BLOCK_N, GROUPS, DOT, SWAP)
        u = _mxfp4_dot_step(u, wb3, sc3, x, BLOCK_N, GROUPS, DOT, SWAP)
    if SWAP:
        g = tl.trans(g)
        u = tl.trans(u)
    return g, u


@triton.jit
def _f16_halves_f32(t):
    """uint32 holding two fp16 bit patterns -> (low, high) as fp32 (exact)."""
    lo = (t & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e2m1_pair(w, Q: tl.constexpr):
    """Nibbles Q and Q+4 of each uint32 word (elements 8i+Q and 8i+Q+4) -> fp32 value / 2^14, decoded two at a
    time: one shift pair and one and/or per two codes (fp16 bits s|ee|m at 15|11..10|9 in each half)."""
    x = w >> (4 * Q)
    return _f16_halves_f32(((x & 0x00070007) << 9) | ((x & 0x00080008) << 12))


@triton.jit
def _e2m1_word_prmt(w):
    """sm_90 only (PTX): the 8 codes of each uint32 word (element j in bits 4j..4j+3) -> 8 fp32 values / 2^14.

    Each code becomes the E5M2 byte s|000|ee|m|0, the high byte of its fp16 value / 2^14: the even codes of a
    word in one register and the odd ones in another (shifts and masks shared by 4 codes), then a byte permute
    (prmt, zero low bytes) makes each fp16 pair and cvt widens the halves: 11 integer instructions per 8 codes
    where _e2m1_pair takes 16 (ptxas does not find this form in the equivalent Triton bit ops)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u, ev, od, p;
        .reg .b16 h0, h1;
        shl.b32 t, $8, 4;
        and.b32 t, t, 0x80808080;
        shl.b32 u, $8, 1;
        and.b32 u, u, 0x0E0E0E0E;
        or.b32 ev, t, u;
        and.b32 t, $8, 0x80808080;
        shr.b32 u, $8, 3;
        and.b32 u, u, 0x0E0E0E0E;
        or.b32 od, t, u;
        prmt.b32 p, ev, 0, 0x1404;
        mov.b32 {h0, h1}, p;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $2, h1;
        prmt.b32 p, ev, 0, 0x3424;
        mov.b32 {h0, h1}, p;
        cvt.f32.f16 $4, h0;
        cvt.f32.f16 $6, h1;
        prmt.b32 p, od, 0, 0x1404;
        mov.b32 {h0, h1}, p;
        cvt.f32.f16 $1, h0;
        cvt.f32.f16 $3, h1;
        prmt.b32 p, od, 0, 0x3424;
        mov.b32 {h0, h1}, p;
        cvt.f32.f16 $5, h0;
        cvt.f32.f16 $7, h1;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _mxfp4_stream_words(w_base, g0, n_groups, r_ok, GROUPS: tl.constexpr):
    """uint32 words [BN, G, 4] of one K step (a row's scale group of 32 codes is 4 words: one 16 B load per
    thread); groups past n_groups read nothing."""
    gg = g0 + tl.arange(0, GROUPS)
    word = gg[:, None] * 4 + tl.arange(0, 4)[None, :]
    w = tl.load(w_base[:, None, None] + word[None, :, :], mask=r_ok[:, None, None] & (gg < n_groups)[None, :, None],
                other=0)
    return w.to(tl.uint32, bitcast=True)


@triton.jit
def _mxfp4_stream_scales(s_base, g0, n_groups, r_ok, GROUPS: tl.constexpr):
    """UE8M0 scale bytes [BN, G] of one K step."""
    gg = g0 + tl.arange(0, GROUPS)
    return tl.load(s_base[:, None] + gg[None, :], mask=r_ok[:, None] & (gg < n_groups)[None, :], other=0)


@triton.jit
def _mxfp4_stream_x(x_base, g0, K, GROUPS: tl.constexpr):
    """x of one K step (GROUPS * 32 values in x's own dtype)."""
    kx = g0 * 32 + tl.arange(0, GROUPS * 32)
    return tl.load(x_base + kx, mask=kx < K, other=0.0)


@triton.jit
def _mxfp4_stream_xs(x, GROUPS: tl.constexpr):
    """x of one K step split by nibble slot: xs[p] = x at elements 8i + p of each word i, [G, 4] fp32 each."""
    x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (GROUPS, 4, 2, 2, 2)))  # element 8i + p, p = 4h + 2a + b: b
    x00, x01 = tl.split(x0)  # (b=0) a
    x10, x11 = tl.split(x1)  # (b=1) a
    p0, p4 = tl.split(x00)
    p2, p6 = tl.split(x01)
    p1, p5 = tl.split(x10)
    p3, p7 = tl.split(x11)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _mxfp4_stream_sum(w, xs, PRMT: tl.constexpr):
    """[BN, G] unscaled group sums (x 2^-14) of one tile of words w [BN, G, 4]: one FMA per code."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    if PRMT:
        v = _e2m1_word_prmt(w)
        for p in tl.static_range(8):
            part += v[p] * xs[p][None, :, :]
    else:
        for q in tl.static_range(4):
            lo, hi = _e2m1_pair(w, q)  # elements 8i+q, 8i+q+4 (two codes per bit op, fp16 halves)
            part += lo * xs[q][None, :, :]  # two separate adds: each contracts to one FMA
            part += hi * xs[q + 4][None, :, :]
    return tl.sum(part, axis=2)  # the 4 words of a group are in one thread: no shuffle


@triton.jit
def _mxfp4_stream(w1_base, s1_base, w3_base, s3_base, x_base, K, r_ok,
                  BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PAIR: tl.constexpr, PREFETCH: tl.constexpr,
                  PRMT: tl.constexpr):
    """One token row (M = 1): W1 x (and W3 x when PAIR) over all K for a [BLOCK_N] row tile, no tl.dot.

    w*_base address uint32 words (8 codes each). The tile is [BLOCK_N, GROUPS, 4] words: one row's scale group
    per 16 B, so the group sum stays inside one thread and is scaled once; partials accumulate per (row, group
    slot) and are reduced across slots once at the end.
    PREFETCH: register double buffering. Triton software-pipelines only loads that feed a tl.dot, so without it
    each step waits for DRAM with nothing of its own in flight; with it the next step's words, scales and x are
    loaded (masked off past the end) before the current step is decoded, and carried into the next iteration.
    PRMT: the sm_90 inline-PTX decode (_e2m1_word_prmt); else the bit-op pair decode (gfx90a, the interpreter).
    """
    n_groups = K // 32
    acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    if PREFETCH:
        x = _mxfp4_stream_x(x_base, 0, K, GROUPS)
        w1 = _mxfp4_stream_words(w1_base, 0, n_groups, r_ok, GROUPS)
        s1 = _mxfp4_stream_scales(s1_base, 0, n_groups, r_ok, GROUPS)
        if PAIR:
            w3 = _mxfp4_stream_words(w3_base, 0, n_groups, r_ok, GROUPS)
            s3 = _mxfp4_stream_scales(s3_base, 0, n_groups, r_ok, GROUPS)
    for g0 in range(0, n_groups, GROUPS):
        if PREFETCH:
            nx = _mxfp4_stream_x(x_base, g0 + GROUPS, K, GROUPS)
            nw1 = _mxfp4_stream_words(w1_base, g0 + GROUPS, n_groups, r_ok, GROUPS)
            ns1 = _mxfp4_stream_scales(s1_base, g0 + GROUPS, n_groups, r_ok, GROUPS)
            if PAIR:
                nw3 = _mxfp4_stream_words(w3_base, g0 + GROUPS, n_groups, r_ok, GROUPS)
                ns3 = _mxfp4_stream_scales(s3_base, g0 + GROUPS, n_groups, r_ok, GROUPS)
            xs = _mxfp4_stream_xs(x, GROUPS)
            acc1 += _mxfp4_stream_sum(w1, xs, PRMT) * _e8m0(s1, 0)
            if PAIR:
                acc3 += _mxfp4_stream_sum(w3, xs, PRMT) * _e8m0(s3, 0)
            x, w1, s1 = nx, nw1, ns1
            if PAIR:
                w3, s3 = nw3, ns3
        else:  # words loaded after x's split and scales after the sum: the order that gives gfx90a v_fma_mix_f32
            xs = _mxfp4_stream_xs(_mxfp4_stream_x(x_base, g0, K, GROUPS), GROUPS)
            part = _mxfp4_stream_sum(_mxfp4_stream_words(w1_base, g0, n_groups, r_ok, GROUPS), xs, PRMT)
            acc1 += part * _e8m0(_mxfp4_stream_scales(s1_base, g0, n_groups, r_ok, GROUPS), 0)
            if PAIR:
                part = _mxfp4_stream_sum(_mxfp4_stream_words(w3_base, g0, n_groups, r_ok, GROUPS), xs, PRMT)
                acc3 += part * _e8m0(_mxfp4_stream_scales(s3_base, g0, n_groups, r_ok, GROUPS), 0)
    return tl.sum(acc1, axis=1) * 16384.0, tl.sum(acc3, axis=1) * 16384.0  # undo the decode's 2^-14 (exact)


@triton.jit
def moe_gate_up_kernel(
    x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
    pair_tok_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr,
    I, D, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hp,
    HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    DOT: tl.constexpr = 1, STREAM: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    PRMT: tl.constexpr = False, SWAP: tl.constexpr = False,
):
    """h[pair] = swiglu(W1[e] x, W3[e] x) for one expert block x one tile of the I outputs (fp32 h).
    STREAM: one token, the dot-free stream (w*_ptr uint32 views; PREFETCH and PRMT as in _mxfp4_stream); else
    tl.dot in DOT's operand dtype (0 fp32, 1 bf16, 2 fp16) over BLOCK_M gathered pair rows."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(blk_e_ptr + b)
    if e >= 0:
        lo = tl.load(blk_lo_ptr + b)
        hi = tl.load(blk_hi_ptr + b)
        pairs = lo + tl.arange(0, BLOCK_M)
        m_ok = pairs < hi
        tok = tl.load(pair_tok_ptr + pairs, mask=m_ok, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = offs_n < I
        x_row = x_ptr + tok.to(tl.int64) * stride_xt
        e64 = e.to(tl.int64)
        w_off = e64 * stride_we + offs_n * stride_wn
        s_off = e64 * stride_se + offs_n * stride_sn
        if STREAM:  # BLOCK_M == 1: one (token, expert) pair per block; w*_ptr are uint32 views
            g1, u1 = _mxfp4_stream(w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off, s3_ptr + s_off,
                                   x_row, D, r_ok, BLOCK_N, GROUPS, True, PREFETCH, PRMT)
            g = g1[None, :]
            u = u1[None, :]
        else:
            g, u = _mxfp4_pair_dot(w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off, s3_ptr + s_off, x_row, D,
                                   r_ok, m_ok, BLOCK_M, BLOCK_N, GROUPS, DOT, SWAP)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + pairs[:, None] * stride_hp + offs_n[None, :], h, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def moe_down_kernel(
    h_ptr, w2_ptr, s2_ptr, c_ptr,
    pair_id_ptr, pair_w_ptr, blk_e_ptr, blk_lo_ptr, blk_hi_ptr,
    D, I,
    stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_cp,
    out_ptr, add_ptr, lock_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT: tl.constexpr = 1,
    STREAM: tl.constexpr = False, SUM: tl.constexpr = False, HAS_ADD: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, PRMT: tl.constexpr = False, SPLITP: tl.constexpr = 1,
    SWAP: tl.constexpr = False,
):
    """contrib[t*k + j] = weights[t, j] * W2[e] h[pair], in the pair's own row (summed in order later).
    STREAM, PREFETCH, PRMT as in moe_gate_up_kernel. SUM (one token, STREAM: block j is pair j): the last of
    the k pair programs of an output tile adds the k rows (SPLITP: k rounded up to a power of two; plus
    add_ptr's shared-expert row when HAS_ADD) into out_ptr (`_split_sum`): no sum launch."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(blk_e_ptr + b)
    if e >= 0:
        lo = tl.load(blk_lo_ptr + b)
        hi = tl.load(blk_hi_ptr + b)
        pairs = lo + tl.arange(0, BLOCK_M)
        m_ok = pairs < hi
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = offs_n < D
        h_row = h_ptr + pairs.to(tl.int64) * stride_hp
        e64 = e.to(tl.int64)
        w_at = w2_ptr + e64 * stride_we + offs_n * stride_wn
        s_at = s2_ptr + e64 * stride_se + offs_n * stride_sn
        if STREAM:  # BLOCK_M == 1; w2_ptr is a uint32 view
            y1, _ = _mxfp4_stream(w_at, s_at, w_at, s_at, h_row, I, r_ok, BLOCK_N, GROUPS, False, PREFETCH,
                                  PRMT)
            y = y1[None, :]
        else:
            y = _mxfp4_tile_dot(w_at, s_at, h_row, I, r_ok, m_ok, BLOCK_M, BLOCK_N, GROUPS, DOT, SWAP)
        pid = tl.load(pair_id_ptr + pairs, mask=m_ok, other=0)
        wt = tl.load(pair_w_ptr + pid, mask=m_ok, other=0.0).to(tl.float32)
        if SUM:
            _split_sum(tl.sum(y * wt[:, None], axis=0), c_ptr + offs_n, out_ptr + offs_n, r_ok, b,
                       tl.num_programs(1), stride_cp, lock_ptr + pid_n, add_ptr + offs_n, HAS_ADD, SPLITP)
        else:
            tl.store(c_ptr + pid[:, None].to(tl.int64) * stride_cp + offs_n[None, :], y * wt[:, None],
                     mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def moe_sum_kernel(c_ptr, out_ptr, add_ptr, D, TOPK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr):
    """out[t] = sum_j contrib[t, j] in the order j = 0..k-1 (bit-reproducible, no atomics), plus add[t] (the
    shared expert) when HAS_ADD."""
    t = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    base = c_ptr + t.to(tl.int64) * TOPK * D + offs
    acc = tl.load(base, mask=ok, other=0.0)
    for j in tl.static_range(1, TOPK):
        acc += tl.load(base + j * D, mask=ok, other=0.0)
    if HAS_ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------
# Norm and RoPE.


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
    formula of every RoPE here (rope_kernel's, the compressor's, and the attention kernels' on their output)."""
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


# ----------------------------------------------------------------------------------------------------
# Attention (shared K = V, sink in the denominator) and indexer scores.


@triton.jit
def attention_kernel(
    q_ptr, kv_ptr, sink_ptr, mask_ptr, o_ptr,
    S, H, L, D, scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_kl, stride_mb, stride_ms,
    stride_ob, stride_os, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr = False, CHUNK=0, part_ptr=None, ml_ptr=None,
    ROPE: tl.constexpr = False, cos_ptr=None, sin_ptr=None, HALF=0, SCAN: tl.constexpr = 256,
    GATHER: tl.constexpr = True,
):
    """One query position x BLOCK_H heads per program (the heads share the KV rows: they are the dot's M).

    Online softmax with fp32 running max m and sum l, both started from the sink (m = sink, l = 1), so the
    sink is in the denominator only and a row with no visible key returns zeros. GATHER: only visible keys are
    read (sparse attention's point: a query reads its window and its 512 picked entries, whatever the context).
    The mask is read SCAN keys at a time, and each block of BLOCK_L keys gathers the next BLOCK_L visible ones,
    the r-th visible key of a scan being at the count of keys whose inclusive visible-prefix count is <= r: a
    compaction in registers, with no index buffer and no branch in the key loop (an `if` there kept Triton's
    pipeliner from loading the next keys early, NOTES 142), in the keys' ascending order. Not GATHER (a decode
    split over a short context, where most keys are visible): every key is read and the mask applied to the
    logits, so the key loads do not wait for the mask's.
    SPLIT (decode, flash-decoding): program axis 0 is (position, split); each split covers CHUNK keys, starts
    from m = -1e30, l = 0 (no sink) and writes its unnormalised acc, m and l for attention_combine_kernel.
    ROPE (the op's `rotary`, unsplit; attention_combine_kernel does it for SPLIT): the output is rounded, then
    un-rotated by cos/sin (float64 [B * S, HALF]) as rope(inverse) would do it in a launch of its own. (q's norm
    and RoPE stay in norm_rope: done here by every split program, they cost each program what they saved the
    chain, and under Triton 3.6 pushed this kernel to 256 VGPRs and scratch on gfx90a; NOTES run 100.)
    """
    if SPLIT:
        n_split = tl.cdiv(L, CHUNK)
        s_idx = tl.program_id(0) // n_split
        split = tl.program_id(0) % n_split
        l_lo = split * CHUNK
        l_hi = tl.minimum(l_lo + CHUNK, L)
    else:
        s_idx = tl.program_id(0)
        l_lo = 0
        l_hi = L
    s_idx = s_idx.to(tl.int64)  # row bases in int64: a long prefill's mask (S x L) and q (S x H x D) pass 2^31
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + s_idx * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if SPLIT:
        m_i = tl.full((BLOCK_H,), -1e30, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
    else:
        m_i = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        l_i = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    offs_l = tl.arange(0, BLOCK_L)
    offs_c = tl.arange(0, SCAN)
    mask_row = mask_ptr + b * stride_mb + s_idx * stride_ms
    for c0 in range(l_lo, l_hi, SCAN):
        if GATHER:
            cl = c0 + offs_c
            vis = (tl.load(mask_row + cl, mask=cl < l_hi, other=0) != 0).to(tl.int32)
            rank = tl.cumsum(vis, axis=0)  # inclusive: how many of this scan's keys up to each one are visible
            n_keys = tl.sum(vis, axis=0)
        else:
            n_keys = tl.minimum(l_hi - c0, SCAN)
        for j0 in range(0, n_keys, BLOCK_L):
            r = j0 + offs_l
            in_range = r < n_keys
            if GATHER:
                ll = c0 + tl.sum((rank[None, :] <= r[:, None]).to(tl.int32), axis=1)  # the r-th visible key
                ok = in_range
            else:
                ll = c0 + r
                ok = tl.load(mask_row + ll, mask=in_range, other=0) != 0
            kv = tl.load(kv_ptr + b * stride_kb + ll[:, None] * stride_kl + offs_d[None, :],
                         mask=in_range[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                logit = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale
            else:
                logit = tl.dot(q, tl.trans(kv)) * scale
            logit = tl.where(ok[None, :], logit, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, kv.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
    if SPLIT:
        # partials laid out [B, S, n_split, H, D] and [B, S, n_split, 2, H] (contiguous, fp32)
        row = (b * S + s_idx) * n_split + split
        tl.store(part_ptr + (row * H + offs_h[:, None]) * D + offs_d[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + row * 2 * H + offs_h, m_i, mask=h_ok)
        tl.store(ml_ptr + row * 2 * H + H + offs_h, l_i, mask=h_ok)
    else:
        out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
        if ROPE:
            cs_row = (b * S + s_idx) * HALF
            c, sn, rot = _rope_cs(cos_ptr + cs_row, sin_ptr + cs_row, 0, D - 2 * HALF, HALF, -1.0, BLOCK_D)
            out = _rope_tile(out.to(tl.float32), c, sn, rot, BLOCK_H, BLOCK_D).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * stride_ob + s_idx * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def attention_combine_kernel(part_ptr, ml_ptr, sink_ptr, o_ptr, S, H, D, n_split,
                             stride_ob, stride_os, stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_S: tl.constexpr, ROPE: tl.constexpr = False, cos_ptr=None, sin_ptr=None, HALF=0):
    """Merge the splits of one (b, s), with the sink in the denominator, BLOCK_S splits per step loaded at once
    (a fixed tree within a step, steps in order): one loop step waits for one round trip, not one per split.
    Program (s, b, head block x D block): a decode token's merge spreads over the GPU. ROPE: the merged output is
    rounded, then un-rotated (attention_kernel's ROPE; BLOCK_D even)."""
    s_idx = tl.program_id(0)
    b = tl.program_id(1)
    n_d = tl.cdiv(D, BLOCK_D)
    offs_h = (tl.program_id(2) // n_d) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = (tl.program_id(2) % n_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    hd_ok = h_ok[:, None] & (offs_d[None, :] < D)
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    if ROPE:
        cs_row = (b * S + s_idx) * HALF
        c, sn, rot = _rope_cs(cos_ptr + cs_row, sin_ptr + cs_row, (tl.program_id(2) % n_d) * BLOCK_D, D - 2 * HALF,
                              HALF, -1.0, BLOCK_D)
    row0 = (b * S + s_idx) * n_split
    m = sink
    for j0 in range(0, n_split, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        at = ml_ptr + ((row0 + j) * 2 * H)[:, None] + offs_h[None, :]
        mj = tl.load(at, mask=(j < n_split)[:, None] & h_ok[None, :], other=-1e30)
        m = tl.maximum(m, tl.max(mj, axis=0))
    l_tot = tl.exp(sink - m)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for j0 in range(0, n_split, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        j_ok = (j < n_split)[:, None] & h_ok[None, :]
        at = ml_ptr + ((row0 + j) * 2 * H)[:, None] + offs_h[None, :]
        w = tl.exp(tl.load(at, mask=j_ok, other=-1e30) - m[None, :])
        l_tot += tl.sum(tl.load(at + H, mask=j_ok, other=0.0) * w, axis=0)
        p = tl.load(part_ptr + (((row0 + j)[:, None] * H + offs_h[None, :]) * D)[:, :, None] + offs_d[None, None, :],
                    mask=j_ok[:, :, None] & hd_ok[None, :, :], other=0.0)
        acc += tl.sum(p * w[:, :, None], axis=0)
    out = (acc / l_tot[:, None]).to(o_ptr.dtype.element_ty)
    if ROPE:
        out = _rope_tile(out.to(tl.float32), c, sn, rot, BLOCK_H, BLOCK_D).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * stride_ob + s_idx * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
             out, mask=hd_ok)


@triton.jit
def index_scores_kernel(
    q_ptr, k_ptr, w_ptr, o_ptr,
    S, H, T, D, scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_ob, stride_os,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    vis_ptr=None, stride_vb=0, stride_vs=0, stride_vt=0, VISIBLE: tl.constexpr = False,
):
    """o[b, s, t] = scale * sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]); heads summed in fp32, in order.
    VISIBLE: entries whose flag vis[b, s, t] (uint8, any strides: broadcast dims have stride 0) is 0 score -inf."""
    s_idx = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    t_ok = offs_t < T
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + s_idx * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    k = tl.load(k_ptr + b * stride_kb + offs_t[:, None] * stride_kt + offs_d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + b * stride_wb + s_idx * stride_ws + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    sc = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
    if VISIBLE:
        v = tl.load(vis_ptr + b * stride_vb + s_idx * stride_vs + offs_t * stride_vt, mask=t_ok, other=0)
        sc = tl.where(v != 0, sc, float("-inf"))
    tl.store(o_ptr + b * stride_ob + s_idx * stride_os + offs_t, sc, mask=t_ok)


# ----------------------------------------------------------------------------------------------------
# Unquantized linear at decode sizes; mHC's pre/post/Sinkhorn split.


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


@triton.jit
def compress_pool_kernel(kv_ptr, gate_ptr, rkv_ptr, rg_ptr, ape_ptr, ent_ptr, pos_ptr, C, D,
                         stride_kb, stride_rb, stride_rs, stride_eb, stride_es,
                         R: tl.constexpr, RING: tl.constexpr, NSLOT: tl.constexpr, BLOCK_C: tl.constexpr):
    """compress_step, part 1, program (b, channel block): write this token's row into ring slot pos % RING
    (gate + ape[pos % R]) for the channels this program pools, then pool its window per channel by a
    softmax over the slots (RING = 2R: slots of the previous window at channels [0, D) = Ca, of this
    window at [D, 2D) = Cb), into entry slot pos // R in the entries' dtype."""
    b = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    d_ok = rd < D
    p = tl.load(pos_ptr)
    slot, j, w = p % RING, p % R, p // R
    for half in tl.static_range(RING // R):  # the channel ranges this program owns: [rd] and, for CSA, [D + rd]
        ch = rd + half * D
        g = tl.load(gate_ptr + b * stride_kb + ch, mask=d_ok).to(tl.float32) + tl.load(ape_ptr + j * C + ch,
                                                                                       mask=d_ok)
        row_kv = tl.load(kv_ptr + b * stride_kb + ch, mask=d_ok).to(tl.float32)
        tl.store(rkv_ptr + b * stride_rb + slot * stride_rs + ch, row_kv, mask=d_ok)
        tl.store(rg_ptr + b * stride_rb + slot * stride_rs + ch, g, mask=d_ok)
    tl.debug_barrier()  # the loads below read the slot just written (same program, other threads)
    s = tl.arange(0, NSLOT)
    if RING == 2 * R:
        rslot = tl.where(s < R, ((w + 1) % 2) * R + s, (w % 2) * R + s - R)
        choff = tl.where(s < R, 0, D)
    else:
        rslot = s
        choff = s * 0
    s_ok = s < RING
    off = b * stride_rb + rslot[:, None] * stride_rs + choff[:, None] + rd[None, :]
    m = s_ok[:, None] & d_ok[None, :]
    kv = tl.load(rkv_ptr + off, mask=m, other=0.0)
    g = tl.load(rg_ptr + off, mask=m, other=float("-inf"))
    g = tl.where(d_ok[None, :], g, 0.0)  # columns past D: finite, never stored
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    pooled = tl.sum(kv * e, axis=0) / tl.sum(e, axis=0)
    tl.store(ent_ptr + b * stride_eb + w * stride_es + rd, pooled.to(ent_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def compress_finish_kernel(ent_ptr, valid_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, D, HALF, EPS, stride_eb,
                           stride_es, stride_vb, R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """compress_step, part 2, one program per batch row: RMSNorm (fp32 statistics) of entry pos // R, rounded
    to the entries' dtype as the reference's norm output is, then RoPE of its last 2 * HALF dims; the entry's
    valid flag (uint8) set when this token closes the window."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr)
    tl.store(valid_ptr + b * stride_vb + p // R, ((p + 1) % R == 0).to(tl.uint8))
    row = ent_ptr + b * stride_eb + (p // R) * stride_es
    rd = tl.arange(0, BLOCK_D)
    ok = rd < D
    x = tl.load(row + rd, mask=ok, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / D + EPS) * tl.load(norm_ptr + rd, mask=ok, other=0.0).to(tl.float32)
    tl.store(row + rd, y.to(ent_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()
    t = tl.arange(0, BLOCK_R)
    t_ok = t < HALF
    even = row + D - 2 * HALF + 2 * t
    c = tl.load(cos_ptr + b * HALF + t, mask=t_ok, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * HALF + t, mask=t_ok, other=0.0).to(tl.float32)
    x0 = tl.load(even, mask=t_ok, other=0.0).to(tl.float32)
    x1 = tl.load(even + 1, mask=t_ok, other=0.0).to(tl.float32)
    tl.debug_barrier()
    y0, y1 = _rotate(x0, x1, c, sn)
    tl.store(even, y0.to(ent_ptr.dtype.element_ty), mask=t_ok)
    tl.store(even + 1, y1.to(ent_ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def topk_kernel(s_ptr, idx_ptr, margin_ptr, W, stride_s,
                K: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_W: tl.constexpr):
    """Top-K of one row (the router's 256 experts) in K passes of one max over unique `_sort_key` keys
    (largest value, then lowest index among equals: ties never by memory order; NaN ranks first, as in a
    descending sort), and the margin K-th minus (K+1)-th value (inf without a (K+1)-th). One launch instead of
    a device sort and its slicing."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    ok = w < W
    v = tl.load(s_ptr + row * stride_s + w, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _sort_key(v, w), -9223372036854775807 - 1)
    best = key  # the K-th pick's key after the loop (K >= 1)
    for t in tl.static_range(K):
        best = tl.max(key, axis=0)
        tl.store(idx_ptr + row * K + t, _key_index(best))
        key = tl.where(key == best, -9223372036854775807 - 1, key)
    if HAS_NEXT:
        margin = _key_value(best) - _key_value(tl.max(key, axis=0))
    else:
        margin = float("inf")
    tl.store(margin_ptr + row, margin)


@triton.jit
def _sort_key(v, w):
    """Unique int64 keys of values v at indices w (1-D) whose descending order is a stable descending sort of
    v: the value's bits made order-preserving in the high half (one NaN, above +inf: NaN first; -0.0 as +0.0),
    the complemented index in the low half (ties to the lower index)."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = tl.where(v != v, 0x7FC00000, v.to(tl.int32, bitcast=True))
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order = float order (an involution)
    return (order.to(tl.int64) << 32) | (4294967295 - w.to(tl.int64))


@triton.jit
def _key_index(key):
    """The index (int64) a `_sort_key` key was made from."""
    return 4294967295 - (key & 4294967295)


@triton.jit
def _key_value(key):
    """The fp32 value a `_sort_key` key was made from (NaN for NaN, +0.0 for -0.0)."""
    order = (key >> 32).to(tl.int32)
    return (order ^ ((order >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def topk_sort_kernel(s_ptr, idx_ptr, margin_ptr, mask_ptr, W, K, stride_s, stride_m,
                     IDX: tl.constexpr, MASK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Top-K of one row of up to BLOCK_W scores (the indexer's 512 of T entries) by one in-register sort of
    unique int64 keys: the score's bits made order-preserving in the high half (NaN first, as a descending
    sort puts it), the complemented index in the low half (ties to the lower index). IDX: the K indices in
    order and the K-th minus (K+1)-th margin (as topk_kernel); MASK: the picked set as a mask (keys at or above
    the K-th), without entries scored -inf (what the caller hid)."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    ok = w < W
    v = tl.load(s_ptr + row * stride_s + w, mask=ok, other=float("-inf")).to(tl.float32)
    key = tl.where(ok, _sort_key(v, w), -9223372036854775807 - 1)
    srt = tl.sort(key, descending=True)
    kth = tl.sum(tl.where(w == K - 1, srt, 0), axis=0)
    if MASK:
        tl.store(mask_ptr + row * stride_m + w, ((key >= kth) & (v != float("-inf"))).to(tl.int8), mask=ok)
    if IDX:
        tl.store(idx_ptr + row * K + w, _key_index(srt), mask=w < K)
        vk = tl.sum(tl.where(key == kth, v, 0.0), axis=0)
        nxt = tl.sum(tl.where(w == K, srt, 0), axis=0)
        vn = tl.sum(tl.where((key == nxt) & ok, v, 0.0), axis=0)
        tl.store(margin_ptr + row, tl.where(W > K, vk - vn, float("inf")))


@triton.jit
def _softplus(v):
    """log(1 + e^v) as torch computes it (v above 20 passes through): max(v, 0) + log1p(t), t = e^-|v| in (0, 1],
    with log1p(t) = 2 atanh(s), s = t / (2 + t) <= 1/3, by its series to s^15 (truncation < 1.5e-9 relative).
    No log of 1 + t: rounding 1 + t to fp32 costs log(1 + t) up to 6e-8 / t relative (6e-4 at t = 1e-4, v ~ -9)."""
    t = tl.exp(-tl.abs(v))
    s = t / (2.0 + t)
    s2 = s * s
    p = 1.0 / 13.0 + s2 / 15.0
    p = 1.0 / 11.0 + s2 * p
    p = 1.0 / 9.0 + s2 * p
    p = 1.0 / 7.0 + s2 * p
    p = 1.0 / 5.0 + s2 * p
    p = 1.0 / 3.0 + s2 * p
    lp = 2.0 * s * (1.0 + s2 * p)
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + lp)


@triton.jit
def route_kernel(l_ptr, bias_ptr, fixed_ptr, idx_ptr, w_ptr, margin_ptr, W, stride_l, scale,
                 K: tl.constexpr, KP: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                 FIXED: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_W: tl.constexpr):
    """One token's MoE routing in one launch (it was ten small ones): scores of the router logits (SCORING 0
    sqrt(softplus), 1 sigmoid, 2 softmax), the experts (top-K of score + bias, ties to the lower id, as
    topk_kernel, one max per pick; FIXED: given, for hash routing), their scores normalized to sum 1 times
    `scale`, the margin."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    ok = w < W
    v = tl.load(l_ptr + row * stride_l + w, mask=ok, other=0.0).to(tl.float32)
    if SCORING == 0:
        sc = tl.sqrt(_softplus(v))
    elif SCORING == 1:
        sc = tl.sigmoid(v)
    else:
        e = tl.exp(tl.where(ok, v, float("-inf")) - tl.max(tl.where(ok, v, float("-inf")), axis=0))
        sc = e / tl.sum(e, axis=0)
    sel = sc
    if HAS_BIAS:
        sel = sc + tl.load(bias_ptr + w, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _sort_key(sel, w), -9223372036854775807 - 1)
    kk = tl.arange(0, KP)
    picked = tl.zeros([KP], dtype=tl.int32)
    kth = 0.0
    for t in tl.static_range(K):
        if FIXED:
            i = tl.load(fixed_ptr + row * K + t).to(tl.int32)
        else:
            best = tl.max(key, axis=0)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
            i = _key_index(best).to(tl.int32)
            kth = _key_value(best)
        picked = tl.where(kk == t, i, picked)
    wk = tl.sum(tl.where((w[None, :] == picked[:, None]) & (kk < K)[:, None], sc[None, :], 0.0), axis=1)
    wk = wk / (tl.sum(wk, axis=0) + 1e-20) * scale
    tl.store(idx_ptr + row * K + kk, picked.to(tl.int64), mask=kk < K)
    tl.store(w_ptr + row * K + kk, wk, mask=kk < K)
    if HAS_NEXT and not FIXED:
        margin = kth - _key_value(tl.max(key, axis=0))
    else:
        margin = float("inf")
    tl.store(margin_ptr + row, margin)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, I, limit, stride_g, stride_u, stride_y,
                  HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = silu(min(g, limit)) * clamp(u, -limit, limit) in fp32, rounded once to y's dtype."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(y_ptr + row * stride_y + c, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def hc_mix_partial_kernel(h_ptr, fn_ptr, part_ptr, N, D, CHUNK, MIX, stride_h, stride_fn, stride_p, stride_hn,
                          PW: tl.constexpr, NP: tl.constexpr, MIXP: tl.constexpr, BLOCK_D: tl.constexpr,
                          DOTS: tl.constexpr = True):
    """Split part of mHC's mix: per (row, split) over one chunk of D for all N streams (stream j of a row at
    j * stride_hn: 0 for the first block's streams, one embedding broadcast), the dots with every fn row (fn
    [MIX, N * D]: stream j's column d at j * D + d) at part[row, split, :MIX] and the streams' Gram matrix
    sum_d h_j h_k at part[row, split, MIX:MIX + N * N] (its trace: the sum of squares; in fp64, as part is, so
    that pre^T G pre keeps the precision of a direct sum of squares of x even where the streams cancel). Split
    so the 1.5 MB fn (V4-Flash) streams through many SMs at decode; hc_pre_kernel adds the splits in order.
    DOTS False (many rows): the Gram matrix alone, hc_mix_dot_kernel writes the dots."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    i = tl.arange(0, NP)
    i_ok = i < N
    j = tl.arange(0, MIXP)
    j_ok = j < MIX
    acc = tl.zeros([MIXP, NP, BLOCK_D], dtype=tl.float32)
    gram = tl.zeros([NP, NP, BLOCK_D], dtype=tl.float64)
    for dd in range(0, CHUNK, BLOCK_D):
        rd = sp * CHUNK + dd + tl.arange(0, BLOCK_D)
        hd_ok = i_ok[:, None] & (rd < D)[None, :]
        hv = tl.load(h_ptr + row * stride_h + i[:, None] * stride_hn + rd[None, :], mask=hd_ok,
                     other=0.0).to(tl.float32)
        if DOTS:
            f = tl.load(fn_ptr + j[:, None, None] * stride_fn + (i[:, None] * D + rd[None, :])[None, :, :],
                        mask=j_ok[:, None, None] & hd_ok[None, :, :], other=0.0)
            acc += f * hv[None, :, :]
        hd = hv.to(tl.float64)
        gram += hd[:, None, :] * hd[None, :, :]
    out = part_ptr + row * stride_p + sp * PW
    if DOTS:
        tl.store(out + j, tl.sum(tl.sum(acc, axis=2), axis=1), mask=j_ok)
    tl.store(out + MIX + i[:, None] * N + i[None, :], tl.sum(gram, axis=2), mask=i_ok[:, None] & i_ok[None, :])


@triton.jit
def hc_mix_dot_kernel(h_ptr, fn_ptr, part_ptr, ROWS, N, D, CHUNK, MIX, stride_h, stride_fn, stride_p, stride_hn,
                      PW: tl.constexpr, MIXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_FN: tl.constexpr = False):
    """The mix dots at many rows (a prefill): part[row, split, :MIX] = sum over the N streams and the split's
    CHUNK of D of h[row, j, d] fn[m, j * D + d], as hc_mix_partial_kernel's, for BLOCK_M rows a program, so a
    tile of fn serves BLOCK_M rows (one row a program re-read the 1.5 MB fn from the L2 for every row). SPLIT_FN
    (bf16 streams) splits each fp32 fn tile into three parts of the streams' dtype (8 + 8 + 8 bits: the whole fp32
    significand, and bf16 has fp32's exponent range), so three tensor-core dots take exact products; otherwise one
    tl.dot in IEEE fp32 (no tf32). Each BLOCK_K step's dots start from zero and are added to an fp64 sum on the
    FMA units (promotion, as DeepSeek's FP8 GEMMs do on Hopper): sm_90's tensor cores do not sum fp32 in IEEE
    order, and carried over every step the dots came 5.3e-5 rel. from float64 at 4096 rows; promoted, 1.3e-7, the
    row form's 2.2e-7 or better, for 1.3% more time (NOTES runs 159, 166)."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    sp = tl.program_id(1)
    m = tl.arange(0, MIXP)
    r_ok = r < ROWS
    m_ok = m < MIX
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, D)
    rows = h_ptr + r.to(tl.int64)[:, None] * stride_h
    acc = tl.zeros([BLOCK_M, MIXP], dtype=tl.float64)
    for j in range(N):
        for d0 in range(lo, hi, BLOCK_K):
            d = d0 + tl.arange(0, BLOCK_K)
            d_ok = d < hi
            hv = tl.load(rows + j * stride_hn + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            f = tl.load(fn_ptr + m[None, :] * stride_fn + (j * D + d)[:, None], mask=d_ok[:, None] & m_ok[None, :],
                        other=0.0)
            if SPLIT_FN:
                p1 = f.to(hv.dtype)
                rest = f - p1.to(tl.float32)
                p2 = rest.to(hv.dtype)
                p3 = (rest - p2.to(tl.float32)).to(hv.dtype)
                step = tl.dot(hv, p3)
                step = tl.dot(hv, p2, step)
                step = tl.dot(hv, p1, step)
            else:
                step = tl.dot(hv.to(tl.float32), f, input_precision="ieee")
            acc += step.to(tl.float64)
    out = part_ptr + r.to(tl.int64)[:, None] * stride_p + sp * PW + m[None, :]
    tl.store(out, acc, mask=r_ok[:, None] & m_ok[None, :])


@triton.jit
def hc_pre_kernel(part_ptr, h_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, x_ptr,
                  N, D, SPLIT, ITERS, NORM_EPS, HC_EPS, stride_p, stride_h, stride_x, stride_hn,
                  PW: tl.constexpr, NP: tl.constexpr, SPLITP: tl.constexpr, BLOCK_D: tl.constexpr,
                  WEIGHTS: tl.constexpr = False, NORM: tl.constexpr = False, nw_ptr=None, xn_ptr=None,
                  BLOCK_EPS=0.0):
    """Program (row, D block), fp32, from the split mix sums part [row, split, PW] (the dots with fn's rows,
    then the streams' Gram matrix G at PW - N*N; splits summed in order, times the streams' inverse RMS).
    The collapse (op hc_pre; the model head's, whose fn has N rows, too): pre = sigmoid + eps and this block of
    the collapsed block input sum_k pre_k h_k in x's dtype; every D block recomputes pre so the collapse spreads
    over the GPU. NORM: also this block of the block's normed input x * rsqrt(mean(x^2) + BLOCK_EPS) * nw (the
    RMSNorm after mHC, no launch of its own): the sum of squares of the whole row of x is pre^T G pre (fp64:
    with streams that cancel, ||h||^2 >> ||x||^2, an fp32 G would lose that ratio squared), so no block waits
    for another (it is that of x before x is rounded to its dtype: the same up to that rounding).
    WEIGHTS (op hc_weights, one program a row, beside the block): post = 2 sigmoid and comb = row softmax then
    ITERS alternating column/row normalizations (Sinkhorn) instead, into post_ptr and comb_ptr."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    ok = i < N
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = rd < D
    if not WEIGHTS:
        hv = tl.load(h_ptr + row * stride_h + i[:, None] * stride_hn + rd[None, :], mask=ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)  # first: its round trip overlaps the split sums' loads below
    sp = tl.arange(0, SPLITP)  # every split's partials loaded at once and summed by a tree (fixed order)
    sp_ok = sp < SPLIT
    part = part_ptr + row * stride_p + sp * PW
    ok2 = ok[:, None] & ok[None, :]
    ij = i[:, None] * N + i[None, :]
    gram = tl.sum(tl.load(part[:, None, None] + PW - N * N + ij[None, :, :], mask=sp_ok[:, None, None] & ok2[None],
                          other=0.0), axis=0)  # [NP, NP], fp64
    ss = tl.sum(tl.sum(tl.where(i[:, None] == i[None, :], gram, 0.0), axis=1), axis=0).to(tl.float32)  # trace
    r = 1.0 / tl.sqrt(ss / (N * D) + NORM_EPS)
    if WEIGHTS:
        m_post = tl.sum(tl.load(part[:, None] + N + i[None, :], mask=sp_ok[:, None] & ok[None, :], other=0.0),
                        axis=0).to(tl.float32)
        m_comb = tl.sum(tl.load(part[:, None, None] + 2 * N + ij[None, :, :],
                                mask=sp_ok[:, None, None] & ok2[None, :, :], other=0.0), axis=0).to(tl.float32)
        post = 2.0 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=ok, other=0.0))
        c = m_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij, mask=ok2, other=0.0)
        c = tl.where(ok2, c, tl.where(ok[:, None], float("-inf"), 0.0))  # padded columns get no mass
        e = tl.exp(c - tl.max(c, axis=1)[:, None])
        comb = tl.where(ok2, e / tl.sum(e, axis=1)[:, None] + HC_EPS, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + HC_EPS)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + HC_EPS)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + HC_EPS)
        tl.store(post_ptr + row * N + i, post, mask=ok)
        tl.store(comb_ptr + row * N * N + ij, comb, mask=ok2)
    else:
        m_pre = tl.sum(tl.load(part[:, None] + i[None, :], mask=sp_ok[:, None] & ok[None, :], other=0.0),
                       axis=0).to(tl.float32)
        pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=ok, other=0.0)) + HC_EPS
        pre = tl.where(ok, pre, 0.0)
        x = tl.sum(pre[:, None] * hv, axis=0).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + rd, x, mask=d_ok)
        if NORM:
            pd = pre.to(tl.float64)
            ssx = tl.maximum(tl.sum(tl.sum(pd[:, None] * gram * pd[None, :], axis=1), axis=0), 0.0)
            rx = (1.0 / tl.sqrt(ssx / D + BLOCK_EPS)).to(tl.float32)
            y = x.to(tl.float32) * rx * tl.load(nw_ptr + rd, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(xn_ptr + row * stride_x + rd, y.to(xn_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def hc_post_kernel(out_ptr, h_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, part_ptr, N, D, MIX, stride_o, stride_h,
                   stride_y, stride_fn, stride_p, stride_hn, NP: tl.constexpr, BLOCK_D: tl.constexpr,
                   MIXP: tl.constexpr = 1, PW: tl.constexpr = 1, MIX_NEXT: tl.constexpr = False,
                   STEPS: tl.constexpr = 1, DOTS: tl.constexpr = True):
    """New streams y[k, d] = post_k out[d] + sum_j comb[j, k] h[j, d] (fp32), one row and STEPS D blocks per
    program; h [rows, N, D] (stream stride stride_hn: 0 for the first block's broadcast embedding) and y
    contiguous per row, post [rows, N], comb [rows, N, N] fp32. Every input of a block
    (and fn's slice) is loaded before any arithmetic: a loop over j or k waited for one round trip per step.
    MIX_NEXT (the op hc_post_pre): also the next hc_pre's split mix partials of this program's blocks, from y as
    rounded to its dtype (what hc_pre would read): the dots with fn's MIX rows (fp32 sums) and the streams' Gram
    matrix (fp64), at part[row, split, :MIX] and part[row, split, MIX:] (hc_mix_partial_kernel's layout, one
    split per program). STEPS > 1 (a prefill's many rows): fewer, longer programs, and fewer splits for hc_pre.
    DOTS False (many rows): the Gram matrix alone, hc_mix_dot_kernel writes the dots from y."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    ok = i < N
    m = tl.arange(0, MIXP)
    m_ok = m < MIX
    post = tl.load(post_ptr + row * N + i, mask=ok, other=0.0)
    comb = tl.load(comb_ptr + row * N * N + i[:, None] * N + i[None, :], mask=ok[:, None] & ok[None, :], other=0.0)
    dots = tl.zeros([MIXP, NP, BLOCK_D], dtype=tl.float32)
    gram = tl.zeros([NP, NP, BLOCK_D], dtype=tl.float64)
    for step in range(STEPS):
        rd = (tl.program_id(1) * STEPS + step) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = rd < D
        jd_ok = ok[:, None] & d_ok[None, :]
        o = tl.load(out_ptr + row * stride_o + rd, mask=d_ok, other=0.0).to(tl.float32)
        hh = tl.load(h_ptr + row * stride_h + i[:, None] * stride_hn + rd[None, :], mask=jd_ok,
                     other=0.0).to(tl.float32)
        if MIX_NEXT and DOTS:
            f = tl.load(fn_ptr + m[:, None, None] * stride_fn + (i[:, None] * D + rd[None, :])[None, :, :],
                        mask=m_ok[:, None, None] & jd_ok[None, :, :], other=0.0)  # [MIX, k, d]
        acc = post[:, None] * o[None, :] + tl.sum(comb[:, :, None] * hh[:, None, :], axis=0)  # [k, d]
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_y + i[:, None] * D + rd[None, :], y, mask=jd_ok)
        if MIX_NEXT:
            yf = tl.where(jd_ok, y.to(tl.float32), 0.0)
            if DOTS:
                dots += f * yf[None, :, :]
            yd = yf.to(tl.float64)
            gram += yd[:, None, :] * yd[None, :, :]
    if MIX_NEXT:
        at = part_ptr + row * stride_p + tl.program_id(1) * PW
        if DOTS:
            tl.store(at + m, tl.sum(tl.sum(dots, axis=2), axis=1), mask=m_ok)
        tl.store(at + MIX + i[:, None] * N + i[None, :], tl.sum(gram, axis=2), mask=ok[:, None] & ok[None, :])


# ----------------------------------------------------------------------------------------------------
# MXFP4 at one token on the tensor cores (CUDA sm_80+, inline PTX mma.sync m16n8k16 bf16 -> fp32)
#
# The weights are repacked once (ops: `mma_repack`) so that each lane's two 16-byte loads of a [16 rows x 128 K]
# tile hold exactly its A fragments for the tile's 8 mma steps, with each code's bits placed so that shifts and
# masks (`_a_regs`: 12 integer instructions a word of 8 codes) make bf16 pairs of E2M1 x 2^-126 values (bf16
# subnormals for the 0.5 code: exact on the tensor cores). x is the B operand times 2^64 (so products of ordinary
# activations stay fp32 normals), block-diagonal over the tile's 4 scale groups and split hi + lo in bf16 (columns
# 2q, 2q + 1 hold group q's two parts); so each accumulator column holds one group's partial sum, and per tile the
# lane undoes the 2^-62 and applies the group scales. These kernels are written per thread: every address comes
# from the hardware lane id and each program is one warp, so they do not depend on how Triton lays tensors over
# threads; the split-K sums and the epilogues are ordinary Triton code over the tile's rows (fixed-order trees).
# Limits: |x| < 2^64 (bf16 x 2^64 must not overflow); a product |code x x| below about 2^-87 flushes to zero.


@triton.jit
def _lane_roles():
    """This thread's (lane, g, t, gg, part): fragment row group g = lane // 4, column pair t = lane % 4, and for
    the B operand its column's scale group gg = g // 2 and hi/lo part g % 2 (one [32] element per lane)."""
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((32,), dtype=tl.int32)],
                                     dtype=tl.int32, is_pure=True, pack=1)
    g = lane // 4
    return lane, g, lane % 4, g // 2, g % 2


@triton.jit
def _ld16(ptr):
    """16 bytes as 4 words (streamed once: no L1 allocation)."""
    return tl.inline_asm_elementwise("ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                     [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True,
                                     pack=1)


@triton.jit
def _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _quad_sum(v):
    """Sum over the 4 lanes of a fragment row (lane xor 1, 2)."""
    v += tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, 0xffffffff;", "=f,f", [v], dtype=tl.float32,
                                   is_pure=True, pack=1)
    return v + tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;", "=f,f", [v],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _a_regs(w):
    """A word's 8 codes -> the lane's 4 A registers (see `mma_repack` for where each code's bits sit)."""
    p0 = w & 0x81C081C0
    p1 = ((w >> 3) & 0x01C001C0) | ((w << 1) & 0x80008000)
    p2 = ((w << 3) & 0x01C001C0) | ((w << 2) & 0x80008000)
    p3 = ((w << 6) & 0x01C001C0) | ((w << 3) & 0x80008000)
    return p0, p1, p2, p3


@triton.jit
def _mma_step(w, b0, b1, act, c0, c1, c2, c3):
    a0, a1, a2, a3 = _a_regs(w)
    z = tl.zeros_like(b0)
    return _mma_bf16(a0, a1, a2, a3, tl.where(act, b0, z), tl.where(act, b1, z), c0, c1, c2, c3)


@triton.jit
def _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg, s0, s1):
    """One [16 rows x 128 K] tile: 8 mma steps; the lane's B registers (xb*) are live in steps 2 gg, 2 gg + 1
    (its column's group). Returns the tile's contribution to rows g and g + 8, group scales applied."""
    c0 = tl.zeros_like(s0).to(tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    c0, c1, c2, c3 = _mma_step(w0, xb0, xb1, gg == 0, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w1, xb2, xb3, gg == 0, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w2, xb0, xb1, gg == 1, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w3, xb2, xb3, gg == 1, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w4, xb0, xb1, gg == 2, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w5, xb2, xb3, gg == 2, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w6, xb0, xb1, gg == 3, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w7, xb2, xb3, gg == 3, c0, c1, c2, c3)
    two62 = 4611686018427387904.0  # undoes E2M1 x 2^-126 and x x 2^64 before the scale: no exponent wraps
    return (c0 + c1) * two62 * _e8m0(s0, 0), (c2 + c3) * two62 * _e8m0(s1, 0)


@triton.jit
def _x_2_64(v0, v1, v2, v3):
    """4 bf16 pairs times 2^64 (x * 2^64 + -0 by fma.bf16x2: exact, which sm_80 has and mul.bf16x2 needs sm_90)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 c, z; mov.b32 c, 0x5F805F80; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $4, c, z; "
        "fma.rn.bf16x2 $1, $5, c, z; fma.rn.bf16x2 $2, $6, c, z; fma.rn.bf16x2 $3, $7, c, z; }",
        "=r,=r,=r,=r,r,r,r,r", [v0, v1, v2, v3],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _mma_x(x_ptr, part):
    """The lane's 4 B registers of a tile from its first x pair: bf16 x times 2^64 (hi part; lanes of the lo
    part get zero)."""
    p = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    v0, v1, v2, v3 = _x_2_64(tl.load(p), tl.load(p + 4), tl.load(p + 8), tl.load(p + 12))
    z = tl.zeros_like(v0)
    hi = part == 0
    return tl.where(hi, v0, z), tl.where(hi, v1, z), tl.where(hi, v2, z), tl.where(hi, v3, z)


@triton.jit
def _mma_h(ptr):
    """The lane's 4 B registers of a tile of the split h, stored in lane order (`_hb_index`): one 16-byte load
    (through L1: every row tile's programs read the same h). Not pure: h is written by the launch before, so the
    compiler must keep this load after the programmatic dependent launch's wait (a pure asm may be hoisted)."""
    return tl.inline_asm_elementwise("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)


@triton.jit
def _mma_program(e_ptr, K, SPLIT: tl.constexpr):
    """A one-warp program's place: (row-tile program, pair j, K part sk, row-tile programs, pair j's expert, the
    K tiles of a row tile, those of one part)."""
    ktt = K // 128
    return (tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
            tl.load(e_ptr + tl.program_id(1)).to(tl.int64), ktt, ktt // SPLIT)


@triton.jit
def _mma_tile_load(wp, sp, n):
    """The lane's 8 words and 2 scale bytes of tile n from its tile-0 addresses (wp: the lane's first word of a
    tile stored as [2, 32 lanes, 4 words], so each 16-byte load of a warp reads 512 consecutive bytes; sp: its
    scale pair, read as one 16-bit load)."""
    w0, w1, w2, w3 = _ld16(wp + n * 256)
    w4, w5, w6, w7 = _ld16(wp + n * 256 + 128)
    sv = tl.load((sp + n * 64).to(tl.pointer_type(tl.uint16), bitcast=True))
    return w0, w1, w2, w3, w4, w5, w6, w7, sv & 0xFF, sv >> 8


@triton.jit
def _hb_index(ch):
    """Where h's channel ch (hi part; lo: + 32) sits in hb: per 128-channel tile, in the order the down kernel's
    lanes read their B registers (lane = 4 (2 gg + part) + t holds pairs 2t, 2t + 8, 2t + 16, 2t + 24 of group gg:
    8 consecutive bf16, one 16-byte load)."""
    kk = ch % 128
    r = kk % 32
    return (ch // 128) * 256 + (8 * (kk // 32) + (r % 8) // 2) * 8 + (r // 8) * 2 + r % 2


@triton.jit
def moe_mma_gate_up_kernel(x_ptr, w_ptr, s_ptr, e_ptr, part_ptr, lock_ptr, hb_ptr, I, D, TOPK, limit,
                           HAS_LIMIT: tl.constexpr, SPLIT: tl.constexpr, SPLITP: tl.constexpr,
                           PDL: tl.constexpr = False):
    """A few tokens, one warp a program: (16-channel tile c, pair j = token j // TOPK's slot, K part sk) streams
    the gate and the up row tiles of expert e_ptr[j] (repacked, interleaved per 16 rows) over D / SPLIT against
    that token's x. The last K part of a tile to
    arrive adds the SPLIT partials (a fixed tree), applies the clamped SwiGLU and writes h times 2^64 split hi + lo
    in bf16: hb [pairs, I / 128, 256] (the down kernel's B operand as it is, `_hb_index`). PDL (sm_90): the down launch
    may start once every program of this one has started (it waits for this launch's end before it reads h)."""
    if PDL:
        gdc_launch_dependents()
    c, j, sk, n_ct, e, ktt, kt = _mma_program(e_ptr, D, SPLIT)
    lane, g, t, gg, part = _lane_roles()
    tile0 = (e * n_ct + c) * 2 * ktt + sk * kt  # the gate row tile's first tile of this part; up: + ktt
    wg = w_ptr + (tile0 * 256 + lane * 4)
    wu = wg + ktt * 256
    sg = s_ptr + (tile0 * 64 + lane * 2)
    su = sg + ktt * 64
    xp = x_ptr + ((j // TOPK).to(tl.int64) * D + sk * kt * 128 + gg * 32 + 2 * t)
    a0, a1, a2, a3, a4, a5, a6, a7, gs0, gs1 = _mma_tile_load(wg, sg, 0)
    b0, b1, b2, b3, b4, b5, b6, b7, us0, us1 = _mma_tile_load(wu, su, 0)
    x0, x1, x2, x3 = _mma_x(xp, part)
    gt = tl.zeros((32,), dtype=tl.float32)
    gb = gt
    ut = gt
    ub = gt
    for i in range(kt):
        w0, w1, w2, w3, w4, w5, w6, w7 = a0, a1, a2, a3, a4, a5, a6, a7
        v0, v1, v2, v3, v4, v5, v6, v7 = b0, b1, b2, b3, b4, b5, b6, b7
        cg0, cg1, cu0, cu1 = gs0, gs1, us0, us1
        y0, y1, y2, y3 = x0, x1, x2, x3
        n = tl.minimum(i + 1, kt - 1)  # the last step reloads its own tile (unused)
        a0, a1, a2, a3, a4, a5, a6, a7, gs0, gs1 = _mma_tile_load(wg, sg, n)
        b0, b1, b2, b3, b4, b5, b6, b7, us0, us1 = _mma_tile_load(wu, su, n)
        x0, x1, x2, x3 = _mma_x(xp + n * 128, part)
        top, bot = _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2, y3, gg, cg0, cg1)
        gt += top
        gb += bot
        top, bot = _mma_tile(v0, v1, v2, v3, v4, v5, v6, v7, y0, y1, y2, y3, gg, cu0, cu1)
        ut += top
        ub += bot
    pp = part_ptr + (j * SPLIT + sk) * 2 * I + c * 16 + g
    tl.store(pp, _quad_sum(gt), mask=t == 0)
    tl.store(pp + 8, _quad_sum(gb), mask=t == 0)
    tl.store(pp + I, _quad_sum(ut), mask=t == 0)
    tl.store(pp + I + 8, _quad_sum(ub), mask=t == 0)
    tl.debug_barrier()
    lock_at = lock_ptr + j * n_ct + c
    if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
        q = tl.arange(0, SPLITP)[:, None]
        ch = c * 16 + tl.arange(0, 16)[None, :]
        at = part_ptr + (j * SPLIT + q) * 2 * I + ch
        ok = q < SPLIT
        gs = tl.sum(tl.load(at, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        us = tl.sum(tl.load(at + I, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        if HAS_LIMIT:
            gs = tl.minimum(gs, limit)
            us = tl.minimum(tl.maximum(us, -limit), limit)
        h = gs / (1.0 + tl.exp(-gs)) * us * 18446744073709551616.0  # x 2^64: exact
        hi = h.to(tl.bfloat16)
        lo = (h - hi.to(tl.float32)).to(tl.bfloat16)
        at = hb_ptr + j * 2 * I + _hb_index(c * 16 + tl.arange(0, 16))
        tl.store(at, hi)
        tl.store(at + 32, lo)  # part 1: the lanes 4 x 2 further on
        tl.atomic_xchg(lock_at, 0)


@triton.jit
def moe_mma_down_kernel(hb_ptr, w_ptr, s_ptr, e_ptr, wt_ptr, part_ptr, lock_ptr, out_ptr, add_ptr, D, I, TOPK,
                        SPLIT: tl.constexpr, TOPKP: tl.constexpr, SUM: tl.constexpr, HAS_ADD: tl.constexpr,
                        PDL: tl.constexpr = False):
    """A few tokens, one warp a program: (16-row tile r of D, pair j, K part sk) streams expert e_ptr[j]'s down
    rows over I / SPLIT (a power of two), two tiles a step, with hb (the gate/up kernel's split h) as B. The last
    arrival adds the partials by fixed trees: SUM: out[t, r rows] = sum_j wt[j] sum_sk part (+ add[t]) over the
    TOPK pairs of token t = j // TOPK, else out[j, r rows] = wt[j] sum_sk part (fp32 contributions). PDL (sm_90,
    launched as a programmatic dependent of the launch before it, gate/up or a kernel after it): the first step's
    weights and the pairs' experts are read before the wait in the source, so they must have been written before
    gate/up began (the host launches without PDL right after a repack); everything else is read and written after
    it. (In the sm_90 SASS only the scales and experts load before it: ptxas sinks the words' .nc loads below the
    wait. Loads kept above it, up to all of a part's tiles, were no faster: NOTES run 118.)"""
    r, j, sk, n_rt, e, ktt, kt = _mma_program(e_ptr, I, SPLIT)
    lane, g, t, gg, part = _lane_roles()
    tile0 = (e * n_rt + r) * ktt + sk * kt
    wp = w_ptr + (tile0 * 256 + lane * 4)
    sp = s_ptr + (tile0 * 64 + lane * 2)
    xp = hb_ptr + (j * 2 * I + sk * kt * 256 + lane * 8)
    a0, a1, a2, a3, a4, a5, a6, a7, as0, as1 = _mma_tile_load(wp, sp, 0)
    b0, b1, b2, b3, b4, b5, b6, b7, bs0, bs1 = _mma_tile_load(wp + 256, sp + 64, 0)  # tile 1
    if PDL:
        gdc_wait()  # gate/up (and every earlier launch) done and its writes visible: hb, the shared expert
    x0, x1, x2, x3 = _mma_h(xp)
    x4, x5, x6, x7 = _mma_h(xp + 256)
    top = tl.zeros((32,), dtype=tl.float32)
    bot = top
    for i in range(0, kt, 2):
        w0, w1, w2, w3, w4, w5, w6, w7 = a0, a1, a2, a3, a4, a5, a6, a7
        v0, v1, v2, v3, v4, v5, v6, v7 = b0, b1, b2, b3, b4, b5, b6, b7
        ca0, ca1, cb0, cb1 = as0, as1, bs0, bs1
        y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        n = tl.minimum(i + 2, kt - 2)  # the last step reloads its own tiles (unused)
        a0, a1, a2, a3, a4, a5, a6, a7, as0, as1 = _mma_tile_load(wp, sp, n)
        b0, b1, b2, b3, b4, b5, b6, b7, bs0, bs1 = _mma_tile_load(wp + 256, sp + 64, n)  # n + 1
        x0, x1, x2, x3 = _mma_h(xp + n * 256)
        x4, x5, x6, x7 = _mma_h(xp + n * 256 + 256)
        p, q = _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2, y3, gg, ca0, ca1)
        top += p
        bot += q
        p, q = _mma_tile(v0, v1, v2, v3, v4, v5, v6, v7, y4, y5, y6, y7, gg, cb0, cb1)
        top += p
        bot += q
    pp = part_ptr + (j * SPLIT + sk) * D + r * 16 + g
    tl.store(pp, _quad_sum(top), mask=t == 0)
    tl.store(pp + 8, _quad_sum(bot), mask=t == 0)
    tl.debug_barrier()
    rows = r * 16 + tl.arange(0, 16)
    if SUM:
        tok = j // TOPK
        lock_at = lock_ptr + tok * n_rt + r
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == TOPK * SPLIT - 1:
            slot = tl.arange(0, TOPKP)
            jj = tok * TOPK + slot[:, None, None]
            ss = tl.arange(0, SPLIT)[None, :, None]
            ok = slot[:, None, None] < TOPK
            parts = tl.load(part_ptr + (jj * SPLIT + ss) * D + rows[None, None, :], mask=ok, other=0.0,
                            cache_modifier=".cg")
            wts = tl.load(wt_ptr + tok * TOPK + slot, mask=slot < TOPK, other=0.0).to(tl.float32)
            tot = tl.sum(tl.sum(parts, axis=1) * wts[:, None], axis=0)
            out_at = tok.to(tl.int64) * D + rows
            if HAS_ADD:
                tot += tl.load(add_ptr + out_at).to(tl.float32)
            tl.store(out_ptr + out_at, tot.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(lock_at, 0)
    else:
        lock_at = lock_ptr + j * n_rt + r
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
            ss = tl.arange(0, SPLIT)[:, None]
            parts = tl.load(part_ptr + (j * SPLIT + ss) * D + rows[None, :], cache_modifier=".cg")
            tot = tl.sum(parts, axis=0) * tl.load(wt_ptr + j).to(tl.float32)
            tl.store(out_ptr + j * D + rows, tot)
            tl.atomic_xchg(lock_at, 0)


# FP8 at a few tokens (2-8 rows: a batched decode step) on the tensor cores (CUDA sm_80+, bf16 x). The checkpoint's
# own layout, no repack: lane (g, t) loads 32 consecutive bytes of W rows g and g + 8 a step of 128 columns (one scale
# block); its word i is mma step i's A registers (bytes 0-1: A columns 2t, 2t + 1; bytes 2-3: 2t + 8, 2t + 9), and its
# B registers are the same 4 x values of token g (B column g), so the mma's K order, free as long as A and B agree,
# is the bytes' own. E4M3 -> bf16 x 2^-120 in 3 integer instructions a pair, x x 2^64 as in the MXFP4 kernels; the
# accumulator's column n is token n: lane (g, t) ends with rows g, g + 8 of tokens 2t, 2t + 1. At one token the
# stream is as fast (NOTES run 61) and fuses x's norm or SwiGLU, so it keeps M = 1. Limits as the MXFP4 kernels'.


@triton.jit
def _ld16x(ptr):
    """16 bytes as 4 words, cached (x: every program of the launch reads it)."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _e4m3_bf16x2(w):
    """A word's 4 E4M3 bytes -> bf16 pairs (bytes 0, 1) and (2, 3) of value x 2^-120: each byte with its sign
    replicated into the byte above (prmt), shifted left 4 and masked, puts s at bit 15 and eeee|mmm at 10..4."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; prmt.b32 a, $2, $2, 0x9180; prmt.b32 b, $2, $2, 0xB3A2; shl.b32 a, a, 4; "
        "shl.b32 b, b, 4; and.b32 $0, a, 0x87F087F0; and.b32 $1, b, 0x87F087F0; }",
        "=r,=r,r", [w], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _fp8_mma_load(wp, wp8, k):
    """The lane's 16 words of the step at column k: 32 bytes of row g (wp) and of row g + 8 (wp8), the pointers
    already at the lane's 32 t bytes."""
    return _ld16(wp + k) + _ld16(wp + k + 16) + _ld16(wp8 + k) + _ld16(wp8 + k + 16)


@triton.jit
def _fp8_mma_x(xp, keep):
    """The lane's 16 B registers of a step: its token's 32 x values at xp times 2^64, zero where not keep."""
    r = ()
    for j in tl.static_range(4):
        x0, x1, x2, x3 = _x_2_64(*_ld16x(xp + 8 * j))
        z = tl.zeros_like(x0)
        r = r + (tl.where(keep, x0, z), tl.where(keep, x1, z), tl.where(keep, x2, z), tl.where(keep, x3, z))
    return r


@triton.jit
def _fp8_mma_store(y_ptr, at, stride_ym, m, M, v):
    tl.store(y_ptr + m * stride_ym + at, v.to(y_ptr.dtype.element_ty), mask=m < M)


@triton.jit
def fp8_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr, M, R, K, stride_xm, stride_xg, stride_wn,
                   stride_sn, stride_ym, stride_yg, stride_ps, K_CHUNK, SPLIT: tl.constexpr, SPLITP: tl.constexpr):
    """M <= 8 tokens, one warp a program: (16-row tile c, K part sk, group grp) streams W's rows grp * R + 16 c ..
    over [sk K_CHUNK, +K_CHUNK) in steps of 128 columns, the next step's loads issued before this one's mma.
    y[m, grp, rows] in y's dtype; SPLIT > 1: the partials ([SPLIT, M, G, R] fp32 at part_ptr, y's strides after
    the first) are added by the last to arrive."""
    c = tl.program_id(0)
    sk = tl.program_id(1)
    grp = tl.program_id(2)
    lane, g, t, _, _ = _lane_roles()
    row0 = grp * R + c * 16
    k_lo = sk * K_CHUNK
    steps = (tl.minimum(K - k_lo, K_CHUNK)) // 128
    wp = w_ptr + ((row0 + g).to(tl.int64) * stride_wn + k_lo + t * 32)
    wp8 = wp + 8 * stride_wn
    keep = g < M  # B column g is token g
    xp = x_ptr + (tl.minimum(g, M - 1).to(tl.int64) * stride_xm + grp * stride_xg + k_lo + t * 32)
    sp = s_ptr + ((row0 // 128) * stride_sn + k_lo // 128)
    nxt = _fp8_mma_load(wp, wp8, 0)
    z = tl.zeros((32,), dtype=tl.float32)
    top0, top1, bot0, bot1 = z, z, z, z
    two56 = 72057594037927936.0  # undoes E4M3 x 2^-120 and x x 2^64 before the scale: no exponent wraps
    for i in range(steps):
        cur = nxt
        nxt = _fp8_mma_load(wp, wp8, tl.minimum(i + 1, steps - 1) * 128)  # the last step reloads (unused)
        xb = _fp8_mma_x(xp + i * 128, keep)
        q0, q1, q2, q3 = z, z, z, z
        for j in tl.static_range(8):
            a0, a2 = _e4m3_bf16x2(cur[j])
            a1, a3 = _e4m3_bf16x2(cur[8 + j])
            q0, q1, q2, q3 = _mma_bf16(a0, a1, a2, a3, xb[2 * j], xb[2 * j + 1], q0, q1, q2, q3)
        sc = _e8m0(tl.load(sp + i), 0)  # applied after two56 (folded first, scales from 2^72 up would overflow)
        top0 += q0 * two56 * sc
        top1 += q1 * two56 * sc
        bot0 += q2 * two56 * sc
        bot1 += q3 * two56 * sc
    at = grp * stride_yg + c * 16 + g
    dst = y_ptr if SPLIT == 1 else part_ptr + sk * stride_ps  # y, or this part's fp32 partials
    _fp8_mma_store(dst, at, stride_ym, 2 * t, M, top0)
    _fp8_mma_store(dst, at, stride_ym, 2 * t + 1, M, top1)
    _fp8_mma_store(dst, at + 8, stride_ym, 2 * t, M, bot0)
    _fp8_mma_store(dst, at + 8, stride_ym, 2 * t + 1, M, bot1)
    if SPLIT > 1:
        tl.debug_barrier()
        lock_at = lock_ptr + c + tl.num_programs(0) * grp
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
            # the last K part to arrive adds the partials by one fixed tree. Its tensors are made afresh (not from
            # the lane-role ones, whose layout must stay one element a lane: a 2-D use would re-lay them)
            q = tl.arange(0, SPLITP)[:, None, None]
            m = tl.arange(0, 8)[None, :, None]
            rows = grp * stride_yg + c * 16 + tl.arange(0, 16)[None, None, :]
            ok = (q < SPLIT) & (m < M)
            parts = tl.load(part_ptr + q * stride_ps + m * stride_ym + rows, mask=ok, other=0.0, cache_modifier=".cg")
            m2 = tl.arange(0, 8)[:, None]
            tl.store(y_ptr + m2 * stride_ym + grp * stride_yg + c * 16 + tl.arange(0, 16)[None, :],
                     tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=m2 < M)
            tl.atomic_xchg(lock_at, 0)


# ----------------------------------------------------------------------------------------------------
# ISA compile specs (pytest_cdna2/isa.py compiles each ahead of time for gfx90a and sm_90). One entry per
# kernel at representative V4-Flash tiles; `matmul` says whether the kernel must contain MFMA (v_mfma).


def _sig(names: str, types: str, **const: object) -> tuple[dict[str, str], dict[str, object]]:
    """Signature dict from parallel space-separated lists; constexpr names given as keywords."""
    sig = dict(zip(names.split(), types.split(), strict=True))
    sig.update({k: "constexpr" for k in const})
    return sig, dict(const)


_FP8_ARGS = ("x_ptr w_ptr s_ptr y_ptr M R K stride_xm stride_xg stride_wn stride_sn stride_ym stride_yg",
             "*bf16 *u8 *u8 *bf16 i32 i32 i32 i32 i32 i32 i32 i32 i32")
_FP8_STREAM_ARGS = (_FP8_ARGS[0] + " K_CHUNK part_ptr lock_ptr stride_ps", _FP8_ARGS[1] + " i32 *fp32 *i32 i32")
_FP8_WORDS_ARGS = (_FP8_STREAM_ARGS[0], _FP8_STREAM_ARGS[1].replace("*u8", "*i32", 1))  # PREFETCH: W as uint32 words
_MOE_UP = ("x_ptr w1_ptr s1_ptr w3_ptr s3_ptr h_ptr pair_tok_ptr blk_e_ptr blk_lo_ptr blk_hi_ptr I D limit "
           "stride_xt stride_we stride_wn stride_se stride_sn stride_hp",
           "*bf16 *u8 *u8 *u8 *u8 *fp32 *i32 *i32 *i32 *i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32")
_MOE_DOWN = ("h_ptr w2_ptr s2_ptr c_ptr pair_id_ptr pair_w_ptr blk_e_ptr blk_lo_ptr blk_hi_ptr D I "
             "stride_hp stride_we stride_wn stride_se stride_sn stride_cp out_ptr add_ptr lock_ptr",
             "*fp32 *u8 *u8 *fp32 *i32 *fp32 *i32 *i32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 *bf16 *bf16 *i32")
_ATTN = ("q_ptr kv_ptr sink_ptr mask_ptr o_ptr S H L D scale stride_qb stride_qs stride_qh stride_kb "
         "stride_kl stride_mb stride_ms stride_ob stride_os stride_oh",
         "*bf16 *bf16 *fp32 *u8 *bf16 i32 i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32")
_IDX = ("q_ptr k_ptr w_ptr o_ptr S H T D scale stride_qb stride_qs stride_qh stride_kb stride_kt stride_wb "
        "stride_ws stride_ob stride_os",
        "*bf16 *bf16 *bf16 *fp32 i32 i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32")

# (name, kernel, (signature, constexprs), num_warps, matmul)
ISA_SPECS: list[tuple[str, object, tuple[dict[str, str], dict[str, object]], int, bool]] = [
    ("fp8_stream", fp8_stream_kernel,  # the default tile (FP8_STREAM)
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, LOCAL=16), 4, False),
    ("fp8_stream_unroll", fp8_stream_kernel,  # two tiles a step, no in-thread sums
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=2, SPLIT=1), 4, False),
    ("fp8_stream_long", fp8_stream_kernel,  # FP8_STREAM_LONG: 8 rows x 1 KB a step (K >= 2048), split K
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=8, BLOCK_K=1024, HW=False, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, LOCAL=16),
     4, False),
    ("fp8_stream_xnorm", fp8_stream_kernel,  # wq_b's form: q_norm applied as x is read (the row's RMS first)
     _sig(_FP8_STREAM_ARGS[0] + " nw_ptr x_eps", _FP8_STREAM_ARGS[1] + " *bf16 fp32", BLOCK_N=32, BLOCK_K=256,
          HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, X_NORM=True, XP=1024, LOCAL=16), 4, False),
    ("fp8_stream_glu", fp8_stream_kernel,  # the shared expert's w2: swiglu(gate, up) applied as x is read
     _sig(_FP8_STREAM_ARGS[0] + " glu_limit", _FP8_STREAM_ARGS[1] + " fp32", BLOCK_N=8, BLOCK_K=1024,
          HW=False, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, X_GLU=2, LOCAL=16), 4, False),
    ("fp8_stream_rows", fp8_stream_kernel,  # gfx90a's E4M3 bit decode, per-row scales, split K
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=False, UNROLL=1, SPLIT=4, SPLITP=4, LOCAL=16),
     4, False),
    ("fp8_matmul", matmul_kernel,  # FP8_DOT as gfx90a runs a long prefill (64 rows a program)
     _sig(*_FP8_ARGS, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=False), 8, True),
    ("fp8_matmul_scaled_steps", matmul_kernel,  # fp32 x (and fp16): each step's partial scaled, no fold
     _sig(_FP8_ARGS[0], _FP8_ARGS[1].replace("*bf16 *u8 *u8 *bf16", "*fp32 *u8 *u8 *fp32"), BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=64, IEEE=True, FOLD=False), 8, True),
    ("dense_matmul", matmul_kernel,  # the compressors' bf16 W at a long prefill
     _sig(_FP8_ARGS[0], _FP8_ARGS[1].replace("*u8 *u8", "*bf16 *bf16"), BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
          IEEE=False, SCALED=False), 8, True),
    ("dense_matmul_parts", matmul_kernel,  # the head at a prefill with every position's logits: fp32 x, bf16 W
     _sig(_FP8_ARGS[0], "*fp32 *bf16 *bf16 *fp32 " + _FP8_ARGS[1].split(" ", 4)[4], BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=64, IEEE=False, SCALED=False, PARTS=3), 8, True),
    ("moe_gate_up_dot", moe_gate_up_kernel,
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=16, BLOCK_N=32, GROUPS=4, DOT=1), 4, True),
    ("moe_down_dot", moe_down_kernel,
     _sig(*_MOE_DOWN, BLOCK_M=16, BLOCK_N=64, GROUPS=4, DOT=1), 4, True),
    ("moe_gate_up_stream", moe_gate_up_kernel,  # the default gate/up tile (MOE_STREAM) as gfx90a runs it
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=4, GROUPS=32, STREAM=True), 2, False),
    ("moe_down_stream", moe_down_kernel,  # one token: the k pair rows summed by the last pair (+ shared)
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, SUM=True, HAS_ADD=True, SPLITP=8), 4, False),
    ("fp8_stream_prefetch", fp8_stream_kernel,  # the default tile (FP8_STREAM), register double buffering
     _sig(*_FP8_WORDS_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, PREFETCH=True,
          LOCAL=16), 4, False),
    ("moe_gate_up_stream_prefetch", moe_gate_up_kernel,
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=16, GROUPS=8, STREAM=True, PREFETCH=True), 4, False),
    ("moe_down_stream_prefetch", moe_down_kernel,
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, SUM=True, HAS_ADD=True, PREFETCH=True, SPLITP=8), 4, False),
    ("moe_sum", moe_sum_kernel, _sig("c_ptr out_ptr add_ptr D", "*fp32 *bf16 *bf16 i32", TOPK=6, BLOCK_D=1024,
                                     HAS_ADD=True), 4, False),
    ("rms_norm", rms_norm_kernel,
     _sig("x_ptr w_ptr y_ptr D eps stride_x stride_y", "*bf16 *bf16 *bf16 i32 fp32 i32 i32",
          HAS_W=True, BLOCK_D=4096), 4, False),
    ("rope", rope_kernel,
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32",
          BLOCK_H=64, BLOCK_D=512, BLOCK_R=32, NORM=False, HAS_W=False), 4, False),
    ("norm_rope", rope_kernel,  # decode: one head per program, RMSNorm (weighted, as kv_norm) then RoPE
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32",
          BLOCK_H=1, BLOCK_D=512, BLOCK_R=32, NORM=True, HAS_W=True), 4, False),
    ("norm_rope_ring", rope_kernel,  # decode's K=V row, also written into the window ring
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS ring_ptr ok_ptr pos_ptr W stride_rb stride_rs "
          "stride_ob", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32 *bf16 *u8 *i64 i32 i32 i32 i32",
          BLOCK_H=1, BLOCK_D=512, BLOCK_R=32, NORM=True, HAS_W=True, RING=True), 4, False),
    ("rope_cos_sin", rope_cos_sin_kernel,
     _sig("pos_ptr inv_ptr cos_ptr sin_ptr N HALF ALIGN", "*i64 *fp64 *fp64 *fp64 i32 i32 i32", BLOCK_N=16,
          BLOCK_R=32), 4, False),
    ("attention", attention_kernel,  # the model's form: the output's inverse RoPE in the epilogue (ROPE)
     _sig(_ATTN[0] + " cos_ptr sin_ptr HALF", _ATTN[1] + " *fp64 *fp64 i32", BLOCK_H=16, BLOCK_L=16,
          BLOCK_D=512, IEEE=False, SPLIT=False, CHUNK=0, part_ptr=None, ml_ptr=None, ROPE=True, SCAN=512), 8, True),
    ("attention_split", attention_kernel,
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=16, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=False), 8, True),
    ("attention_split_gather", attention_kernel,  # a decode split over a long context: only visible keys read
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=16, BLOCK_D=512, IEEE=False, SPLIT=True), 8, True),
    ("attention_combine", attention_combine_kernel,
     _sig("part_ptr ml_ptr sink_ptr o_ptr S H D n_split stride_ob stride_os stride_oh cos_ptr sin_ptr HALF",
          "*fp32 *fp32 *fp32 *bf16 i32 i32 i32 i32 i32 i32 i32 *fp64 *fp64 i32", BLOCK_H=16, BLOCK_D=32, BLOCK_S=16,
          ROPE=True), 4, False),
    ("index_scores", index_scores_kernel,
     _sig(*_IDX, BLOCK_H=64, BLOCK_T=32, BLOCK_D=128, IEEE=False), 4, True),
    ("index_scores_visible", index_scores_kernel,  # hidden entries -inf in the same launch
     _sig(_IDX[0] + " vis_ptr stride_vb stride_vs stride_vt", _IDX[1] + " *u8 i32 i32 i32", BLOCK_H=64, BLOCK_T=32,
          BLOCK_D=128, IEEE=False, VISIBLE=True), 4, True),
    ("dense_gemv", dense_gemv_kernel,
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
          SPLITP=0), 2, False),
    ("dense_gemv_narrow", dense_gemv_kernel,  # narrow W (router, compressors): all of K in one load
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=2, BLOCK_K=4096,
          SPLITP=0), 4, False),
    ("dense_gemv_split", dense_gemv_kernel,  # the in-kernel split-K sum (integer atomics, fixed order)
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
          SPLITP=16), 2, False),
    ("dense_mma", dense_mma_kernel,  # the head at 2-16 fp32 rows: 4 bf16 parts a row on MFMA / mma
     _sig("xp_ptr w_ptr y_ptr M N K stride_xc stride_wn stride_ym", "*bf16 *bf16 *fp32 i32 i32 i32 i32 i32 i32",
          PARTS=4, BLOCK_N=128, BLOCK_C=32, BLOCK_K=64, IEEE=False), 4, True),
    ("compress_pool", compress_pool_kernel,
     _sig("kv_ptr gate_ptr rkv_ptr rg_ptr ape_ptr ent_ptr pos_ptr C D stride_kb stride_rb stride_rs stride_eb "
          "stride_es", "*fp32 *fp32 *fp32 *fp32 *fp32 *bf16 *i64 i32 i32 i32 i32 i32 i32 i32",
          R=128, RING=128, NSLOT=128, BLOCK_C=64), 4, False),
    ("compress_pool_csa", compress_pool_kernel,
     _sig("kv_ptr gate_ptr rkv_ptr rg_ptr ape_ptr ent_ptr pos_ptr C D stride_kb stride_rb stride_rs stride_eb "
          "stride_es", "*fp32 *fp32 *fp32 *fp32 *fp32 *bf16 *i64 i32 i32 i32 i32 i32 i32 i32",
          R=4, RING=8, NSLOT=8, BLOCK_C=64), 4, False),
    ("compress_finish", compress_finish_kernel,
     _sig("ent_ptr valid_ptr norm_ptr cos_ptr sin_ptr pos_ptr D HALF EPS stride_eb stride_es stride_vb",
          "*bf16 *u8 *bf16 *fp64 *fp64 *i64 i32 i32 fp32 i32 i32 i32", R=4, BLOCK_D=512, BLOCK_R=32), 4, False),
    ("topk", topk_kernel, _sig("s_ptr idx_ptr margin_ptr W stride_s", "*fp32 *i64 *fp32 i32 i32", K=6, HAS_NEXT=True,
                               BLOCK_W=256), 1, False),
    ("topk_sort", topk_sort_kernel,
     _sig("s_ptr idx_ptr margin_ptr mask_ptr W K stride_s stride_m", "*fp32 *i64 *fp32 *i8 i32 i32 i32 i32",
          IDX=True, MASK=True, BLOCK_W=4096), 8, False),
    ("route", route_kernel,
     _sig("l_ptr bias_ptr fixed_ptr idx_ptr w_ptr margin_ptr W stride_l scale",
          "*fp32 *fp32 *fp32 *i64 *fp32 *fp32 i32 i32 fp32", K=6, KP=8, SCORING=0, HAS_BIAS=True, FIXED=False,
          HAS_NEXT=True, BLOCK_W=256), 1, False),
    ("route_hash", route_kernel,  # hash layers: the experts come from the token-id table
     _sig("l_ptr bias_ptr fixed_ptr idx_ptr w_ptr margin_ptr W stride_l scale",
          "*fp32 *fp32 *i32 *i64 *fp32 *fp32 i32 i32 fp32", K=6, KP=8, SCORING=0, HAS_BIAS=False, FIXED=True,
          HAS_NEXT=True, BLOCK_W=256), 1, False),
    ("swiglu", swiglu_kernel,
     _sig("g_ptr u_ptr y_ptr I limit stride_g stride_u stride_y", "*bf16 *bf16 *bf16 i32 fp32 i32 i32 i32",
          HAS_LIMIT=True, BLOCK=1024), 4, False),
    ("hc_mix_partial", hc_mix_partial_kernel,
     _sig("h_ptr fn_ptr part_ptr N D CHUNK MIX stride_h stride_fn stride_p stride_hn",
          "*bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32", PW=40, NP=4, MIXP=32, BLOCK_D=32), 4, False),
    ("hc_pre", hc_pre_kernel,  # the collapse with the block's RMSNorm (op hc_pre, and hc_post_pre's second launch)
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn nw_ptr xn_ptr BLOCK_EPS",
          "*fp64 *bf16 *fp32 *fp32 *fp32 *fp32 *bf16 i32 i32 i32 i32 fp32 fp32 i32 i32 i32 i32 *bf16 *bf16 fp32",
          PW=40, NP=4, SPLITP=128, BLOCK_D=256, NORM=True), 1, False),
    ("hc_weights", hc_pre_kernel,  # post and comb (Sinkhorn) from the mix sums, beside the block (op hc_weights)
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn", "*fp64 *fp64 *fp32 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 i32 fp32 fp32 i32 i32 "
          "i32 i32", PW=40, NP=4, SPLITP=128, BLOCK_D=1, WEIGHTS=True), 1, False),
    ("hc_head", hc_pre_kernel,  # the model head's collapse and final norm: pre weights only, fp32 out
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn nw_ptr xn_ptr BLOCK_EPS",
          "*fp64 *bf16 *fp32 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 i32 fp32 fp32 i32 i32 i32 i32 *bf16 *fp32 fp32",
          PW=20, NP=4, SPLITP=128, BLOCK_D=256, NORM=True), 1, False),
    ("hc_post", hc_post_kernel,
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=256), 4, False),
    ("hc_post_pre", hc_post_kernel,  # with the next hc_pre's mix partials (op hc_post_pre)
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=32, MIXP=32, PW=40, MIX_NEXT=True), 4, False),
    ("hc_post_gram", hc_post_kernel,  # a prefill's: the Gram matrix only, hc_mix_dot the dots (HC_MIX_DOT)
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=32, MIXP=32, PW=40, MIX_NEXT=True, STEPS=32, DOTS=False), 4, False),
    ("hc_mix_dot", hc_mix_dot_kernel,  # bf16 streams: fn in three bf16 parts, three MFMA dots (ROCm's tile)
     _sig("h_ptr fn_ptr part_ptr ROWS N D CHUNK MIX stride_h stride_fn stride_p stride_hn",
          "*bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", PW=40, MIXP=32, BLOCK_M=16, BLOCK_K=64,
          SPLIT_FN=True), 4, True),
]

# Compiled for sm_90 only: the E4M3 hardware conversion (gfx90a has no FP8 units and takes the bit decode above),
# the inline-PTX E2M1 decode (PRMT), the one-token tensor-core MXFP4 kernels (inline PTX mma.sync) and the prefill
# MoE's swapped 128-row dots (MOE_DOT on CUDA; ROCm keeps MOE_DOT_ROCM's forms), and attention's CUDA tiles.
ISA_SPECS_SM90: list[tuple[str, object, tuple[dict[str, str], dict[str, object]], int, bool]] = [
    ("fp8_stream_hw", fp8_stream_kernel,
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=True, UNIFORM=True, UNROLL=1, SPLIT=1, LOCAL=16), 4, False),
    ("attention_wide", attention_kernel,  # ATTN_WIDE as CUDA runs a prefill (ROCm: ATTN_WIDE_ROCM, above)
     _sig(_ATTN[0] + " cos_ptr sin_ptr HALF", _ATTN[1] + " *fp64 *fp64 i32", BLOCK_H=16, BLOCK_L=16,
          BLOCK_D=512, IEEE=False, SPLIT=False, CHUNK=0, part_ptr=None, ml_ptr=None, ROPE=True, SCAN=512), 2, True),
    ("attention_wide_split", attention_kernel,  # ATTN_WIDE_SPLIT (decode) on CUDA
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=32, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=False, SCAN=256), 4, True),
    ("attention_wide_split_gather", attention_kernel,  # the same over a long context (ATTN_GATHER_KEYS)
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=32, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=True, SCAN=256), 4, True),
    ("moe_gate_up_dot_swap", moe_gate_up_kernel,  # MOE_DOT on CUDA past 64 pairs an expert: 128 rows, acc^T
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=128, BLOCK_N=64, GROUPS=2, DOT=1, SWAP=True), 4, True),
    ("moe_down_dot_swap", moe_down_kernel,  # MOE_DOT_DOWN's (ROCm runs neither: MOE_DOT_ROCM)
     _sig(*_MOE_DOWN, BLOCK_M=128, BLOCK_N=128, GROUPS=2, DOT=1, SWAP=True), 8, True),
    ("fp8_stream_hw_long", fp8_stream_kernel,
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=8, BLOCK_K=1024, HW=True, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, LOCAL=16),
     4, False),
    ("fp8_stream_hw_prefetch", fp8_stream_kernel,
     _sig(*_FP8_WORDS_ARGS, BLOCK_N=32, BLOCK_K=256, HW=True, UNIFORM=True, UNROLL=1, SPLIT=1, PREFETCH=True,
          LOCAL=16), 4, False),
    ("moe_gate_up_stream_prmt", moe_gate_up_kernel,  # the default gate/up tile (MOE_STREAM) as it runs on sm_90
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=4, GROUPS=32, STREAM=True, PREFETCH=True, PRMT=True), 2, False),
    ("moe_mma_gate_up", moe_mma_gate_up_kernel,  # the few-token tensor-core MXFP4 (inline PTX mma.sync)
     _sig("x_ptr w_ptr s_ptr e_ptr part_ptr lock_ptr hb_ptr I D TOPK limit",
          "*bf16 *i32 *u8 *i64 *fp32 *i32 *bf16 i32 i32 i32 fp32", HAS_LIMIT=True, SPLIT=4, SPLITP=4,
          PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_down", moe_mma_down_kernel,
     _sig("hb_ptr w_ptr s_ptr e_ptr wt_ptr part_ptr lock_ptr out_ptr add_ptr D I TOPK",
          "*bf16 *i32 *u8 *i64 *fp32 *fp32 *i32 *bf16 *bf16 i32 i32 i32", SPLIT=2, TOPKP=8, SUM=True, HAS_ADD=True,
          PDL=PDL_AVAILABLE), 1, True),
    ("moe_down_stream_prmt", moe_down_kernel,
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, PRMT=True), 4, False),
    ("fp8_mma", fp8_mma_kernel,  # a few tokens' FP8 linear on the tensor cores (inline PTX mma.sync)
     _sig("x_ptr w_ptr s_ptr y_ptr part_ptr lock_ptr M R K stride_xm stride_xg stride_wn stride_sn stride_ym "
          "stride_yg stride_ps K_CHUNK", "*bf16 *u8 *u8 *bf16 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32",
          SPLIT=2, SPLITP=2), 1, True),
]
