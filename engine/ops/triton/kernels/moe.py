"""MXFP4 MoE experts: gate/up with the clamped SwiGLU fused and down with the routed weights, as tl.dot blocks of
tokens grouped by expert or as a per-pair stream; the fixed-order sum over experts; the plain SwiGLU."""

from __future__ import annotations

import triton
import triton.language as tl

from .base import _e2m1_f32, _e8m0, _split_sum

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
def moe_pair_rows_kernel(e_ptr, rows_ptr, P, PP: tl.constexpr, CHUNK: tl.constexpr):
    """The few-token tensor-core MoE's pairs two to a program row, so one decode of an expert's weights serves two
    tokens: pair j (flat token x k + slot, expert e_ptr[j]) goes to row (pairs of a smaller expert id) + rank // 2,
    column rank % 2, where rank counts the earlier pairs of its expert. rows [P, 2] int32, -1 where no pair (the
    rows after an expert's last are empty). One program, P <= PP; integer counts only, so the table is the same on
    every run."""
    j = tl.arange(0, PP)
    live = j < P
    tl.store(rows_ptr + 2 * j, -1, mask=live)
    tl.store(rows_ptr + 2 * j + 1, -1, mask=live)
    ej = tl.load(e_ptr + j, mask=live, other=0)
    below = tl.zeros((PP,), dtype=tl.int32)
    rank = below
    for c0 in range(0, P, CHUNK):
        jj = c0 + tl.arange(0, CHUNK)
        ee = tl.load(e_ptr + jj, mask=jj < P, other=0)
        ok = (jj < P)[None, :]
        below += tl.sum((ok & (ee[None, :] < ej[:, None])).to(tl.int32), axis=1)
        rank += tl.sum((ok & (ee[None, :] == ej[:, None]) & (jj[None, :] < j[:, None])).to(tl.int32), axis=1)
    tl.debug_barrier()  # the -1 fills above are done before any pair lands
    tl.store(rows_ptr + 2 * (below + rank // 2) + rank % 2, j, mask=live)
