"""cdna2_engine: the bundled DeepSeek-V4 engine (official FP8/MXFP4 checkpoint layout).

    model = cdna2_engine.load_model("goldens/tiny-v4/model", device="cpu", dtype=torch.float64)
    logits = model.forward(input_ids)              # [B, T, vocab]
    gen = model.generate(input_ids, 32)            # greedy: gen.tokens, gen.logits
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, convert_hf_checkpoint, read_checkpoint, weight_bytes
from .config import Config, ConfigError
from .model import Generation, Model, Selection, Trace
from .ops import get_ops

__all__ = ["load_model", "convert_hf_checkpoint", "Model", "Config", "Generation", "Trace", "Selection",
           "CheckpointError", "ConfigError"]
__version__ = "0.1.0"

_DTYPES = {"float64": torch.float64, "fp64": torch.float64, "double": torch.float64, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def load_model(path: str | Path, *, device: str | torch.device = "cpu", backend: str = "reference",
               dtype: torch.dtype | str | None = None, reference_ops: str | list[str] | None = None) -> Model:
    """Load a checkpoint folder (official or transformers layout) onto `device`.

    dtype: activation dtype; default float32 on the CPU and bfloat16 on a GPU. backend: "reference"
    (plain torch) or "triton"; `reference_ops` names triton ops to run from the reference instead (a list, or a
    comma list as env CDNA2_REFERENCE_OPS takes, which it overrides).
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but torch sees no GPU: use device='cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device}: torch sees {torch.cuda.device_count()} GPU(s), so use cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1} (or set HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device}: the engine runs on 'cpu' or 'cuda' (ROCm GPUs are 'cuda' in torch)")
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype {dtype} is not a float compute dtype: use one of {sorted(_DTYPES)}")
    _check_fits(Path(path), device)
    cfg, weights = read_checkpoint(path)
    ops = get_ops(backend, reference_ops)
    return Model(cfg, weights, device=device, dtype=dtype, ops=ops, source=str(path))


def _free_bytes(device: torch.device) -> int | None:
    """Memory the weights can take on `device`: the GPU's free memory (with blocks torch cached after an earlier
    model was dropped), or the host's MemAvailable (Linux), lowered to a cgroup v2 limit's headroom (a container)."""
    if device.type == "cuda":  # the driver's free memory plus what torch's caching allocator holds unused
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def _check_fits(folder: Path, device: torch.device) -> None:
    """One line before a copy that cannot fit: the engine holds every weight on one device (on the CPU, stacking
    the experts copies them out of the memory-mapped files: ~94% of V4-Flash), so V4-Flash (~160 GB) on one GPU or
    a smaller host ran out of memory after minutes of copying, or had the kernel end the process with no summary.
    The bytes are the tensors the reader loads (MTP's left out), from the files' headers."""
    try:
        need = weight_bytes(folder)
    except (CheckpointError, OSError, ValueError):
        return  # read_checkpoint names what is wrong, its config.json first
    free = _free_bytes(device)
    if free is not None and need > free:
        where = f"{device} has {_size(free)} free" if device.type == "cuda" else \
            f"the host has {_size(free)} available"
        raise ValueError(f"{folder}: its weights take {_size(need)} and {where}: the bundled engine holds a "
                         "model on one device; use a larger one, or an engine that spreads it "
                         "(--cdna2-engine=module:factory)")
