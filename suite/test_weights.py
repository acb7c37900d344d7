"""Weight tier: every packed tensor of the checkpoint decodes the same in the engine's decoders and in
independent ones (ml_dtypes' float8_e4m3fn and float4_e2m1fn), scales are finite, and bytes survive a
host -> device -> host round trip. Exact: a decoder one bit off fails here, not three tiers later."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

from cdna2_engine import formats
from cdna2_engine.checkpoint import read_checkpoint

pytestmark = pytest.mark.weight


def _packed(model_dir: Path):
    """(key, weight, scale) for every tensor stored with a UE8M0 scale, read straight from the files."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files: point --cdna2-model at a checkpoint folder")
    for name in files:
        with safe_open(str(model_dir / name), "pt") as f:
            keys = set(f.keys())
            for k in sorted(keys):
                if k.endswith(".weight") and k.removesuffix(".weight") + ".scale" in keys:
                    yield k, f.get_tensor(k), f.get_tensor(k.removesuffix(".weight") + ".scale")


@pytest.fixture(scope="module")
def packed(cdna2_settings, request):
    """The checkpoint's packed tensors. First the whole checkpoint goes through the bundled engine's reader
    (official layout: every key, shape, dtype, scale grid and finite value against config.json), so a broken
    checkpoint stops the run in one line here, as it would when loaded, instead of passing the decode checks
    on what is left of it."""
    model_dir = cdna2_settings.model
    try:
        if (model_dir / "config.json").is_file():  # a checkpoint in the official layout (not a custom engine's own)
            read_checkpoint(model_dir)
        items = list(_packed(model_dir))
    except (ValueError, OSError, SafetensorError) as e:  # CheckpointError, ConfigError, a corrupt index or shard
        message = f"cdna2: weight tier: {e}"
        request.session.shouldstop = message
        raise pytest.fail.Exception(message, pytrace=False) from None  # raised in `except`: no chained repeat
    if not items:
        pytest.skip(f"{cdna2_settings.model} holds no FP8/MXFP4 tensors with scales")
    return items


def test_ue8m0_scales_are_finite(packed):
    for key, _, scale in packed:
        raw = scale.view(torch.uint8)
        assert scale.dtype == torch.float8_e8m0fnu, f"{key}: scale dtype {scale.dtype}, expected float8_e8m0fnu"
        assert not (raw == 255).any(), f"{key}: {(raw == 255).sum()} NaN (0xFF) scales"


def _fp8_independent(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes by ml_dtypes' float8_e4m3fn times 2**(byte - 127) per 128 x 128 block, in float64."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the independent FP8 decoder")
    import numpy as np

    vals = w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    exp = scale.view(torch.uint8).numpy().astype(np.float64) - 127
    return torch.from_numpy(vals * np.repeat(np.repeat(np.exp2(exp), 128, 0)[: w.shape[0]], 128, 1)[:, : w.shape[1]])


def _mxfp4_independent(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (element 2j low, 2j+1 high) by ml_dtypes' float4_e2m1fn times 2**(byte - 127) per 32, float64."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the independent FP4 decoder")
    import numpy as np

    raw = w.view(torch.uint8).numpy()
    nib = np.stack([raw & 0xF, raw >> 4], -1).reshape(*raw.shape[:-1], -1)
    vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    exp = scale.view(torch.uint8).numpy().astype(np.float64) - 127
    return torch.from_numpy(vals * np.repeat(np.exp2(exp), 32, axis=-1))


def test_fp8_weights_decode_identically(packed):
    """E4M3 bytes through the engine's decoder (torch's float8_e4m3fn cast) vs ml_dtypes' float8_e4m3fn, with
    2**(byte-127) per 128x128 block."""
    n = 0
    for key, w, scale in packed:
        if w.dtype != torch.float8_e4m3fn:
            continue
        ours, independent = formats.fp8_block_dequantize(w, scale, dtype=torch.float64), _fp8_independent(w, scale)
        assert torch.equal(ours, independent), f"{key}: FP8 decode differs at {(ours != independent).sum()} values"
        n += 1
    assert n, "no FP8 tensors found"


def test_mxfp4_weights_decode_identically(packed):
    """E2M1 nibbles (element 2j low, 2j+1 high) through the engine vs ml_dtypes' float4_e2m1fn."""
    n = 0
    for key, w, scale in packed:
        if w.dtype not in (torch.int8, torch.uint8):
            continue
        ours, independent = formats.mxfp4_dequantize(w, scale, dtype=torch.float64), _mxfp4_independent(w, scale)
        assert torch.equal(ours, independent), f"{key}: MXFP4 decode differs at {(ours != independent).sum()} values"
        n += 1
    assert n, "no MXFP4 tensors found"


def test_decoders_on_multi_block_scale_grids():
    """The engine's decoders against ml_dtypes on synthetic tensors whose scale grids have several rows and
    columns and ragged edges: a checkpoint whose FP8 tensors are one 128 x 128 block each (the bundled tiny
    model's) cannot show a grid read transposed or a block size off (a column-major read of a 2 x 3 grid moved
    a 256 x 384 decode by 0.32 rel.). Random codes (NaN bytes excluded), random scales 2^-8 .. 2^7."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (300, 400), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # E4M3's NaN codes out: compared by value below
    w = codes.view(torch.float8_e4m3fn)
    scale = torch.randint(119, 135, (3, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 300, 400
    ours = formats.fp8_block_dequantize(w, scale, dtype=torch.float64)
    assert torch.equal(ours, _fp8_independent(w, scale)), "FP8 decode with a 3 x 4 block-scale grid differs"

    packed = torch.randint(0, 256, (48, 80), generator=g, dtype=torch.uint8)  # K = 160: 5 scales a row
    mx_scale = torch.randint(119, 135, (48, 5), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ours = formats.mxfp4_dequantize(packed, mx_scale, dtype=torch.float64)
    assert torch.equal(ours, _mxfp4_independent(packed, mx_scale)), "MXFP4 decode with 5 scales a row differs"


def test_device_round_trip_keeps_bytes(packed, cdna2_device):
    if cdna2_device.type == "cpu":
        pytest.skip("the weights are already on the CPU: there is no device to round-trip through")
    for key, w, scale in packed:
        for t, what in ((w, "weight"), (scale, "scale")):
            raw = t.view(torch.uint8)
            back = raw.to(cdna2_device).cpu()
            assert torch.equal(raw, back), f"{key} {what}: bytes changed on the way through {cdna2_device}"
