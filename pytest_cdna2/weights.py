"""The weight tier's single pass over a checkpoint: every packed tensor (a `.weight` stored beside a UE8M0
`.scale`) as stored, its scales checked, its bytes round-tripped through the device, and each stored shape
decoded by the engine's decoders and by independent ones (ml_dtypes), holding one tensor at a time, so
V4-Flash's ~160 GB is checked on a host with a few GB free. A checkpoint in the official layout is read once:
the bundled engine's reader validates it and hands each stored tensor to the checks on the way
(:func:`scan_checkpoint`); another engine's files are read directly (:func:`scan_weights`). The suite's tests
(suite/test_weights.py) assert on what the pass found; each failure is one line per tensor."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from cdna2_engine import formats
from cdna2_engine.checkpoint import shard_files, stream_checkpoint

FP8, MXFP4, SCALES, ROUND_TRIP = "fp8", "mxfp4", "scales", "round_trip"


@dataclass
class WeightScan:
    """What one pass found: packed tensors read, those decoded per format, per check the tensors that failed it."""

    tensors: int = 0
    decoded: Counter = field(default_factory=Counter)
    problems: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, check: str, line: str) -> None:
        self.problems.setdefault(check, []).append(line)


def packed_tensors(model_dir: Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor,
                                                                                            torch.Tensor]]:
    """(key, weight, scale) for every tensor stored with a `.scale` (but the weights in `skip`), one at a time,
    in file and key order."""
    for path in shard_files(model_dir):  # a bad index or no files: CheckpointError, the reader's one line
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for k in sorted(keys):
                scale_key = k.removesuffix(".weight") + ".scale"
                if k.endswith(".weight") and scale_key in keys and k not in skip:
                    yield k, f.get_tensor(k), f.get_tensor(scale_key)


def fp8_independent(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes by ml_dtypes' float8_e4m3fn times 2**(byte - 127) per 128 x 128 block, in float64."""
    import ml_dtypes

    vals = w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    exp = scale.view(torch.uint8).numpy().astype(np.float64) - 127
    return torch.from_numpy(vals * np.repeat(np.repeat(np.exp2(exp), 128, 0)[: w.shape[0]], 128, 1)[:, : w.shape[1]])


def mxfp4_independent(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (element 2j low, 2j+1 high) by ml_dtypes' float4_e2m1fn times 2**(byte - 127) per 32, float64."""
    import ml_dtypes

    raw = w.view(torch.uint8).numpy()
    nib = np.stack([raw & 0xF, raw >> 4], -1).reshape(*raw.shape[:-1], -1)
    vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    exp = scale.view(torch.uint8).numpy().astype(np.float64) - 127
    return torch.from_numpy(vals * np.repeat(np.exp2(exp), 32, axis=-1))


def _decode(key: str, w: torch.Tensor, scale: torch.Tensor, scan: WeightScan) -> None:
    if w.dtype == torch.float8_e4m3fn:
        kind, ours, independent = FP8, formats.fp8_block_dequantize(w, scale, dtype=torch.float64), \
            fp8_independent(w, scale)
    elif w.dtype in (torch.int8, torch.uint8):
        kind, ours, independent = MXFP4, formats.mxfp4_dequantize(w, scale, dtype=torch.float64), \
            mxfp4_independent(w, scale)
    else:
        return
    scan.decoded[kind] += 1
    if not torch.equal(ours, independent):
        scan.fail(kind, f"{key}: {kind.upper()} decode differs at {(ours != independent).sum()} values")


class _Scanner:
    """The per-tensor checks of one pass; `visit` takes tensors as a reader meets them (a `.weight`, then its
    `.scale`), holding only the weight that waits for its scale."""

    def __init__(self, device: torch.device, decode: bool) -> None:
        self.scan, self.device, self.decode = WeightScan(), device, decode
        self.shapes: set = set()
        self.waiting: tuple[str, torch.Tensor] | None = None
        self.seen: set[str] = set()  # file keys read (a reader may store names otherwise: `model.` prefixes)

    def visit(self, key: str, file_key: str, t: torch.Tensor) -> None:
        self.seen.add(file_key)
        if key.endswith(".weight"):
            self.waiting = (key, t)
        elif key.endswith(".scale") and self.waiting and self.waiting[0] == key.removesuffix(".scale") + ".weight":
            (wkey, w), self.waiting = self.waiting, None
            self.check(wkey, w, t)

    def check(self, key: str, w: torch.Tensor, scale: torch.Tensor) -> None:
        scan = self.scan
        scan.tensors += 1
        nans = int((scale.view(torch.uint8) == 255).sum()) if scale.dtype == torch.float8_e8m0fnu else 0
        if scale.dtype != torch.float8_e8m0fnu:
            scan.fail(SCALES, f"{key}: scale dtype {scale.dtype}, expected float8_e8m0fnu")
        elif nans:
            scan.fail(SCALES, f"{key}: {nans} NaN (0xFF) scales")
        elif self.decode and (w.dtype, w.shape, scale.shape) not in self.shapes:  # bad scales fail a decode too
            self.shapes.add((w.dtype, w.shape, scale.shape))
            _decode(key, w, scale, scan)
        if self.device.type != "cpu":
            for t, what in ((w, "weight"), (scale, "scale")):
                raw = t.view(torch.uint8)
                if not torch.equal(raw, raw.to(self.device).cpu()):
                    scan.fail(ROUND_TRIP, f"{key} {what}: bytes changed on the way through {self.device}")


def scan_weights(model_dir: Path, device: torch.device, decode: bool = True) -> WeightScan:
    """One pass over the packed tensors, read straight from the files (any engine's checkpoint); `decode` False
    when ml_dtypes (the independent decoder) is absent. Scales and device bytes are checked in every tensor; the
    decoders compared on the first tensor of each stored (dtype, shape, scale grid). A decode is an elementwise
    function of a code and the scale its position maps to, so every code at every scale (suite's decoder table
    test) and every shape here cover it; decoding all of V4-Flash's ~280 G values twice in float64 would take
    hours (43 ns a value on this CPU's two cores)."""
    scanner = _Scanner(device, decode)
    for key, w, scale in packed_tensors(model_dir):
        scanner.check(key, w, scale)
    return scanner.scan


def scan_checkpoint(model_dir: Path, device: torch.device, decode: bool = True) -> WeightScan:
    """The same checks in the bundled engine's reader's single pass over an official-layout checkpoint (every
    key, shape, dtype, scale grid and finite value against config.json): a broken checkpoint raises the reader's
    one line, as loading it would, and no byte is read twice (V4-Flash: ~160 GB from disk, not ~320). Packed
    tensors the engine does not read (V4-Flash's multi-token-prediction layers, `mtp.*`) are read after it."""
    scanner = _Scanner(device, decode)
    for _ in stream_checkpoint(model_dir, on_read=scanner.visit):
        pass
    for key, w, scale in packed_tensors(model_dir, skip=frozenset(scanner.seen)):
        scanner.check(key, w, scale)
    return scanner.scan
