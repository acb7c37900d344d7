"""Which device the suite runs on: parse ``--cdna2-device``, describe GPUs, pin xdist workers.

On ROCm, PyTorch exposes AMD GPUs through ``torch.cuda`` (``torch.version.hip`` is set), and each GCD of an
MI250 is its own device: ``--cdna2-device=1`` is the second GCD. Everything here reads torch at call time so
tests can monkeypatch ``torch.cuda`` functions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
import torch

__all__ = [
    "DeviceInfo",
    "parse_device_spec",
    "default_device_spec",
    "worker_index",
    "pick_for_worker",
    "describe",
    "list_devices",
]


@dataclass(frozen=True)
class DeviceInfo:
    """One device as the header and ``cdna2 info`` show it."""

    device: str  # "cpu" or "cuda:N" (also on ROCm)
    name: str
    arch: str  # "gfx90a", "sm_90", or the CPU's machine name
    wave_size: int | None  # 64 on AMD CDNA, 32 on NVIDIA, None on the CPU
    gcd: int | None  # the GPU index: on MI250 each GCD is one device
    total_memory: int | None  # bytes
    runtime: str  # "HIP 6.2.x", "CUDA 12.4", or "CPU"

    def line(self) -> str:
        """One human line, e.g. ``cuda:0 AMD Instinct MI250X gfx90a wave64 GCD 0 64.0 GiB HIP 6.2``."""
        if self.gcd is None:
            return f"cpu ({self.name}, {torch.get_num_threads()} threads, torch {torch.__version__})"
        mem = f"{self.total_memory / 2**30:.1f} GiB" if self.total_memory else "? GiB"
        unit = "GCD" if self.runtime.startswith("HIP") else "GPU"  # an MI250 GCD is one device
        return f"{self.device} {self.name} {self.arch} wave{self.wave_size} {unit} {self.gcd} {mem} {self.runtime}"


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device_spec() -> str:
    """The first GPU when there is one, else the CPU: a bare ``pytest`` checks what the machine has."""
    return "0" if _gpu_count() > 0 else "cpu"


def _available_text() -> str:
    n = _gpu_count()
    gpus = ", ".join(str(i) for i in range(n)) if n else "none"
    return f"available: cpu; GPUs: {gpus}"


SPEC_FORMS = "cpu, N (or cuda:N), N,M or all"


def parse_device_spec(spec: str | None, option: str = "--cdna2-device") -> list[str]:
    """``cpu|N|N,M|all`` -> torch device strings (``N`` may be written ``cuda:N``, torch's form, which names the
    same device on ROCm); a missing GPU is a usage error listing what exists. Errors name ``option``."""
    if spec is not None and not spec.strip():
        raise pytest.UsageError(f"{option}='': empty: expected {SPEC_FORMS} ({_available_text()})")
    spec = (spec or default_device_spec()).strip().lower()
    if spec == "cpu":
        return ["cpu"]
    n = _gpu_count()
    if spec == "all":
        if n == 0:
            raise pytest.UsageError(f"{option}=all: no GPU is visible to torch ({_available_text()})")
        return [f"cuda:{i}" for i in range(n)]
    if not re.fullmatch(r"(cuda:)?\d+(,(cuda:)?\d+)*", spec):
        raise pytest.UsageError(f"{option}={spec!r}: expected {SPEC_FORMS} ({_available_text()})")
    indices = [int(s.removeprefix("cuda:")) for s in spec.split(",")]
    if len(set(indices)) != len(indices):
        raise pytest.UsageError(f"{option}={spec}: a device is listed twice")
    for i in indices:
        if i >= n:
            raise pytest.UsageError(f"{option}={spec}: GPU {i} does not exist ({_available_text()})")
    return [f"cuda:{i}" for i in indices]


def worker_index(env: dict[str, str] | None = None) -> int | None:
    """The xdist worker number (``gw3`` -> 3), or None outside xdist."""
    name = (os.environ if env is None else env).get("PYTEST_XDIST_WORKER", "")
    m = re.fullmatch(r"gw(\d+)", name)
    return int(m.group(1)) if m else None


def pick_for_worker(devices: list[str], worker: int | None) -> str:
    """Pin xdist worker gwN to ``devices[N % len]``, so ``-n 4 --cdna2-device=0,1`` puts two on each GCD."""
    return devices[0] if worker is None else devices[worker % len(devices)]


def describe(device: str) -> DeviceInfo:
    """Name, arch, wave size, GCD, memory and runtime of one device string."""
    if device == "cpu":
        import platform

        return DeviceInfo("cpu", platform.processor() or platform.machine() or "cpu",
                          platform.machine(), None, None, None, "CPU")
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    hip = getattr(torch.version, "hip", None)
    if hip:
        arch = str(getattr(props, "gcnArchName", "") or "gfx?").split(":")[0]
        runtime = f"HIP {hip}"
    else:
        arch = f"sm_{props.major}{props.minor}"
        runtime = f"CUDA {torch.version.cuda}"
    wave = getattr(props, "warp_size", None) or (64 if hip else 32)
    return DeviceInfo(f"cuda:{index}", props.name, arch, int(wave), index,
                      int(getattr(props, "total_memory", 0) or 0), runtime)


def list_devices() -> list[DeviceInfo]:
    """Every device torch sees, the CPU first."""
    return [describe("cpu")] + [describe(f"cuda:{i}") for i in range(_gpu_count())]
