"""Perf tier: pytest-benchmark timings of the engine, run only after every correctness test of the session
passed (the plugin skips them otherwise, naming what failed, and on the CPU). Each reports achieved bytes
per second against the weight bytes a decode step must read."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.perf


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def test_decode_step(benchmark, cdna2_engine):
    """One greedy decode step after a 256-token prefill (the cache is rebuilt outside the timing)."""
    eng = cdna2_engine
    ids = torch.randint(0, eng.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    ids = ids.to(eng.device)

    def setup():
        cache = eng.new_cache()
        eng.step(ids, cache)
        _sync(eng.device)
        return (cache,), {}

    def step(cache):
        eng.step(ids[:, -1:], cache)
        _sync(eng.device)

    benchmark.pedantic(step, setup=setup, rounds=30, warmup_rounds=2)
    if hasattr(eng, "weight_bytes"):
        benchmark.extra_info["weight_bytes"] = eng.weight_bytes()
        benchmark.extra_info["GBps_weights"] = eng.weight_bytes() / benchmark.stats["median"] / 1e9


def test_prefill(benchmark, cdna2_engine):
    eng = cdna2_engine
    ids = torch.randint(0, eng.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))
    ids = ids.to(eng.device)

    def run():
        eng.forward(ids)
        _sync(eng.device)

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    benchmark.extra_info["tokens_per_s"] = ids.numel() / benchmark.stats["median"]
