"""A named catalog of the porting bugs this suite exists to catch, injectable into a loaded Model.

Each fault reproduces one real failure mode of moving V4 serving to another accelerator; the project's
own tests inject them and assert that the suite fails and names the right place (sensitivity), and users
can do the same: `CDNA2_FAULT=rope_twice pytest --cdna2-engine=cdna2_engine.faults:load_faulty`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .ops import QWeight


def _wrap(model, name: str, fn: Callable) -> None:
    setattr(model.ops, name, fn)


def expert_scale_off_by_one(model, layer: int = 2, expert: int | None = None) -> None:
    """One routed expert's MXFP4 down-projection scales read one exponent step high (x2): the classic
    E8M0 bias slip, in expert `expert` (None: expert 0)."""
    e = model.experts[layer]["w2"]
    if e.kind != "mxfp4":
        raise ValueError("expert_scale_off_by_one needs MXFP4 experts")
    expert = 0 if expert is None else expert
    scale = e.scale.clone()
    scale[expert] = (scale[expert].view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    model.experts[layer]["w2"] = QWeight(e.data, scale, e.kind)


def rope_twice(model) -> None:
    """RoPE applied twice to q and k (a fused kernel plus a framework call): wrong relative angles."""
    base, fused = model.ops.rope, model.ops.norm_rope

    def rope(x, cos, sin, inverse=False):
        return base(base(x, cos, sin, inverse), cos, sin, inverse) if not inverse else base(x, cos, sin, True)

    _wrap(model, "rope", rope)
    _wrap(model, "norm_rope", lambda x, weight, eps, cos, sin, ring=None:  # rotated before the fused op: the
          fused(base(x, cos, sin), weight, eps, cos, sin, ring))  # decode's window ring gets the wrong angles too


def fp16_softmax_stats(model) -> None:
    """Attention logits, running max, exponentials and sum kept in fp16 (a kernel that skips the fp32
    statistics): about 1e-3 relative error on every row, overflow past 65504."""

    rope = model.ops.rope

    def attention(q, kv, sink, mask, scale, rotary=None):
        if rotary is not None:  # the output un-rotated, as the op does it
            return rope(attention(q, kv, sink, mask, scale), *rotary, inverse=True)
        logits = (torch.einsum("bshd,bld->bhsl", q.float(), kv.float()) * scale).half()
        logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
        full = torch.cat([logits, sink.half().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)], -1)
        e = (full - full.amax(-1, keepdim=True)).exp()
        probs = (e / e.sum(-1, keepdim=True))[..., :-1]
        return torch.einsum("bhsl,bld->bshd", probs.float(), kv.float()).to(q.dtype)

    _wrap(model, "attention", attention)


def sink_dropped(model) -> None:
    """The per-head sink left out of the softmax denominator (a kernel without sink support)."""
    base = model.ops.attention
    _wrap(model, "attention", lambda q, kv, sink, mask, scale, rotary=None: base(
        q, kv, torch.full_like(sink, -1e30), mask, scale, rotary))


def moe_sum_order_varies(model) -> None:
    """The routed experts' and the shared expert's outputs added in arrival order (float atomics, as a scatter-add
    kernel does), which changes from call to call, so two identical runs differ in the last bits. Arrival order is
    modelled as the addends rotated by one more place at each call of a layer (not drawn at random: with 3 addends,
    the bundled model's 2 routed + shared, a random order would repeat in every layer once in 80 runs); it needs 3
    or more, since a sum of two is the same in either order."""
    base = model.ops.moe_experts
    calls: dict[int, int] = {}  # per layer (its down weights' id): how many times it has run

    def moe_experts(x, w1, w3, w2, idx, weights, limit, shared=None):
        parts = [base(x, w1, w3, w2, idx[:, j:j + 1], weights[:, j:j + 1], limit) for j in range(idx.shape[1])]
        if shared is not None:
            parts.append(shared() if callable(shared) else shared)
        turn = calls[id(w2)] = calls.get(id(w2), -1) + 1
        out = torch.zeros_like(parts[0])
        for j in range(len(parts)):
            out = out + parts[(j + turn) % len(parts)]
        return out

    _wrap(model, "moe_experts", moe_experts)


def kv_batch_stride_zero(model) -> None:
    """Attention reads every sequence's keys from the batch's first one (a batch stride left at 0): a batch of one
    is right, every other row attends to another sequence's context."""
    base = model.ops.attention
    _wrap(model, "attention", lambda q, kv, sink, mask, scale, rotary=None: base(
        q, kv[:1].expand_as(kv), sink, mask, scale, rotary))


def decode_position_off_by_one(model) -> None:
    """A decode step's RoPE angles are those of position p + 1 (the cache length read after the append): a prefill
    is right, every incrementally decoded token is rotated one position off."""
    base, decode = model.ops.rope_cos_sin, model.decode
    decoding = []

    def rope_cos_sin(positions, inv_freq, align=1):
        return base(positions + 1 if decoding else positions, inv_freq, align)

    def decode_step(*args, **kwargs):
        decoding.append(True)
        try:
            return decode(*args, **kwargs)
        finally:
            decoding.pop()

    _wrap(model, "rope_cos_sin", rope_cos_sin)
    model.decode = decode_step


FAULTS: dict[str, Callable] = {f.__name__: f for f in (expert_scale_off_by_one, rope_twice, fp16_softmax_stats,
                                                        sink_dropped, moe_sum_order_varies, kv_batch_stride_zero,
                                                        decode_position_off_by_one)}


def inject(model, name: str, **kwargs) -> None:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}: choose from {sorted(FAULTS)}")
    FAULTS[name](model, **kwargs)


def load_faulty(path: str, *, device: str = "cpu", backend: str = "reference", **kwargs):
    """An engine factory for `--cdna2-engine`: the bundled engine with the fault named by CDNA2_FAULT."""
    from . import load_model

    name = os.environ.get("CDNA2_FAULT", "")
    if not name:
        raise ValueError(f"CDNA2_FAULT is not set: name the fault to inject, one of {sorted(FAULTS)}")
    model = load_model(path, device=device, backend=backend, **kwargs)
    inject(model, name)
    return model
