"""The router's selection for every scoring function, recomputed by hand from the tapped MoE input: the
scores (sqrtsoftplus, sigmoid, softmax; transformers 5.23 has no softmax, so this is its only check), the
bias used for selection only, ties to the lower expert id, the weights as DeepSeek's Gate makes them, and the hash
layers' tid2eid lookup."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import cdna2_engine
from cdna2_engine.checkpoint import read_checkpoint
from cdna2_engine.ops import get_ops

from tiny_configs import make_checkpoint, make_config

SCORES = {
    "sqrtsoftplus": lambda z: torch.nn.functional.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: torch.softmax(z, -1),
}


@pytest.mark.parametrize("scoring", sorted(SCORES))
def test_router_selection_matches_the_formula(tmp_path, scoring):
    cfg = make_config("csa-only", scoring_func=scoring, num_hash_layers=1)
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=6), dtype=torch.float64)
    # experts in twins (2i + 1 scores as 2i): with 3 of 8 picked, every row's third pick is a tie at the boundary
    for name in ("layers.1.ffn.gate.weight", "layers.1.ffn.gate.bias"):
        t = model.w[name].data if name.endswith("weight") else model.w[name]
        t[1::2] = t[0::2]
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    tr = model.trace(ids, taps=["0.ffn_in", "1.ffn_in"])
    assert (0, "router") not in tr.selections  # layer 0 is a hash layer: nothing to record
    # layer 1: top-k of score + bias over the normed MoE input
    x = tr.taps["1.ffn_in"].double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    x = x * model.w["layers.1.ffn_norm.weight"].double()
    logits = x @ model.w["layers.1.ffn.gate.weight"].data.double().T
    biased = SCORES[scoring](logits) + model.w["layers.1.ffn.gate.bias"].double()
    want = [sorted(range(cfg.n_routed_experts), key=lambda e, r=row: (-r[e].item(), e))[: cfg.num_experts_per_tok]
            for row in biased.reshape(-1, cfg.n_routed_experts)]
    got = tr.selections[(1, "router")].indices.reshape(-1, cfg.num_experts_per_tok).tolist()
    k = cfg.num_experts_per_tok
    ranked = biased.reshape(-1, cfg.n_routed_experts).sort(-1, descending=True).values
    assert torch.equal(ranked[:, k - 1], ranked[:, k]), "every row must tie at the k-th pick (the twins)"
    assert got == want


def test_hash_layer_routes_by_its_table(tmp_path):
    """A hash layer's experts are tid2eid[token]: the same weights with that layer top-k routed and its router
    forced to the table's picks give the same logits. Forcing the hash layer's own router is refused (it
    silently replaced the table)."""
    cfg = make_config("csa-only", num_hash_layers=1)
    path = make_checkpoint(tmp_path, cfg, seed=6)
    model = cdna2_engine.load_model(path, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    picks = {(0, "router"): model.w["layers.0.ffn.gate.tid2eid"].long()[ids]}
    with pytest.raises(ValueError, match=r"layer 0 routes by token id .* its router cannot be forced") as e:
        model.forward(ids, selections=picks)
    assert "\n" not in str(e.value)
    w = read_checkpoint(path)[1]
    del w["layers.0.ffn.gate.tid2eid"]
    w["layers.0.ffn.gate.bias"] = torch.zeros(cfg.n_routed_experts)  # selects only; forced picks ignore it
    topk = cdna2_engine.Model(replace(cfg, num_hash_layers=0), w, device=torch.device("cpu"), dtype=torch.float64,
                              ops=get_ops())
    hashed = model.forward(ids)
    assert not torch.equal(topk.forward(ids), hashed)  # its own top-k picks other experts
    assert torch.equal(topk.forward(ids, selections=picks), hashed)


def test_bad_input_ids_and_taps_are_one_line_errors(tmp_path):
    cfg = make_config("csa-only")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=2), dtype=torch.float64)
    for bad, match in [(torch.tensor([[1, cfg.vocab_size]]), "out of range 0..96"),
                       (torch.tensor([[-1, 2]]), "out of range"), (torch.tensor([1, 2]), r"must be \[batch, tokens\]"),
                       ([[1, 2]], "must be an integer tensor .* got list"),
                       (torch.tensor([[1.0, 2.0]]), "must be an integer tensor .* got torch.float32"),
                       (torch.tensor([[True]]), "must be an integer tensor .* got torch.bool")]:
        for call in (model.forward, model.trace, lambda ids: model.generate(ids, 2)):
            with pytest.raises(ValueError, match=match):
                call(bad)
    with pytest.raises(ValueError, match=r"unknown tap\(s\) \['9.attn'\]"):
        model.trace(torch.tensor([[1, 2]]), taps=["9.attn"])
    with pytest.raises(ValueError, match=r"unknown tap\(s\) \['9.attn'\]"):
        model.trace(torch.tensor([[1, 2]]), taps="0.attn,9.attn")


@pytest.mark.parametrize("shape", [(1, 0), (0, 4), (0, 0)])
def test_empty_input_ids_are_refused(tmp_path, shape):
    """No tokens (or no rows) failed deep in a reshape; generate ran nothing and returned empty."""
    cfg = make_config("csa-only")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=2), dtype=torch.float64)
    for call in (model.forward, model.trace, lambda ids: model.generate(ids, 3)):
        with pytest.raises(ValueError, match=rf"input_ids has no tokens \(shape {re.escape(str(shape))}\)") as e:
            call(torch.zeros(shape, dtype=torch.long))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("taps, want", [("0.attn", ["0.attn"]), ("0.attn, 1.ffn", ["0.attn", "1.ffn"]),
                                        (["1.ffn"], ["1.ffn"])])
def test_taps_given_as_a_string(tmp_path, taps, want):
    """A str is one tap or a comma list (as reference_ops), not its characters."""
    cfg = make_config("csa-only")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=2), dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3]])
    assert sorted(model.trace(ids, taps=taps).taps) == want
    assert sorted(model.generate(ids, 2, taps=taps).taps) == want


@pytest.mark.parametrize("scoring", sorted(SCORES))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_route_weights_leave_the_bias_out(scoring, backend):
    """The bias picks the experts; their weights are the unbiased scores, normalized to sum 1 except for softmax
    (its scores already sum to 1 over all experts: DeepSeek's Gate leaves them), times the scale (a bias added into
    the weights still picked the same experts, so the selection test above could not see it)."""
    from cdna2_engine.ops import reference as ref

    ops = ref if backend == "reference" else pytest.importorskip("cdna2_engine.ops.triton")
    g = torch.Generator().manual_seed(9)
    dtype = torch.float64 if backend == "reference" else torch.float32  # the kernel routes fp32 logits
    logits = torch.randn(5, 16, generator=g, dtype=torch.float64)
    bias = torch.rand(16, generator=g, dtype=torch.float64) * 0.5
    idx, w, _ = ops.route(logits.to(dtype), bias.to(dtype), 4, scoring, 2.5)
    scores = SCORES[scoring](logits)
    want_idx = [sorted(range(16), key=lambda e, r=row: (-r[e].item(), e))[:4] for row in scores + bias]
    assert idx.tolist() == want_idx
    picked = scores.gather(-1, idx.long())
    # rtol 1e-6: the kernel's fp32 scores and 4-term sum, ~10x fp32 rounding (2^-24); float64 meets it by far
    norm = picked if scoring == "softmax" else picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(w.double(), norm * 2.5, rtol=1e-6, atol=0)
