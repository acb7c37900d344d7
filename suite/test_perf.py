"""Perf tier: pytest-benchmark timings of the engine, run only after every correctness test of the session
passed (the plugin skips them otherwise, naming what failed, and on the CPU). Each records tokens per second
in the benchmark's extra_info (and the engine's resident weight bytes where it reports them); the kernels'
fractions of copy bandwidth and a decode step's byte floor are bench/'s (bench_kernels.py, bench_slice.py).
With --benchmark-disable each runs once, untimed, and records nothing, as pytest-benchmark intends."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.perf


def _sync(device):
    """Every GPU holding memory, not only the engine's first: an engine spread over several finishes on its last
    (GPUs the run never touched are left alone: synchronizing one would create a context there)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        for i in range(torch.cuda.device_count()):
            if torch.cuda.memory_allocated(i):
                torch.cuda.synchronize(i)


def test_decode(benchmark, cdna2_engine):
    """A 256-token prompt then 64 greedy tokens through `generate`, the path users run (on a GPU with the
    triton backend: every decode step after the first replayed as one CUDA graph)."""
    eng = cdna2_engine
    ids = torch.randint(0, eng.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    ids = ids.to(eng.device)
    new = 64

    def run():
        eng.generate(ids, new)
        _sync(eng.device)

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    if benchmark.disabled:
        return
    benchmark.extra_info["tokens_per_s_incl_prefill"] = new / benchmark.stats["median"]
    if hasattr(eng, "weight_bytes"):
        benchmark.extra_info["weight_bytes"] = eng.weight_bytes()


def test_prefill(benchmark, cdna2_engine):
    eng = cdna2_engine
    ids = torch.randint(0, eng.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))
    ids = ids.to(eng.device)

    def run():
        eng.forward(ids)
        _sync(eng.device)

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    if not benchmark.disabled:
        benchmark.extra_info["tokens_per_s"] = ids.numel() / benchmark.stats["median"]
