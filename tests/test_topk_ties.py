"""Top-k selections break exact ties by the lower index, never by memory order (DESIGN.md section 4).

With few indexer heads, ReLU zeros make exact score ties among compressed entries; torch.topk's tie order
depends on the row length, so a prefix prefill could then select differently from the longer prefill.
"""

from __future__ import annotations

import pytest
import torch

import cdna2_engine
from cdna2_engine.ops import reference

from tiny_configs import make_checkpoint, make_config


def test_reference_topk_prefers_lower_index_on_ties():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    idx, margin = reference.topk(scores, 2)
    assert idx.tolist() == [[1, 2], [0, 1]]
    assert margin.tolist() == [0.0, 0.0]  # the 3rd score ties the 2nd: a flip there is not a bug
    idx, margin = reference.topk(scores[:1], 3)
    assert idx.tolist() == [[1, 2, 4]] and margin.tolist() == [1.0]


def test_topk_is_independent_of_row_length_under_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (64, 40), generator=g).float()  # heavy ties
    for n in (12, 25, 40):
        idx, _ = reference.topk(scores[:, :n], 5)
        for r in range(scores.shape[0]):  # every row: the highest scores, ties to the lower index
            order = sorted(range(n), key=lambda j: (-scores[r, j].item(), j))[:5]
            assert idx[r].tolist() == order, r


def test_prefix_prefill_matches_longer_prefill_with_indexer_ties(tmp_path):
    cfg = make_config("csa-only", index_n_heads=2, index_topk=6)  # 2 heads: many exact ReLU-zero ties
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=3), dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, 140), generator=torch.Generator().manual_seed(4))
    full = model.trace(ids)
    margins = torch.cat([s.margin.flatten() for (_, kind), s in full.selections.items() if kind == "indexer"])
    assert (margins == 0).sum() > 10, "the config must produce exact ties for this test to mean anything"
    for n in (50, 97, 121):
        part = model.trace(ids[:, :n])
        for key, sel in part.selections.items():
            assert torch.equal(sel.indices, full.selections[key].indices[:, :n]), f"{key} differs at prefix {n}"
        # float64: a prefix's prefill sums the same terms as the full one, reassociated at most (~1e-15)
        assert torch.allclose(part.logits, full.logits[:, :n], rtol=0, atol=1e-12)


def test_forced_selections_are_used(tmp_path):
    cfg = make_config("csa-only")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=8), dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(9))
    tr = model.trace(ids)
    assert set(tr.selections) == {(0, "indexer"), (0, "router"), (1, "indexer"), (1, "router")}
    same = model.forward(ids, selections=tr.selections)
    assert torch.equal(same, tr.logits)
    moved = tr.selections[(1, "router")].indices.roll(1, dims=1)  # other tokens' experts
    other = model.forward(ids, selections={(1, "router"): moved})
    assert not torch.allclose(other, tr.logits)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """`mixed` (layer 0 sliding and hash-routed, 1 CSA, 2 HCA, 3 CSA): the model, ids [2, 40] and their trace."""
    cfg = make_config("mixed")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path_factory.mktemp("sel"), cfg, seed=8), dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(9))
    return model, ids, model.trace(ids)


@pytest.mark.parametrize("make, match", [
    (lambda r, x: {(4, "router"): r}, r"unknown key \(4, 'router'\): use \(layer, 'router' \| 'indexer'\) with "
                                      r"layer in 0..3"),  # was ignored
    (lambda r, x: {(1, "routr"): r}, r"unknown key \(1, 'routr'\)"),  # was ignored
    (lambda r, x: {1: r}, "unknown key 1:"),
    (lambda r, x: {(2, "indexer"): x}, r"layer 2 has no indexer \(compress ratio 128"),  # was ignored
    (lambda r, x: {(0, "router"): r}, "layer 0 routes by token id"),  # replaced the hash routing
    (lambda r, x: {(1, "router"): r[:1]}, r"\(1, 'router'\)\] has shape \(1, 40, 3\), \(2, 40\) positions need "
                                          r"\(2, 40, 3\)"),  # was a raw torch error
    (lambda r, x: {(1, "router"): r[:, :32]}, r"has shape \(2, 32, 3\), \(2, 40\) positions need \(2, 40, 3\)"),
    (lambda r, x: {(1, "indexer"): x[..., :4]}, r"has shape \(2, 40, 4\), \(2, 40\) positions need \(2, 40, 5\)"),
    (lambda r, x: {(1, "router"): r.float()}, "indices must be an integer tensor, got torch.float32"),
    (lambda r, x: {(1, "router"): torch.full_like(r, 8)}, r"holds ids 8..8, outside 0..7 \(expert ids"),  # IndexError
    (lambda r, x: {(1, "router"): r - 1}, r"holds ids -1..6, outside 0..7"),
    (lambda r, x: {(3, "indexer"): x + 1}, r"holds ids 0..10, outside -1..9 \(compressed entries"),  # was ignored
])
def test_bad_forced_selections_are_one_line_errors(traced, make, match):
    model, ids, tr = traced
    sel = make(tr.selections[(1, "router")].indices, tr.selections[(1, "indexer")].indices)
    for call in (model.forward, model.trace):
        with pytest.raises(ValueError, match=match) as e:
            call(ids, selections=sel)
        assert "\n" not in str(e.value)


def test_recorded_selections_force_as_tensors_or_selections(traced):
    model, ids, tr = traced
    assert torch.equal(model.forward(ids, selections=tr.selections), tr.logits)
    assert torch.equal(model.forward(ids, selections={k: s.indices for k, s in tr.selections.items()}), tr.logits)
