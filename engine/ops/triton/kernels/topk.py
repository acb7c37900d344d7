"""Top-k with the lower index winning ties: k passes for a small k, one in-register sort for the indexer's selection
(and topk_mask), and the router (sqrt(softplus), sigmoid or softmax scores, bias; FIXED: given experts, hash
routing)."""

from __future__ import annotations

import triton
import triton.language as tl


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
    topk_kernel, one max per pick; FIXED: given, for hash routing), their scores normalized to sum 1 (not
    softmax's: DeepSeek's Gate) times `scale`, the margin."""
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
    if SCORING != 2:
        wk = wk / (tl.sum(wk, axis=0) + 1e-20)
    wk = wk * scale
    tl.store(idx_ptr + row * K + kk, picked.to(tl.int64), mask=kk < K)
    tl.store(w_ptr + row * K + kk, wk, mask=kk < K)
    if HAS_NEXT and not FIXED:
        margin = kth - _key_value(tl.max(key, axis=0))
    else:
        margin = float("inf")
    tl.store(margin_ptr + row, margin)
