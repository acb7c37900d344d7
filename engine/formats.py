"""Number formats of DeepSeek-V4 checkpoints: E2M1 (MXFP4), E4M3 (+ FNUZ) and UE8M0 block scales.

Plain torch on any device, so the reference path and the suite can decode packed weights without a
GPU and without numpy. Every function here is checked against independent decoders (ml_dtypes and
torch's own float8 dtypes) in tests/test_formats.py.

Layouts (DESIGN.md section 3):
- MXFP4 routed experts: ``int8 [..., N, K/2]``, element 2j in the low nibble and 2j+1 in the high
  nibble, with a ``float8_e8m0fnu [..., N, K/32]`` scale (one per 32 values along K).
- FP8 linears: ``float8_e4m3fn [N, K]`` with a ``float8_e8m0fnu [ceil(N/128), ceil(K/128)]`` scale.

Scale rule for both quantizers: ``scale = 2**ceil(log2(amax / fmt_max))``, the smallest power of two
that lets the group's largest magnitude fit without clipping (DeepSeek's ue8m0 quantizers round the
scale up the same way). No value clips, so each element's error is at most half a format step at its
magnitude, times the scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "MXFP4_GROUP",
    "FP8_BLOCK",
    "e2m1_to_float",
    "float_to_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "e8m0_to_float",
    "float_to_e8m0",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "fp8_block_quantize",
    "fp8_block_dequantize",
    "e4m3fn_to_e4m3fnuz",
    "block_scale_expand",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
MXFP4_GROUP = 32
FP8_BLOCK = 128

# E8M0 exponent range: byte b is 2**(b - 127); 255 is NaN, so usable exponents are -127..127.
_E8M0_BIAS = 127
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

# Non-negative E2M1 values, indexed by the 3 magnitude bits (exponent 2 bits, mantissa 1 bit).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoint i lies between magnitude codes i and i+1. A tie rounds to the even code (mantissa bit 0),
# i.e. up when i+1 is even: midpoints 0.75, 1.75, 3.5 round up, 0.25, 1.25, 2.5, 5.0 round down.
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_E2M1_MAGNITUDES[:-1], _E2M1_MAGNITUDES[1:], strict=True))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (no double rounding through float32); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_finite(x: Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: input has NaN or Inf; the format has neither (refusing to guess a code)")


# --------------------------------------------------------------------------------------------- E2M1


def e2m1_to_float(codes: Tensor) -> Tensor:
    """Decode E2M1 codes (0..15, bit 3 = sign) to float32; code 8 decodes to -0.0."""
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"e2m1_to_float: codes must be an integer tensor, got {codes.dtype}")
    c = codes.to(torch.int64)
    if c.numel() and bool(((c < 0) | (c > 15)).any()):
        raise ValueError("e2m1_to_float: codes must lie in 0..15 (one nibble each); unpack bytes first")
    lut = torch.tensor(_E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES), device=codes.device)
    return lut[c]


def float_to_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest E2M1 code (ties to even mantissa), saturating at +-6; returns uint8 codes.

    Why each choice: round-to-nearest-even is what hardware and ml_dtypes do, so codes match bit for
    bit; saturation (not NaN) because E2M1 has no NaN/Inf. The sign bit is always kept, so -0.0 and
    negative values that round to zero give code 8 (negative zero), as an IEEE cast would.
    Non-finite input raises ValueError: NaN has no E2M1 code, and silently mapping it to 0 or 6 would
    hide corrupt weights. float64 input is rounded in float64 (casting through float32 first could
    round a value just off a midpoint onto it and then the wrong way).
    """
    _check_finite(x, "float_to_e2m1")
    xf = x.to(_compute_dtype(x.dtype))
    a = xf.abs()
    mag = torch.zeros(xf.shape, dtype=torch.uint8, device=xf.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = a >= mid if (i + 1) % 2 == 0 else a > mid
        mag += up.to(torch.uint8)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    return mag | sign


def pack_e2m1(codes: Tensor) -> Tensor:
    """Pack E2M1 codes [..., K] two a byte into int8 [..., K/2]: element 2j low nibble, 2j+1 high.

    int8 because that is the dtype the official checkpoint stores (the bytes are the same as torch's
    float4_e2m1fn_x2, which packs the even element into the low nibble too).
    """
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"pack_e2m1: codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("pack_e2m1: codes must have at least one dimension")
    k = codes.shape[-1]
    if k % 2:
        raise ValueError(
            f"pack_e2m1: last dim K={k} must be even (two codes a byte); shape {tuple(codes.shape)}"
        )
    if codes.numel() and bool(((codes < 0) | (codes > 15)).any()):
        raise ValueError("pack_e2m1: codes must lie in 0..15")
    c = codes.to(torch.uint8)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.view(torch.int8)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Unpack int8/uint8 bytes [..., K/2] into E2M1 codes uint8 [..., K] (inverse of pack_e2m1)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_e2m1: packed must be int8 or uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_e2m1: packed must have at least one dimension")
    p = packed.view(torch.uint8)
    codes = torch.stack((p & 0x0F, p >> 4), dim=-1)
    return codes.reshape(*p.shape[:-1], p.shape[-1] * 2)


# --------------------------------------------------------------------------------------------- E8M0


def _e8m0_bytes(scale: Tensor) -> Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise ValueError(f"expected a float8_e8m0fnu or uint8 scale, got {scale.dtype}")


def e8m0_to_float(scale: Tensor) -> Tensor:
    """Decode E8M0 scales (float8_e8m0fnu or raw uint8 bytes) to float32: 2**(byte-127), 255 is NaN.

    Built from the bits rather than through torch's cast, so it also runs on devices whose torch
    build lacks float8_e8m0fnu kernels. Byte 0 (2**-127) is a float32 subnormal.
    """
    b = _e8m0_bytes(scale).to(torch.int32)
    bits = b << 23  # biased exponent straight into float32's exponent field (same bias, 127)
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)  # 2**-127: subnormal
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


def _exponent_to_e8m0(exp: Tensor) -> Tensor:
    """Integer exponents (already range-checked) to float8_e8m0fnu."""
    return (exp.to(torch.int32) + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def float_to_e8m0(x: Tensor) -> Tensor:
    """Encode positive powers of two 2**-127..2**127 exactly as float8_e8m0fnu.

    Anything else raises ValueError instead of rounding: a scale that is not a power of two means the
    caller computed it wrongly, and rounding it would silently change every value it scales.
    """
    if not x.is_floating_point():
        raise ValueError(f"float_to_e8m0: expected a floating tensor, got {x.dtype}")
    xf = x.to(_compute_dtype(x.dtype))
    if not bool((torch.isfinite(xf) & (xf > 0)).all()):
        raise ValueError("float_to_e8m0: scales must be finite and > 0 (E8M0 has no zero or sign)")
    mant, exp = torch.frexp(xf)  # x = mant * 2**exp, mant in [0.5, 1)
    if not bool((mant == 0.5).all()):
        bad = xf[mant != 0.5].flatten()[:4].tolist()
        raise ValueError(f"float_to_e8m0: scales must be powers of two, got e.g. {bad}")
    e = exp.to(torch.int32) - 1
    if not bool(((e >= _E8M0_MIN_EXP) & (e <= _E8M0_MAX_EXP)).all()):
        raise ValueError("float_to_e8m0: scale outside E8M0's range 2**-127..2**127")
    return _exponent_to_e8m0(e)


def _pow2(e: Tensor, dtype: torch.dtype) -> Tensor:
    """Exact 2**e (integer tensor e, normal range of dtype) built from the exponent bits.

    Bits rather than exp2/ldexp, whose exactness depends on the device's math library.
    """
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _ceil_pow2_exponent(amax: Tensor, fmt_max: float, what: str) -> Tensor:
    """Smallest integer e with amax <= fmt_max * 2**e, clamped below to E8M0's 2**-127.

    Exact integer arithmetic on frexp's parts (no log2 rounding): with amax = m * 2**p and
    fmt_max = f * 2**q (m, f in [0.5, 1)), m/f lies in (1/2, 1] when m <= f, so e = p - q,
    and in (1, 2) otherwise, so e = p - q + 1. An all-zero group takes the clamp.
    """
    m, p = torch.frexp(amax)
    f, q = torch.frexp(torch.tensor(fmt_max, dtype=torch.float64))
    e = p.to(torch.int32) - int(q) + (m > float(f)).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, _E8M0_MIN_EXP)).clamp(min=_E8M0_MIN_EXP)
    if e.numel() and bool((e > _E8M0_MAX_EXP).any()):
        raise ValueError(f"{what}: |w| too large for an E8M0 scale (needs 2**{int(e.max())} > 2**127)")
    return e


# -------------------------------------------------------------------------------------------- MXFP4


def mxfp4_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize w [..., N, K] to MXFP4: packed int8 [..., N, K/2] and float8_e8m0fnu [..., N, K/32].

    Scale per 32 values along K: ``2**ceil(log2(amax / 6))``, the no-clip power-of-two ceiling that
    DeepSeek's ue8m0 quantizers use. Because ``amax / scale <= 6`` no value saturates, and each
    element's error is at most half an E2M1 step at its magnitude times the scale (0.25, 0.5 or 1 times
    the scale for |w|/scale in [0,2], (2,4], (4,6]). OCP's MX spec instead takes
    ``2**(floor(log2 amax) - 2)``: the same scale when amax's significand is <= 1.5, half of it above
    (then the top of the group lands in (6, 8) and clips to 6), so its error is not bounded by the
    rounding step; in exchange the small values of such groups get one more binade of resolution.
    An all-zero group (or one whose amax/6 is below 2**-127) gets the smallest E8M0 scale, 2**-127
    (byte 0): the limit of the rule as amax goes to 0, and it decodes to exact zeros whatever the scale.
    """
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(
            f"mxfp4_quantize: expected a floating tensor [..., N, K], got {w.dtype} {tuple(w.shape)}"
        )
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(
            f"mxfp4_quantize: K={k} must be a multiple of {MXFP4_GROUP} (one scale per 32 along K); "
            f"shape {tuple(w.shape)}"
        )
    _check_finite(w, "mxfp4_quantize")
    g = w.to(_compute_dtype(w.dtype)).reshape(*w.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    e = _ceil_pow2_exponent(g.abs().amax(dim=-1), E2M1_MAX, "mxfp4_quantize")
    scaled = g * _pow2(-e, g.dtype).unsqueeze(-1)  # exact: a power of two (-e <= 127 is normal)
    codes = float_to_e2m1(scaled).reshape(w.shape)
    return pack_e2m1(codes), _exponent_to_e8m0(e)


def mxfp4_dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode MXFP4 (int8 [..., N, K/2] + float8_e8m0fnu [..., N, K/32]) to dtype [..., N, K].

    Value times scale is exact in float32 (a 2-bit significand times a power of two), so the only
    rounding is the final cast to dtype.
    """
    if packed.dim() < 1 or tuple(scale.shape[:-1]) != tuple(packed.shape[:-1]) or (
        scale.shape[-1] * MXFP4_GROUP != packed.shape[-1] * 2
    ):
        raise ValueError(
            f"mxfp4_dequantize: scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}: "
            f"expected scale {(*packed.shape[:-1], packed.shape[-1] * 2 // MXFP4_GROUP)}"
        )
    cd = _compute_dtype(dtype)
    vals = e2m1_to_float(unpack_e2m1(packed)).to(cd)
    k = vals.shape[-1]
    g = vals.reshape(*vals.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    s = e8m0_to_float(scale).to(cd).unsqueeze(-1)
    return (g * s).reshape(vals.shape).to(dtype)


# ------------------------------------------------------------------------------------- FP8 (E4M3)


def block_scale_expand(scale: Tensor, n: int, k: int, block: int = FP8_BLOCK) -> Tensor:
    """Expand a per-block scale [..., nb_n, nb_k] to float32 [..., n, k] (repeat each block, crop edges).

    Accepts float8_e8m0fnu/uint8 (decoded by e8m0_to_float) or an already-float scale.
    """
    nb = (-(-n // block), -(-k // block))
    if scale.dim() < 2 or tuple(scale.shape[-2:]) != nb:
        raise ValueError(
            f"block_scale_expand: scale grid {tuple(scale.shape)} does not fit a weight of ({n}, {k}) "
            f"in {block}x{block} blocks: expected (..., {nb[0]}, {nb[1]})"
        )
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        s = e8m0_to_float(scale)
    else:
        s = scale.to(torch.float32)
    s = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :n, :k]


def _round_to_e4m3_grid(v: Tensor) -> Tensor:
    """Round to the nearest E4M3 value (ties to even) in v's own dtype; |v| must be <= 448.

    Done by hand rather than by torch's cast because torch (2.13) casts float64 to float8 through
    float32, which double-rounds values just off a midpoint; the result here is exactly representable.
    """
    _, exp = torch.frexp(v)  # |v| in [2**(exp-1), 2**exp)
    # Step between E4M3 neighbours: 2**(exp-1-3) for normals, 2**-9 for subnormals (|v| < 2**-6).
    step_exp = (exp - 4).clamp(min=-9)
    return torch.round(v * _pow2(-step_exp, v.dtype)) * _pow2(step_exp, v.dtype)  # round: half to even


def fp8_block_quantize(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize w [..., N, K] to float8_e4m3fn [..., N, K] with float8_e8m0fnu [..., ceil(N/b), ceil(K/b)].

    Scale per block x block tile (edge tiles may be partial): ``2**ceil(log2(amax / 448))``, the same
    no-clip power-of-two ceiling as mxfp4_quantize, so every element's error is at most half an E4M3
    step at its magnitude times the scale. Rounding is to nearest, ties to even.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(
            f"fp8_block_quantize: expected a floating tensor [..., N, K], got {w.dtype} {tuple(w.shape)}"
        )
    if block < 1:
        raise ValueError(f"fp8_block_quantize: block must be >= 1, got {block}")
    _check_finite(w, "fp8_block_quantize")
    n, k = w.shape[-2:]
    nb_n, nb_k = -(-n // block), -(-k // block)
    wf = w.to(_compute_dtype(w.dtype))
    padded = torch.nn.functional.pad(wf.abs(), (0, nb_k * block - k, 0, nb_n * block - n))
    tiles = padded.reshape(*w.shape[:-2], nb_n, block, nb_k, block)
    e = _ceil_pow2_exponent(tiles.amax(dim=(-3, -1)), E4M3_MAX, "fp8_block_quantize")
    inv = block_scale_expand(_pow2(-e, wf.dtype), n, k, block).to(wf.dtype)
    scaled = wf * inv  # exact: a power of two
    w8 = _round_to_e4m3_grid(scaled).to(torch.float8_e4m3fn)
    return w8, _exponent_to_e8m0(e)


def fp8_block_dequantize(
    w8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> Tensor:
    """Decode float8 (e4m3fn or e4m3fnuz) [..., N, K] times its block scale to dtype [..., N, K]."""
    if w8.dim() < 2:
        raise ValueError(f"fp8_block_dequantize: expected [..., N, K], got shape {tuple(w8.shape)}")
    n, k = w8.shape[-2:]
    nb = (*w8.shape[:-2], -(-n // block), -(-k // block))
    if tuple(scale.shape) != nb:
        raise ValueError(
            f"fp8_block_dequantize: scale grid {tuple(scale.shape)} does not fit weight {tuple(w8.shape)} "
            f"in {block}x{block} blocks: expected {nb}"
        )
    cd = _compute_dtype(dtype)
    s = block_scale_expand(scale, n, k, block).to(cd)
    return (w8.to(cd) * s).to(dtype)


def e4m3fn_to_e4m3fnuz(w8: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Reinterpret OCP float8_e4m3fn bytes as float8_e4m3fnuz for MI300 (CDNA3); returns the scale doubled.

    MI300's (gfx942) FP8 hardware uses the FNUZ variant: exponent bias 8 instead of 7, so the same bit
    pattern means half the value and the scale doubles to compensate (returned as float32, since the
    doubled 2**127 would not fit E8M0). FNUZ has no negative zero: its 0x80 is the only NaN, so fn's
    -0.0 (0x80) becomes 0x00, and fn's NaNs (0x7F, 0xFF) become 0x80 so a NaN stays a NaN instead of
    turning into +-240. CDNA2 (MI250, gfx90a) has no FP8 at all: there, decode fn bytes in registers.
    """
    if w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3fn_to_e4m3fnuz: expected float8_e4m3fn, got {w8.dtype}")
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        if scale.numel() and bool((_e8m0_bytes(scale) == 254).any()):
            raise ValueError("e4m3fn_to_e4m3fnuz: a scale of 2**127 cannot be doubled in float32")
        s = e8m0_to_float(scale)
    else:
        s = scale.to(torch.float32)
    b = w8.view(torch.uint8)
    is_nan = (b & 0x7F) == 0x7F
    b = torch.where(b == 0x80, torch.zeros_like(b), b)
    b = torch.where(is_nan, torch.full_like(b, 0x80), b)
    return b.view(torch.float8_e4m3fnuz), s * 2
