"""mHC hyper-connections: the mix partial sums, the pre collapse with its Sinkhorn, and the post expansion (with the
next pre's mix partials)."""

from __future__ import annotations

import triton
import triton.language as tl


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
