"""transformers' DeepseekV4ForCausalLM as a user engine for pytest-cdna2 (the README's Model API), on an
official-layout checkpoint dequantized at load: an independent implementation the suite can judge.

    PYTHONPATH=examples pytest --cdna2-engine=transformers_engine:load --cdna2-model=M --cdna2-goldens=G

It records what the token tier's near-tie rule and bisect need through forward hooks: taps under the goldens'
names and every router and indexer pick with its margin and best k + 4 entries' scores, and forces given picks
(only which entries are used: the weights stay transformers' own). Built on transformers 5.23's module layout.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config


def _record(picks: torch.Tensor, scores: torch.Tensor, k: int) -> NS:
    """Picks padded to k with -1 (fewer entries than k), the margin (k-th minus (k+1)-th score) and the best
    k + 4 entries with their scores (-1 / -inf: none), from which the suite reads a flip's near-tie band."""
    picks = torch.cat([picks, picks.new_full((*picks.shape[:-1], k - picks.shape[-1]), -1)], -1)
    r = k + 4
    top = scores.topk(min(r, scores.shape[-1]), -1)
    vals = torch.nn.functional.pad(top.values, (0, r - top.values.shape[-1]), value=float("-inf"))
    ranked = torch.nn.functional.pad(top.indices, (0, r - top.indices.shape[-1]), value=-1)
    ranked = torch.where(vals == float("-inf"), -1, ranked)
    margin = (vals[..., k - 1] - vals[..., k]).nan_to_num(nan=float("inf"), posinf=float("inf"))  # none: inf
    return NS(indices=picks, margin=margin, ranked=ranked, scores=vals)


class TransformersEngine:
    def __init__(self, path: str, device: str, dtype: torch.dtype):
        q = FineGrainedFP8Config(weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4", dequantize=True)
        hf = DeepseekV4ForCausalLM.from_pretrained(path, quantization_config=q, dtype=dtype)
        self.hf = hf.to(device=device, dtype=dtype).eval()  # from_pretrained leaves some stored bf16 tensors bf16
        self.hf.set_experts_implementation("eager")  # torch's grouped_mm has no float64
        self.config, self.device, self.dtype = hf.config, torch.device(device), dtype
        self._t: dict | None = None  # the trace in progress
        for i, layer in enumerate(self.hf.model.layers):
            self._hooks(i, layer)

    def _tap(self, name: str, pre: bool = False):
        def hook(mod, args, out=None):
            if self._t is not None and name in self._t["want"]:
                self._t["taps"][name] = (args[0] if pre else out[0] if isinstance(out, tuple) else out).detach()
        return hook

    def _hooks(self, i: int, layer) -> None:
        layer.input_layernorm.register_forward_pre_hook(self._tap(f"{i}.attn_in", True))
        layer.self_attn.register_forward_hook(self._tap(f"{i}.attn_out"))
        layer.ffn_hc.register_forward_pre_hook(self._tap(f"{i}.attn", True))
        layer.post_attention_layernorm.register_forward_pre_hook(self._tap(f"{i}.ffn_in", True))
        layer.mlp.register_forward_hook(self._tap(f"{i}.ffn_out"))
        layer.register_forward_hook(self._tap(f"{i}.ffn"))
        if not layer.mlp.is_hash:
            layer.mlp.gate.register_forward_hook(self._router_hook(i))
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            indexer.scorer.register_forward_hook(self._keep_scores)
            indexer.register_forward_hook(self._indexer_hook(i))

    def _router_hook(self, i: int):
        def hook(mod, args, out):
            if self._t is None:
                return None
            logits, _, picks = out
            scores = mod.score_fn(logits)  # in transformers' own dtype: forcing changes the picks only
            sel = _record(picks, (scores + mod.e_score_correction_bias).double(), mod.top_k)
            T = self._t["T"]
            self._t["sel"][(i, "router")] = NS(**{n: getattr(sel, n).view(-1, T, *getattr(sel, n).shape[1:])
                                                  for n in ("indices", "margin", "ranked", "scores")})
            forced = self._t["force"].get((i, "router"))
            if forced is None:
                return None
            idx = forced.reshape(-1, mod.top_k)
            w = scores.gather(1, idx)
            return logits, w / (w.sum(-1, keepdim=True) + 1e-20) * mod.routed_scaling_factor, idx
        return hook

    def _keep_scores(self, mod, args, out) -> None:
        if self._t is not None:
            self._t["scores"] = out

    def _indexer_hook(self, i: int):
        def hook(mod, args, out):
            if self._t is None:
                return None
            s = self._t.pop("scores").double()  # [B, T, entries], before the causal mask
            pos = torch.arange(s.shape[1], device=s.device)
            closed = ((pos + 1) // mod.compress_rate)[:, None]  # entries closed at each position
            s = s.masked_fill(torch.arange(s.shape[2], device=s.device) >= closed, float("-inf"))
            self._t["sel"][(i, "indexer")] = _record(out, s, min(mod.index_topk, s.shape[-1]))  # k: at most the
            # entries there are
            return self._t["force"].get((i, "indexer"))  # None keeps transformers' own pick
        return hook

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(ids).logits

    @torch.no_grad()
    def trace(self, ids: torch.Tensor, taps=(), selections: dict | None = None) -> NS:
        taps = taps.split(",") if isinstance(taps, str) else list(taps or ())
        force = {k: (v if isinstance(v, torch.Tensor) else v.indices).to(self.device)
                 for k, v in (selections or {}).items()}
        self._t = {"want": set(taps), "taps": {}, "sel": {}, "force": force, "T": ids.shape[1]}
        try:
            logits = self.hf(ids).logits
            return NS(logits=logits, taps=self._t["taps"], selections=self._t["sel"])
        finally:
            self._t = None

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> NS:
        tokens = ids.new_empty(ids.shape[0], 0)
        logits = torch.empty(ids.shape[0], 0, self.config.vocab_size, device=ids.device, dtype=self.dtype)
        out = self.hf(ids, use_cache=True) if max_new_tokens else None
        for step in range(max_new_tokens):
            last = out.logits[:, -1:]
            tokens, logits = torch.cat([tokens, last.argmax(-1)], 1), torch.cat([logits, last.to(logits)], 1)
            if step + 1 < max_new_tokens:  # no forward for a token nobody asked about
                out = self.hf(tokens[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        return NS(tokens=tokens, logits=logits)


def load(path: str, *, device: str = "cpu", backend: str = "reference", dtype: str | None = None):
    """The factory: `backend` is ignored (one path); `dtype` a name, float32 by default."""
    return TransformersEngine(path, device, getattr(torch, dtype or "float32"))
