"""What several kernel families share: the E8M0 / E4M3 / E2M1 bit decodes (gfx90a has no FP8 or FP4
units), the in-launch deterministic split-K sum, and the programmatic-dependent-launch intrinsics (sm_90)."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90): Triton 3.5+ (3.4's helpers do not compile; the backend refuses < 3.5)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton (the backend refuses it; the ISA audit still compiles the rest)
    gdc_launch_dependents = gdc_wait = None
PDL_AVAILABLE = gdc_wait is not None

# fp32 bits of the UE8M0 scale are (s << 23) (s = 0 maps to 0.0, not 2^-127; s = 255 is NaN in UE8M0).


@triton.jit
def _e8m0(s_u8, EXTRA: tl.constexpr):
    """UE8M0 byte -> fp32 2^(s - 127 + EXTRA) by placing s + EXTRA in the fp32 exponent field."""
    e = s_u8.to(tl.int32) + EXTRA
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f32(b_u8):
    """E4M3 byte -> its exact fp32 value: bits s|eeee|mmm placed at 31|26..23|22..20 give value * 2^-120
    (e = 0 codes land on fp32 subnormals, which both targets keep), times 2^120 (exact)."""
    b = b_u8.to(tl.uint32)
    f = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return f * 1.329227995784916e36  # 2^120


@triton.jit
def _e2m1_f32(c):
    """E2M1 code (low 4 bits of a uint32) -> its exact fp32 value: bits s|ee|m at 31|24..23|22 give
    value * 2^-126 (the +-0.5 codes are fp32 subnormals), times 2^126."""
    f = (((c & 0x7) << 22) | ((c & 0x8) << 28)).to(tl.float32, bitcast=True)
    return f * 8.507059173023462e37  # 2^126



@triton.jit
def _split_sum(y, part_at, out_at, ok, split, n_split, part_stride, lock_at, add_at, HAS_ADD: tl.constexpr,
               SPLITP: tl.constexpr):
    """Split-K without a second launch, still deterministic: every split stores its fp32 partial (y and the
    pointers 1-D), then counts itself in on the tile's lock (integer atomic, acq_rel); the last to arrive,
    whichever it is, loads all n_split (<= SPLITP, a power of two) partials at once and adds them by one fixed
    tree (then add_at's values when HAS_ADD), writes the result and resets the lock for the next launch (or
    replay). One load of every partial, not one per split: summed in a loop, each split's L2 round trip waited
    for the add before it (n_split x ~0.4 us on the H200). The barrier orders all threads' partial stores before
    the release (the usual semaphore pattern)."""
    tl.store(part_at + split * part_stride, y, mask=ok)
    tl.debug_barrier()
    if tl.atomic_add(lock_at, 1, sem="acq_rel") == n_split - 1:
        j = tl.arange(0, SPLITP)
        parts = tl.load(part_at[None, :] + j[:, None] * part_stride, mask=(j < n_split)[:, None] & ok[None, :],
                        other=0.0)
        tot = tl.sum(parts, axis=0)
        if HAS_ADD:
            tot += tl.load(add_at, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_at, tot.to(out_at.dtype.element_ty), mask=ok)
        tl.atomic_xchg(lock_at, 0)
