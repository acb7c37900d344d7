"""Every op in plain torch: the engine's inner oracle and the spec the Triton kernels are tested against.

Numerics policy (DESIGN.md section 4): weights are decoded on the fly from their packed form into the
compute dtype; every matmul, softmax statistic and norm statistic runs in fp32 at least (fp64 when the
activations are fp64), and the result is cast back to the activation dtype. Top-k breaks ties by the
lower index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import formats
from . import QWeight


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense [..., N, K] tensor in `dtype` (transient: never stored)."""
    if w.kind == "fp8":
        return formats.fp8_block_dequantize(w.data, w.scale, dtype=dtype)
    if w.kind == "mxfp4":
        return formats.mxfp4_dequantize(w.data, w.scale, dtype=dtype)
    return w.data.to(dtype)


def linear(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype | None = None,
           x_norm: tuple[torch.Tensor, float] | None = None, glu: float | None = None) -> torch.Tensor:
    """y = x @ W^T; x [..., K], W [N, K] -> [..., N] in out_dtype (default x's; the router wants fp32 logits
    from bf16 activations); with x_norm = (weight, eps), of rms_norm(x, weight, eps); with glu (a limit), x is
    [..., gate | up] (2K wide) and y is of swiglu(gate, up, glu) (a backend may fuse either)."""
    if glu is not None:
        k = x.shape[-1] // 2
        x = swiglu(x[..., :k], x[..., k:], glu)
    if x_norm is not None:
        x = rms_norm(x, *x_norm)
    acc = _acc(x.dtype)
    return (x.to(acc) @ dequantize(w, acc).T).to(out_dtype or x.dtype)


def grouped_linear(x: torch.Tensor, w: QWeight, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [..., G, Kg], W [G*R, Kg] (group g owns rows g*R..) -> [..., G, R]."""
    acc = _acc(x.dtype)
    wd = dequantize(w, acc)
    wd = wd.view(groups, -1, wd.shape[-1])  # [G, R, Kg]
    return torch.einsum("...gk,grk->...gr", x.to(acc), wd).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with statistics in fp32 (fp64 for fp64 input); weight None is the unweighted norm."""
    acc = _acc(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE on the last 2*cos.shape[-1] dims of x [B, S, H, D]; cos/sin [B, S, rd/2].

    `inverse` rotates by -angle (V4 un-rotates the attention output, since V is K and carries RoPE).
    """
    acc = _acc(x.dtype)
    rd = 2 * cos.shape[-1]
    nope, r = x[..., :-rd], x[..., -rd:].to(acc)
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)
    if inverse:
        s = -s
    x0, x1 = r[..., 0::2], r[..., 1::2]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, ring: tuple | None = None) -> torch.Tensor:
    """RMSNorm of each head row of x [B, S, H, D] (weight None: unweighted), then RoPE: q's and kv's path.
    ring (keys [B, W, D], flags [B, W] bool, pos [1]; decode, x [B, 1, 1, D]): the row is also written into
    the sliding window's ring slot pos % W, and the slot flagged visible."""
    y = rope(rms_norm(x, weight, eps), cos, sin)
    if ring is not None:
        keys, ok, pos = ring
        slot = pos.reshape(1) % keys.shape[1]
        keys.index_copy_(1, slot, y.reshape(x.shape[0], 1, -1).to(keys.dtype))
        ok.index_fill_(1, slot, True)
    return y


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., half] of positions [...] (rounded down to a multiple of `align`: a compressed entry sits at
    its window's first position) times inv_freq [half], in float64 (positions reach 1M: an fp32 angle would be
    off by whole radians); `rope` casts them to its compute dtype."""
    if align > 1:
        positions = positions // align * align
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return ang.cos(), ang.sin()


def attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor, scale: float,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink in the softmax denominator.

    q [B, S, H, D], kv [B, L, D] (K = V), sink [H], mask [B, S, L] bool (True = may attend) -> [B, S, H, D].
    A row with no visible key gives zeros (the sink takes all the mass).
    rotary = (cos, sin), V4's attention: the output un-rotated by the angles q and kv were rotated by (V is K and
    carries RoPE), as rope(..., inverse=True) does: one op, so a backend can apply it where the output is made.
    """
    if rotary is not None:
        return rope(attention(q, kv, sink, mask, scale), *rotary, inverse=True)
    acc = _acc(q.dtype)
    logits = torch.einsum("bshd,bld->bhsl", q.to(acc), kv.to(acc)) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink_logit = sink.to(acc).view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    full = torch.cat([logits, sink_logit], dim=-1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("bhsl,bld->bshd", probs, kv.to(acc)).to(q.dtype)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """Lightning-indexer scores: sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]) * scale -> [B, S, T] (fp32+), -inf where
    `visible` (bool, broadcastable to [B, S, T]) is False: hidden entries never win a pick."""
    acc = _acc(q.dtype)
    dots = torch.einsum("bshd,btd->bsht", q.to(acc), k.to(acc))
    scores = (torch.relu(dots) * scale * weights.to(acc).unsqueeze(-1)).sum(dim=2)
    return scores if visible is None else torch.where(visible, scores, float("-inf"))


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken by the lower index (never by memory order).

    Returns (indices [..., k], margin [...]): margin is the k-th minus the (k+1)-th score (inf when there is
    no (k+1)-th), the distance to the nearest selection flip.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = order.indices[..., :k]
    vals = order.values
    if scores.shape[-1] > k:
        margin = vals[..., k - 1] - vals[..., k]
    else:
        margin = torch.full(scores.shape[:-1], float("inf"), dtype=scores.dtype, device=scores.device)
    return idx, margin


def topk_mask(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `topk` set along the last dim as a bool mask, without entries scored -inf (what the caller hid
    before picking); written into `out` when given (a slice of a bigger mask)."""
    hit = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    hit.scatter_(-1, topk(scores, k)[0], True)
    return torch.logical_and(hit, scores != float("-inf"), out=out)


def hc_mix_sums(h: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """mHC's mix as the sums a backend may split: [..., splits, MIX + n*n] (float64 here; a backend's may be
    any float dtype), per split the dots of the flattened streams h [..., n, D] (not normalized) with fn's MIX
    rows, then the streams' Gram matrix sum_d h_j h_k (its trace: their sum of squares); summed over the
    splits they give the mix (`_hc_mix`). One split here."""
    hd = h.double()
    dots = hd.flatten(-2) @ fn.double().T
    return torch.cat([dots, (hd @ hd.transpose(-1, -2)).flatten(-2)], -1).unsqueeze(-2)


def _hc_mix(sums: torch.Tensor, n: int, d: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """mHC's mix logits [..., MIX] in dtype from its sums: the dots of the RMS-normalized (no weight) flattened
    streams with fn's rows, the inverse RMS from the Gram matrix's trace over n * d values."""
    s = sums.double().sum(-2)
    ss = s[..., -n * n:].unflatten(-1, (n, n)).diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)
    return (s[..., :-n * n] * torch.rsqrt(ss / (n * d) + eps)).to(dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, block_norm: tuple[torch.Tensor, float] | None = None):
    """The model head's mHC: the streams h [..., n, D] collapsed by pre = sigmoid(mix * scale + base) + eps
    (fn has n rows: no post, no comb) -> [..., D] in fp32 (fp64 for fp64 h), for the final norm; with
    `block_norm` = (weight, eps), (that, its rms_norm) (a backend may fuse the norm)."""
    acc = _acc(h.dtype)
    mix = _hc_mix(hc_mix_sums(h, fn), h.shape[-2], h.shape[-1], norm_eps, acc)
    pre = torch.sigmoid(mix * scale.to(acc) + base.to(acc)) + hc_eps
    y = (pre.unsqueeze(-1) * h.to(acc)).sum(-2)
    return y if block_norm is None else (y, rms_norm(y, *block_norm))


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float,
           hc_eps: float, block_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """mHC before a block, from the streams h [..., n, D]: (the mix sums (`hc_mix_sums`' form), the collapsed
    block input sum_k pre_k h_k [..., D] in h.dtype), pre = sigmoid(mix * scale + base) + eps in fp32 (fp64 for
    fp64 h). With `block_norm` = (weight, eps) also the block's normed input rms_norm(x, weight, eps), third.
    The block's post and comb come from the sums by `hc_weights`: only the mHC post after the block reads them,
    so a caller can make them beside the block."""
    acc = _acc(h.dtype)
    sums = hc_mix_sums(h, fn)
    mix = _hc_mix(sums, n, h.shape[-1], norm_eps, acc)
    pre = torch.sigmoid(mix[..., :n] * scale[0].to(acc) + base[:n].to(acc)) + hc_eps
    x = (pre.unsqueeze(-1) * h.to(acc)).sum(-2).to(h.dtype)
    return (sums, x) if block_norm is None else (sums, x, rms_norm(x, *block_norm))


def hc_weights(sums: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, d: int, iters: int,
               norm_eps: float, hc_eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """mHC's post [..., n] (the expand) and comb [..., n, n] (a row softmax made doubly stochastic by `iters`
    Sinkhorn normalizations) from the mix sums of streams of width d and dtype `dtype` (hc_pre's first
    result); fp32 (fp64 for fp64 streams)."""
    acc = _acc(dtype)
    mix = _hc_mix(sums, n, d, norm_eps, acc)
    base, scale = base.to(acc), scale.to(acc)
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, -1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return post, comb


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a block: new streams post_k * out + sum_j comb[j, k] h_j, [..., n, D] in h.dtype."""
    acc = post.dtype
    return (post.unsqueeze(-1) * out.to(acc).unsqueeze(-2) + comb.transpose(-1, -2) @ h.to(acc)).to(h.dtype)


def hc_post_pre(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float, hc_eps: float,
                block_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """mHC between two blocks: hc_post of the block before, then hc_pre of the next (fn, base, scale): the new
    streams, then hc_pre's results for the next block (a backend may fuse all of it)."""
    h2 = hc_post(out, h, post, comb)
    return (h2, *hc_pre(h2, fn, base, scale, n, norm_eps, hc_eps, block_norm))


def compress_step(kv: torch.Tensor, gate: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                  entries: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, ratio: int, eps: float) -> None:
    """One decode token through a compressor's fixed buffers (cache.StaticCompressor), in place: its row
    kv/gate [B, 1, c] goes into ring slot pos % ring (the gate plus the position bias ape[pos % ratio]),
    then its window is pooled (closed or not) into entry slot pos // ratio: a per-channel softmax over
    the window's slots (CSA, ring = 2 * ratio: the previous window's Ca half, channels :d, and this
    window's Cb half, channels d:), RMSNorm, RoPE with cos/sin [B, 1, rd/2] of the window's first
    position; valid [B, slots] (bool) marks the entry visible when this token closes its window. `pos` is a
    [1] device tensor: no host sync, so a CUDA graph can hold it."""
    acc = ring_kv.dtype
    ring, d, r = ring_kv.shape[1], entries.shape[-1], ratio
    ring_kv.index_copy_(1, pos % ring, kv.to(acc))
    ring_gate.index_copy_(1, pos % ring, gate.to(acc) + ape.to(acc).index_select(0, pos % r))
    w = pos // r
    slots = torch.arange(r, device=kv.device)
    cur = (w % (ring // r)) * r + slots
    if ring == 2 * r:
        prev = ((w + 1) % 2) * r + slots
        kvs = torch.cat([ring_kv[:, prev, :d], ring_kv[:, cur, d:]], 1)  # [B, 2r, d]
        gs = torch.cat([ring_gate[:, prev, :d], ring_gate[:, cur, d:]], 1)
    else:
        kvs, gs = ring_kv[:, cur], ring_gate[:, cur]
    pooled = (kvs * torch.softmax(gs, dim=1)).sum(1, keepdim=True)  # [B, 1, d]
    pooled = rms_norm(pooled.to(entries.dtype), norm, eps)
    entries.index_copy_(1, w, rope(pooled.unsqueeze(2), cos, sin).squeeze(2))
    valid.index_copy_(1, w, ((pos + 1) % r == 0).expand(valid.shape[0], 1))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32 (fp64), rounded once."""
    acc = _acc(gate.dtype)
    g, u = gate.to(acc), up.to(acc)
    if limit and limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


def _router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "softmax":
        return logits.softmax(-1)
    raise ValueError(f"unknown router scoring {scoring!r}: use sqrtsoftplus, sigmoid or softmax")


def selection_scores(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str) -> torch.Tensor:
    """What `route` ranks: the router's scores of logits [T, E] plus the bias (the weights leave it out)."""
    scores = _router_scores(logits, scoring)
    return scores if bias is None else scores + bias.to(scores.dtype)


def ranked(scores: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best r entries along the last dim, best first, ties to the lower index as `topk`: (indices, scores)
    [..., r], -1 and -inf past the entries there are and for entries scored -inf (hidden)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx, vals = order.indices[..., :r], order.values[..., :r]
    idx = torch.where(vals == float("-inf"), -1, idx)
    pad = r - idx.shape[-1]
    if pad > 0:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
        vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
    return idx, vals


def route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scoring: str, scale: float,
          fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing of router logits [T, E] (fp32 or fp64): scores by `scoring` (sqrtsoftplus, sigmoid or
    softmax), the experts = top-k of scores + bias (ties to the lower id, `topk`) unless `fixed` [T, k] gives
    them (hash routing, forced selections), weights = their scores normalized to sum 1 (not for softmax, whose
    scores already sum to 1 over all experts: DeepSeek's Gate), times `scale`.
    Returns (experts [T, k] int64, weights [T, k] in the logits' dtype, margin [T]: inf when fixed)."""
    scores = _router_scores(logits, scoring)
    if fixed is None:
        idx, margin = topk(scores if bias is None else scores + bias.to(scores.dtype), k)
    else:
        idx = fixed.reshape(-1, k).long()
        margin = torch.full(idx.shape[:1], float("inf"), dtype=scores.dtype, device=scores.device)
    weights = scores.gather(-1, idx)
    if scoring != "softmax":
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * scale, margin


def moe_experts(
    x: torch.Tensor,
    w1: QWeight,
    w3: QWeight,
    w2: QWeight,
    idx: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts: x [T, D], stacked expert weights w1/w3 [E, I, D], w2 [E, D, I], idx/weights [T, k].

    out[t] = sum_j weights[t, j] * W2[e] swiglu(W1[e] x, W3[e] x), e = idx[t, j], summed in order j = 0..k-1
    (a fixed order: no atomics, bit-reproducible), plus shared[t] (the shared expert's output) when given,
    then rounded once. Only the experts that tokens selected are decoded. `shared` may be a callable that
    returns it, called only when the sum needs it (the model computes it on a side stream and joins there).
    """
    acc = _acc(x.dtype)
    xa = x.to(acc)
    contrib = torch.zeros(*idx.shape, x.shape[-1], dtype=acc, device=x.device)  # [T, k, D]
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        xe = xa[tok]
        g = xe @ _expert(w1, e, acc).T
        u = xe @ _expert(w3, e, acc).T
        h = swiglu(g, u, limit)
        contrib[tok, slot] = (h @ _expert(w2, e, acc).T) * weights[tok, slot].to(acc).unsqueeze(-1)
    out = contrib[:, 0]
    for j in range(1, idx.shape[1]):
        out = out + contrib[:, j]
    if callable(shared):
        shared = shared()
    if shared is not None:
        out = out + shared.to(acc)
    return out.to(x.dtype)


def _expert(w: QWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(QWeight(w.data[e], None if w.scale is None else w.scale[e], w.kind), dtype)
