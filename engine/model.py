"""The DeepSeek-V4 forward, written once over the ops interface (engine/ops).

Shapes: B batch, S tokens in this chunk, H heads of head_dim hd (one shared K=V head), hc hyper-connection
streams of width D, T compressed entries. A chunk runs at absolute positions cache.pos .. cache.pos+S-1; a
full prefill is one chunk from an empty cache, a decode step is a chunk of one.

Spec of record: the V4 paper and transformers 5.23 `deepseek_v4` (formulas checked against it in
tests/test_vs_transformers.py). Where DeepSeek's own inference code simulates quantization of
activations (FP8 act-quant, FP4 indexer), this engine, like transformers, computes in full precision.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .cache import Cache, CompressorState, LayerCache, StaticCache, StaticCompressor, StaticLayer
from .config import Config, rope_inv_freq
from .ops import QWeight, split_names
from .ops.reference import ranked, selection_scores
from .streams import SideStream, stream_key

# entries recorded past a selection's k: a flip is judged within the near-tie band these span. The bf16 reference's
# 300 flips on the bundled goldens (CPU, 2026-12-07) swapped in the (k+1)-th entry, 19 of them the (k+2)-th (a
# three-way tie); a flip that brings in an entry past the (k+4)-th counts as a bug.
RANKED_EXTRA = 4


@dataclass
class Selection:
    """A sparse choice at every position: indices [B, S, k] (-1 = no entry), the k-th minus (k+1)-th score
    [B, S] (inf when nothing competes) and the best k + RANKED_EXTRA entries `ranked` [B, S, r] with their
    selection `scores` (-1 / -inf: none). A flip is rounding, not a bug, only when the picks that replace it
    are still a top-k of these scores each moved by less than half a tie margin (a near-tie band)."""

    indices: torch.Tensor
    margin: torch.Tensor | None
    ranked: torch.Tensor | None = None
    scores: torch.Tensor | None = None


@dataclass
class Trace:
    logits: torch.Tensor
    selections: dict[tuple[int, str], Selection] = field(default_factory=dict)
    taps: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, n] the new tokens
    logits: torch.Tensor  # [B, n, vocab] the logits that chose each of them
    taps: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, n, ...] at each new token
    selections: dict = field(default_factory=dict)  # recorded when generate forced some: as Trace.selections


TAP_KINDS = ("attn_in", "attn_out", "attn", "ffn_in", "ffn_out", "ffn")


def tap_names(num_layers: int) -> list[str]:
    """Every tap in forward order: per layer the collapsed attention input [B, T, D] (after mHC's pre
    mix), the attention output [B, T, D], the streams after mHC's post mix [B, T, hc, D]; same for the MoE."""
    return [f"{i}.{k}" for i in range(num_layers) for k in TAP_KINDS]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Rope:
    """cos/sin [B, S, rd/2] for absolute positions (the ops' rope_cos_sin: float64, cast by `rope`)."""

    def __init__(self, cfg: Config, compressed: bool, device: torch.device, ops):
        self.inv_freq, self.ops = rope_inv_freq(cfg, compressed).to(device), ops

    def __call__(self, positions: torch.Tensor, align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rope_cos_sin(positions, self.inv_freq, align)


def _join_rows(w: dict, a: str, b: str) -> QWeight | None:
    """Two linears that read the same input as one weight (one launch, one longer stream): rows of `a` then
    `b`, stored as "<a>+<b's leaf>" in place of both. FP8 joins only on a 128-row scale-block boundary;
    other pairs stay apart (None)."""
    wa, wb = w[a], w[b]
    if wa.kind != wb.kind or wa.kind not in ("dense", "fp8") or (wa.kind == "fp8" and wa.data.shape[0] % 128):
        return None
    scale = None if wa.scale is None else torch.cat([wa.scale, wb.scale])
    joined = QWeight(torch.cat([wa.data, wb.data]), scale, wa.kind)
    del w[a], w[b]
    w[a.rsplit(".", 1)[0] + "+" + b.rsplit(".", 2)[-2]] = joined
    return joined


class Compressor:
    """Softmax-gated pooling of `ratio` tokens into one entry (HCA: disjoint windows; CSA, ratio 4: each
    entry pools the previous window's Ca half with this window's Cb half, 2*ratio slots), then RMSNorm
    and RoPE at the window's first position."""

    def __init__(self, w: dict, prefix: str, ratio: int, dim: int, model: Model):
        wkv, wgate = w[prefix + "wkv.weight"], w[prefix + "wgate.weight"]
        self.w_both = _join_rows(w, prefix + "wkv.weight", prefix + "wgate.weight")
        self.wkv, self.wgate = (None, None) if self.w_both is not None else (wkv, wgate)
        self.c = wkv.shape[0]  # kv (and gate) channels
        self.ape, self.norm = w[prefix + "ape"], w[prefix + "norm.weight"]
        self.ratio, self.dim, self.overlap, self.m = ratio, dim, ratio == 4, model

    def _kv_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected rows [B, S, c] each, in x's dtype (views of one projection when the weights joined)."""
        ops = self.m.ops
        if self.w_both is None:
            return ops.linear(x, self.wkv), ops.linear(x, self.wgate)
        return ops.linear(x, self.w_both).split(self.c, -1)

    def __call__(self, x: torch.Tensor, st: CompressorState) -> torch.Tensor:
        ops, r, d = self.m.ops, self.ratio, self.dim
        acc = _acc(x.dtype)
        kv, gate = (t.to(acc) for t in self._kv_gate(x))
        if st.pending_kv is not None:
            kv, gate = torch.cat([st.pending_kv, kv], 1), torch.cat([st.pending_gate, gate], 1)
        B, n = kv.shape[0], kv.shape[1] // r
        st.pending_kv, st.pending_gate = kv[:, n * r:], gate[:, n * r:]
        if n == 0:
            return self._entries(st, x)
        kv = kv[:, : n * r].view(B, n, r, -1)
        gate = gate[:, : n * r].view(B, n, r, -1) + self.ape.to(acc)
        if self.overlap:
            ca_kv, cb_kv, ca_g, cb_g = kv[..., :d], kv[..., d:], gate[..., :d], gate[..., d:]
            first_kv = st.prev_kv if st.prev_kv is not None else kv.new_zeros(B, r, d)
            first_g = st.prev_gate if st.prev_gate is not None else gate.new_full((B, r, d), float("-inf"))
            prev_kv = torch.cat([first_kv.unsqueeze(1), ca_kv[:, :-1]], 1)
            prev_g = torch.cat([first_g.unsqueeze(1), ca_g[:, :-1]], 1)
            st.prev_kv, st.prev_gate = ca_kv[:, -1], ca_g[:, -1]
            kv, gate = torch.cat([prev_kv, cb_kv], 2), torch.cat([prev_g, cb_g], 2)  # [B, n, 2r, d]
        pooled = (kv * torch.softmax(gate, dim=2)).sum(2)  # [B, n, d], per-channel softmax over the slots
        pooled = ops.rms_norm(pooled.to(x.dtype), self.norm, self.m.cfg.rms_norm_eps)
        pos = (st.count() + torch.arange(n, device=x.device)) * r
        cos, sin = self.m.rope_c(pos.expand(B, n))
        new = ops.rope(pooled.unsqueeze(2), cos, sin).squeeze(2)
        st.entries = new if st.entries is None else torch.cat([st.entries, new], 1)
        return st.entries

    def _entries(self, st: CompressorState, x: torch.Tensor) -> torch.Tensor:
        if st.entries is None:
            st.entries = x.new_zeros(x.shape[0], 0, self.dim)
        return st.entries

    def decode(self, x: torch.Tensor, st: StaticCompressor, pos: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """One token at device position `pos` [1]: its row goes into the ring, then the window it belongs to
        is pooled (closed or not) into entry slot pos // ratio. Branch-free, so a CUDA graph can hold it; an
        unclosed window's entry is invisible (attention and indexer see slot t once (pos + 1) // ratio > t).
        Returns every entry slot [B, slots, d]."""
        kv, gate = self._kv_gate(x)  # [B, 1, c], in x's dtype: compress_step widens them
        cos, sin = ctx.rope(self.m.rope_c, pos, x.shape[0], 1, align=self.ratio)  # at the window's first position
        self.m.ops.compress_step(kv, gate, st.kv, st.gate, st.entries, st.valid, self.ape, self.norm, cos, sin, pos,
                          self.ratio, self.m.cfg.rms_norm_eps)
        return st.entries

    def to_static(self, st: CompressorState, pos: int, batch: int, capacity: int, dtype: torch.dtype,
                  entries: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> StaticCompressor:
        """The same state in `decode`'s fixed shapes (pending rows and CSA's previous Ca half into the ring);
        `entries` [B, slots, d] and `valid` [B, slots] may be views into the layer's key and mask buffers."""
        r, d, dev, acc = self.ratio, self.dim, self.ape.device, _acc(dtype)
        ring, c = (2 * r if self.overlap else r), self.c
        kv = torch.zeros(batch, ring, c, dtype=acc, device=dev)
        gate = torch.full((batch, ring, c), float("-inf"), dtype=acc, device=dev)
        n, start = pos % r, pos - pos % r
        if n:
            slots = (start + torch.arange(n, device=dev)) % ring
            kv[:, slots], gate[:, slots] = st.pending_kv, st.pending_gate + self.ape[:n].to(acc)
        if self.overlap and st.prev_kv is not None:
            slots = (start - r + torch.arange(r, device=dev)) % ring
            kv[:, slots, :d], gate[:, slots, :d] = st.prev_kv, st.prev_gate
        slots = capacity // r + 1
        entries = torch.zeros(batch, slots, d, dtype=dtype, device=dev) if entries is None else entries.zero_()
        valid = torch.zeros(batch, slots, dtype=torch.bool, device=dev) if valid is None else valid.zero_()
        if st.count():
            entries[:, : st.count()] = st.entries
            valid[:, : st.count()] = True
        return StaticCompressor(kv, gate, entries, valid)


class Attention:
    """Low-rank q with an unweighted per-head norm, one shared K=V head, partial interleaved RoPE,
    sliding window plus (CSA) indexer-selected or (HCA) all compressed entries, a sink per head, inverse
    RoPE on the output, grouped output projection."""

    def __init__(self, w: dict, i: int, model: Model):
        cfg, p = model.cfg, f"layers.{i}.attn."
        self.m, self.i, self.p, self.w = model, i, p, w
        self.ratio = cfg.compress_ratios[i]
        self.rope = model.rope_c if self.ratio else model.rope_main
        self.q_lora = w[p + "wq_a.weight"].shape[0]
        self.wqkv = _join_rows(w, p + "wq_a.weight", p + "wkv.weight")  # both read x: one stream (FP8: if aligned)
        self.compressor = Compressor(w, p + "compressor.", self.ratio, cfg.head_dim, model) if self.ratio else None
        self.indexer = (Compressor(w, p + "indexer.compressor.", 4, cfg.index_head_dim, model)
                        if self.ratio == 4 else None)

    def _project(self, x: torch.Tensor, pos: torch.Tensor, ctx: _Ctx, ring: tuple | None = None,
                 side: SideStream | None = None, pick: tuple | None = None):
        """q [B, S, H, hd] (normed, RoPE'd), the new K=V rows [B, S, hd] (also written into the window `ring`
        when decoding), q's low-rank qr (before q_norm), cos/sin. With a `side` stream (decode), kv's norm and RoPE
        are issued there once qr exists, and `pick` = (stream, fn) issues fn(qr) on its stream, while q is finished
        here."""
        cfg, w, p, ops = self.m.cfg, self.w, self.p, self.m.ops
        B, S, _ = x.shape
        H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = ctx.rope(self.rope, pos, B, S)
        if self.wqkv is None:
            qr, kv = ops.linear(x, w[p + "wq_a.weight"]), ops.linear(x, w[p + "wkv.weight"])
        else:
            qr, kv = ops.linear(x, self.wqkv).split(self.q_lora, -1)
        qn = self._q_norm()  # qr [B, S, q_lora] stays un-normed: its two readers apply q_norm as they read it
        if side is not None:
            side.hold(kv)  # read beside: alive until the join
        with side.beside() if side is not None else contextlib.nullcontext():  # decode: beside q's projection
            kv = ops.norm_rope(kv.unsqueeze(2), w[p + "kv_norm.weight"], eps, cos, sin, ring).squeeze(2)  # [B, S, hd]
        if pick is not None:
            pick[0].hold(qr)
            with pick[0].beside():
                pick[1](qr)
        q = ops.norm_rope(ops.linear(qr, w[p + "wq_b.weight"], x_norm=qn).view(B, S, H, hd), None, eps, cos, sin)
        return q, kv, qr, cos, sin

    def _q_norm(self) -> tuple[torch.Tensor, float]:
        """q_norm, the RMSNorm of q's low-rank qr, as the `x_norm` of the two linears that read qr."""
        return self.w[self.p + "q_norm.weight"], self.m.cfg.rms_norm_eps

    def _output(self, q, keys, mask, cos, sin) -> torch.Tensor:
        cfg, w, p, ops = self.m.cfg, self.w, self.p, self.m.ops
        B, S = q.shape[:2]
        o = ops.attention(q, keys, w[p + "attn_sink"], mask, cfg.head_dim**-0.5, (cos, sin))  # and un-rotates
        o = ops.grouped_linear(o.reshape(B, S, cfg.o_groups, -1), w[p + "wo_a.weight"], cfg.o_groups)
        return ops.linear(o.flatten(2), w[p + "wo_b.weight"])

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's per-head weights w_h [B, S, heads] (fp32): they read x, not qr."""
        return self.m.ops.linear(x, self.w[self.p + "indexer.weights_proj.weight"], _acc(x.dtype))

    def _picked(self, x, qr, keys, pos, visible, ctx, out=None, hw=None) -> torch.Tensor:
        """CSA's mask [B, S, T] over the compressed entries: visible ([S, T] or [B, 1, T]) and picked by the
        lightning indexer, the top-k of the compressed `keys` [B, T, Di] per query by sum_h w_h relu(q_h . k)
        (written into `out` when given; `hw`: `_head_weights(x)` when already issued). Forced picks (-1: none)
        replace the engine's own, which are still recorded when recording."""
        m, cfg, w, p, ops = self.m, self.m.cfg, self.w, self.p + "indexer.", self.m.ops
        B, S, _ = x.shape
        T = keys.shape[1]
        forced = ctx.forced(self.i, "indexer")
        k = min(cfg.index_topk, T)
        if k and (forced is None or ctx.recording):
            cos, sin = ctx.rope(m.rope_c, pos, B, S)
            q = ops.linear(qr, w[p + "wq_b.weight"], x_norm=self._q_norm())
            q = q.view(B, S, cfg.index_n_heads, cfg.index_head_dim)
            q = ops.rope(q, cos, sin)
            hw = self._head_weights(x) if hw is None else hw
            scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
            scores = ops.index_scores(q, keys, hw, scale, visible)  # [B, S, T], -inf where not visible
            own = ops.topk_mask(scores, k, out=out if forced is None else None)  # hidden (-inf): never in it
            if ctx.recording:  # the picks of the mask attended with (not a second top-k: a mask kernel's bug
                # shows), best first, -1 past them (a hidden entry in the mask by its id, scored lowest); the
                # band from a plain sort of the same scores
                n = max(k, int(own.sum(-1).max()))
                low = torch.finfo(scores.dtype).min
                idx = ranked(torch.where(own, scores.clamp(min=low), float("-inf")), n)[0]
                top, vals = ranked(scores, k + RANKED_EXTRA)
                inf = float("inf")  # -inf minus -inf: no competitor
                margin = torch.nan_to_num(vals[..., k - 1] - vals[..., k], nan=inf, posinf=inf)
                ctx.record(self.i, "indexer", Selection(idx, margin, top, vals))
            if forced is None:
                return own
        hit = torch.zeros(B, S, T + 1, dtype=torch.bool, device=x.device)
        if forced is not None:
            hit.scatter_(-1, torch.where((forced >= 0) & (forced < T), forced, T), True)  # an entry not made yet
            # (generate's prefill forced with picks checked against the whole run's entries): none
        return torch.logical_and(visible, hit[..., :T], out=out)

    def __call__(self, x: torch.Tensor, lc: LayerCache, pos: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """A chunk of S tokens at host-known positions (prefill, or decode from a growing `Cache`)."""
        B, S, _ = x.shape
        q, kv, qr, cos, sin = self._project(x, pos, ctx)
        keys = kv if lc.window is None else torch.cat([lc.window, kv], 1)
        win = self.m.cfg.sliding_window
        lc.window = keys[:, max(0, keys.shape[1] - (win - 1)):]  # the newest win - 1 rows (none for win 1)
        end = ctx.start + S  # host ints: no device sync on the decode path
        kpos = torch.arange(end - keys.shape[1], end, device=x.device)
        mask = (kpos[None] <= pos[:, None]) & (kpos[None] > pos[:, None] - win)  # [S, L]
        mask = mask.expand(B, S, -1)
        if self.ratio:
            entries = self.compressor(x, lc.compressor)  # [B, T, hd]
            T = entries.shape[1]
            cmask = torch.arange(T, device=x.device)[None] < ((pos + 1) // self.ratio)[:, None]  # [S, T] closed
            if self.indexer is not None:
                cmask = self._picked(x, qr, self.indexer(x, lc.indexer), pos, cmask, ctx)
            keys, mask = torch.cat([keys, entries.to(keys.dtype)], 1), torch.cat([mask, cmask.expand(B, S, T)], -1)
        return self._output(q, keys, mask, cos, sin)

    def decode(self, x: torch.Tensor, sl: StaticLayer, pos: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """One token at device position `pos` [1] over a `StaticLayer`: fixed shapes, no host sync. Beside q's
        projection: a compressed layer's compressor and kv's norm into the window ring on the side stream, the
        indexer (its compressor, then its pick once qr exists) on the second, its head weights on this one;
        attention waits for all three."""
        side, side2, pick = self.m.side, self.m.side2, None
        side.hold(x)
        if self.ratio:
            with side.beside():
                self.compressor.decode(x, sl.compressor, pos, ctx)  # HCA: its valid flags are the entry mask
            if self.indexer is not None:
                side2.hold(x)
                with side2.beside():
                    ikeys = self.indexer.decode(x, sl.indexer, pos, ctx)
                hw = self._head_weights(x)  # here, before q's projection: the indexer's branch is the longest

                def picked(qr: torch.Tensor) -> None:  # the indexer's own (ratio 4) valid flags: the same as the
                    # compressor's, without waiting for the other branch
                    self._picked(x, qr, ikeys, pos, sl.indexer.valid.unsqueeze(1), ctx, out=sl.entry_mask, hw=hw)

                pick = (side2, picked)
        q, _, _, cos, sin = self._project(x, pos, ctx, (sl.window, sl.window_ok, pos), side, pick)  # kv: ring
        side.join()
        side2.join()
        return self._output(q, sl.keys, sl.mask, cos, sin)

    def to_static(self, lc: LayerCache, pos: int, batch: int, capacity: int, dtype: torch.dtype) -> StaticLayer:
        cfg, dev = self.m.cfg, self.m.device
        win = cfg.sliding_window
        slots = capacity // self.ratio + 1 if self.ratio else 0
        sl = StaticLayer(torch.zeros(batch, win + slots, cfg.head_dim, dtype=dtype, device=dev),
                         torch.zeros(batch, 1, win + slots, dtype=torch.bool, device=dev), win)
        n = 0 if lc.window is None else lc.window.shape[1]
        if n:
            held = torch.arange(pos - n, pos, device=dev) % win
            sl.window[:, held], sl.window_ok[:, held] = lc.window, True
        if self.ratio:  # HCA's visible entries are its mask; CSA's are also indexer-picked, so kept apart
            sl.compressor = self.compressor.to_static(lc.compressor, pos, batch, capacity, dtype,
                                                      sl.keys[:, win:], None if self.indexer else sl.entry_mask[:, 0])
            if self.indexer is not None:
                sl.indexer = self.indexer.to_static(lc.indexer, pos, batch, capacity, dtype)
        return sl


class MoE:
    """Routed experts (hash-routed by token id on the first num_hash_layers layers, else top-k of score +
    bias) weighted by the normalized scores times routed_scaling_factor, plus the shared expert."""

    def __init__(self, w: dict, i: int, model: Model):
        p, cfg = f"layers.{i}.ffn.", model.cfg
        self.m, self.i, self.p, self.w = model, i, p, w
        self.hash = cfg.is_hash_layer(i)
        self.inter = w[p + "shared_experts.w1.weight"].shape[0]
        self.w13 = _join_rows(w, p + "shared_experts.w1.weight", p + "shared_experts.w3.weight")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, ctx: _Ctx | None = None) -> torch.Tensor:
        m, cfg, w, p, ops = self.m, self.m.cfg, self.w, self.p, self.m.ops
        ctx = ctx or _Ctx(None, False, ())
        B, S, D = x.shape
        x2 = x.reshape(-1, D)
        m.side.hold(x2)
        start = m.side.mark()
        logits = ops.linear(x2, w[p + "gate.weight"], _acc(x.dtype))  # router logits in fp32 (fp64)
        with m.side.beside(after=start):  # the shared expert's gate/up beside the router and the routing,
            shared_h = self.shared_up(x2)  # issued after the router: a graph dispatches the router's grid first
        k = cfg.num_experts_per_tok
        route = (k, cfg.scoring_func, cfg.routed_scaling_factor)
        bias = w.get(p + "gate.bias")
        forced = ctx.forced(self.i, "router")
        fixed = ctx.hash_experts.get(self.i) if self.hash else None
        if self.hash and fixed is None:
            fixed = w[p + "gate.tid2eid"][ids.reshape(-1)]
        if fixed is None and (forced is None or ctx.recording):  # forced: the engine's own pick is still recorded
            idx, weights, margin = ops.route(logits, bias, *route)
            if ctx.recording:
                top, vals = ranked(selection_scores(logits, bias, cfg.scoring_func), k + RANKED_EXTRA)
                ctx.record(self.i, "router", Selection(idx.view(B, S, -1), margin.view(B, S), top.view(B, S, -1),
                                                       vals.view(B, S, -1)))
        if forced is not None:
            fixed = forced.reshape(-1, k)
        if fixed is not None:
            idx, weights, _ = ops.route(logits, bias, *route, fixed)
        e = m.experts[self.i]
        routed = m.side.mark()

        def joined() -> torch.Tensor:  # called by moe_experts once it needs the shared expert: after gate/up
            # w2 waits for the routing too and is issued after the routed gate/up, so that the gate/up grid is
            # dispatched first: dispatched ahead, w2's grid took the SMs and gate/up started ~4 us late (run 72)
            with m.side.beside(after=routed):
                shared = self.shared_down(shared_h)
            m.side.join()
            return shared

        out = ops.moe_experts(x2, e["w1"], e["w3"], e["w2"], idx, weights, cfg.swiglu_limit, joined)
        return out.view(B, S, D)

    def shared_up(self, x2: torch.Tensor) -> torch.Tensor:
        """The shared expert's (SwiGLU MLP in FP8) first half of x2 [T, D]: [gate | up] rows when w1 and w3 are
        joined (w2 reads them through swiglu), else swiglu's output."""
        cfg, w, p, ops = self.m.cfg, self.w, self.p, self.m.ops
        if self.w13 is not None:
            return ops.linear(x2, self.w13)
        g, u = ops.linear(x2, w[p + "shared_experts.w1.weight"]), ops.linear(x2, w[p + "shared_experts.w3.weight"])
        return ops.swiglu(g, u, cfg.swiglu_limit)

    def shared_down(self, h: torch.Tensor) -> torch.Tensor:
        """The shared expert's w2 of `shared_up`'s output."""
        w2 = self.w[self.p + "shared_experts.w2.weight"]
        if self.w13 is not None:
            return self.m.ops.linear(h, w2, glu=self.m.cfg.swiglu_limit)
        return self.m.ops.linear(h, w2)


def _padded(parts: list[torch.Tensor], width: int, fill: float) -> torch.Tensor:
    """Steps' [B, s, w] pieces joined along positions, each padded with `fill` (or cut) to `width` columns."""
    return torch.cat([torch.nn.functional.pad(t, (0, max(0, width - t.shape[-1])), value=fill)[..., :width]
                      for t in parts], 1)


class _Ctx:
    """Per-call bookkeeping: selections to force, selections and taps to record."""

    def __init__(self, forced: dict | None, record: bool, taps: tuple[str, ...]):
        self._forced, self._record = forced or {}, record
        self.start = 0  # absolute position of the chunk's first token (set by Model.step)
        self.selections: dict[tuple[int, str], Selection] = {}
        self.taps_wanted, self.taps = set(taps), {}
        self._memo: dict[tuple, object] = {}
        self.hash_experts: dict[int, torch.Tensor] = {}  # a decode step's hash-routed experts per layer, made early

    @property
    def recording(self) -> bool:
        return self._record

    def forced(self, layer: int, kind: str) -> torch.Tensor | None:
        sel = self._forced.get((layer, kind))
        return None if sel is None else (sel.indices if isinstance(sel, Selection) else sel)

    def record(self, layer: int, kind: str, sel: Selection) -> None:
        if self._record:
            self.selections[(layer, kind)] = sel

    def tap(self, name: str, h: torch.Tensor) -> None:
        if name in self.taps_wanted:
            self.taps[name] = h

    def begin(self, start: int) -> None:
        """A new chunk at absolute position `start`: RoPE values of an earlier chunk no longer apply."""
        self.start = start
        self._memo.clear()
        self.hash_experts = {}

    def memo(self, key: tuple, make):
        """`make()` once per chunk under `key`: device values that every layer of a step shares (RoPE's
        cos/sin), computed once instead of once per layer."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rope(self, rope: _Rope, pos: torch.Tensor, batch: int, tokens: int,
             align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of `rope` at `pos` ([B, S] after expand; rounded down to a multiple of `align`: a decode
        step's compressed-entry position per ratio), computed once per chunk (one launch)."""
        shared = self._memo.get(("rope", id(rope), align, batch, tokens))  # `share_rope`'s, made before any fork
        if shared is not None:
            return shared
        key = ("rope", id(rope), align, stream_key(pos.device))  # per branch: branches may run at once
        return self.memo(key, lambda: rope(pos.expand(batch, tokens), align))

    def share_rope(self, ropes: set[tuple[_Rope, int]], pos: torch.Tensor, batch: int) -> None:
        """One decode token's cos/sin for every (rope, align) in `ropes`, issued now, joined before any branch
        forks, so every branch reads them instead of computing its own on its path to attention. Keyed without
        `pos`: a decode step has one position (the static cache's), and `begin` clears them each step."""
        for rope, align in ropes:
            self._memo[("rope", id(rope), align, batch, 1)] = rope(pos.expand(batch, 1), align)


class Model:
    """A loaded DeepSeek-V4: `forward` (full-prefill logits), `trace` (plus selections and taps),
    `generate` (greedy incremental decode). Weights stay in their stored (packed) form on `device`."""

    def __init__(self, cfg: Config, weights: dict, *, device: torch.device, dtype: torch.dtype, ops,
                 source: str | None = None):
        self.cfg, self.device, self.dtype, self.ops, self.source, self._sha = cfg, device, dtype, ops, source, None
        self.w = {k: (v.to(device) if isinstance(v, (QWeight, torch.Tensor)) else v) for k, v in weights.items()}
        self.rope_main, self.rope_c = _Rope(cfg, False, device, ops), _Rope(cfg, True, device, ops)
        self.side, self.side2 = SideStream(device, 1), SideStream(device, 2)  # a decode step's side branches
        self.side_hc = SideStream(device, 3)  # each block's mHC post and comb, beside the block
        self.experts = [self._stack_experts(i) for i in range(cfg.num_hidden_layers)]
        self.attn = [Attention(self.w, i, self) for i in range(cfg.num_hidden_layers)]
        self.moe = [MoE(self.w, i, self) for i in range(cfg.num_hidden_layers)]
        # the cos/sin a decode step reads: q and kv's rope per layer, and each compressor's at its window start
        self._decode_ropes = {(a.rope, 1) for a in self.attn} | {(self.rope_c, a.ratio) for a in self.attn if a.ratio}

    def _stack_experts(self, i: int) -> dict[str, QWeight]:
        """Routed experts as [E, N, K(/2)] stacks (packed stays packed); the per-expert keys are dropped."""
        out = {}
        for name in ("w1", "w2", "w3"):
            keys = [f"layers.{i}.ffn.experts.{e}.{name}.weight" for e in range(self.cfg.n_routed_experts)]
            ws = [self.w.pop(k) for k in keys]
            scale = None if ws[0].scale is None else torch.stack([q.scale for q in ws])
            out[name] = QWeight(torch.stack([q.data for q in ws]), scale, ws[0].kind)
        return out

    # ------------------------------------------------------------------------------------------ API
    @property
    def config(self) -> Config:
        return self.cfg

    @contextlib.contextmanager
    def reference_ops(self, names: list[str] | tuple[str, ...]):
        """This model with the ops `names` also taken from the reference for the block (the kernel search of
        bisect and the token tier: loading a model per op held two copies, refused for V4-Flash on one GPU)."""
        from .ops import get_ops

        old = self.ops
        self._use_ops(get_ops(old.backend, sorted(set(old.reference_ops) | set(split_names(names)))))
        try:
            yield self
        finally:
            self._use_ops(old)

    def _use_ops(self, ops) -> None:
        self.ops = self.rope_main.ops = self.rope_c.ops = ops

    def checkpoint_sha256(self) -> str | None:
        """sha256 over the checkpoint's config.json and safetensors (computed on first use: it reads every
        byte, minutes for a full-size checkpoint)."""
        if self._sha is None and self.source is not None:
            from .checkpoint import checkpoint_sha256

            self._sha = checkpoint_sha256(self.source)
        return self._sha

    def weight_bytes(self) -> int:
        """Resident bytes of all weights as held (packed FP8/FP4 plus scales)."""
        ts = list(self.w.values()) + [q for e in self.experts for q in e.values()]
        return sum(t.nbytes() if isinstance(t, QWeight) else t.numel() * t.element_size() for t in ts)

    def tap_names(self) -> list[str]:
        """Every tap `trace`/`generate` can record, in forward order."""
        return tap_names(self.cfg.num_hidden_layers)

    def new_cache(self) -> Cache:
        return Cache.empty(self.cfg.num_hidden_layers)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, selections: dict | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of a full prefill (float32; float64 when the model runs in float64).
        `selections` forces sparse picks: {(layer, "router" | "indexer"): indices [B, T, k] or Selection}, as
        `trace` records them for these input_ids (a hash layer's router routes by token id: not forceable)."""
        self._check_ids(input_ids)
        forced = self._check_selections(selections, input_ids.shape)
        return self.step(input_ids, self.new_cache(), _Ctx(forced, False, ()))

    __call__ = forward

    @torch.no_grad()
    def trace(self, input_ids: torch.Tensor, *, taps: str | tuple[str, ...] | list[str] = (),
              selections: dict | None = None) -> Trace:
        """A full prefill that also records every sparse selection (with margins) and the named taps
        (see `tap_names`: e.g. "L.attn", "L.ffn", the hyper-connection streams after layer L's blocks).
        With `selections` forced, the recorded selections are the engine's own picks given that upstream
        (so a flip there is this layer's rounding, not a consequence of an earlier flip); the forced ones
        are what the forward uses. `taps` may be one name or a comma list."""
        self._check_ids(input_ids)
        taps = self._check_taps(taps)
        ctx = _Ctx(self._check_selections(selections, input_ids.shape), True, taps)
        logits = self.step(input_ids, self.new_cache(), ctx)
        return Trace(logits, ctx.selections, ctx.taps)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 taps: str | tuple[str, ...] | list[str] = (), graph: bool | None = None,
                 selections: dict | None = None) -> Generation:
        """Greedy decode (argmax ties -> lower id): a prefill, then one `decode` step per new token over a
        `StaticCache`. `graph` (default: on for CUDA/ROCm devices with the triton backend, no taps and no
        selections) replays the step as a CUDA graph after the first one. Prompt + max_new_tokens must fit in
        max_position_embeddings (as vLLM's max_model_len).

        `selections` forces sparse picks at every position the decode computes (the prompt's and each new
        token's but the last: `trace` records them on those tokens; `{}` forces none) and records the engine's
        own picks given them in `Generation.selections`, as `trace` does (none when max_new_tokens is 0): so a
        decode can be judged against its prefill with a near-tie flip told apart from a bug."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        self._check_ids(input_ids, max_new_tokens)
        taps = self._check_taps(taps)
        B, T = input_ids.shape
        S = T + max(max_new_tokens, 1) - 1  # positions whose picks the run computes
        forcing = selections is not None
        forced = self._check_selections(selections, (B, S)) if forcing else {}
        if graph is None:
            graph = self.graph_safe() and not taps and not forcing
        if graph and (taps or forcing):
            raise ValueError(f"generate: {'taps' if taps else 'selections'} cannot be "
                             f"{'recorded' if taps else 'forced'} inside a CUDA graph; pass graph=False")
        if graph and self.device.type != "cuda":
            raise ValueError(f"generate: graph=True needs a CUDA/ROCm device, the model is on {self.device}")
        toks, logits, tapped, picked = [], [], {t: [] for t in taps}, []

        def ctx_at(start: int, stop: int) -> _Ctx:
            return _Ctx({key: idx[:, start:stop] for key, idx in forced.items()}, forcing, taps)

        ctx = ctx_at(0, T)
        cache, sc, replay = self.new_cache(), None, None
        out = self.step(input_ids, cache, ctx, last_only=not forcing)[:, -1] if max_new_tokens else None
        for n in range(max_new_tokens):
            ids = out.argmax(-1, keepdim=True)
            toks.append(ids)
            logits.append(out)
            picked.append(ctx.selections)
            for t in taps:
                tapped[t].append(ctx.taps[t][:, -1])
            if n + 1 == max_new_tokens:
                break
            if sc is None:
                sc = self.static_cache(cache, T + max_new_tokens)
                replay = DecodeGraph(self, sc) if graph else None
            ctx = ctx_at(T + n, T + n + 1)
            out = (replay(ids) if replay else self.decode(ids, sc, ctx))[:, -1]
        return Generation(  # no new tokens: empty, of the dtype and device n > 0 would give
            torch.cat(toks, 1) if toks else torch.zeros(B, 0, dtype=torch.long, device=self.device),
            torch.stack(logits, 1) if logits else torch.zeros(B, 0, self.cfg.vocab_size, dtype=_acc(self.dtype),
                                                              device=self.device),
            {t: torch.stack(v, 1) for t, v in tapped.items()},
            self._joined_picks(picked, S) if forcing else {},
        )

    def _joined_picks(self, picked: list[dict], S: int) -> dict:
        """Each step's recorded selections as one Selection per key over all S positions, k as `trace` of S
        tokens has it (an early step's indexer sees fewer entries: the columns it lacks are -1, no entry)."""
        out = {}
        for key in picked[0] if picked else ():
            k = self._pick_width(key[1], S)

            steps = [p[key] for p in picked]
            out[key] = Selection(_padded([s.indices for s in steps], k, -1), torch.cat([s.margin for s in steps], 1),
                                 _padded([s.ranked for s in steps], k + RANKED_EXTRA, -1),
                                 _padded([s.scores for s in steps], k + RANKED_EXTRA, -math.inf))
        return out

    def _pick_width(self, kind: str, S: int) -> int:
        """k of a router or indexer selection over S tokens (CSA, ratio 4, has S // 4 entries)."""
        return self.cfg.num_experts_per_tok if kind == "router" else min(self.cfg.index_topk, S // 4)

    def graph_safe(self) -> bool:
        """Whether a decode step can be captured: a GPU, and every op a triton kernel (reference ops read
        values back to the host, e.g. the reference MoE's expert list; float64 runs them all)."""
        return (self.device.type == "cuda" and self.ops.backend == "triton" and not self.ops.reference_ops
                and self.dtype != torch.float64 and all(q.kind == "mxfp4" for e in self.experts for q in e.values()))

    def _check_ids(self, input_ids: torch.Tensor, new_tokens: int = 0) -> None:
        """Once per public call, not per decode step (the range check syncs with a GPU)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
                or input_ids.dtype == torch.bool:
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, tokens], got {got}: pass "
                             "torch.tensor(ids, dtype=torch.long)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if not input_ids.numel():
            raise ValueError(f"input_ids has no tokens (shape {tuple(input_ids.shape)}): pass at least one row of "
                             "at least one token")
        T, limit = input_ids.shape[1], self.cfg.max_position_embeddings
        if T + new_tokens > limit:
            what = f"{T} prompt tokens + max_new_tokens {new_tokens}" if new_tokens else f"{T} tokens"
            raise ValueError(f"input_ids: {what} exceed max_position_embeddings {limit}: shorten the prompt"
                             + (" or ask for fewer tokens" if new_tokens else ""))
        if input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"input_ids out of range 0..{self.cfg.vocab_size - 1}")

    def _check_taps(self, taps: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """The tap names as a tuple (a str is one name or a comma list), each one checked."""
        taps = tuple(split_names(taps))
        valid = set(tap_names(self.cfg.num_hidden_layers))
        bad = sorted(set(taps) - valid)
        if bad:
            last = self.cfg.num_hidden_layers - 1
            raise ValueError(f"unknown tap(s) {bad}: use 'L.<{'|'.join(TAP_KINDS)}>' with L in 0..{last}")
        return taps

    def _check_selections(self, selections: dict | None, shape: tuple[int, int]) -> dict:
        """Forced selections as {(layer, kind): indices} on the model's device, every key, shape and id checked
        against the config and the [B, S] positions they cover: a wrong one failed deep in the forward or was
        ignored."""
        cfg, (B, S) = self.cfg, tuple(shape)
        out = {}
        for key, sel in (selections or {}).items():
            i, kind = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
            if not (isinstance(i, int) and 0 <= i < cfg.num_hidden_layers and kind in ("router", "indexer")):
                raise ValueError(f"selections: unknown key {key!r}: use (layer, 'router' | 'indexer') with layer in "
                                 f"0..{cfg.num_hidden_layers - 1}")
            if kind == "router" and cfg.is_hash_layer(i):
                raise ValueError(f"selections: layer {i} routes by token id (num_hash_layers {cfg.num_hash_layers}), "
                                 f"its router cannot be forced: drop key {key!r}")
            if kind == "indexer" and cfg.compress_ratios[i] != 4:
                raise ValueError(f"selections: layer {i} has no indexer (compress ratio {cfg.compress_ratios[i]}; "
                                 f"CSA layers, ratio 4, have one): drop key {key!r}")
            idx = sel.indices if isinstance(sel, Selection) else sel
            if not (isinstance(idx, torch.Tensor) and idx.dtype in (torch.int64, torch.int32, torch.int16, torch.int8)):
                raise ValueError(f"selections[{key!r}]: indices must be an integer tensor, got "
                                 f"{getattr(idx, 'dtype', type(idx).__name__)}")
            entries = S // 4  # CSA's compressed entries after a prefill of S tokens
            k = self._pick_width(kind, S)
            lo, hi = (0, cfg.n_routed_experts - 1) if kind == "router" else (-1, entries - 1)
            if tuple(idx.shape) != (B, S, k):
                raise ValueError(f"selections[{key!r}] has shape {tuple(idx.shape)}, {(B, S)} positions need "
                                 f"{(B, S, k)}: record them with trace on those tokens")
            if idx.numel() and (idx.min() < lo or idx.max() > hi):
                what = "expert ids" if kind == "router" else "compressed entries (-1: none)"
                raise ValueError(f"selections[{key!r}] holds ids {int(idx.min())}..{int(idx.max())}, outside {lo}..{hi}"
                                 f" ({what} of layer {i} for {S} tokens)")
            out[key] = idx.to(self.device)
        return out

    # ------------------------------------------------------------------------------------------ math
    def step(self, input_ids: torch.Tensor, cache: Cache, ctx: _Ctx | None = None, *,
             last_only: bool = False) -> torch.Tensor:
        """Run one chunk through the model, advancing `cache`; logits [B, S, vocab], or [B, 1, vocab] of the last
        position with `last_only` (a prefill before decoding: the last layer's FFN, the mHC head and the vocab
        head then run on that position alone, the cache being complete before them)."""
        ctx = ctx or _Ctx(None, False, ())
        if last_only and (ctx._forced or ctx._record):
            raise ValueError("step: last_only cannot force or record sparse selections (they cover every position)")
        if cache.pos + input_ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"step: {cache.pos} cached + {input_ids.shape[1]} new tokens exceed "
                             f"max_position_embeddings {self.cfg.max_position_embeddings}")
        ids = input_ids.to(self.device)
        pos = torch.arange(cache.pos, cache.pos + ids.shape[1], device=self.device)
        ctx.begin(cache.pos)
        cache.batch = ids.shape[0]
        out = self._body(ids, ctx, lambda i, x: self.attn[i](x, cache.layers[i], pos, ctx), last_only)
        cache.pos += ids.shape[1]
        return out

    def static_cache(self, cache: Cache, capacity: int) -> StaticCache:
        """`cache` (after a prefill) in fixed shapes for `decode`, room for `capacity` tokens in all."""
        if capacity < cache.pos:
            raise ValueError(f"static cache capacity {capacity} is below the {cache.pos} tokens already cached")
        if capacity > self.cfg.max_position_embeddings:
            raise ValueError(f"static cache capacity {capacity} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}: decode no further than the model's positions")
        if not cache.batch:
            raise ValueError("static_cache needs a prefilled cache: run Model.step on the prompt first")
        layers = [a.to_static(c, cache.pos, cache.batch, capacity, self.dtype)
                  for a, c in zip(self.attn, cache.layers, strict=True)]
        return StaticCache(layers, torch.tensor([cache.pos], device=self.device), capacity, cache.pos)

    def decode(self, token: torch.Tensor, sc: StaticCache, ctx: _Ctx | None = None) -> torch.Tensor:
        """One decode step over a `StaticCache`: token [B, 1] -> logits [B, 1, vocab], position read from and
        advanced on the device, every shape fixed: the step `DecodeGraph` captures. Numerically the same
        as `step` with one token (only the window's summation order differs). A step past `capacity`
        tokens is refused (`generate` sizes the cache)."""
        if sc.host_pos >= sc.capacity:
            raise ValueError(f"static cache full: capacity {sc.capacity} tokens; build it with a larger capacity")
        ctx = ctx or _Ctx(None, False, ())
        ctx.begin(sc.host_pos)
        pos = sc.pos
        self.side.reset()
        self.side2.reset()
        self.side_hc.reset()
        with self.side.beside():  # beside the embedding and the first mHC mix; joined before the first attention
            ctx.share_rope(self._decode_ropes, pos, token.shape[0])
            ids = token.to(self.device).reshape(-1)
            ctx.hash_experts = {i: self.w[f"layers.{i}.ffn.gate.tid2eid"][ids] for i, moe in enumerate(self.moe)
                                if moe.hash}  # the token's hash-routed experts, off the router's path

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            if i == 0:
                self.side.join()
            a = self.attn[i].decode(x, sc.layers[i], pos, ctx)
            if i == self.cfg.num_hidden_layers - 1:  # pos has no reader left: advance it beside the last MoE
                with self.side.beside():
                    sc.pos += 1
            return a

        out = self._body(token, ctx, attend)
        self.side.join()
        sc.host_pos += 1
        return out

    def _body(self, ids: torch.Tensor, ctx: _Ctx, attend, last_only: bool = False) -> torch.Tensor:
        """Embedding, the layers (attention by `attend(layer, normed input)`), mHC head, final norm, head;
        `last_only`: from the last layer's FFN on, only the last position (nothing after it reads the others)."""
        cfg, w, ops = self.cfg, self.w, self.ops
        B, S = ids.shape
        x = torch.nn.functional.embedding(ids, w["embed.weight"]).to(self.dtype)
        h = x.unsqueeze(2).expand(B, S, cfg.hc_mult, -1)  # [B, S, hc, D]
        n, d, iters, eps, hc_eps = cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps, cfg.hc_eps
        side = self.side_hc

        def pre(i: int, block: str, h: torch.Tensor, after: tuple = ()) -> tuple:
            """mHC before block (i, block): hc_pre, or with `after` = (out, post, comb) of the block before,
            hc_post_pre; the new streams, post, comb, input and normed input. Post and comb (Sinkhorn) come from
            the mix sums beside the block: only the mHC post after it reads them (joined before that post)."""
            p = f"layers.{i}.hc_{block}_"
            fn, base, scale = w[p + "fn"], w[p + "base"], w[p + "scale"]
            nw = (w[f"layers.{i}.{block}_norm.weight"], eps)  # the block's RMSNorm, applied by the mHC op
            if after:
                side.join()
                h, sums, xin, xn = ops.hc_post_pre(after[0], h, *after[1:], fn, base, scale, n, eps, hc_eps, nw)
            else:
                sums, xin, xn = ops.hc_pre(h, fn, base, scale, n, eps, hc_eps, nw)
            side.hold(sums)
            with side.beside():
                post, comb = ops.hc_weights(sums, base, scale, n, d, iters, eps, hc_eps, h.dtype)
            return h, post, comb, xin, xn

        h, post, comb, xin, xn = pre(0, "attn", h)
        for i in range(cfg.num_hidden_layers):  # hc_post_pre: one block's mHC post and the next one's pre
            ctx.tap(f"{i}.attn_in", xin)
            a = attend(i, xn)
            ctx.tap(f"{i}.attn_out", a)
            h, post, comb, xin, xn = pre(i, "ffn", h, (a, post, comb))
            last = last_only and i + 1 == cfg.num_hidden_layers
            if last:  # post and comb are still being made beside: cut after the join below
                h, xin, xn, ids = (t[:, -1:] for t in (h, xin, xn, ids))
            ctx.tap(f"{i}.attn", h)
            ctx.tap(f"{i}.ffn_in", xin)
            f = self.moe[i](xn, ids, ctx)
            ctx.tap(f"{i}.ffn_out", f)
            if i + 1 < cfg.num_hidden_layers:
                h, post, comb, xin, xn = pre(i + 1, "attn", h, (f, post, comb))
            else:
                side.join()
                h = ops.hc_post(f, h, *((post[:, -1:], comb[:, -1:]) if last else (post, comb)))
            ctx.tap(f"{i}.ffn", h)
        _, y = ops.hc_head(h, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], cfg.rms_norm_eps, cfg.hc_eps,
                           (w["norm.weight"], cfg.rms_norm_eps))
        return ops.linear(y, w["head.weight"])


class DecodeGraph:
    """`Model.decode` captured as one CUDA graph (torch.cuda graphs; ROCm has them too): `graph(token)`
    copies the token into the captured input and replays every launch of the step with no Python.

    The first call runs the step eagerly on a side stream (it JIT-compiles every Triton kernel and sizes
    the allocator's pool; it is a real step and advances the cache), then captures the next step's work
    without running it. Returns a fresh [B, 1, vocab] logits tensor each call."""

    def __init__(self, model: Model, sc: StaticCache):
        self.model, self.sc, self.graph = model, sc, None

    @torch.no_grad()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            if self.sc.host_pos >= self.sc.capacity:
                raise ValueError(f"static cache full: capacity {self.sc.capacity} tokens; build a larger one")
            self.token.copy_(token)
            self.graph.replay()
            self.sc.host_pos += 1
            return self.out.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.model.decode(token, self.sc)
        torch.cuda.current_stream().wait_stream(side)
        if self.sc.host_pos >= self.sc.capacity:
            return out  # full: nothing left to capture (a further call is refused by decode)
        self.token = token.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.model.decode(self.token, self.sc)
        self.sc.host_pos -= 1  # capturing recorded the step without running it
        return out
