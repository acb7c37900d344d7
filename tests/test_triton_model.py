"""The whole model on the triton backend (Triton's interpreter on the CPU) against the reference backend,
on the engine tests' tiny configs (every layer type; HCA's ratio 128 reached with 140 tokens): the prefill,
and greedy decode steps through the static cache (the step a CUDA graph captures on a GPU).

Tolerance (the kernels issue's done-when): float32 activations within 1e-5 relative per position of the
float64 reference, as the float32 reference itself is (tests/test_vs_transformers.py measured 2.4e-6);
>= 99% of positions, since a sparse top-k may flip at a near-tie and move one position far.
"""

from __future__ import annotations

import pytest
import torch

import cdna2_engine

from tiny_configs import CONFIGS, make_checkpoint, make_config

pytest.importorskip("triton")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_triton_backend_matches_reference(tmp_path, name):
    cfg = make_config(name)
    path = make_checkpoint(tmp_path, cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (1, 140), generator=torch.Generator().manual_seed(5))
    truth = cdna2_engine.load_model(path, dtype=torch.float64).forward(ids)
    tri = cdna2_engine.load_model(path, dtype=torch.float32, backend="triton")
    assert tri.ops.linear.__module__.endswith("triton") and tri.ops.attention.__module__.endswith("triton")
    out = tri.forward(ids)
    assert torch.isfinite(out).all(), f"{name}: non-finite logits (the 1% below forgives near-tie flips, not NaN)"
    rel = (out.double() - truth).norm(dim=-1) / truth.norm(dim=-1)
    assert (rel <= 1e-5).double().mean() >= 0.99, f"{name}: worst {rel.max():.2e}"
    if name != "mixed":
        return
    # one op switched back to its reference (CDNA2_REFERENCE_OPS's mechanism) still agrees
    mixed = cdna2_engine.load_model(path, dtype=torch.float32, backend="triton", reference_ops=["attention"])
    assert mixed.ops.attention.__module__.endswith("reference")
    out = mixed.forward(ids)
    assert torch.isfinite(out).all()
    rel = (out.double() - truth).norm(dim=-1) / truth.norm(dim=-1)
    assert (rel <= 1e-5).double().mean() >= 0.99, f"attention from the reference: worst {rel.max():.2e}"
    # hc_weights, or the pre ops alone: they pass the mix sums between them, in a form both backends share (a
    # causal prefix of the prompt: its logits are truth's first ones)
    short = ids[:, :48]
    for ref_ops in (["hc_weights"], ["hc_pre", "hc_post_pre"]):
        mixed = cdna2_engine.load_model(path, dtype=torch.float32, backend="triton", reference_ops=ref_ops)
        assert all(getattr(mixed.ops, op).__module__.endswith("reference") for op in ref_ops)
        out = mixed.forward(short)
        assert torch.isfinite(out).all()
        rel = (out.double() - truth[:, :48]).norm(dim=-1) / truth[:, :48].norm(dim=-1)
        assert (rel <= 1e-5).double().mean() >= 0.99, f"{ref_ops}: worst {rel.max():.2e}"


@pytest.mark.parametrize("batch", [1, 2])  # 1: the one-token MoE stream; 2: strided mask/entry views per row
def test_triton_decode_steps_match_reference(tmp_path, batch):
    """Decode over the StaticCache on the triton backend (compress_step and its valid flags written into the
    key mask, the indexer's pick written into a strided slice of it, the one-token MoE stream, the dense GEMV,
    hc_post_pre at one row) against the float64 reference: a prompt that leaves CSA and HCA windows open, then
    steps across a CSA window close and an HCA close at position 128."""
    cfg = make_config("mixed")
    path = make_checkpoint(tmp_path, cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (batch, 122), generator=torch.Generator().manual_seed(6))
    truth = cdna2_engine.load_model(path, dtype=torch.float64).generate(ids, 10)
    got = cdna2_engine.load_model(path, dtype=torch.float32, backend="triton").generate(ids, 10)
    assert torch.equal(got.tokens, truth.tokens)
    rel = (got.logits.double() - truth.logits).norm(dim=-1) / truth.logits.norm(dim=-1)
    assert rel.max() <= 1e-5, f"worst {rel.max():.2e}"
