"""Device selection and description, with torch.cuda monkeypatched to pretend GPUs exist."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_plugin_fake_engine import run_inprocess as run

from pytest_cdna2 import devices

MI250_GCD = SimpleNamespace(name="AMD Instinct MI250X/MI250", gcnArchName="gfx90a:sramecc+:xnack-", warp_size=64,
                            total_memory=64 * 2**30, major=9, minor=0)
H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 * 2**30)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend ``n`` GPUs with properties ``props`` under runtime ``hip``/``cuda``."""

    def install(n, props=MI250_GCD, hip="6.2.41133", cuda=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", cuda)

    return install


def test_default_is_first_gpu_else_cpu(gpus):
    gpus(0)
    assert devices.parse_device_spec(None) == ["cpu"]
    gpus(2)
    assert devices.parse_device_spec(None) == ["cuda:0"]


def test_specs(gpus):
    gpus(4)
    assert devices.parse_device_spec("cpu") == ["cpu"]
    assert devices.parse_device_spec("2") == ["cuda:2"]
    assert devices.parse_device_spec("1,3") == ["cuda:1", "cuda:3"]
    assert devices.parse_device_spec(" ALL ") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert devices.parse_device_spec("cuda:2") == ["cuda:2"]  # torch's form, as `cdna2 bisect --device` takes it
    assert devices.parse_device_spec("cuda:1,3") == ["cuda:1", "cuda:3"]


@pytest.mark.parametrize(
    ("n", "spec", "message"),
    [
        (2, "2", r"GPU 2 does not exist \(available: cpu; GPUs: 0, 1\)"),
        (0, "0", r"GPU 0 does not exist \(available: cpu; GPUs: none\)"),
        (0, "all", r"no GPU is visible to torch \(available: cpu; GPUs: none\)"),
        (2, "gpu0", r"expected cpu, N \(or cuda:N\), N,M or all \(available: cpu; GPUs: 0, 1\)"),
        (2, "1,1", r"listed twice"),
        (2, "-1", r"expected cpu, N \(or cuda:N\), N,M or all"),
        (2, "cuda:2", r"GPU 2 does not exist"),
        (2, "cuda", r"expected cpu, N \(or cuda:N\)"),
    ],
)
def test_bad_specs_are_usage_errors_listing_devices(gpus, n, spec, message):
    gpus(n)
    with pytest.raises(pytest.UsageError, match=message):
        devices.parse_device_spec(spec)


def test_xdist_pinning_round_robin():
    assert devices.worker_index({"PYTEST_XDIST_WORKER": "gw5"}) == 5
    assert devices.worker_index({}) is None
    pair = ["cuda:0", "cuda:1"]
    assert [devices.pick_for_worker(pair, w) for w in (0, 1, 2, 3)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert devices.pick_for_worker(pair, None) == "cuda:0"


def test_describe_rocm_gcd(gpus):
    gpus(2)
    d = devices.describe("cuda:1")
    assert (d.arch, d.wave_size, d.gcd, d.runtime) == ("gfx90a", 64, 1, "HIP 6.2.41133")
    assert d.line() == "cuda:1 AMD Instinct MI250X/MI250 gfx90a wave64 GCD 1 64.0 GiB HIP 6.2.41133"


def test_describe_rocm_without_warp_size_defaults_to_64(gpus):
    gpus(1, props=SimpleNamespace(name="AMD", gcnArchName="gfx90a", total_memory=0, major=9, minor=0))
    assert devices.describe("cuda:0").wave_size == 64


def test_describe_cuda(gpus):
    gpus(1, props=H200, hip=None, cuda="12.8")
    d = devices.describe("cuda:0")
    assert (d.name, d.arch, d.wave_size, d.runtime) == ("NVIDIA H200", "sm_90", 32, "CUDA 12.8")
    assert d.line() == "cuda:0 NVIDIA H200 sm_90 wave32 GPU 0 141.0 GiB CUDA 12.8"


def test_list_devices_cpu_first(gpus):
    gpus(2)
    assert [d.device for d in devices.list_devices()] == ["cpu", "cuda:0", "cuda:1"]
    assert devices.describe("cpu").line().startswith("cpu (")


def test_plugin_pins_xdist_worker_and_shows_header(pytester, gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    pytester.makepyfile(
        """
        def test_device(cdna2_device, cdna2_devices):
            assert str(cdna2_device) == "cuda:1"
            assert [str(d) for d in cdna2_devices] == ["cuda:0", "cuda:1"]
        """
    )
    r = run(pytester, "--cdna2-device=0,1", "-p", "no:xdist")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines([
        "cdna2 device: cuda:0 AMD Instinct MI250X/MI250 gfx90a wave64 GCD 0 64.0 GiB HIP 6.2.41133",
        "cdna2 device: cuda:1 AMD Instinct MI250X/MI250 gfx90a wave64 GCD 1 *",
        "cdna2: xdist workers pinned round-robin over cuda:0, cuda:1",
    ])


def test_plugin_missing_gpu_is_a_usage_error(pytester, gpus):
    gpus(1)
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-device=3")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--cdna2-device=3: GPU 3 does not exist (available: cpu; GPUs: 0)*"])


def test_plugin_reads_the_device_from_ini(pytester, gpus):
    from test_plugin_fake_engine import FAST

    gpus(2)
    pytester.makeini("[pytest]\ncdna2_device = 1\n")
    pytester.makepyfile("def test_device(cdna2_device):\n    assert str(cdna2_device) == 'cuda:1'\n")
    pytester.runpytest_inprocess(*FAST).assert_outcomes(passed=1)
