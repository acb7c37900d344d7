"""Attention with sinks over the sliding window and compressed KV (prefill and split decode, fp32 running max
and sum), the indexer's scores, and the KV compressors' pooling and finish."""

from __future__ import annotations

import triton
import triton.language as tl

from .norm_rope import _rope_cs, _rope_tile, _rotate

P16_SCALE: tl.constexpr = tl.constexpr(32768.0)  # fp16 softmax weights enter the dot times 2^15 (attention_kernel)


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
    fp16 q and kv: the softmax weights enter the dot times 2^15 (exact, undone after the loop), so the small ones
    are not fp16 subnormals, which MI200's matrix units flush to zero.
    ROPE (the op's `rotary`, unsplit; attention_combine_kernel does it for SPLIT): the output is rounded, then
    un-rotated by cos/sin (float64 [B * S, HALF]) as rope(inverse) would do it in a launch of its own. (q's norm
    and RoPE stay in the op norm_rope, rope_kernel's NORM: done here by every split program, they cost each program
    what they saved the chain, and under Triton 3.6 pushed this kernel to 256 VGPRs and scratch on gfx90a; NOTES
    run 100.)
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
    FP16: tl.constexpr = kv_ptr.dtype.element_ty == tl.float16
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
            elif FP16:  # p <= 1, so p x 2^15 stays under fp16's 65504
                acc = acc * alpha[:, None] + tl.dot((p * P16_SCALE).to(kv.dtype), kv)
            else:  # bf16: its subnormals lie below 2^-126
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
    if FP16 and not IEEE:
        acc = acc * (1.0 / P16_SCALE)  # exact: the dots' 2^15 undone
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
