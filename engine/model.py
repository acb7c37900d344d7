"""The DeepSeek-V4 forward, written once over the ops interface (engine/ops).

Shapes: B batch, S tokens in this chunk, H heads of head_dim hd (one shared K=V head), hc hyper-connection
streams of width D, T compressed entries. A chunk runs at absolute positions cache.pos .. cache.pos+S-1; a
full prefill is one chunk from an empty cache, a decode step is a chunk of one.

Spec of record: the V4 paper and transformers 5.23 `deepseek_v4` (formulas checked against it in
tests/test_vs_transformers.py). Where DeepSeek's own inference code simulates quantization of
activations (FP8 act-quant, FP4 indexer), this engine, like transformers, computes in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import Cache, CompressorState, LayerCache
from .config import Config, rope_inv_freq
from .ops import QWeight
from .ops.reference import swiglu


@dataclass
class Selection:
    """A sparse choice at every position: indices [B, S, k] (-1 = no entry) and the k-th minus (k+1)-th
    score [B, S] (inf when nothing competes): a small margin means a flip there is rounding, not a bug."""

    indices: torch.Tensor
    margin: torch.Tensor | None


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


TAP_KINDS = ("attn_in", "attn_out", "attn", "ffn_in", "ffn_out", "ffn")


def tap_names(num_layers: int) -> list[str]:
    """Every tap in forward order: per layer the collapsed attention input [B, T, D] (after mHC's pre
    mix), the attention output [B, T, D], the streams after mHC's post mix [B, T, hc, D]; same for the MoE."""
    return [f"{i}.{k}" for i in range(num_layers) for k in TAP_KINDS]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Rope:
    """cos/sin [B, S, rd/2] for absolute positions, computed in float64 then cast by the ops."""

    def __init__(self, cfg: Config, compressed: bool, device: torch.device):
        self.inv_freq = rope_inv_freq(cfg, compressed).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        return ang.cos(), ang.sin()


class Compressor:
    """Softmax-gated pooling of `ratio` tokens into one entry (HCA: disjoint windows; CSA, ratio 4: each
    entry pools the previous window's Ca half with this window's Cb half, 2*ratio slots), then RMSNorm
    and RoPE at the window's first position."""

    def __init__(self, w: dict, prefix: str, ratio: int, dim: int, model: Model):
        self.wkv, self.wgate = w[prefix + "wkv.weight"], w[prefix + "wgate.weight"]
        self.ape, self.norm = w[prefix + "ape"], w[prefix + "norm.weight"]
        self.ratio, self.dim, self.overlap, self.m = ratio, dim, ratio == 4, model

    def __call__(self, x: torch.Tensor, st: CompressorState) -> torch.Tensor:
        ops, r, d = self.m.ops, self.ratio, self.dim
        acc = _acc(x.dtype)
        kv, gate = ops.linear(x, self.wkv).to(acc), ops.linear(x, self.wgate).to(acc)
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


class Attention:
    """Low-rank q with an unweighted per-head norm, one shared K=V head, partial interleaved RoPE,
    sliding window plus (CSA) indexer-selected or (HCA) all compressed entries, a sink per head, inverse
    RoPE on the output, grouped output projection."""

    def __init__(self, w: dict, i: int, model: Model):
        cfg, p = model.cfg, f"layers.{i}.attn."
        self.m, self.i, self.p, self.w = model, i, p, w
        self.ratio = cfg.compress_ratios[i]
        self.rope = model.rope_c if self.ratio else model.rope_main
        self.compressor = Compressor(w, p + "compressor.", self.ratio, cfg.head_dim, model) if self.ratio else None
        self.indexer = (Compressor(w, p + "indexer.compressor.", 4, cfg.index_head_dim, model)
                        if self.ratio == 4 else None)

    def __call__(self, x: torch.Tensor, lc: LayerCache, pos: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        cfg, w, p, ops = self.m.cfg, self.w, self.p, self.m.ops
        B, S, _ = x.shape
        H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = self.rope(pos.expand(B, S))
        qr = ops.rms_norm(ops.linear(x, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], eps)  # [B, S, q_lora]
        q = ops.rms_norm(ops.linear(qr, w[p + "wq_b.weight"]).view(B, S, H, hd), None, eps)
        q = ops.rope(q, cos, sin)
        kv = ops.rms_norm(ops.linear(x, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], eps)
        kv = ops.rope(kv.unsqueeze(2), cos, sin).squeeze(2)  # [B, S, hd]

        keys = kv if lc.window is None else torch.cat([lc.window, kv], 1)
        win = cfg.sliding_window
        lc.window = keys[:, max(0, keys.shape[1] - (win - 1)):]  # the newest win - 1 rows (none for win 1)
        end = ctx.start + S  # host ints: no device sync on the decode path
        kpos = torch.arange(end - keys.shape[1], end, device=x.device)
        mask = (kpos[None] <= pos[:, None]) & (kpos[None] > pos[:, None] - win)  # [S, L]
        mask = mask.expand(B, S, -1)
        if self.ratio:
            entries = self.compressor(x, lc.compressor)  # [B, T, hd]
            T = entries.shape[1]
            visible = torch.arange(T, device=x.device)[None] < ((pos + 1) // self.ratio)[:, None]  # [S, T]
            cmask = visible.expand(B, S, T)
            if self.indexer is not None:
                sel = self._select(x, qr, lc, pos, visible, ctx)
                hit = torch.zeros(B, S, T + 1, dtype=torch.bool, device=x.device)
                hit.scatter_(-1, torch.where(sel >= 0, sel, T), True)
                cmask = cmask & hit[..., :T]
            keys, mask = torch.cat([keys, entries.to(keys.dtype)], 1), torch.cat([mask, cmask], -1)
        o = ops.attention(q, keys, w[p + "attn_sink"], mask, hd**-0.5)
        o = ops.rope(o, cos, sin, inverse=True)
        o = ops.grouped_linear(o.reshape(B, S, cfg.o_groups, -1), w[p + "wo_a.weight"], cfg.o_groups)
        return ops.linear(o.flatten(2), w[p + "wo_b.weight"])

    def _select(self, x, qr, lc, pos, visible, ctx: _Ctx) -> torch.Tensor:
        """Lightning indexer: top-k compressed entries per query by sum_h w_h relu(q_h . k)."""
        m, cfg, w, p, ops = self.m, self.m.cfg, self.w, self.p + "indexer.", self.m.ops
        B, S, _ = x.shape
        keys = self.indexer(x, lc.indexer)  # [B, T, Di]
        T = keys.shape[1]
        forced = ctx.forced(self.i, "indexer")
        k = min(cfg.index_topk, T)
        if k == 0:
            return torch.full((B, S, 0), -1, dtype=torch.long, device=x.device)
        if forced is not None and not ctx.recording:
            return forced
        cos, sin = m.rope_c(pos.expand(B, S))
        q = ops.linear(qr, w[p + "wq_b.weight"]).view(B, S, cfg.index_n_heads, cfg.index_head_dim)
        q = ops.rope(q, cos, sin)
        hw = ops.linear(x.to(_acc(x.dtype)), w[p + "weights_proj.weight"]) * cfg.index_n_heads**-0.5
        scores = ops.index_scores(q, keys, hw, cfg.index_head_dim**-0.5)  # [B, S, T]
        scores = scores.masked_fill(~visible, float("-inf"))
        idx, margin = ops.topk(scores, k)
        idx = torch.where(torch.gather(scores, -1, idx) == float("-inf"), -1, idx)
        ctx.record(self.i, "indexer", idx, torch.nan_to_num(margin, nan=float("inf")))
        return idx if forced is None else forced  # forced: the engine's own pick is recorded, not used


class MoE:
    """Routed experts (hash-routed by token id on the first num_hash_layers layers, else top-k of score +
    bias) weighted by the normalized scores times routed_scaling_factor, plus the shared expert."""

    def __init__(self, w: dict, i: int, model: Model):
        p, cfg = f"layers.{i}.ffn.", model.cfg
        self.m, self.i, self.p, self.w = model, i, p, w
        self.hash = cfg.is_hash_layer(i)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        m, cfg, w, p, ops = self.m, self.m.cfg, self.w, self.p, self.m.ops
        B, S, D = x.shape
        x2 = x.reshape(-1, D)
        logits = ops.linear(x2.to(_acc(x.dtype)), w[p + "gate.weight"])  # router in fp32 or fp64
        if cfg.scoring_func == "sqrtsoftplus":
            scores = torch.nn.functional.softplus(logits).sqrt()
        elif cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        forced = ctx.forced(self.i, "router")
        if self.hash:
            idx = w[p + "gate.tid2eid"][ids.reshape(-1)].long()
        elif forced is None or ctx.recording:  # forced: the engine's own pick is still recorded
            idx, margin = ops.topk(scores + w[p + "gate.bias"].to(scores.dtype), cfg.num_experts_per_tok)
            ctx.record(self.i, "router", idx.view(B, S, -1), margin.view(B, S))
        if forced is not None:
            idx = forced.reshape(-1, cfg.num_experts_per_tok)
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        e = m.experts[self.i]
        routed = ops.moe_experts(x2, e["w1"], e["w3"], e["w2"], idx, weights, cfg.swiglu_limit)
        g = ops.linear(x2, w[p + "shared_experts.w1.weight"])
        u = ops.linear(x2, w[p + "shared_experts.w3.weight"])
        shared = ops.linear(swiglu(g, u, cfg.swiglu_limit), w[p + "shared_experts.w2.weight"])
        return (routed + shared).view(B, S, D)


class _Ctx:
    """Per-call bookkeeping: selections to force, selections and taps to record."""

    def __init__(self, forced: dict | None, record: bool, taps: tuple[str, ...]):
        self._forced, self._record = forced or {}, record
        self.start = 0  # absolute position of the chunk's first token (set by Model.step)
        self.selections: dict[tuple[int, str], Selection] = {}
        self.taps_wanted, self.taps = set(taps), {}

    @property
    def recording(self) -> bool:
        return self._record

    def forced(self, layer: int, kind: str) -> torch.Tensor | None:
        sel = self._forced.get((layer, kind))
        return None if sel is None else (sel.indices if isinstance(sel, Selection) else sel)

    def record(self, layer: int, kind: str, idx: torch.Tensor, margin: torch.Tensor) -> None:
        if self._record:
            self.selections[(layer, kind)] = Selection(idx, margin)

    def tap(self, name: str, h: torch.Tensor) -> None:
        if name in self.taps_wanted:
            self.taps[name] = h


class Model:
    """A loaded DeepSeek-V4: `forward` (full-prefill logits), `trace` (plus selections and taps),
    `generate` (greedy incremental decode). Weights stay in their stored (packed) form on `device`."""

    def __init__(self, cfg: Config, weights: dict, *, device: torch.device, dtype: torch.dtype, ops,
                 source: str | None = None):
        self.cfg, self.device, self.dtype, self.ops, self.source, self._sha = cfg, device, dtype, ops, source, None
        self.w = {k: (v.to(device) if isinstance(v, (QWeight, torch.Tensor)) else v) for k, v in weights.items()}
        self.rope_main, self.rope_c = _Rope(cfg, False, device), _Rope(cfg, True, device)
        self.experts = [self._stack_experts(i) for i in range(cfg.num_hidden_layers)]
        self.attn = [Attention(self.w, i, self) for i in range(cfg.num_hidden_layers)]
        self.moe = [MoE(self.w, i, self) for i in range(cfg.num_hidden_layers)]

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
        """Logits [B, T, vocab] of a full prefill (float32; float64 when the model runs in float64)."""
        self._check_ids(input_ids)
        return self.step(input_ids, self.new_cache(), _Ctx(selections, False, ()))

    __call__ = forward

    @torch.no_grad()
    def trace(self, input_ids: torch.Tensor, *, taps: tuple[str, ...] | list[str] = (),
              selections: dict | None = None) -> Trace:
        """A full prefill that also records every sparse selection (with margins) and the named taps
        (see `tap_names`: e.g. "L.attn", "L.ffn", the hyper-connection streams after layer L's blocks).
        With `selections` forced, the recorded selections are the engine's own picks given that upstream
        (so a flip there is this layer's rounding, not a consequence of an earlier flip); the forced ones
        are what the forward uses."""
        self._check_ids(input_ids)
        self._check_taps(taps)
        ctx = _Ctx(selections, True, tuple(taps))
        logits = self.step(input_ids, self.new_cache(), ctx)
        return Trace(logits, ctx.selections, ctx.taps)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 taps: tuple[str, ...] | list[str] = ()) -> Generation:
        """Greedy decode: a prefill, then one incremental step per new token (argmax ties -> lower id)."""
        self._check_ids(input_ids)
        self._check_taps(taps)
        cache, toks, logits, tapped = self.new_cache(), [], [], {t: [] for t in taps}
        ids = input_ids
        for _ in range(max_new_tokens):
            ctx = _Ctx(None, False, tuple(taps))
            out = self.step(ids, cache, ctx)[:, -1]
            ids = out.argmax(-1, keepdim=True)
            toks.append(ids)
            logits.append(out)
            for t in taps:
                tapped[t].append(ctx.taps[t][:, -1])
        B = input_ids.shape[0]
        return Generation(
            torch.cat(toks, 1) if toks else input_ids.new_zeros(B, 0),
            torch.stack(logits, 1) if logits else torch.zeros(B, 0, self.cfg.vocab_size),
            {t: torch.stack(v, 1) for t, v in tapped.items()},
        )

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        """Once per public call, not per decode step (the range check syncs with a GPU)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"input_ids out of range 0..{self.cfg.vocab_size - 1}")

    def _check_taps(self, taps) -> None:
        valid = set(tap_names(self.cfg.num_hidden_layers))
        bad = sorted(set(taps) - valid)
        if bad:
            last = self.cfg.num_hidden_layers - 1
            raise ValueError(f"unknown tap(s) {bad}: use 'L.<{'|'.join(TAP_KINDS)}>' with L in 0..{last}")

    # ------------------------------------------------------------------------------------------ math
    def step(self, input_ids: torch.Tensor, cache: Cache, ctx: _Ctx | None = None) -> torch.Tensor:
        """Run one chunk through the model, advancing `cache`; logits [B, S, vocab]."""
        ctx = ctx or _Ctx(None, False, ())
        cfg, w, ops = self.cfg, self.w, self.ops
        ids = input_ids.to(self.device)
        B, S = ids.shape
        pos = torch.arange(cache.pos, cache.pos + S, device=self.device)
        ctx.start = cache.pos
        x = w["embed.weight"][ids].to(self.dtype)
        h = x.unsqueeze(2).expand(B, S, cfg.hc_mult, -1)  # [B, S, hc, D]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            post, comb, xin = self._hc_pre(h, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"])
            ctx.tap(f"{i}.attn_in", xin)
            a = self.attn[i](ops.rms_norm(xin, w[p + "attn_norm.weight"], cfg.rms_norm_eps), cache.layers[i], pos, ctx)
            ctx.tap(f"{i}.attn_out", a)
            h = self._hc_post(a, h, post, comb)
            ctx.tap(f"{i}.attn", h)
            post, comb, xin = self._hc_pre(h, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"])
            ctx.tap(f"{i}.ffn_in", xin)
            f = self.moe[i](ops.rms_norm(xin, w[p + "ffn_norm.weight"], cfg.rms_norm_eps), ids, ctx)
            ctx.tap(f"{i}.ffn_out", f)
            h = self._hc_post(f, h, post, comb)
            ctx.tap(f"{i}.ffn", h)
        cache.pos += S
        acc = _acc(self.dtype)
        hf = h.to(acc)
        pre = torch.sigmoid(self._hc_mix(hf, w["hc_head_fn"]) * w["hc_head_scale"].to(acc)
                            + w["hc_head_base"].to(acc)) + cfg.hc_eps
        y = (pre.unsqueeze(-1) * hf).sum(2)
        y = ops.rms_norm(y, w["norm.weight"], cfg.rms_norm_eps)
        return ops.linear(y, w["head.weight"])

    def _hc_mix(self, hf: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        flat = hf.flatten(2)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return flat @ fn.to(hf.dtype).T

    def _hc_pre(self, h, fn, base, scale):
        """mHC: from the streams, the collapse weights (pre), the expand weights (post) and a doubly
        stochastic mixing matrix (comb, Sinkhorn); returns (post, comb, collapsed input)."""
        cfg, n = self.cfg, self.cfg.hc_mult
        acc = _acc(h.dtype)
        hf = h.to(acc)
        mix = self._hc_mix(hf, fn)
        base, scale = base.to(acc), scale.to(acc)
        pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
        comb = mix[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
        comb = torch.softmax(comb, -1) + cfg.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        xin = (pre.unsqueeze(-1) * hf).sum(2).to(h.dtype)
        return post, comb, xin

    @staticmethod
    def _hc_post(out, h, post, comb):
        """New streams: post_k * out + sum_j comb[j, k] * h_j."""
        acc = post.dtype
        return (post.unsqueeze(-1) * out.to(acc).unsqueeze(-2) + comb.transpose(-1, -2) @ h.to(acc)).to(h.dtype)
