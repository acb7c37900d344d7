"""Determinism tier: the same input gives the same output (fixed reduction order, no float atomics), a row
does not depend on its batch neighbours, incremental decode reproduces the prefill, devices agree."""

from __future__ import annotations

import gc

import pytest
import torch

from pytest_cdna2.judge import batch_spread, judge_incremental, probe_ids

pytestmark = pytest.mark.determinism

def _ids(engine, repeat: int = 1) -> torch.Tensor:
    return probe_ids(engine, repeat)


def test_repeat_runs_are_bit_identical(cdna2_engine, cdna2_tolerance, cdna2_record):
    ids = _ids(cdna2_engine, repeat=3)
    a, b = cdna2_engine.forward(ids), cdna2_engine.forward(ids)
    diff = (a - b).abs().max().item()
    cdna2_record("repeat_max_abs", diff, cdna2_tolerance.determinism.repeat_max_abs)
    assert diff <= cdna2_tolerance.determinism.repeat_max_abs, f"two identical runs differ by {diff:.3e}"


def test_batch_of_one_matches_batch_of_many(cdna2_engine, cdna2_tolerance, cdna2_record):
    limit = cdna2_tolerance.determinism.batch_max_abs
    for row, diff in enumerate(batch_spread(cdna2_engine)):
        cdna2_record("batch_max_abs", diff, limit, what=f"row {row}")
        assert diff <= limit, f"the probe at row {row} of a batch of 4 differs from batch 1 by {diff:.3e}"


def test_incremental_decode_matches_prefill(cdna2_engine, cdna2_tolerance, cdna2_record):
    """Greedy decode (prefill + one step per token) against one prefill of the same tokens; the probe is
    long enough to wrap the sliding window and close compression windows during the decode. A decode whose
    sparse picks flipped at near-ties is judged against a prefill given its picks (pytest_cdna2.judge)."""
    limit = cdna2_tolerance.determinism.incremental_max_abs
    r = judge_incremental(cdna2_engine, limit, cdna2_tolerance.token.tie_margins)
    cdna2_record("incremental_max_abs", r.diff, limit,
                 what=f"{r.near_tie_flips} near-tie flips" if r.near_tie_flips else "")
    assert not r.message, r.message


def test_devices_agree(cdna2_devices, cdna2_device, cdna2_engine, cdna2_settings, cdna2_tolerance, cdna2_record):
    """The same model on every selected device (GCD vs GCD) gives the same logits: the session's engine on its
    device, one more engine at a time on each other (each may take a device's memory: V4-Flash)."""
    if len(cdna2_devices) < 2:
        pytest.skip("needs several devices: --cdna2-device=N,M or all")
    from pytest_cdna2.engines import load_engine

    s = cdna2_settings
    outs = []
    for dev in cdna2_devices:
        if dev == cdna2_device:
            outs.append(cdna2_engine.forward(_ids(cdna2_engine)).cpu())
            continue
        eng = load_engine(s.engine, s.model, device=str(dev), backend=s.backend, dtype=s.dtype,
                          option="--cdna2-engine")
        outs.append(eng.forward(_ids(eng)).cpu())
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for dev, out in zip(cdna2_devices[1:], outs[1:], strict=True):
        diff = (out - outs[0]).abs().max().item()
        cdna2_record("device_max_abs", diff, cdna2_tolerance.determinism.device_max_abs, what=str(dev))
        limit = cdna2_tolerance.determinism.device_max_abs
        assert diff <= limit, f"{dev} differs from {cdna2_devices[0]} by {diff:.3e}"
