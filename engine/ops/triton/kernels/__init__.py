"""Triton kernels for the V4 ops, one module a family; launchers live in `ops/triton/__init__.py`, the ISA compile
specs in `specs.py`.

Portability rules kept here (DESIGN.md sections 4 and 6):
- gfx90a has no FP8/FP4 units: E4M3 and E2M1 are decoded in registers with integer bit ops. A code's
  sign/exponent/mantissa bits are shifted into an fp32 (or, for the uint32-word decode, two fp16) bit
  pattern whose value is the code's value times a power of two (small codes land on subnormals, which
  both targets keep: the ISA tier checks the denormal mode), and one exact multiply restores the value.
  The operand handed to a matrix unit is then a normal number (MI200 MFMA flushes fp16/bf16 subnormals).
  Attention's softmax weights (<= 1) enter its fp16 dot times 2^15, so weights down to 2^-29 stay fp16
  normals (tests/test_triton_kernels.py emulates the flush: unscaled, a row with 15% of its mass in subnormal
  weights came out 29% off). Not covered: fp16 activations under 2^-14 and fp16 MoE weights (code x scale)
  under 2^-14 flush on MI200 (an activation's or a block's own size of error; bf16's subnormals, the GPU
  default's, lie below 2^-126).
- Every dot and reduction accumulates in fp32; fp32 operands use `input_precision="ieee"` (no tf32).
- No lane-count literal: block sizes are constexpr and Triton maps them onto num_warps x 32 (CUDA) or
  num_warps x 64 (gfx90a) lanes.
- Deterministic: no float atomics; split work is combined in a fixed order (`_split_sum` counts arrivals with
  integer atomics, and the last split adds all partials in split order). On gfx90a a split tile's partials must
  be stored by one wavefront: the barrier before the counter does not wait for other wavefronts' stores there.
  The launchers refuse tiles of more than 64 values on ROCm, a proxy (Triton 3.9 stores the default tiles, of 8
  to 64 values, from the first wavefront: checked in their AMDGCN).
"""

from __future__ import annotations

from .attention import (
    attention_combine_kernel,
    attention_kernel,
    compress_finish_kernel,
    compress_pool_kernel,
    index_scores_kernel,
)
from .base import PDL_AVAILABLE
from .dense import dense_gemv_kernel, dense_mma_kernel
from .fp8 import fp8_stream_kernel, matmul_kernel
from .mhc import hc_mix_dot_kernel, hc_mix_partial_kernel, hc_post_kernel, hc_pre_kernel
from .mma import (
    fp8_mma_kernel,
    moe_mma_down_kernel,
    moe_mma_gate_up_kernel,
    moe_mma_one_kernel,
    moe_mma_one_sum_kernel,
)
from .moe import moe_down_kernel, moe_gate_up_kernel, moe_pair_rows_kernel, moe_sum_kernel, swiglu_kernel
from .norm_rope import rms_norm_kernel, rope_cos_sin_kernel, rope_kernel
from .specs import ISA_SPECS, ISA_SPECS_SM90
from .topk import route_kernel, topk_kernel, topk_sort_kernel

__all__ = [
    "ISA_SPECS", "ISA_SPECS_SM90", "PDL_AVAILABLE",
    "attention_combine_kernel", "attention_kernel", "compress_finish_kernel", "compress_pool_kernel",
    "dense_gemv_kernel", "dense_mma_kernel", "fp8_mma_kernel", "fp8_stream_kernel", "hc_mix_dot_kernel",
    "hc_mix_partial_kernel", "hc_post_kernel", "hc_pre_kernel", "index_scores_kernel", "matmul_kernel",
    "moe_down_kernel", "moe_gate_up_kernel", "moe_mma_down_kernel", "moe_mma_gate_up_kernel", "moe_mma_one_kernel",
    "moe_mma_one_sum_kernel", "moe_pair_rows_kernel",
    "moe_sum_kernel", "rms_norm_kernel", "rope_cos_sin_kernel", "rope_kernel", "route_kernel", "swiglu_kernel",
    "topk_kernel", "topk_sort_kernel",
]
