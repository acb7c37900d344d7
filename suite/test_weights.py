"""Weight tier: every packed tensor of the checkpoint decodes the same in the engine's decoders and in
independent ones (ml_dtypes' float8_e4m3fn and float4_e2m1fn), scales are finite, and bytes survive a
host -> device -> host round trip. Exact: a decoder one bit off fails here, not three tiers later. One pass
over the files holds one tensor at a time (pytest_cdna2.weights), so a 160 GB checkpoint needs no 160 GB host."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors import SafetensorError

from cdna2_engine import formats
from pytest_cdna2.weights import (
    FP8,
    MXFP4,
    ROUND_TRIP,
    SCALES,
    fp8_independent,
    mxfp4_independent,
    scan_checkpoint,
    scan_weights,
)

pytestmark = pytest.mark.weight
HAVE_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None
needs_ml_dtypes = pytest.mark.skipif(not HAVE_ML_DTYPES, reason="ml_dtypes is the independent FP8/FP4 decoder: "
                                     "pip install ml-dtypes (the suite extra has it)")


@pytest.fixture(scope="module")
def scan(cdna2_settings, cdna2_device, request):
    """One pass over the checkpoint's packed tensors. An official-layout checkpoint goes through the bundled
    engine's reader, one tensor at a time (every key, shape, dtype, scale grid and finite value against
    config.json), with the checks on each tensor it reads: a broken checkpoint stops the run in one line here, as
    it would when loaded, instead of passing the decode checks on what is left of it."""
    model_dir = cdna2_settings.model
    try:
        if (model_dir / "config.json").is_file():  # a checkpoint in the official layout (not a custom engine's own)
            found = scan_checkpoint(model_dir, cdna2_device, decode=HAVE_ML_DTYPES)
        else:
            found = scan_weights(model_dir, cdna2_device, decode=HAVE_ML_DTYPES)
    except (ValueError, OSError, SafetensorError) as e:  # CheckpointError, ConfigError, a corrupt index or shard
        message = f"cdna2: weight tier: {e}"
        request.session.shouldstop = message
        raise pytest.fail.Exception(message, pytrace=False) from None  # raised in `except`: no chained repeat
    if not found.tensors:
        pytest.skip(f"{model_dir} holds no FP8/MXFP4 tensors with scales")
    return found


def _no_problems(scan, check: str) -> None:
    lines = scan.problems.get(check, [])
    assert not lines, f"{len(lines)} tensor(s): " + "; ".join(lines[:5]) + (" ..." if len(lines) > 5 else "")


def test_ue8m0_scales_are_finite(scan):
    _no_problems(scan, SCALES)


@needs_ml_dtypes
def test_fp8_weights_decode_identically(scan):
    """E4M3 bytes through the engine's decoder (torch's float8_e4m3fn cast) vs ml_dtypes' float8_e4m3fn, with
    2**(byte-127) per 128x128 block: the first tensor of each stored shape (pytest_cdna2.weights)."""
    _no_problems(scan, FP8)
    assert scan.decoded[FP8], "no FP8 tensors found"


@needs_ml_dtypes
def test_mxfp4_weights_decode_identically(scan):
    """E2M1 nibbles (element 2j low, 2j+1 high) through the engine vs ml_dtypes' float4_e2m1fn: the first
    tensor of each stored shape."""
    _no_problems(scan, MXFP4)
    assert scan.decoded[MXFP4], "no MXFP4 tensors found"


@needs_ml_dtypes
def test_decoders_on_every_code_at_every_scale():
    """Every E4M3 byte and every pair of E2M1 nibbles at every UE8M0 scale byte 0..254 (2^-127 .. 2^127), the
    engine's decoders against ml_dtypes in float64: with the checkpoint's shapes (above) this covers a decode,
    an elementwise function of a code and its position's scale. NaN codes must decode to NaN."""
    scales = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = torch.arange(256, dtype=torch.uint8).view(2, 128).repeat(64, 255)  # 255 blocks of 128 x 128
    w, grid = w.view(torch.float8_e4m3fn), scales.view(1, 255)  # block j: every byte 64 times, scale byte j
    ours, independent = formats.fp8_block_dequantize(w, grid, dtype=torch.float64), fp8_independent(w, grid)
    same = torch.equal(ours.isnan(), independent.isnan()) and torch.equal(ours.nan_to_num(), independent.nan_to_num())
    assert same, "FP8 decode differs from ml_dtypes' float8_e4m3fn at some code and scale"

    packed = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(255, 1)  # 16 rows of 32 codes a scale byte
    grid = scales.repeat_interleave(16).view(-1, 1)
    ours, independent = formats.mxfp4_dequantize(packed, grid, dtype=torch.float64), mxfp4_independent(packed, grid)
    assert torch.equal(ours, independent), "MXFP4 decode differs from ml_dtypes' float4_e2m1fn at some code and scale"


@needs_ml_dtypes
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
    assert torch.equal(ours, fp8_independent(w, scale)), "FP8 decode with a 3 x 4 block-scale grid differs"

    packed = torch.randint(0, 256, (48, 80), generator=g, dtype=torch.uint8)  # K = 160: 5 scales a row
    mx_scale = torch.randint(119, 135, (48, 5), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ours = formats.mxfp4_dequantize(packed, mx_scale, dtype=torch.float64)
    assert torch.equal(ours, mxfp4_independent(packed, mx_scale)), "MXFP4 decode with 5 scales a row differs"


def test_device_round_trip_keeps_bytes(scan, cdna2_device):
    if cdna2_device.type == "cpu":
        pytest.skip("the weights are already on the CPU: there is no device to round-trip through")
    _no_problems(scan, ROUND_TRIP)
