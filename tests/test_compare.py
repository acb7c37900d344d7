"""compare.py metrics on small inputs whose expected values are worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_cdna2.compare import (
    assert_logits_close,
    assert_tensors_close,
    logit_metrics,
    tensor_metrics,
    token_divergence,
)
from pytest_cdna2.tolerance import load_profile

D = torch.float64


def test_tensor_metrics_by_hand():
    # diff = [0, 4]; |diff| = 4, |e| = 3 -> rel 4/3; <a,e> = 9, |a| = 5 -> cosine 9/15 = 0.6
    m = tensor_metrics(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]), rtol_fro=0.1)
    assert m.rel_fro == pytest.approx(4 / 3)
    assert m.cosine == pytest.approx(0.6)
    assert m.max_abs == 4.0 and m.max_abs_index == (1,)
    # rms(e) = 3/sqrt(2) -> per-element tolerance 0.1 * 2.1213 = 0.2121: only the 4 exceeds it
    assert m.mismatch_tol == pytest.approx(0.3 / math.sqrt(2))
    assert m.mismatches == 1 and m.nonfinite == 0


def test_mismatch_count_and_index_in_2d():
    e = torch.ones(2, 2, dtype=D)  # rms 1 -> tolerance 0.1 per element
    a = torch.tensor([[1.2, 1.0], [1.0, 1.05]], dtype=D)
    m = tensor_metrics(a, e, rtol_fro=0.1)
    assert m.mismatches == 1  # 0.2 > 0.1, 0.05 is not
    assert m.max_abs_index == (0, 0)
    assert m.rel_fro == pytest.approx(math.sqrt(0.2**2 + 0.05**2) / 2)
    assert tensor_metrics(a, e).mismatches == 2  # without rtol: any difference counts


def test_zero_tensors():
    z = torch.zeros(3)
    assert (tensor_metrics(z, z).rel_fro, tensor_metrics(z, z).cosine) == (0.0, 1.0)
    m = tensor_metrics(torch.tensor([0.0, 1.0, 0.0]), z)
    assert m.rel_fro == math.inf and m.cosine == 0.0


def test_nonfinite_positions():
    nan, inf = math.nan, math.inf
    e = torch.tensor([1.0, nan, inf, 2.0])
    same = tensor_metrics(torch.tensor([1.0, nan, inf, 2.0]), e)
    assert same.nonfinite == 0 and same.rel_fro == 0.0  # NaN/Inf where expected has them too is agreement
    m = tensor_metrics(torch.tensor([1.0, nan, -inf, nan]), e)
    assert m.nonfinite == 2 and m.nonfinite_index == (2,)  # -inf vs inf, then NaN vs 2


def test_assert_tensors_close_message_names_what_metric_value_limit():
    with pytest.raises(AssertionError) as ei:
        assert_tensors_close(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]), rtol_fro=0.1, what="layer 3 wo_b")
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("layer 3 wo_b: rel_fro 1.333e+00 > limit 1.000e-01")
    assert "max_abs 4.000e+00 at index (1,)" in msg and "cosine 0.600000000" in msg and "1/2 elements" in msg


def test_assert_tensors_close_passes_and_fails_on_nan_and_shape():
    e = torch.linspace(1, 2, 10, dtype=D)
    assert assert_tensors_close(e * (1 + 1e-6), e, rtol_fro=1e-5).rel_fro == pytest.approx(1e-6)
    bad = e.clone()
    bad[7] = math.nan
    pattern = r"^k: nonfinite: 1 NaN/Inf value\(s\) not in expected, first at index \(7,\)"
    with pytest.raises(AssertionError, match=pattern):
        assert_tensors_close(bad, e, rtol_fro=1.0, what="k")
    with pytest.raises(AssertionError, match=r"shape \(10,\) != expected \(2, 5\)"):
        assert_tensors_close(e, e.reshape(2, 5), rtol_fro=1.0)


def test_kl_and_cosine_by_hand():
    # expected uniform over 2 tokens; actual softmax [3/4, 1/4]:
    # KL = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3)
    e = torch.tensor([[0.0, 0.0]], dtype=D)
    a = torch.tensor([[math.log(3), 0.0]], dtype=D)
    m = logit_metrics(a, e)
    assert m.kl_max == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    assert m.max_abs == pytest.approx(math.log(3)) and m.max_abs_at == (0, 0, 0)
    # cosine of [1, 0] and [1, 1] is 1/sqrt(2)
    m = logit_metrics(torch.tensor([[1.0, 1.0]], dtype=D), torch.tensor([[1.0, 0.0]], dtype=D))
    assert m.cosine_min == pytest.approx(1 / math.sqrt(2))


def test_kl_ignores_tokens_the_expected_masks_out():
    e = torch.tensor([[0.0, 0.0, -math.inf]], dtype=D)
    a = torch.tensor([[0.0, 0.0, -math.inf]], dtype=D)
    m = logit_metrics(a, e)
    assert m.kl_max == 0.0 and m.nonfinite == 0
    m = logit_metrics(torch.tensor([[0.0, -math.inf, 0.0]], dtype=D), e)
    assert m.kl_max == math.inf and m.nonfinite == 2


def _three_steps():
    # argmax expected per step: 0, 1, 2; actual: 0, 2, 2 -> top-1 agreement 2/3, first divergence at step 1,
    # where the expected token (1) has one larger actual logit (0.9 > 0.5): rank 1.
    e = torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0]], dtype=D)
    a = torch.tensor([[5.0, 0, 0], [0.1, 0.5, 0.9], [0, 0, 5.0]], dtype=D)
    return a, e


def test_top1_first_divergence_and_topk_rank():
    a, e = _three_steps()
    m = logit_metrics(a, e)
    assert m.top1_agreement == pytest.approx(2 / 3)
    assert m.first_divergence == (0, 1) and m.topk_rank == 1
    assert m.kl_max_at == (0, 1) and m.cosine_min_at == (0, 1)
    assert logit_metrics(e, e).first_divergence is None and logit_metrics(e, e).topk_rank is None


def test_batched_first_divergence_is_the_earliest_step():
    a, e = _three_steps()
    row1 = e.clone()
    row1[0] = torch.tensor([1.0, 2.0, 3.0])  # diverges at step 0: expected token 0 has two larger logits
    a2 = torch.stack([a, row1])
    m = logit_metrics(a2, torch.stack([e, e]))
    assert m.first_divergence == (1, 0)
    assert m.topk_rank == 2  # worst rank over every row's first divergence (row 0: 1, row 1: 2)


def test_assert_logits_close_topk_and_top1():
    a, e = _three_steps()
    assert_logits_close(a, e, limits={"topk": 2}, what="p00")  # rank 1 is within the top 2
    with pytest.raises(AssertionError) as ei:
        assert_logits_close(a, e, limits={"topk": 1, "top1_min": 1.0}, what="prompt p00")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("prompt p00: ")
    assert "top1 0.6667 < limit 1.0 (first divergence at step 1)" in msg
    assert "step 1: topk containment: expected token is rank 1 in actual, limit top-1" in msg


def test_assert_logits_close_names_step_metric_value_limit():
    e = torch.zeros(4, 2, dtype=D)
    a = e.clone()
    a[2] = torch.tensor([math.log(3), 0.0])  # KL at step 2 = 0.5 ln(4/3) = 1.438e-01
    with pytest.raises(AssertionError, match=r"^prompt p07: step 2: kl 1\.438e-01 > limit 1\.000e-01$"):
        assert_logits_close(a, e, limits={"kl_max": 0.1}, what="prompt p07")
    with pytest.raises(AssertionError, match=r"batch 1 step 2: max_abs 1\.099e\+00 at token 0 > limit 1\.000e-02"):
        assert_logits_close(torch.stack([e, a]), torch.stack([e, e]), limits={"max_abs": 0.01})
    assert_logits_close(a, e, limits={"kl_max": 0.2})  # unchecked keys do not fail


def test_assert_logits_close_takes_profile_limits():
    e = torch.randn(5, 260, dtype=D, generator=torch.Generator().manual_seed(0))
    m = assert_logits_close(e + 1e-9, e, limits=load_profile().token)
    assert m.top1_agreement == 1.0 and m.kl_max < 1e-12
    with pytest.raises(AssertionError, match="cosine"):
        assert_logits_close(-e, e, limits=load_profile().token, what="w")


def test_bad_shapes_and_limits():
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) != expected \(3, 2\)"):
        assert_logits_close(torch.zeros(2, 3), torch.zeros(3, 2), limits={})
    with pytest.raises(ValueError, match=r"\[T, V\] or \[B, T, V\]"):
        logit_metrics(torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match="limits"):
        assert_logits_close(torch.zeros(2, 3), torch.zeros(2, 3), limits=0.1)


def test_token_divergence():
    assert token_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert token_divergence(torch.tensor([1, 2]), torch.tensor([1, 2])) is None
    assert token_divergence([1, 2], [1, 2, 3]) == 2


def test_selection_diff_splits_near_ties_from_real_flips():
    from types import SimpleNamespace as S

    from pytest_cdna2.compare import selection_diff

    golden = {
        (0, "router"): S(indices=torch.tensor([[0, 1], [2, 3], [1, 2]]), margin=torch.tensor([0.5, 1e-6, 0.5])),
        (1, "indexer"): S(indices=torch.tensor([[4, 5], [5, 6], [6, 7]]), margin=torch.tensor([0.5, 0.5, 0.5])),
    }
    engine = {
        (0, "router"): S(indices=torch.tensor([[[1, 0], [2, 4], [1, 2]]]), margin=None),  # [1, T, k]; order free
        (1, "indexer"): S(indices=torch.tensor([[4, 5], [5, 6], [6, 0]]), margin=None),
    }
    d = selection_diff(engine, golden, tie_margin=1e-4)
    # step 1 of layer 0 flips at margin 1e-6 < 1e-4: a near-tie; step 2 of layer 1 flips at margin 0.5: real
    assert d.near_tie == ((0, "router", 1),) and d.real == ((1, "indexer", 2),)
    assert d.compared == 6 and d.first_real == (1, "indexer", 2)
    assert selection_diff(golden, golden, tie_margin=0.0).first_real is None
    with pytest.raises(ValueError, match="selection keys differ"):
        selection_diff({}, golden, tie_margin=0.0)


# an indexer row with 3 picks of which 2 exist (-1: none), ranked best first; entries 7 and 8 tie with pick 5
BAND = dict(ranked=[3, 5, 7, 8, 9, -1], scores=[2.0, 1.0, 0.99, 0.98, 0.5, -math.inf])


@pytest.mark.parametrize("actual, width", [
    ([3, 5, -1], -0.01),  # the same picks: minus their margin (inside any band)
    ([3, 7, -1], 0.01),  # the runner-up in place of the k-th pick
    ([3, 8, -1], 0.02),  # the (k+2)-th at a three-way tie: its gap to the best left out
    ([7, 5, -1], 1.01),  # a clear winner evicted: wide
    ([3, 5, 5], math.inf),  # a pick repeated in place of "none" (a review's mutation: taken as a near-tie)
    ([3, -2, 5], math.inf),  # an id below -1
    ([3, 5, 6], math.inf),  # one pick more than the golden has
    ([3, 11, -1], math.inf),  # an entry outside the ranking
])
def test_flip_width_is_the_band_a_flip_needs(actual, width):
    from pytest_cdna2.compare import flip_width

    assert flip_width(actual, [3, 5, -1], BAND["ranked"], BAND["scores"]) == pytest.approx(width)


def test_selection_diff_takes_a_tie_margin_per_kind():
    """Router scores round far less than indexer scores: one swap of the same band width is rounding in an
    indexer selection and a bug in a router selection when their margins say so."""
    from types import SimpleNamespace as S

    from pytest_cdna2.compare import selection_diff

    gold = S(indices=torch.tensor([[3, 5]]), margin=torch.tensor([0.01]), ranked=torch.tensor([[3, 5, 7]]),
             scores=torch.tensor([[2.0, 1.0, 0.99]]))
    swap = S(indices=torch.tensor([[3, 7]]), margin=None)
    d = selection_diff({(0, "router"): swap, (1, "indexer"): swap}, {(0, "router"): gold, (1, "indexer"): gold},
                       tie_margin={"router": 0.005, "indexer": 0.05})
    assert d.real == ((0, "router", 0),) and d.near_tie == ((1, "indexer", 0),)
    with pytest.raises(ValueError, match=r"no tie margin for kind 'indexer' \(have \['router'\]\)"):
        selection_diff({(1, "indexer"): swap}, {(1, "indexer"): gold}, tie_margin={"router": 0.005})


@pytest.mark.parametrize("part, value, message", [
    ("ranked", torch.zeros(1, 0, dtype=torch.long), r"ranked \(1, 0\) and scores \(1, 3\): expected the same shape"),
    ("margin", torch.ones(2), r"margin of shape \(2,\) does not give one value per position \(1\)"),
    ("scores", torch.ones(2, 3), r"scores of shape \(2, 3\) does not give one row per position \(1\)"),
])
def test_selection_diff_names_a_part_that_does_not_fit(part, value, message):
    """A user engine's ranking or margin that does not cover every position is one ValueError naming it (the
    judges turn it into the tier's one-line failure), not an IndexError or a reshape error."""
    from types import SimpleNamespace as S

    from pytest_cdna2.compare import selection_diff

    gold = dict(indices=torch.tensor([[3, 5]]), margin=torch.tensor([0.01]), ranked=torch.tensor([[3, 5, 7]]),
                scores=torch.tensor([[2.0, 1.0, 0.99]]))
    gold[part] = value
    with pytest.raises(ValueError, match=message):
        selection_diff({(0, "router"): S(indices=torch.tensor([[3, 7]]), margin=None)}, {(0, "router"): S(**gold)},
                       tie_margin=0.05)


@pytest.mark.parametrize("limits", [{"topk": 5}, {}], ids=["topk-only", "no-limits"])
def test_a_nan_row_fails_whatever_the_limits(limits):
    """NaN in the actual logits only fails even when no metric limit would notice it (the greedy check passes
    only topk, and a NaN row ranks the expected argmax first)."""
    from pytest_cdna2.compare import assert_logits_close

    e = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    a = e.clone()
    a[2] = float("nan")
    with pytest.raises(AssertionError, match=r"nonfinite 32 at step 2 \(limit 0\)"):
        assert_logits_close(a, e, limits=limits)


def test_first_real_flip_is_the_earliest_step_then_the_lowest_layer():
    """`cdna2 bisect` starts at first_real: the earliest step, and at that step the lowest layer (a later layer
    at the same step may be the echo of the first)."""
    from types import SimpleNamespace as S

    from pytest_cdna2.compare import selection_diff

    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    golden = {(layer, "router"): S(indices=idx, margin=torch.ones(3)) for layer in (0, 1, 2)}
    engine = {(0, "router"): S(indices=torch.tensor([[0, 1], [2, 3], [4, 6]]), margin=None),  # step 2
              (1, "router"): S(indices=torch.tensor([[0, 1], [2, 7], [4, 6]]), margin=None),  # steps 1, 2
              (2, "router"): S(indices=torch.tensor([[0, 1], [2, 7], [4, 5]]), margin=None)}  # step 1
    assert selection_diff(engine, golden, tie_margin=1e-4).first_real == (1, "router", 1)
    engine[(2, "router")] = S(indices=idx[:, :1], margin=None)
    with pytest.raises(ValueError, match=r"selection \(2, 'router'\): shape \(1, 3, 1\) != expected \(1, 3, 2\)"):
        selection_diff(engine, golden, tie_margin=1e-4)


def test_limits_hold_at_their_boundary():
    """Each limit passes an error 1% under it and fails one 1% over it (a check made 10x looser passed every test
    above: each compared with limits far from the error)."""
    e = torch.linspace(1, 2, 10, dtype=D)
    a = e.clone()
    a[3] += 0.05
    rel = 0.05 / e.norm().item()
    assert_tensors_close(a, e, rtol_fro=rel * 1.01)
    with pytest.raises(AssertionError, match="rel_fro"):
        assert_tensors_close(a, e, rtol_fro=rel * 0.99)
    logits = torch.zeros(3, 4, dtype=D)
    off = logits.clone()
    off[1, 2] = 0.05
    assert_logits_close(off, logits, limits={"max_abs": 0.0505})
    with pytest.raises(AssertionError, match=r"step 1: max_abs 5\.000e-02 at token 2 > limit 4\.950e-02"):
        assert_logits_close(off, logits, limits={"max_abs": 0.0495})


def test_logit_metrics_in_chunks_equal_the_whole(monkeypatch):
    """Chunks of 3 positions (V4-Flash's vocabulary is metered by LOGIT_ROWS) give the metrics of one pass,
    locations included: ties, a bf16 side, and non-finite values past the first chunk."""
    from pytest_cdna2 import compare

    g = torch.Generator().manual_seed(4)
    e = (torch.randn(2, 7, 11, generator=g) * 3).round()  # rounded: argmax and max-abs ties
    a = (e + torch.randn(2, 7, 11, generator=g)).round()
    a[1, 5, 3], e[1, 6, 2] = float("nan"), float("inf")  # both in the last chunks
    row_metrics, seen = compare._row_metrics, []
    monkeypatch.setattr(compare, "_row_metrics", lambda x, y: seen.append(len(x)) or row_metrics(x, y))
    for actual in (a, a.bfloat16()):
        seen.clear()
        monkeypatch.setattr(compare, "LOGIT_ROWS", 3)
        chunked = compare.logit_metrics(actual, e)
        assert max(seen) == 3 and sum(seen) == 14
        monkeypatch.setattr(compare, "LOGIT_ROWS", 10**9)
        whole = compare.logit_metrics(actual, e)
        assert torch.equal(chunked.kl, whole.kl) and chunked.nonfinite == whole.nonfinite == 2
        for f in ("kl_max_at", "cosine_min", "cosine_min_at", "max_abs", "max_abs_at", "top1_agreement",
                  "first_divergence", "topk_rank", "nonfinite_at"):
            assert getattr(chunked, f) == getattr(whole, f), f
