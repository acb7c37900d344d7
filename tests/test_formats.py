"""engine/formats.py against independent decoders: ml_dtypes, torch's float8 dtypes, hand-written tables.

The expected values never come from the code under test: codes are checked against ml_dtypes' casts,
scales against numpy's log2 of the group amax, errors against bounds derived from the format's grid.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from cdna2_engine.formats import (
    block_scale_expand,
    e2m1_to_float,
    e4m3fn_to_e4m3fnuz,
    e8m0_to_float,
    float_to_e2m1,
    float_to_e8m0,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    pack_e2m1,
    unpack_e2m1,
)

# OCP MX spec table for E2M1 (sign bit 3, then 2 exponent bits, 1 mantissa bit), written out by hand.
E2M1_SPEC = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def md_e2m1_codes(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' E2M1 codes of float32 values (round to nearest even; saturates to +-6, even for Inf)."""
    return x.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise-meaningful equality: equal values, equal sign of zero, NaN at the same places.

    NaNs are masked before any cast: torch 2.13 decodes fnuz/e8m0 NaN as a signalling float32 NaN
    (0x7F800001), which numpy warns about when widening it.
    """
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    a, b = np.asarray(a[~nan_a], np.float64), np.asarray(b[~nan_b], np.float64)
    return bool(np.array_equal(a, b) and np.array_equal(np.signbit(a), np.signbit(b)))


# ------------------------------------------------------------------------------------------ E2M1


def test_e2m1_decode_every_code_vs_spec_and_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    ours = e2m1_to_float(codes)
    assert ours.dtype == torch.float32
    md = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert same_floats(ours.numpy(), np.array(E2M1_SPEC))
    assert same_floats(ours.numpy(), md)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64])
def test_e2m1_decode_accepts_integer_dtypes(dtype):
    codes = torch.arange(16, dtype=dtype).reshape(4, 4)
    assert same_floats(e2m1_to_float(codes).numpy().ravel(), np.array(E2M1_SPEC))


def test_e2m1_decode_rejects_out_of_range_codes():
    with pytest.raises(ValueError, match=r"0\.\.15"):
        e2m1_to_float(torch.tensor([16]))


def test_packed_bytes_are_torch_float4_e2m1fn_x2_bytes():
    # torch's float4_e2m1fn_x2 holds two E2M1 values a byte, element 2j in the low nibble (torch's own
    # test packer, torch.testing._internal.common_quantized.pack_uint4, does `x[1::2] << 4 | x[::2]`),
    # which is the checkpoint's order: the packed bytes must view as that dtype and back unchanged.
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    packed = pack_e2m1(codes)
    as_fp4 = packed.view(torch.float4_e2m1fn_x2)
    assert as_fp4.shape == (8, 32) and as_fp4.element_size() == 1
    assert torch.equal(as_fp4.view(torch.int8), packed)


def test_e2m1_decode_vs_torch_float4_e2m1fn_x2():
    # Use torch's own decoder of float4_e2m1fn_x2 where it has one. torch 2.13 on CPU has none
    # ("copy_kernel" not implemented for 'Float4_e2m1fn_x2'), so this skips there and runs once it does.
    packed = pack_e2m1(torch.arange(16, dtype=torch.uint8))
    try:
        decoded = packed.view(torch.float4_e2m1fn_x2).to(torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch {torch.__version__} cannot decode float4_e2m1fn_x2: {str(exc)[:80]}")
    assert same_floats(decoded.reshape(-1).numpy(), np.array(E2M1_SPEC))


def _dense_e2m1_grid() -> np.ndarray:
    mids = np.array(E2M1_MIDPOINTS + [0.0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    down, up = np.nextafter(mids, np.float32(-np.inf)), np.nextafter(mids, np.float32(np.inf))
    near = np.concatenate([mids, down, up])
    big = np.array([6.5, 7.0, 8.0, 1e3, 1e30, np.finfo(np.float32).max], np.float32)
    tiny = np.array([1e-45, 1e-38, 1e-20, 0.0], np.float32)
    dense = np.linspace(-8, 8, 16001, dtype=np.float32)
    pos = np.concatenate([near, big, tiny])
    return np.concatenate([dense, pos, -pos])  # -pos includes -0.0 and tiny negatives


def test_float_to_e2m1_dense_grid_vs_ml_dtypes():
    # ml_dtypes rounds to nearest, ties to even, and saturates at +-6 (checked: 7 -> 6, 1e30 -> 6).
    x = _dense_e2m1_grid()
    ours = float_to_e2m1(torch.from_numpy(x))
    assert ours.dtype == torch.uint8
    np.testing.assert_array_equal(ours.numpy(), md_e2m1_codes(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_float_to_e2m1_other_input_dtypes_vs_ml_dtypes(dtype):
    x = torch.from_numpy(_dense_e2m1_grid()).to(dtype)  # all representable in float32 afterwards
    x = x[torch.isfinite(x)]  # float32 max overflows bf16/fp16
    ours = float_to_e2m1(x)
    np.testing.assert_array_equal(ours.numpy(), md_e2m1_codes(x.to(torch.float32).numpy()))


def test_float_to_e2m1_ties_to_even_by_hand():
    # Midpoint between codes i and i+1 goes to the even code (E2M1 mantissa bit 0).
    expected = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    x = torch.tensor(list(expected))
    assert float_to_e2m1(x).tolist() == list(expected.values())
    assert float_to_e2m1(-x).tolist() == [c | 8 for c in expected.values()]


def test_float_to_e2m1_saturates_and_keeps_sign():
    x = torch.tensor([6.0, 6.0001, 1e30, -7.0, -1e30, 0.0, -0.0, -1e-30, -0.2, 1e-30])
    assert float_to_e2m1(x).tolist() == [7, 7, 7, 15, 15, 0, 8, 8, 8, 0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_float_to_e2m1_rejects_non_finite(bad):
    # (ml_dtypes would give +-6 for +-Inf and code 8 for NaN; we refuse instead.)
    with pytest.raises(ValueError, match="NaN or Inf"):
        float_to_e2m1(torch.tensor([1.0, bad]))


def test_float_to_e2m1_float64_rounds_once():
    # Just past a midpoint in float64: correct rounding goes up. Casting through float32 first (as
    # ml_dtypes does for float64: it gives 0 and 2 here) lands on the midpoint and then ties down.
    x = torch.tensor([0.25 + 2**-40, 1.25 + 2**-40, -(0.25 + 2**-40)], dtype=torch.float64)
    assert float_to_e2m1(x).tolist() == [1, 3, 9]


# ------------------------------------------------------------------------------------ pack/unpack


def test_pack_nibble_order_by_hand():
    codes = torch.tensor([[1, 2, 0xF, 0x0, 0x0, 0xF]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0xF0]]
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(unpack_e2m1(packed.view(torch.uint8)), codes)


def test_pack_unpack_round_trip_random():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=g)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1(packed), codes)
    # Independent unpack with numpy bit ops.
    b = packed.view(torch.uint8).numpy()
    np.testing.assert_array_equal(np.stack([b & 0xF, b >> 4], -1).reshape(3, 5, 64), codes.numpy())


def test_pack_odd_k_raises():
    with pytest.raises(ValueError, match=r"K=3 must be even"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------ E4M3 / FNUZ

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def test_e4m3fn_all_bytes_torch_vs_ml_dtypes():
    t = ALL_BYTES.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    m = ALL_BYTES.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert same_floats(t, m)
    assert np.flatnonzero(np.isnan(t)).tolist() == [0x7F, 0xFF]


def test_e4m3fnuz_all_bytes_torch_vs_ml_dtypes():
    t = ALL_BYTES.view(torch.float8_e4m3fnuz).to(torch.float32).numpy()
    m = ALL_BYTES.numpy().view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    assert same_floats(t, m)
    assert np.flatnonzero(np.isnan(t)).tolist() == [0x80]


@pytest.mark.parametrize("scale_byte", [1, 100, 127, 253])
def test_fnuz_conversion_preserves_every_value(scale_byte):
    w8 = ALL_BYTES.view(torch.float8_e4m3fn)
    scale = torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    fnuz, s_fnuz = e4m3fn_to_e4m3fnuz(w8, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz and s_fnuz.dtype == torch.float32
    s_fn = math.ldexp(1.0, scale_byte - 127)
    assert s_fnuz.item() == 2 * s_fn
    fn_vals = ALL_BYTES.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s_fn
    fnuz_bytes = fnuz.view(torch.uint8).numpy()
    fnuz_vals = fnuz_bytes.view(ml_dtypes.float8_e4m3fnuz).astype(np.float64) * s_fnuz.item()
    nan = np.isnan(fn_vals)
    np.testing.assert_array_equal(fnuz_vals[~nan], fn_vals[~nan])  # -0.0 == 0.0 here: sign is lost
    assert np.isnan(fnuz_vals[nan]).all()  # fn NaN (0x7F, 0xFF) stays NaN (0x80), not +-240
    out = fnuz.view(torch.uint8)
    assert out[0x80].item() == 0x00 and out[0x7F].item() == 0x80 and out[0xFF].item() == 0x80
    keep = [b for b in range(256) if b not in (0x7F, 0x80, 0xFF)]
    assert torch.equal(out[keep], ALL_BYTES[keep])  # everything else: the same bits


def test_fnuz_conversion_rejects_undoublable_scale():
    scale = torch.tensor([254], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"2\*\*127"):
        e4m3fn_to_e4m3fnuz(ALL_BYTES.view(torch.float8_e4m3fn), scale)


# ----------------------------------------------------------------------------------------- E8M0


def test_e8m0_every_byte_vs_torch_ml_dtypes_and_ldexp():
    ours_u8 = e8m0_to_float(ALL_BYTES).numpy()
    ours_f8 = e8m0_to_float(ALL_BYTES.view(torch.float8_e8m0fnu)).numpy()
    t = ALL_BYTES.view(torch.float8_e8m0fnu).to(torch.float32).numpy()
    m = ALL_BYTES.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    exact = np.array([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], np.float32)
    for other in (ours_f8, t, m, exact):
        assert same_floats(ours_u8, other)
    assert np.isnan(ours_u8[255]) and not np.isnan(ours_u8[:255]).any()


def test_float_to_e8m0_exact_for_every_power_of_two():
    x = torch.from_numpy(np.array([math.ldexp(1.0, e) for e in range(-127, 128)], np.float32))
    assert torch.equal(float_to_e8m0(x).view(torch.uint8), ALL_BYTES[:255])
    assert torch.equal(float_to_e8m0(x.double()).view(torch.uint8), ALL_BYTES[:255])


@pytest.mark.parametrize(
    "bad, match",
    [(3.0, "powers of two"), (0.75, "powers of two"), (0.0, "> 0"), (-2.0, "> 0"), (math.inf, "> 0"),
     (2.0**-128, "range"), (2.0**128, "range")],
)
def test_float_to_e8m0_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        float_to_e8m0(torch.tensor([1.0, bad], dtype=torch.float64))


# ---------------------------------------------------------------------------------------- MXFP4


def e2m1_half_step(a: np.ndarray) -> np.ndarray:
    """Half the E2M1 spacing around a magnitude a in [0, 6]: steps 0.5 on [0,2], 1 on [2,4], 2 on [4,6]."""
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))


def numpy_pow2_ceil_exponent(amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """The scale rule computed independently in float64: ceil(log2(amax/fmt_max)), zero -> -127."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / fmt_max))
    return np.where(amax > 0, np.maximum(e, -127), -127).astype(np.int64)


def random_weights(shape, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * magnitude
    w.view(-1, shape[-1])[0] = torch.randn(shape[-1], generator=g) ** 3 * magnitude  # heavy tail row
    return w


MX_CASES = [((64, 96), 1.0, 0), ((64, 96), 1e-3, 1), ((64, 96), 1e4, 2), ((3, 16, 64), 0.02, 3),
            ((5, 32), 1e-35, 4)]


@pytest.mark.parametrize("shape, magnitude, seed", MX_CASES)
def test_mxfp4_round_trip_vs_independent_rule(shape, magnitude, seed):
    w = random_weights(shape, magnitude, seed)
    packed, scale = mxfp4_quantize(w)
    n_groups = shape[-1] // 32
    assert packed.dtype == torch.int8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (*shape[:-1], n_groups)

    x = w.numpy().astype(np.float64).reshape(*shape[:-1], n_groups, 32)
    amax = np.abs(x).max(-1)
    e = numpy_pow2_ceil_exponent(amax, 6.0)
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy().astype(np.int64), e + 127)
    s = np.ldexp(1.0, e)[..., None]  # powers of two by construction of the expected bytes
    dec_scale = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(dec_scale[..., None], s)

    v = x / s  # exact: division by a power of two
    assert (np.abs(v) <= 6).all()  # no value clips
    unclamped = e > -127
    assert (amax[unclamped] / s[..., 0][unclamped] > 3).all()  # and the scale is the smallest that fits

    codes = unpack_e2m1(packed).numpy().reshape(v.shape)
    np.testing.assert_array_equal(codes, md_e2m1_codes(v.astype(np.float32)))

    deq = mxfp4_dequantize(packed, scale).numpy().astype(np.float64).reshape(x.shape)
    # Bound: no clipping, so rounding to nearest moves each element by at most half the E2M1 step at
    # its magnitude, in units of the scale: |deq - w| <= s * (0.25, 0.5, 1) for |w|/s in
    # ([0, 2], (2, 4], (4, 6]).
    assert (np.abs(deq - x) <= s * e2m1_half_step(np.abs(v))).all()
    assert (np.abs(deq) <= 6 * s).all()
    np.testing.assert_array_equal(np.abs(deq).max(-1), s[..., 0] * md_e2m1_codes(amax / s[..., 0]).view(
        ml_dtypes.float4_e2m1fn).astype(np.float64))


@pytest.mark.parametrize("shape, magnitude, seed", MX_CASES)
def test_mxfp4_requantize_is_idempotent(shape, magnitude, seed):
    w = random_weights(shape, magnitude, seed)
    p1, s1 = mxfp4_quantize(w)
    d1 = mxfp4_dequantize(p1, s1)
    p2, s2 = mxfp4_quantize(d1)
    assert torch.equal(mxfp4_dequantize(p2, s2), d1)  # values: exactly the same
    # Bytes: the same, except groups whose largest magnitude rounded to 3 (|w|/s in (3, 3.5]): for
    # those the ceil rule picks half the scale on requantization and every code's value doubles
    # (3 -> 6, 1.5 -> 3, ...). After that one step the bytes are a fixed point.
    c1, c2 = unpack_e2m1(p1), unpack_e2m1(p2)
    top = e2m1_to_float(c1).abs().reshape(*shape[:-1], -1, 32).amax(-1)
    halved = (top == 3) & (s1.view(torch.uint8) > 0)
    b1, b2 = s1.view(torch.uint8).to(torch.int32), s2.view(torch.uint8).to(torch.int32)
    assert torch.equal(b2, torch.where(halved, b1 - 1, b1))
    same = ~halved.repeat_interleave(32, dim=-1)
    assert torch.equal(c2[same], c1[same])
    p3, s3 = mxfp4_quantize(mxfp4_dequantize(p2, s2))
    assert torch.equal(p3, p2) and torch.equal(s3.view(torch.uint8), s2.view(torch.uint8))


def test_mxfp4_zero_and_tiny_groups_take_smallest_scale():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-1e-40, 1e-40, 32)  # float32 subnormals, amax/6 < 2**-127
    packed, scale = mxfp4_quantize(w)
    assert scale.view(torch.uint8).tolist() == [[0, 0], [0, 0]]
    assert torch.equal(mxfp4_dequantize(packed, scale)[0], torch.zeros(64))
    deq = mxfp4_dequantize(packed, scale, dtype=torch.float64)[1, 32:]
    assert ((deq - w[1, 32:].double()).abs() <= 0.25 * 2.0**-127).all()


def test_mxfp4_input_dtypes_and_output_dtype():
    w = random_weights((8, 64), 1.0, 7)
    p32, s32 = mxfp4_quantize(w)
    p16, s16 = mxfp4_quantize(w.to(torch.bfloat16))
    p_ref, s_ref = mxfp4_quantize(w.to(torch.bfloat16).float())
    assert torch.equal(p16, p_ref) and torch.equal(s16.view(torch.uint8), s_ref.view(torch.uint8))
    p64, s64 = mxfp4_quantize(w.double())
    assert torch.equal(p64, p32) and torch.equal(s64.view(torch.uint8), s32.view(torch.uint8))
    d = mxfp4_dequantize(p32, s32, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16
    assert torch.equal(d, mxfp4_dequantize(p32, s32).to(torch.bfloat16))


def test_mxfp4_errors():
    with pytest.raises(ValueError, match=r"K=40 must be a multiple of 32.*\(4, 40\)"):
        mxfp4_quantize(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="NaN or Inf"):
        mxfp4_quantize(torch.tensor([[math.nan] * 32]))
    packed, scale = mxfp4_quantize(torch.zeros(4, 64))
    with pytest.raises(ValueError, match=re.escape("scale (4, 1) does not fit packed (4, 32)")):
        mxfp4_dequantize(packed, scale[:, :1])


# ----------------------------------------------------------------------------------------- FP8


def e4m3_half_step(a: np.ndarray) -> np.ndarray:
    """Half the E4M3 spacing at magnitude a <= 448: 3 mantissa bits, so for a in [2**k, 2**(k+1)) the
    step is 2**(k-3) and half of it 2**(k-4); below 2**-6 (subnormals) the step is 2**-9."""
    with np.errstate(divide="ignore"):
        k = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.ldexp(1.0, (np.maximum(k, -6) - 4).astype(np.int64))


def numpy_block_amax(x: np.ndarray, block: int) -> np.ndarray:
    """Per-tile amax with plain loops over (possibly partial) tiles of the last two dims."""
    n, k = x.shape[-2:]
    nb_n, nb_k = -(-n // block), -(-k // block)
    out = np.zeros((*x.shape[:-2], nb_n, nb_k))
    for i in range(nb_n):
        for j in range(nb_k):
            tile = x[..., i * block:(i + 1) * block, j * block:(j + 1) * block]
            out[..., i, j] = np.abs(tile).max(axis=(-2, -1))
    return out


FP8_CASES = [((200, 300), 1.0, 0), ((200, 300), 1e-4, 1), ((128, 128), 3e3, 2), ((129, 257), 0.05, 3),
             ((1, 1), 2.0, 4), ((2, 130, 40), 1.0, 5)]


@pytest.mark.parametrize("shape, magnitude, seed", FP8_CASES)
def test_fp8_block_round_trip_vs_independent_rule(shape, magnitude, seed):
    w = random_weights(shape, magnitude, seed)
    w8, scale = fp8_block_quantize(w)
    n, k = shape[-2:]
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (*shape[:-2], -(-n // 128), -(-k // 128))

    x = w.numpy().astype(np.float64)
    amax = numpy_block_amax(x, 128)
    e = numpy_pow2_ceil_exponent(amax, 448.0)
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy().astype(np.int64), e + 127)
    s_tile = np.ldexp(1.0, e)
    s = np.repeat(np.repeat(s_tile, 128, axis=-2), 128, axis=-1)[..., :n, :k]
    np.testing.assert_array_equal(block_scale_expand(scale, n, k, 128).numpy(), s)

    v = x / s
    assert (np.abs(v) <= 448).all() and (amax / s_tile > 224).all()  # no clip; smallest such scale
    expected = v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(w8.view(torch.uint8).numpy(), expected)

    deq = fp8_block_dequantize(w8, scale).numpy().astype(np.float64)
    # Bound: no clipping, so |deq - w| <= s * half the E4M3 step at |w|/s (see e4m3_half_step).
    assert (np.abs(deq - x) <= s * e4m3_half_step(np.abs(v))).all()
    assert (np.abs(deq) <= 448 * s).all()


@pytest.mark.parametrize("shape, magnitude, seed", FP8_CASES)
def test_fp8_block_requantize_is_idempotent(shape, magnitude, seed):
    w = random_weights(shape, magnitude, seed)
    q1, s1 = fp8_block_quantize(w)
    d1 = fp8_block_dequantize(q1, s1)
    q2, s2 = fp8_block_quantize(d1)
    assert torch.equal(fp8_block_dequantize(q2, s2), d1)
    # As for MXFP4: a tile whose largest value rounded to 224 (half of 448) gets half the scale on
    # requantization (its bytes change, values do not); one step later the bytes are a fixed point.
    n, k = shape[-2:]
    top = torch.from_numpy(numpy_block_amax(q1.to(torch.float64).numpy(), 128))
    halved = top == 224
    b1, b2 = s1.view(torch.uint8).to(torch.int32), s2.view(torch.uint8).to(torch.int32)
    assert torch.equal(b2, torch.where(halved, b1 - 1, b1))
    same = block_scale_expand((~halved).float(), n, k, 128).bool()
    assert torch.equal(q2.view(torch.uint8)[same], q1.view(torch.uint8)[same])
    q3, s3 = fp8_block_quantize(fp8_block_dequantize(q2, s2))
    assert torch.equal(q3.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s3.view(torch.uint8), s2.view(torch.uint8))


def test_fp8_float64_input_rounds_once():
    # torch (2.13) and ml_dtypes cast float64 -> float8 through float32: 1 + 2**-4 + 2**-30 becomes the
    # midpoint 1 + 2**-4 and ties down to 1.0. Correct rounding of the float64 value is 1.125.
    w = torch.tensor([[448.0, 1 + 2**-4 + 2**-30]], dtype=torch.float64)
    w8, scale = fp8_block_quantize(w)
    assert scale.view(torch.uint8).item() == 127
    assert w8.to(torch.float32).tolist() == [[448.0, 1.125]]


def test_fp8_zero_block_and_output_dtype():
    w = torch.zeros(130, 10)
    w[128:] = 1.0
    w8, scale = fp8_block_quantize(w)
    assert scale.view(torch.uint8).tolist() == [[0], [127 - 8]]  # zero tile: 2**-127; ones: 2**-8
    d = fp8_block_dequantize(w8, scale, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and torch.equal(d.float(), w)


def test_fp8_errors():
    w8, scale = fp8_block_quantize(torch.zeros(200, 300))
    with pytest.raises(ValueError, match=re.escape("scale grid (2, 2) does not fit weight (200, 300)")):
        fp8_block_dequantize(w8, scale[:, :2])
    with pytest.raises(ValueError, match=re.escape("expected (..., 2, 3)")):
        block_scale_expand(scale[:1], 200, 300, 128)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8_block_quantize(torch.full((2, 2), math.inf))


def test_requantize_halves_scale_when_top_rounds_to_half_max_by_hand():
    # MXFP4: amax 3.2 -> scale 1, 3.2 rounds to 3; requantizing 3 gives scale 0.5 and code 6.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 3.2, 1.0
    p1, s1 = mxfp4_quantize(w)
    p2, s2 = mxfp4_quantize(mxfp4_dequantize(p1, s1))
    assert (s1.view(torch.uint8).item(), s2.view(torch.uint8).item()) == (127, 126)
    assert unpack_e2m1(p1)[0, :2].tolist() == [5, 2] and unpack_e2m1(p2)[0, :2].tolist() == [7, 4]
    # FP8: amax 225 -> scale 1, 225 rounds to 224; requantizing gives scale 0.5 and 448.
    w = torch.tensor([[225.0, 1.0]])
    q1, t1 = fp8_block_quantize(w)
    q2, t2 = fp8_block_quantize(fp8_block_dequantize(q1, t1))
    assert (t1.view(torch.uint8).item(), t2.view(torch.uint8).item()) == (127, 126)
    assert q1.float().tolist() == [[224.0, 1.0]] and q2.float().tolist() == [[448.0, 2.0]]


def test_block_scale_expand_keeps_rows_and_columns_apart():
    """A square grid of distinct block scales (2 x 2 blocks, 3 x 3 with partial edges): each element gets its own
    block's scale, so a transposed grid (which a non-square grid would also refuse, a square one would not) fails."""
    for n, k in ((256, 256), (300, 260)):
        nb_n, nb_k = -(-n // 128), -(-k // 128)
        scale = torch.arange(nb_n * nb_k, dtype=torch.float32).reshape(nb_n, nb_k) + 1
        got = block_scale_expand(scale, n, k)
        rows, cols = torch.arange(n)[:, None] // 128, torch.arange(k)[None, :] // 128
        assert got.shape == (n, k) and torch.equal(got, rows * nb_k + cols + 1.0)
