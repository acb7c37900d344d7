"""The router's selection for every scoring function, recomputed by hand from the tapped MoE input: the
scores (sqrtsoftplus, sigmoid, softmax; transformers 5.23 has no softmax, so this is its only check), the
bias used for selection only, ties to the lower expert id, and the hash layers' tid2eid lookup."""

from __future__ import annotations

import pytest
import torch

import cdna2_engine

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
    # the hash layer routes by token id: forcing its table's choice changes nothing
    table = model.w["layers.0.ffn.gate.tid2eid"].long()
    same = model.forward(ids, selections={(0, "router"): table[ids]})
    assert torch.equal(same, tr.logits)


def test_bad_input_ids_and_taps_are_one_line_errors(tmp_path):
    cfg = make_config("csa-only")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=2), dtype=torch.float64)
    for bad, match in [(torch.tensor([[1, cfg.vocab_size]]), "out of range 0..96"),
                       (torch.tensor([[-1, 2]]), "out of range"), (torch.tensor([1, 2]), r"must be \[batch, tokens\]")]:
        for call in (model.forward, model.trace, lambda ids: model.generate(ids, 2)):
            with pytest.raises(ValueError, match=match):
                call(bad)
    with pytest.raises(ValueError, match=r"unknown tap\(s\) \['9.attn'\]"):
        model.trace(torch.tensor([[1, 2]]), taps=["9.attn"])


@pytest.mark.parametrize("scoring", sorted(SCORES))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_route_weights_leave_the_bias_out(scoring, backend):
    """The bias picks the experts; their weights are the unbiased scores, normalized, times the scale (a bias
    added into the weights still picked the same experts, so the selection test above could not see it)."""
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
    torch.testing.assert_close(w.double(), picked / picked.sum(-1, keepdim=True) * 2.5, rtol=1e-6, atol=0)
