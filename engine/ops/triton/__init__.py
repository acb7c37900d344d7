"""Triton backend of the ops interface (gfx90a wave64, Hopper, and the CPU through Triton's interpreter).

Each public function has the name and signature of its `reference` twin. Tensors on a GPU run the
compiled kernels; CPU tensors run the same kernel source in Triton's interpreter (a second copy of
the `kernels` package decorated with TRITON_INTERPRET=1, so one process can hold both: the interpreter decides
at decoration time, and the ISA tier needs the compiled copy). The interpreter cannot run bf16
tensors (DESIGN.md section 7), so on the CPU bf16 inputs go to the reference op, as does float64
(the kernels accumulate in fp32). `topk` runs k passes for the router's small k (a device sort of 256
values took 21 us on the H200) and one in-register sort for the indexer's k on rows up to TOPK_MAX_WIDTH;
longer rows take the reference's stable sort.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import torch

from ...streams import BRANCHES, stream_key
from .. import QWeight, version_tuple
from .. import reference as _ref
from . import kernels as _compiled
from .mma_layout import interleave_rows, mma_repack

_INTERP: ModuleType | None = None


_AS_INTERPRETED: dict[int, object] = {}


def _jit_call_interpreted(self, *args, **kwargs):
    """JITFunction.__call__ inside `_interpreting`: triton.language's own @jit helpers (tl.sum, tl.zeros, ...)
    were decorated when triton was imported, normally without TRITON_INTERPRET; run them interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = _AS_INTERPRETED.get(id(self))
    if fn is None:
        fn = _AS_INTERPRETED[id(self)] = InterpretedFunction(self.fn)
    return fn.rewrite()(*args, **kwargs)


def _helper_call_interpreted(self, *args, **kwargs):
    """InterpretedFunction.__call__ (the package's own @jit helpers) inside `_interpreting`, without Triton's
    re-patching of the language at every call. (Triton's also wraps a helper's error in InterpreterError; the
    launch still wraps it once.)"""
    return self.rewrite()(*args, **kwargs)


@contextlib.contextmanager
def _interpreting():
    """One interpreted launch's setting, undone after it, so later compiles in this process (the ISA tier) see the
    real language: the interpreter's patches of triton.language and triton.language.core made once, and nested
    @jit calls run interpreted under them. Triton makes those patches at every call of an interpreted helper,
    and _jit_call_interpreted made and undid them at every call of triton.language's helpers: 250K calls of
    _patch_builtin (inspect.getmembers over a module) in a 40-token prefill, 44% of its time (bench/NOTES.md
    entry 194)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    old = JITFunction.__call__, InterpretedFunction.__call__
    scope = _patch_lang(SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    JITFunction.__call__, InterpretedFunction.__call__ = _jit_call_interpreted, _helper_call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__, InterpretedFunction.__call__ = old
        scope.restore()


@contextlib.contextmanager
def _interpret_env():
    """TRITON_INTERPRET=1 (read by @triton.jit at decoration time, and by the interpreter)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _interpreter_check(triton_version: str, numpy_version: str) -> None:
    """Triton's CPU interpreter before 3.7 turns a runtime int argument (a 1-element array) into a Python int by
    int(array), which NumPy 2.4 refuses: every kernel with a loop over a runtime bound fails (seen with Triton
    3.6.0 and NumPy 2.4.6; 3.6 with NumPy 2.3 and 3.7+ with 2.4 work)."""
    if version_tuple(triton_version) < (3, 7) and version_tuple(numpy_version) >= (2, 4):
        raise RuntimeError(f"Triton {triton_version}'s CPU interpreter cannot run with NumPy {numpy_version} (int() "
                           "of a 1-element array): pip install 'numpy<2.4' or 'triton>=3.7'")


def load_kernels(folder: str, name: str) -> ModuleType:
    """A kernels package (folder: its directory, as engine/ops/triton/kernels) loaded afresh as `name`, its modules
    with it: a second copy whose @triton.jit functions are decorated under the environment of the moment (the
    interpreter's copy; bench/probe_attention.py's older kernels beside the current ones)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _interpreted() -> ModuleType:
    """The kernels package loaded a second time with every @triton.jit turned into an interpreted function."""
    global _INTERP
    if _INTERP is None:
        import numpy
        import triton

        _interpreter_check(triton.__version__, numpy.__version__)
        with _interpret_env():
            _INTERP = load_kernels(os.path.dirname(_compiled.__file__), __name__ + "._kernels_interp")
    return _INTERP


# Compile options every launch (and the ISA tier's audit) passes. FMA contraction is pinned on: the kernels were tuned
# and validated with a*b+c as one FMA (the MXFP4 stream's split adds count on it), and Triton 3.10 turns the default
# off (3.9 warns that TRITON_DEFAULT_FP_FUSION is unset).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


class _Launch:
    """kernel[grid](...) against the compiled or the interpreted copy, chosen by the tensors' device."""

    def __init__(self, t: torch.Tensor):
        self.cpu = t.device.type == "cpu"
        self.mod = _interpreted() if self.cpu else _compiled

    def __call__(self, name: str, grid: tuple[int, ...], *args, **kwargs) -> None:
        fn = getattr(self.mod, name)
        kwargs = {**COMPILE_OPTIONS, **kwargs}
        if self.cpu:
            with _interpret_env(), _interpreting():
                fn[grid](*args, **kwargs)
        else:
            fn[grid](*args, **kwargs)


def _use_reference(*ts: torch.Tensor) -> bool:
    """float64 always, and bf16 on the CPU (the interpreter computes garbage for bf16)."""
    return any(_reference_dtype(t.dtype, t.device) for t in ts)


def _reference_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float64 or (device.type == "cpu" and dtype == torch.bfloat16)


POISON = False  # tests set this: every buffer a kernel writes starts as NaN (integers: their minimum), so an
# unwritten element shows


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if not POISON:
        return out
    if dtype == torch.bool:  # a mask: every unwritten entry reads as picked
        return out.fill_(True)
    return out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(dtype).min)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _packed(t: torch.Tensor, words: bool) -> torch.Tensor:
    """Packed E2M1 bytes as uint8, or as int32 words of 8 codes (K/2 is a multiple of 16 for MXFP4)."""
    return t.contiguous().view(torch.int32 if words else torch.uint8)


# ----------------------------------------------------------------------------------------------------
# FP8 linear

# Device tiles (tuned on the H200 by bench/bench_kernels.py; the CPU interpreter uses its own small ones).
# FP8_DOT: many tokens (a prefill) on tl.dot, BLOCK_M rows of x a program: 16, 32 or 64 by the rows, and on CUDA
# BLOCK_M_CUDA beyond 64 (each program decodes its weight tile once for more rows). The H200 (bench/
# probe_fp8_prefill.py, NOTES runs 148-149), the slice's 7 FP8 weights at 1024 / 4096 tokens: 1617 / 6050 us at
# 64 x 128 x 128 -> 1189 / 4466 us at 128 x 128 x 64 (165-197 -> 235-267 TFLOP/s). On gfx90a, BLOCK_M stays 64
# (untuned there; BLOCK_K 64 halves the tile's LDS from run 134's 64 KiB). The hardware E4M3 conversion was slower
# than the bit decode in this kernel (409 against 382 us on wq_b at 1024 tokens). With the block scales applied in
# the decode (run 169): 1183 / 4445 -> 945 / 3190 us (335-380 TFLOP/s at 4096 tokens); with that, the decoded tile
# as wgmma's register operand (acc^T = tile @ x^T, the MoE dots' SWAP), 128-wide K steps, 256-wide row tiles or 4
# stages were no faster.
FP8_DOT = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "BLOCK_M_CUDA": 128}
# x dtypes whose tile folds the block scales into the decoded weight (matmul_kernel FOLD): bf16 only. fp16's range
# cannot hold every E4M3 value times its scale; fp32's folded dot is one FMA chain over all of K, 3.6-6.5x further
# from float64 on the H200 than the step-scaled two-level sum (NOTES run 180). Tests add fp32 to run the folded form
# in the interpreter (no bf16 there).
FOLD_DTYPES = (torch.bfloat16,)
MIN_PROGRAMS = 264  # two per H200 SM: below this, launches narrow their row tiles or split K
# Tokens padded to 16-, 32-, 64- or 128-row blocks (`moe_prepare`). The H200 (bench/probe_moe_prefill.py, NOTES runs
# 144-153), gate/up + down ms at 256 / 1024 / 4096 tokens: 3.32 / 4.45 / 10.23 at 4 gate/up stages and 64 down
# columns a program -> 3.01 / 3.70 / 9.57 at 3 stages and 128 columns (runs 144-145; 2.80 / 3.55 / 9.29 in run 152);
# SWAP (acc^T = decoded tile @ x^T: on sm_90 the tile becomes wgmma's register operand instead of mma.sync's) and
# 8-warp down programs -> 2.77 / 3.23 / 7.51 (runs 152-153); 128-row blocks beyond 64 pairs an expert (V4-Flash: from
# 2731 tokens; unmeasured between there and 4096) -> 6.41 at 4096 (8192: 13.0 -> 12.4; at 1024 tokens they take
# 3.64 ms for gate/up against 2.05 at 32 rows).
MOE_DOT = {"BLOCK_N": 64, "GROUPS": 2, "num_warps": 4, "num_stages": 3, "SWAP": True, "BLOCK_M_MAX": 128}
MOE_DOT_DOWN = {"BLOCK_N": 128, "num_warps": 8}
# ROCm keeps run 145's forms (untuned there): the ISA tier puts SWAP's 128-row gate/up at 1 wave a SIMD (303 VGPRs +
# 47 AGPRs) and its 128-row down's LDS at 64 KiB, against 1-2 waves for the 16-64-row forms at their 3 stages.
MOE_DOT_ROCM = {"SWAP": False, "BLOCK_M_MAX": 64, "num_warps": 4}
MOE_DOT_M1 = {"BLOCK_N": 32, "GROUPS": 4, "num_warps": 4, "num_stages": 3}  # 1 token, when the stream is off
# Decode (M <= FP8_STREAM_MAX_M) FP8 path: fp8_stream_kernel, a dot-free weight stream. HW: None = E4M3 by the
# hardware conversion where the GPU has it (CUDA, sm_89+), the bit decode elsewhere (gfx90a); True/False force.
FP8_STREAM_MAX_M = 1
# PREFETCH: register double buffering of the next K tile (W then read as uint32 words; needs K % 4 == 0). It lost
# in the slice (run 25) and, with LOCAL, on wq_b (run 125). LOCAL: each thread sums its LOCAL adjacent products of
# a step before they reach the accumulator, which shrinks from [BLOCK_N, BLOCK_K] to [BLOCK_N, BLOCK_K / LOCAL]
# (sm_90: the 64 x 256 tile 124 -> 64 registers, so all of wq_b's programs fit the SMs at once). The H200
# (bench/probe_fp8.py, runs 122-125, and bench_kernels.py, run 128): wq_b 12.2-12.6 -> 10.4-10.8 us (0.73-0.76 of
# copy; a run's first timings can be 5-15% slower) at 32 x 256 with 4 warps, which without LOCAL was not better
# than 64 x 256; wo_a 1.3-1.8 us and the slice's other FP8 shapes 0.05-0.7 us faster. NORM_MAXNREG (CUDA): the
# registers of a stream with a fused x_norm, whose row-RMS prologue took wq_b's kernel from 63 to 67 registers, 7
# programs an SM instead of 8, and its 1024 programs into a second wave: at 64, 13.0 -> 11.1 us (plain 10.1-10.5,
# bench/probe_fp8_norm.py, NOTES runs 234-236), the slice 0.7621 -> 0.7586 ms (ab_slice.py, run 237).
FP8_STREAM = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "UNROLL": 1, "HW": None,
              "PREFETCH": False, "LOCAL": 16, "NORM_MAXNREG": 64}
# Rows of K >= min_k take narrow row tiles that read 1 KB of each row a step: a one-token stream reads DRAM faster
# the longer each row's contiguous run per step is (bench/probe_fp8.py, run 35: wo_b 15.0 -> 12.3 us, the shared
# expert's w1|w3 9.7 -> 7.6, w2 6.7 -> 4.9, wq_a|wkv 6.8 -> 6.0, wo_a 13.8 -> 12.6; at K = 1024 it loses: wq_b 12.3
# -> 15.5). The numbers before are the default launch, whose 64-row tiles the two-programs-per-SM rule below
# narrows to 16 on every shape but wq_b. Its other keys (UNROLL, PREFETCH, HW, LOCAL) come from FP8_STREAM; with
# LOCAL 16 (runs 124, 129): wo_a 12.8 -> 10.9-11.5 us, wo_b 12.3 -> 12.0. The CPU interpreter's tile of the same
# shape class is 4 x 256.
FP8_STREAM_LONG = {"min_k": 2048, "BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}
# MXFP4 MoE at one token: the dot-free stream (one pair per block, uint32-word decode) instead of MOE_DOT_M1.
# PREFETCH: register double buffering of the next K step (None: on for CUDA, where it won on the H200, runs 15-16;
# off for gfx90a, whose prefetching loop compiles 1.2-2.4x longer); PRMT: the inline-PTX E2M1 decode (CUDA only:
# ignored on ROCm and in the CPU interpreter). K splits of the one-token streams lost (run 16) and were removed.
# The gate/up tile reads 512 B of each row a step (4 rows x 32 groups, 2 warps): 0.39 -> 0.45 of copy alone
# (bench/probe_mxfp4.py runs 32-33; the slice the same within noise).
MOE_STREAM = {"on": True, "BLOCK_N": 4, "GROUPS": 32, "num_warps": 2, "num_stages": 2,  # H200 runs 8-16, 25, 32
              "PREFETCH": None, "PRMT": True}
MOE_STREAM_DOWN = {"BLOCK_N": 64, "GROUPS": 8, "num_warps": 8}  # the down stream's own tile (K 2048): run 25
# Up to this many tokens (a batched decode step, a short prefill) each (token, slot) pair takes the one-token
# forms above instead of tokens grouped by expert into tl.dot blocks: at so few tokens an expert rarely has two, and
# a 16-row dot block then decodes its weights for one row. The H200 (NOTES run 105), against the best dot tiles:
# MOE_MMA's tensor-core kernels 3.3x / 2.5x / 1.5x faster at 4 / 16 / 64 tokens (the counters, LOCKS, are sized for
# 64); the stream (gfx90a, fp32/fp16 activations, the CPU interpreter) 1.9x / 1.6x faster at 4 / 16, level at 64.
MOE_PAIRS_MAX_T = {"mma": 64, "stream": 16}
ATTN_CHUNK = 0  # keys per split in decode attention (0: split only when too few programs, into enough splits)
# Attention reads only a query's visible keys (attention_kernel, GATHER), compacting its mask row ATTN_SCAN
# entries at a time (a power of two). A decode split does so from ATTN_GATHER_KEYS keys on and reads every key below
# that, where its key loads then need not wait for its mask's. Unsplit programs (a prefill's, and a batched decode
# of 33+ sequences at 64 heads, where the dense form was not measured) always gather. H200, V4-Flash's 64 heads
# x 512 with CSA masks (bench/probe_attention.py, NOTES runs 161-164): a 4096-token prefill 12.4 -> 3.8 ms, 1024
# tokens 1.10 -> 0.47; one decode token at a 65536 / 8192 / 1024-token context 64 / 19.8 / 13.0 -> 39 / 16.6 / 10.0
# us; the dense form won at 4224 keys (21.9 against 24.5 us) and gathering at 8320 (29.7 against 40.2 us).
ATTN_SCAN = 512
ATTN_GATHER_KEYS = 6144
# Heads over 256 wide (V4: 512; the acc is [16, 512] fp32), GPU: unsplit (prefill) and split (decode) programs. Two
# warps a prefill program (runs 163-164): 1, 4 and 8 warps, 8 heads or 32-key blocks were slower.
ATTN_WIDE = {"BLOCK_H": 16, "BLOCK_L": 16, "num_warps": 2}
ATTN_WIDE_SPLIT = {"BLOCK_H": 16, "BLOCK_L": 32, "num_warps": 4}
ATTN_WIDE_ROCM = {"BLOCK_L": 16, "num_warps": 8}  # both forms there, untuned: the ISA tier's 2 waves a SIMD


# FP8 at 2..max_m tokens (a batched decode step) on the tensor cores (kernels/mma.py `fp8_mma_kernel`: CUDA sm_80+, bf16
# x), instead of the tensor-core tile FP8_DOT, whose 16-row blocks decode W for padding rows (NOTES run 104: 18 us on
# wq_b from 2 to 16 rows, 1.4x one row's stream); min_warps: K is split until the launch has this many one-warp
# programs (run 61's tuning at one token).
FP8_MMA = {"on": True, "max_m": 8, "min_warps": 2048}


def _fp8_mma_on(x: torch.Tensor, wd: torch.Tensor, r: int, k: int) -> bool:
    """2..max_m bf16 tokens on CUDA sm_80+, 16-row tiles, whole 128-column steps, 16-byte aligned rows of W and x."""
    m, g, _ = x.shape
    return (bool(FP8_MMA["on"]) and 2 <= m <= min(8, FP8_MMA["max_m"]) and x.dtype == torch.bfloat16
            and _cuda_cc(x.device) >= (8, 0) and r % 16 == 0 and k % 128 == 0 and wd.stride(0) % 16 == 0
            and wd.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
            and x.stride(1) % 8 == 0 and x.stride(2) == 1 and r // 16 * g <= LOCKS)


def _fp8_grouped(x: torch.Tensor, w: QWeight, groups: int, out_dtype: torch.dtype | None = None,
                 x_norm: tuple[torch.Tensor, float] | None = None, glu: float | None = None) -> torch.Tensor:
    """x [M, G, Kg] (contiguous), W [G*R, Kg] fp8 -> y [M, G, R] in out_dtype (default x.dtype); x_norm and glu
    (one group, the stream path only: `linear` checks): x RMS-normed, or x [M, 1, 2 Kg] = [gate | up] through
    swiglu, as the stream reads it."""
    m, g, k = x.shape
    if glu is not None:
        k //= 2
    n = w.data.shape[0]
    r = n // groups
    wd, sd = _u8(w.data), _u8(w.scale)
    y = _empty(m, g, r, dtype=out_dtype or x.dtype, device=x.device)
    launch = _Launch(x)
    args = (x, wd, sd, y, m, r, k, x.stride(0), x.stride(1), wd.stride(0), sd.stride(0),
            y.stride(0), y.stride(1))
    if x_norm is None and glu is None and _fp8_mma_on(x, wd, r, k):
        tiles = r // 16 * g
        chunk, split = _k_chunk(k, max(1, min(k // 128, triton_cdiv(FP8_MMA["min_warps"], tiles))), 128)
        part = y if split == 1 else _empty(split, m, g, r, dtype=torch.float32, device=x.device)
        launch("fp8_mma_kernel", (r // 16, split, g), x, wd, sd, y, part, _locks(x.device, tiles if split > 1 else 0),
               m, r, k, x.stride(0), x.stride(1), wd.stride(0), sd.stride(0), y.stride(0), y.stride(1),
               part.stride(0), chunk, SPLIT=split, SPLITP=_pow2(split, 1), num_warps=1)
    elif m <= (2 if launch.cpu else FP8_STREAM_MAX_M):
        long = k >= FP8_STREAM_LONG["min_k"]
        c = {**FP8_STREAM, **(FP8_STREAM_LONG if long else {})}  # (min_k rides along unread)
        if launch.cpu:
            c.update({"BLOCK_N": 4, "BLOCK_K": 256} if long else {"BLOCK_N": 16, "BLOCK_K": 64})
        bn, bk = c["BLOCK_N"], c["BLOCK_K"]
        local = c["LOCAL"]
        if local < 1 or local & (local - 1) or bk % local:
            raise ValueError(f"FP8_STREAM LOCAL={local}: must be a power of two dividing BLOCK_K={bk} (the CPU "
                             f"interpreter's tiles are 64 or 256 wide)")
        hw = _hw_fp8(x) if c["HW"] is None else bool(c["HW"])
        while not launch.cpu and bn > 16 and triton_cdiv(r, bn) * m * g < MIN_PROGRAMS:
            bn //= 2  # narrow weights (e.g. the shared expert's 4096 rows): two programs per SM
        uniform = 128 % bn == 0 and (g == 1 or r % 128 == 0)  # a row tile never straddles a scale block
        step = bk * c["UNROLL"]
        programs = triton_cdiv(r, bn) * m * g
        split = max(1, min(triton_cdiv(k, step), triton_cdiv(MIN_PROGRAMS, programs)))
        if launch.cpu:
            split = 2 if k > step else 1  # the interpreter covers both forms at small sizes
        chunk, split = _k_chunk(k, split, step)
        prefetch = bool(c["PREFETCH"]) and k % 4 == 0  # the prefetched tile is read as uint32 words
        if prefetch:  # W read as uint32 words: its view and row stride in the arguments
            wd = wd.view(torch.int32)
            args = (x, wd, sd, *args[3:9], wd.stride(0), *args[10:])
            hw = hw and not launch.cpu  # the word form's hardware conversion is inline PTX: not interpretable
        part = y if split == 1 else _empty(split, m, g, r, dtype=torch.float32, device=x.device)
        if split > 1:
            _split_tile_ok(x.device, bn, "FP8_STREAM")
        locks = _locks(x.device, triton_cdiv(r, bn) * m * g if split > 1 else 0)
        norm = {} if x_norm is None else dict(nw_ptr=x_norm[0].contiguous(), x_eps=float(x_norm[1]), X_NORM=True,
                                              XP=_pow2(k))
        if x_norm is not None and c["NORM_MAXNREG"] and _ptx(x):
            norm["maxnreg"] = c["NORM_MAXNREG"]
        if glu is not None:
            norm.update(glu_limit=float(glu or 0.0), X_GLU=2 if glu and glu > 0 else 1)
        launch("fp8_stream_kernel", (triton_cdiv(r, bn), m * split, g), *args, chunk, part, locks, part.stride(0),
               BLOCK_N=bn, BLOCK_K=bk, HW=hw, UNIFORM=uniform, UNROLL=c["UNROLL"], SPLIT=split, PREFETCH=prefetch,
               SPLITP=_pow2(split, 1), LOCAL=local, num_warps=c["num_warps"], **norm)
    else:
        _tile_matmul(x, wd, sd, y)
    return y


def _tile_matmul(x: torch.Tensor, wd: torch.Tensor, sd: torch.Tensor | None, y: torch.Tensor) -> None:
    """y [M, G, R] = x [M, G, K] @ W^T group by group on tl.dot (`matmul_kernel`, FP8_DOT's tiles): W FP8 bytes
    with their block scales sd, or unquantized (sd None) in x's dtype, or narrower than fp32 x (x then dotted as
    three parts of W's dtype)."""
    m, g, k = x.shape
    parts = 3 if sd is None and wd.dtype != x.dtype else 1
    dot_dtype = x.dtype if parts == 1 else wd.dtype
    r = y.shape[-1]
    launch = _Launch(x)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1} if launch.cpu else FP8_DOT
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    if m > 64 and _ptx(x):
        bm = cfg.get("BLOCK_M_CUDA", 64)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if 128 % bk:
        raise ValueError(f"FP8_DOT BLOCK_K={bk} straddles the 128-column scale blocks: set a divisor of 128")
    while not launch.cpu and bn > 32 and triton_cdiv(r, bn) * triton_cdiv(m, bm) * g < MIN_PROGRAMS:
        bn //= 2  # e.g. the grouped wo_a: 8 groups x 1024 rows are only 64 programs at BLOCK_N 128
    grid = (triton_cdiv(r, bn), triton_cdiv(m, bm), g)
    launch("matmul_kernel", grid, x, wd, wd if sd is None else sd, y, m, r, k, x.stride(0), x.stride(1),
           wd.stride(0), 0 if sd is None else sd.stride(0), y.stride(0), y.stride(1), BLOCK_M=bm, BLOCK_N=bn,
           BLOCK_K=bk, IEEE=dot_dtype == torch.float32, SCALED=sd is not None, FOLD=x.dtype in FOLD_DTYPES,
           PARTS=parts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


@functools.cache
def _cuda_cc(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of a GPU device; (0, 0) on ROCm (no PTX there) and for other devices.
    With `_rocm`, the only two questions launches ask of the device (the ISA tier answers them for a target)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _rocm(device: torch.device) -> bool:
    """A ROCm (HIP) GPU: bf16 dots on MFMA, no PTX, no FP8 units."""
    return device.type == "cuda" and torch.version.hip is not None


def _ptx(t: torch.Tensor) -> bool:
    """Inline PTX can run: a CUDA (not ROCm) tensor."""
    return _cuda_cc(t.device) > (0, 0)


def _hw_fp8(t: torch.Tensor) -> bool:
    """E4M3 conversion in hardware: CUDA sm_89+ (cvt.rn.f16x2.e4m3x2); gfx90a (ROCm) has no FP8 units. The CPU
    interpreter converts fp8 in software either way; it takes the bit decode unless a test forces HW."""
    return _cuda_cc(t.device) >= (8, 9)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _k_chunk(k: int, split: int, step: int) -> tuple[int, int]:
    """(chunk, split): a reduced length k cut into about `split` parts of whole `step`s, the split recounted so
    none is empty."""
    chunk = triton_cdiv(triton_cdiv(k, split), step) * step
    return chunk, triton_cdiv(k, chunk)


X_FUSED_MAX_K = 8192  # the FP8 stream applies an x_norm or glu itself up to this K (the norm reads the whole row)


def linear(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype | None = None,
           x_norm: tuple[torch.Tensor, float] | None = None, glu: float | None = None) -> torch.Tensor:
    """y = x @ W^T in out_dtype (default x's), of rms_norm(x, *x_norm) when x_norm is given, of swiglu(gate, up,
    glu) when glu is given and x is [..., gate | up] (as reference.linear); FP8 weights decoded in registers (at
    decode sizes the stream applies the norm or swiglu as it reads x: no launch of its own), unquantized ones
    streamed at decode sizes (written in out_dtype directly), others via the reference op."""
    if x_norm is not None or glu is not None:  # fused into the FP8 stream's load, else applied first
        k = x.shape[-1] // (1 if glu is None else 2)
        fused = (w.kind == "fp8" and k <= X_FUSED_MAX_K and not _use_reference(x) and x.stride(-1) == 1
                 and x.numel() <= x.shape[-1] * (2 if _Launch(x).cpu else FP8_STREAM_MAX_M))
        if glu is not None and (not fused or x_norm is not None):  # the stream applies one of them, not both
            x, glu = swiglu(x[..., :k], x[..., k:], glu), None
        if x_norm is not None and not fused:
            x, x_norm = rms_norm(x, *x_norm), None
    lead = x.shape[:-1]
    if w.kind == "dense" and not _use_reference(x, w.data):
        x2 = x.reshape(-1, x.shape[-1])
        if _dense_mma_on(x2, w.data):
            return _dense_mma(x2.contiguous(), w.data, out_dtype or x.dtype).reshape(*lead, -1)
        if x2.shape[0] <= DENSE_GEMV_MAX_M:
            return _dense_linear(x, w, out_dtype or x.dtype)
        if _dense_tile_on(x2, w.data, out_dtype or x.dtype):
            y = _empty(x2.shape[0], 1, w.data.shape[0], dtype=x.dtype, device=x.device)
            _tile_matmul(x2.contiguous().unsqueeze(1), w.data, None, y)
            return y.reshape(*lead, -1)
    if w.kind != "fp8" or _use_reference(x):
        return _ref.linear(x, w, out_dtype)
    y = _fp8_grouped(x.reshape(-1, 1, x.shape[-1]).contiguous(), w, 1, out_dtype, x_norm, glu)
    return y.reshape(*lead, -1)


def grouped_linear(x: torch.Tensor, w: QWeight, groups: int) -> torch.Tensor:
    """Block-diagonal projection x [..., G, Kg] with W [G*R, Kg] -> [..., G, R] (FP8 in registers)."""
    if w.kind != "fp8" or _use_reference(x):
        return _ref.grouped_linear(x, w, groups)
    lead = x.shape[:-2]
    y = _fp8_grouped(x.reshape(-1, groups, x.shape[-1]).contiguous(), w, groups)
    return y.reshape(*lead, groups, -1)


# ----------------------------------------------------------------------------------------------------
# MXFP4 MoE


def moe_blocks(idx: torch.Tensor, n_experts: int, block_m: int):
    """Group the (token, slot) pairs by expert without a host sync (a CUDA graph can hold it: no bincount,
    whose CUDA version reads the maximum back to the host).

    Returns (pair_tok, pair_id, blk_e, blk_lo, blk_hi): sorted pairs' token and flat (t*k + j) ids, and per
    launch block its expert (-1 for unused tail blocks) and its [lo, hi) range of sorted pairs. The grid
    has an upper bound of blocks (ceil(P / block_m) + min(E, P)) so it is known on the host.
    """
    flat = idx.reshape(-1).to(torch.int64)
    p = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    nblk = (counts + block_m - 1) // block_m
    cum = torch.cumsum(nblk, 0)
    ub = triton_cdiv(p, block_m) + min(n_experts, p)
    b = torch.arange(ub, device=idx.device)
    e = torch.searchsorted(cum, b, right=True)
    valid = e < n_experts
    ec = e.clamp(max=n_experts - 1)
    first = cum[ec] - nblk[ec]
    lo = starts[ec] + (b - first) * block_m
    hi = starts[ec] + counts[ec]
    blk_e = torch.where(valid, ec, torch.full_like(ec, -1)).to(torch.int32)
    pair_id = order.to(torch.int32)
    pair_tok = (order // idx.shape[-1]).to(torch.int32)
    return pair_tok, pair_id, blk_e, lo.to(torch.int32), hi.to(torch.int32)


def _topk_of(plan: tuple) -> int:
    return plan[-1]


@functools.cache
def _pair_tables(t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair token j // k, pair id j, j + 1) for t tokens' k pairs, token-major; made once, read-only."""
    ids = torch.arange(t * k, dtype=torch.int32, device=device)
    return ids // k, ids, ids + 1


def _pair_rows(idx: torch.Tensor) -> torch.Tensor:
    """[P, 2] int32: the pairs (flat token x k + slot) two to a row by expert (kernels/moe.py
    `moe_pair_rows_kernel`), -1 where none."""
    p = idx.numel()
    rows = _empty(p, 2, dtype=torch.int32, device=idx.device)
    _Launch(idx)("moe_pair_rows_kernel", (1,), idx.reshape(-1), rows, p, PP=_pow2(p, 16), CHUNK=32, num_warps=4)
    return rows


def moe_prepare(x: torch.Tensor, idx: torch.Tensor, n_experts: int, mma: bool | None = None) -> tuple:
    """Block tables for one routing (the part of moe_experts that is not a weight stream): (block rows bm, and
    per block or pair the tables of `moe_blocks`, the tensor-core kernels' pair rows or None, k). `mma`: whether
    the tensor-core kernels take these tokens (`_mma_use`); None: whenever the device allows."""
    t, topk = idx.shape
    mma = _mma_device(x) if mma is None else mma
    if t <= MOE_PAIRS_MAX_T["mma" if mma else "stream"] and MOE_STREAM["on"]:
        # a few tokens: block j is pair j, token-major (no sort; the kernels read the expert ids as they are); on
        # the tensor-core path from MOE_MMA["TWO_MIN_T"] tokens, a table of program rows of two pairs of one expert
        tok, pairs, ends = _pair_tables(t, topk, idx.device)
        rows = _pair_rows(idx) if mma and t >= MOE_MMA["TWO_MIN_T"] else None
        return (1, tok, pairs, idx.reshape(-1), pairs, ends, rows, topk)
    per_expert = triton_cdiv(t * topk, n_experts)  # the smallest block that holds an expert's mean share of pairs
    cap = _moe_dot_tile(x.device, down=False).get("BLOCK_M_MAX", 64)  # (1024 tokens x 6 of 256: 32; NOTES 144, 153)
    if cap not in (16, 32, 64, 128):
        raise ValueError(f"MOE_DOT BLOCK_M_MAX={cap}: expected 16, 32, 64 or 128 (moe_prepare's row blocks)")
    bm = next(b for b in (16, 32, 64, 128) if per_expert <= b or b >= cap)
    return (bm, *moe_blocks(idx, n_experts, bm), None, topk)


def _moe_dot_tile(device: torch.device, down: bool) -> dict:
    """MOE_DOT for gate/up or down on this device (the CPU interpreter takes MOE_DOT's SWAP and row cap)."""
    return {**MOE_DOT, **(MOE_DOT_DOWN if down else {}), **(MOE_DOT_ROCM if _rocm(device) else {})}


def _moe_cfg(launch: _Launch, x: torch.Tensor, bm: int, tokens: int, down: bool = False) -> tuple[int, int, dict]:
    """(BLOCK_N, GROUPS, other launch keywords) for this device, dtype and batch."""
    if bm == 1 and MOE_STREAM["on"]:
        c = dict(MOE_STREAM, **(MOE_STREAM_DOWN if down else {}))
        if launch.cpu:
            c.update(BLOCK_N=16, GROUPS=2, num_warps=4, num_stages=1)
        return c["BLOCK_N"], c["GROUPS"], {"num_warps": c["num_warps"], "num_stages": c["num_stages"],
                                           "STREAM": True,
                                           "PREFETCH": _ptx(x) if c["PREFETCH"] is None else bool(c["PREFETCH"]),
                                           "PRMT": bool(c["PRMT"]) and _ptx(x)}
    dot = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[x.dtype]
    if launch.cpu:
        c = {"BLOCK_N": 16, "GROUPS": 2, "num_warps": 4, "num_stages": 1, "SWAP": MOE_DOT.get("SWAP", False)}
    else:
        c = MOE_DOT_M1 if tokens == 1 else _moe_dot_tile(x.device, down)
    return c["BLOCK_N"], c["GROUPS"], {"num_warps": c["num_warps"], "num_stages": c["num_stages"], "DOT": dot,
                                       "SWAP": bool(c.get("SWAP", False))}


# MXFP4 at a few tokens on the tensor cores (CUDA sm_80+, bf16 activations; kernels/mma.py `moe_mma_*`; one program row
# per (token, slot) pair): the experts' weights repacked once into the mma fragment layout (mma_layout.py; a second
# copy of each stack, made at its first such step), K split over SPLIT programs whose partials the last to arrive
# adds. The H200 (bench/probe_mma.py, run 51): gate_up volume 0.44 -> 0.61 of copy. off: the dot-free stream above.
# SPLITS: rows (from T tokens on, gate/up's split, down's split), the last row whose T a call reaches applies: more
# tokens fill the GPU with fewer K parts, and each split adds a partials round trip (the H200, NOTES runs 225-227,
# `bench/mma_splits.py`: (4, 2) best at 1-3 tokens; (4, 1) at 4; (2, 1) 2-7% faster than (4, 2) at 8-64).
# PDL (sm_90): down is launched as a programmatic dependent of gate/up, so its launch and first loads overlap gate/up's
# end (NOTES runs 63, 118).
# TWO_MIN_T: from this many tokens each program row takes two pairs of one expert (`moe_pair_rows_kernel`), so one
# decode of an expert's tile serves two tokens; the H200 (NOTES run 195): 7-8% slower at 4-8 tokens (the table's
# launch, empty rows), level at 12, 3-15% faster at 16-64 (64: 1409 -> 1218 us).
MOE_MMA = {"on": True, "SPLITS": ((1, 4, 2), (4, 4, 1), (8, 2, 1)), "PDL": True, "TWO_MIN_T": 12}
_MMA_PACKED: dict[tuple[int, ...], tuple] = {}
MOE_MMA_HEADROOM = 1 << 30  # bytes a repack leaves free beyond its copy and the largest stack's transient chunks
# (the step's activations, mma_repack's int64 intermediates: ~0.3 GB at V4-Flash's widths)
_MMA_NO_ROOM: set[torch.device] = set()
_MMA_NO_ROOM_STACKS: dict[tuple[int, ...], tuple] = {}  # stacks refused once, so each keeps the stream path


def _mma_pdl(device: torch.device) -> bool:
    """The down launch as a programmatic dependent of gate/up (MOE_MMA["PDL"]; griddepcontrol is sm_90+, and
    Triton 3.5+ compiles it)."""
    return bool(MOE_MMA["PDL"]) and _compiled.PDL_AVAILABLE and _cuda_cc(device) >= (9, 0)


def _mma_splits(t: int) -> tuple[int, int]:
    """(gate/up's, down's) K splits at t tokens: MOE_MMA["SPLITS"]' last row whose token count t reaches."""
    rows = [r for r in MOE_MMA["SPLITS"] if r[0] <= t] or MOE_MMA["SPLITS"][:1]
    return rows[-1][1], rows[-1][2]


def _mma_device(x: torch.Tensor) -> bool:
    """MOE_MMA on, bf16 x on CUDA sm_80+: the tensor-core kernels can run (shapes aside, `_mma_on`)."""
    return bool(MOE_MMA["on"]) and x.dtype == torch.bfloat16 and _cuda_cc(x.device) >= (8, 0)


def _mma_on(x: torch.Tensor, inter: int, k: int) -> bool:
    """Whether x's tokens' k experts each take the tensor-core kernels: `_mma_device`, tiles that divide (down's
    split a power of two), arrival counters for every tile of either launch."""
    (t, d), (up, down) = x.shape, _mma_splits(x.shape[0])
    return (_mma_device(x) and d % (128 * up) == 0 and inter % (256 * down) == 0 and down & (down - 1) == 0
            and t * k * max(inter, d) // 16 <= LOCKS)


def _entry(table: dict, ts: list[torch.Tensor]) -> tuple | None:
    """`table`'s entry (weakrefs of ts, ...) for these very tensors, or None (an id reused by a new tensor too)."""
    hit = table.get(tuple(id(t) for t in ts))
    if hit is not None and not all(ref() is t for ref, t in zip(hit[0], ts, strict=True)):
        return None
    return hit


def _remember(table: dict, ts: list[torch.Tensor], *value: object) -> None:
    """table[ids of ts] = (weakrefs of ts, *value), dropped with the first of ts to go (e.g. a replaced scale)."""
    key = tuple(id(t) for t in ts)
    table[key] = ([weakref.ref(t) for t in ts], *value)
    for t in ts:
        weakref.finalize(t, table.pop, key, None)


def _mma_cached(ts: list[torch.Tensor]) -> tuple | None:
    """The repack entry of these code and scale tensors (any version), or None."""
    return _entry(_MMA_PACKED, ts)


def _mma_room(device: torch.device, *stacks: tuple[QWeight, ...]) -> bool:
    """Whether the stacks not yet repacked fit the device's free memory (the repack is a second copy of the experts:
    V4-Flash's ~150 GB of them beside the checkpoint's would end a step in an out-of-memory error). No room, or none
    repacked during a graph capture: the stream kernels take those tokens, with one warning per device."""
    if device.type != "cuda":
        return True  # meta tensors (the ISA tier's launch recording): no memory to run out of
    tensors = [[t for w in ws for t in (w.data, w.scale)] for ws in stacks]
    flat = [t for ts in tensors for t in ts]
    if _entry(_MMA_NO_ROOM_STACKS, flat) is not None:
        return False  # decided once: a layer keeps its path (the two differ in the last bits)
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in tensors if _mma_cached(ts) is None]
    if not sizes:
        return True
    if torch.cuda.is_current_stream_capturing():
        return False  # the eager step before the capture found no room (DecodeGraph runs one)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
        torch.cuda.memory_allocated(device)
    need = sum(sizes)
    if need + max(sizes) + MOE_MMA_HEADROOM <= free:  # + the largest: its chunks and their cat live at once
        return True
    _remember(_MMA_NO_ROOM_STACKS, flat)
    if device not in _MMA_NO_ROOM:
        _MMA_NO_ROOM.add(device)
        warnings.warn(f"{device}: the MXFP4 tensor-core path needs a repacked copy of each layer's experts "
                      f"({need / 1e9:.2f} GB) and {free / 1e9:.2f} GB are free: layers without room run as with "
                      "cdna2_engine.ops.triton.MOE_MMA['on'] = False (the same kernels and results, slower at "
                      "2-64 tokens); set that to take them everywhere", stacklevel=2)
    return False


def _mma_use(x: torch.Tensor, w1: QWeight, w3: QWeight, w2: QWeight, k: int) -> bool:
    """Whether moe_experts gives x's tokens to the tensor-core kernels: the device and shapes allow it
    (`_mma_on`, up to MOE_PAIRS_MAX_T["mma"] tokens) and the experts' repacked copy fits (`_mma_room`)."""
    return (bool(MOE_STREAM["on"]) and x.shape[0] <= MOE_PAIRS_MAX_T["mma"] and _mma_on(x, w1.data.shape[1], k)
            and _mma_room(x.device, (w1, w3), (w2,)))


def _mma_weights(*ws: QWeight) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The repacked (words, scales, just repacked?) of one expert stack, or of two interleaved per 16 rows
    (w1 | w3), made at first use and kept while the weights live. Another code or scale tensor (a fault injected as
    a new QWeight) gets its own copy; one changed in place (torch's version counter) is repacked into the same
    buffers at the next eager call, so a captured CUDA graph reads the new values from then on (a replay alone does
    not repack). Just repacked: the repack's kernels are the last launches, whose writes a programmatic dependent
    launch may not see before its wait."""
    ts = [t for w in ws for t in (w.data, w.scale)]
    key = tuple(id(t) for t in ts)
    versions = tuple(t._version for t in ts)
    hit = _mma_cached(ts)
    if hit is not None and hit[1] == versions:
        return hit[2], hit[3], False
    if ts[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("MXFP4 tensor-core weights first needed inside a CUDA graph capture: run the step once "
                           "eagerly before capturing it (DecodeGraph does)")
    e = ws[0].data.shape[0]
    words, scales = [], []
    for lo in range(0, e, 8):  # a few experts at a time: the interleaved copy is transient
        d = [w.data[lo:lo + 8].view(torch.uint8) for w in ws]
        s = [_u8(w.scale[lo:lo + 8]) for w in ws]
        pw, ps = mma_repack(interleave_rows(*d), interleave_rows(*s)) if len(ws) == 2 else mma_repack(d[0], s[0])
        words.append(pw)
        scales.append(ps)
    packed = (torch.cat(words), torch.cat(scales))
    if hit is not None:  # changed in place: same buffers (a graph may hold them), new contents
        hit[2].copy_(packed[0])
        hit[3].copy_(packed[1])
        _MMA_PACKED[key] = (hit[0], versions, hit[2], hit[3])
        return hit[2], hit[3], True
    _remember(_MMA_PACKED, ts, versions, *packed)
    return (*packed, True)


def _mma_gate_up(x: torch.Tensor, w1: QWeight, w3: QWeight, plan: tuple, limit: float) -> torch.Tensor:
    """hb [t k, I / 128, 256] bf16 (one row per (token, slot) pair): swiglu(W1 x, W3 x) x 2^64 split hi + lo, the
    down kernel's B operand (in the order its lanes read it: kernels/mma.py `_hb_index`)."""
    words, scales, _ = _mma_weights(w1, w3)
    p, inter, d, split = plan[3].numel(), w1.data.shape[1], x.shape[1], _mma_splits(x.shape[0])[0]
    hb = _empty(p, inter // 128, 256, dtype=torch.bfloat16, device=x.device)
    part = _empty(p * split, 2, inter, dtype=torch.float32, device=x.device)
    rows = plan[-2]
    _Launch(x)("moe_mma_gate_up_kernel", (inter // 16, p, split), x, words, scales, plan[3],
               plan[3] if rows is None else rows, part, _locks(x.device, p * inter // 16), hb, inter, d, plan[-1],
               float(limit or 0.0), HAS_LIMIT=bool(limit and limit > 0), SPLIT=split, SPLITP=_pow2(split, 1),
               TWO=rows is not None, PDL=_mma_pdl(x.device), num_warps=1)
    return hb


def _mma_down(hb: torch.Tensor, w2: QWeight, weights: torch.Tensor, plan: tuple, out: torch.Tensor | None,
              add: torch.Tensor | None) -> torch.Tensor:
    words, scales, fresh = _mma_weights(w2)
    p, k, inter, d = hb.shape[0], plan[-1], hb.shape[1] * 128, w2.data.shape[1]
    split = _mma_splits(p // k)[1]
    pdl = _mma_pdl(hb.device) and not fresh  # down reads its first weights before its wait: not just written ones
    fused = out is not None
    c = out if fused else _empty(p, d, dtype=torch.float32, device=hb.device)
    part = _empty(p * split, d, dtype=torch.float32, device=hb.device)
    rows = plan[-2]
    _Launch(hb)("moe_mma_down_kernel", (d // 16, p, split), hb, words, scales, plan[3],
                plan[3] if rows is None else rows, weights.contiguous().reshape(-1), part,
                _locks(hb.device, (p // k if fused else p) * d // 16), c, c if add is None else add.contiguous(), d,
                inter, k, SPLIT=split, TOPKP=_pow2(k, 1), SUM=fused, HAS_ADD=add is not None, TWO=rows is not None,
                PDL=pdl, launch_pdl=pdl, num_warps=1)
    return c


# One token on the tensor cores split by channels instead of by phase (kernels/mma.py `moe_mma_one_kernel`: a program
# per (chunk of 16 CT channels, pair) does gate/up, SwiGLU and down's columns for its channels; a second launch adds
# the chunks). CT: 4 (192 programs at V4-Flash's widths, half of down's K tile each) or 8 (96, whole tiles); KS:
# gate/up's K parts a program (its warps: CT KS). Off until the H200 has timed it against the pair.
MOE_MMA_ONE = {"on": False, "CT": 4, "KS": 2, "BLOCK_D": 32}


def _mma_one_on(x: torch.Tensor, inter: int) -> bool:
    """One token, MOE_MMA_ONE on, a form it has (CT 4 or 8, KS 1, 2 or 4) and shapes its tiles divide (each warp
    4 of D's 16-row tiles a step, each K part whole 128-column tiles)."""
    d, ct, ks = x.shape[1], MOE_MMA_ONE["CT"], MOE_MMA_ONE["KS"]
    return (bool(MOE_MMA_ONE["on"]) and ct in (4, 8) and ks in (1, 2, 4) and x.shape[0] == 1 and inter % 128 == 0
            and d % (64 * ct * ks) == 0 and d % MOE_MMA_ONE["BLOCK_D"] == 0)


def _mma_one(x: torch.Tensor, w1: QWeight, w3: QWeight, w2: QWeight, idx: torch.Tensor, weights: torch.Tensor,
             limit: float, shared: torch.Tensor | Callable[[], torch.Tensor] | None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_experts for one token by `moe_mma_one_kernel` and its sum launch (the shared expert, when a callable,
    runs between them); into `out` when given (any float dtype: the tests take fp32)."""
    k, inter, d = idx.shape[1], w1.data.shape[1], x.shape[1]
    ct, ks = MOE_MMA_ONE["CT"], MOE_MMA_ONE["KS"]
    if not _mma_one_on(x, inter):
        raise ValueError(f"MOE_MMA_ONE {MOE_MMA_ONE} does not take x {tuple(x.shape)} with experts {inter} wide: "
                         "one token, widths its tiles divide (`_mma_one_on`)")
    wu, su, _ = _mma_weights(w1, w3)
    wd, sd, _ = _mma_weights(w2)
    chunks = inter // (16 * ct)
    n = k * chunks
    hx = _empty(n, ks, 2, 16 * ct, dtype=torch.float32, device=x.device)
    hb = _empty(n, 256, dtype=torch.bfloat16, device=x.device)
    part = _empty(n, d, dtype=torch.float32, device=x.device)
    pdl = _mma_pdl(x.device)
    _Launch(x)("moe_mma_one_kernel", (chunks, k), x, wu, su, wd, sd, idx.reshape(-1), weights.contiguous().reshape(-1),
               hx, hb, part, inter, d, float(limit or 0.0), HAS_LIMIT=bool(limit and limit > 0), CT=ct, KS=ks,
               PDL=pdl, num_warps=ct * ks)
    if callable(shared):
        shared = shared()
    out = _empty(*x.shape, dtype=x.dtype, device=x.device) if out is None else out
    bd = MOE_MMA_ONE["BLOCK_D"]
    _Launch(x)("moe_mma_one_sum_kernel", (d // bd,), part, out, out if shared is None else shared.contiguous(), d, n,
               HAS_ADD=shared is not None, ROWS=64, BLOCK_D=bd, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def moe_gate_up(x: torch.Tensor, w1: QWeight, w3: QWeight, plan: tuple, limit: float,
                mma: bool | None = None) -> torch.Tensor:
    """One grouped launch: h [T*k, I] (fp32, sorted-pair rows) = swiglu(W1 x, W3 x) per selected expert; on the
    tensor-core path (MOE_MMA) h is that kernel's [T*k, I / 128, 256] bf16 split form, which moe_down takes. `mma`:
    the choice moe_prepare's plan was made for (`_mma_use`); None decides by device and shapes alone."""
    bm, pair_tok, _, blk_e, blk_lo, blk_hi, _, _ = plan
    if bm == 1 and (_mma_on(x, w1.data.shape[1], plan[-1]) if mma is None else mma):
        return _mma_gate_up(x, w1, w3, plan, limit)
    inter, d = w1.data.shape[1], x.shape[1]
    launch = _Launch(x)
    bn, groups, kw = _moe_cfg(launch, x, bm, x.shape[0])
    words = kw.get("STREAM", False)  # the stream reads the packed codes as uint32 words
    d1, s1, d3, s3 = _packed(w1.data, words), _u8(w1.scale), _packed(w3.data, words), _u8(w3.scale)
    h = _empty(pair_tok.numel(), inter, dtype=torch.float32, device=x.device)
    launch("moe_gate_up_kernel", (triton_cdiv(inter, bn), blk_e.numel()),
           x, d1, s1, d3, s3, h, pair_tok, blk_e, blk_lo, blk_hi,
           inter, d, float(limit or 0.0),
           x.stride(0), d1.stride(0), d1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
           HAS_LIMIT=bool(limit and limit > 0), BLOCK_M=bm, BLOCK_N=bn, GROUPS=groups, **kw)
    return h


def moe_down(h: torch.Tensor, w2: QWeight, weights: torch.Tensor, plan: tuple,
             dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
             add: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped launch: contrib [T*k, D] (fp32, row t*k + j) = weights[t, j] * W2[e] h; with the dot
    path h enters the dot in `dtype` (the activations' dtype). With `out` (one token on the stream path, any tokens
    on the tensor-core path) each token's k rows are summed in order (plus `add`) into out in the same launch, and
    out is returned."""
    bm, _, pair_id, blk_e, blk_lo, blk_hi, _, _ = plan
    if h.dim() == 3:  # the tensor-core gate/up's split h
        return _mma_down(h, w2, weights, plan, out, add)
    d, inter = w2.data.shape[1], h.shape[1]
    launch = _Launch(h)
    bn, groups, kw = _moe_cfg(launch, h.new_empty(0, dtype=dtype), bm, h.shape[0] // max(1, _topk_of(plan)), True)
    words = kw.get("STREAM", False)
    fused = out is not None
    if fused and not (words and bm == 1 and h.shape[0] == _topk_of(plan)):
        raise ValueError("moe_down: the fused sum is for one token on the stream path")
    d2, s2 = _packed(w2.data, words), _u8(w2.scale)
    c = _empty(h.shape[0], d, dtype=torch.float32, device=h.device)
    wts = weights.contiguous().reshape(-1)
    if fused:
        _split_tile_ok(h.device, bn, "MOE_STREAM_DOWN")
    locks = _locks(h.device, triton_cdiv(d, bn) if fused else 0)
    launch("moe_down_kernel", (triton_cdiv(d, bn), blk_e.numel()),
           h, d2, s2, c, pair_id, wts, blk_e, blk_lo, blk_hi,
           d, inter,
           h.stride(0), d2.stride(0), d2.stride(1), s2.stride(0), s2.stride(1), c.stride(0),
           out if fused else c, c if add is None else add.contiguous(), locks,
           BLOCK_M=bm, BLOCK_N=bn, GROUPS=groups, SUM=fused, HAS_ADD=add is not None,
           SPLITP=_pow2(blk_e.numel(), 1) if fused else 1, **kw)
    return out if fused else c


def moe_experts(
    x: torch.Tensor,
    w1: QWeight,
    w3: QWeight,
    w2: QWeight,
    idx: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed MXFP4 experts: grouped gate/up with fused clamped SwiGLU, grouped down x routing weight,
    then the fixed-order sum over the k slots plus `shared` (see reference.moe_experts for the math); for one
    token (or a few on the tensor-core path) the sum happens inside the down launch. A callable `shared` is called
    after gate/up."""
    if w1.kind != "mxfp4" or w2.kind != "mxfp4" or w3.kind != "mxfp4" or _use_reference(x):
        return _ref.moe_experts(x, w1, w3, w2, idx, weights, limit, shared)
    t, d = x.shape
    x = x.contiguous()
    mma = _mma_use(x, w1, w3, w2, idx.shape[1])
    if mma and _mma_one_on(x, w1.data.shape[1]):
        return _mma_one(x, w1, w3, w2, idx, weights, limit, shared)
    plan = moe_prepare(x, idx, w1.data.shape[0], mma)
    h = moe_gate_up(x, w1, w3, plan, limit, mma)
    if callable(shared):
        shared = shared()
    out = _empty(*x.shape, dtype=x.dtype, device=x.device)
    if plan[0] == 1 and (t == 1 or h.dim() == 3):  # down sums each token's k rows (+ shared) itself
        return moe_down(h, w2, weights, plan, x.dtype, out=out, add=shared)
    c = moe_down(h, w2, weights, plan, x.dtype)
    bd = 1024
    _Launch(x)("moe_sum_kernel", (triton_cdiv(d, bd), t), c, out, c if shared is None else shared.contiguous(), d,
               TOPK=idx.shape[-1], BLOCK_D=bd, HAS_ADD=shared is not None, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------------
# Unquantized linear at decode sizes, mHC split

# A wide bf16 W on a GPU takes DENSE_MMA below at 2+ rows (the head at 2-16 fp32 rows: 264-278 us, NOTES run 112).
# Above DENSE_GEMV_MAX_M rows, the tile kernel takes 16-bit x with W of its dtype (`_dense_tile_on`), and the
# reference (one float32 copy of W, then a cuBLAS GEMM) everything else; against the reference: the
# H200's head (1.06 GB bf16) at 4 / 8 / 16 / 32 rows streamed 446 / 829 / 1527 / 2981 us, by the reference 2185 /
# 2431 / 2452 / 2855 us (NOTES run 107; the stream's time grows with the rows: its products, not W's bytes, bind it
# there). The crossover lies between 16 and 32 rows; 16 is the last measured win.
DENSE_GEMV_MAX_M = 16
DENSE_GEMV_BLOCK_M = 4  # rows of x a program (its [BLOCK_M, BLOCK_N, BLOCK_K] fp32 products must fit registers)
# H200 run 8: the head at 1.00 of copy. PROGRAMS: weights wider than DENSE_GEMV_NARROW's MAX_N but with too few
# rows to fill the GPU split K until about this many programs (a program is 2 warps)
DENSE_GEMV = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "PROGRAMS": 2048}
# Narrow W (the router, the compressors, the indexer's head weights: up to MAX_N rows of up to MAX_K): BLOCK_N rows
# a program, K in steps of at most ELEMS values over the tile (all of K in one load for one row up to K = 4096),
# no split sum (a K split adds two L2 round trips; at a decode step these GEMVs are latency, not bandwidth: run 42)
DENSE_GEMV_NARROW = {"MAX_N": 4096, "MAX_K": 8192, "BLOCK_N": 2, "ELEMS": 8192, "num_warps": 4}


def _wide(wd: torch.Tensor) -> bool:
    """W too wide for DENSE_GEMV_NARROW (the head): the tensor-core forms take fp32 x against it in bf16 parts."""
    return wd.shape[0] > DENSE_GEMV_NARROW["MAX_N"] or wd.shape[-1] > DENSE_GEMV_NARROW["MAX_K"]


def _dense_tile_on(x2: torch.Tensor, wd: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Many rows on the tile kernel, every product exact, output in x's dtype: 16-bit x against W of its dtype (the
    compressors at a prefill: 4.9 of the 4096-token slice prefill's 65 ms went to a float32 copy of W and a cuBLAS
    float32 GEMM, NOTES run 170), and finite fp32 x against a wide bf16 W (DENSE_MMA's: the head, when every
    position's logits are asked for, NOTES run 171) in parts. The router's and the indexer's fp32 logits, which
    feed top-k selections, keep the reference's IEEE sums (from 16-bit x, and from fp32 x: their W are narrow),
    as does fp32 W."""
    if wd.stride(-1) != 1 or out_dtype != x2.dtype:
        return False
    if x2.dtype == torch.float32:  # (never on the CPU: its interpreter has no bf16)
        return wd.dtype == torch.bfloat16 and _wide(wd)
    return x2.dtype in (torch.bfloat16, torch.float16) and wd.dtype == x2.dtype


def _dense_linear(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """y = x @ W^T for unquantized W and at most DENSE_GEMV_MAX_M rows, fp32 accumulation, y in out_dtype;
    split along K (partials added in split order, in the same launch) when W has too few rows to fill the GPU."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], w.data.shape[0]
    wd = w.data.contiguous()
    bm = _pow2(min(m, DENSE_GEMV_BLOCK_M), 1)
    launch = _Launch(x)
    nar = DENSE_GEMV_NARROW
    if n <= nar["MAX_N"] and k <= nar["MAX_K"]:
        bn, warps = nar["BLOCK_N"], nar["num_warps"]
        bk = max(32, min(_pow2(k), nar["ELEMS"] // (bm * bn)))
        blocks, split = triton_cdiv(n, bn), 1
    else:
        bn, bk, warps = DENSE_GEMV["BLOCK_N"], max(32, DENSE_GEMV["BLOCK_K"] // bm), DENSE_GEMV["num_warps"]
        blocks = triton_cdiv(n, bn)
        split = 1 if launch.cpu and k <= bk else max(1, min(triton_cdiv(k, bk), DENSE_GEMV["PROGRAMS"] // blocks))
    chunk, split = _k_chunk(k, split, bk)
    y = _empty(m, n, dtype=out_dtype, device=x.device)
    part = _empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    tiles = triton_cdiv(m, bm) * blocks
    if split > 1:
        _split_tile_ok(x.device, bm * bn, "DENSE_GEMV")
    launch("dense_gemv_kernel", (tiles, split), x2, wd, y, part, _locks(x.device, tiles if split > 1 else 0),
           m, n, k, chunk, split,
           x2.stride(0), wd.stride(0), y.stride(0), part.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           SPLITP=_pow2(split, 1) if split > 1 else 0, num_warps=warps)
    return y.reshape(*lead, n)


# Wide W (the head) at 2+ rows on the tensor cores: x in bf16 parts, fp32 sums (`dense_mma_kernel`), up to max_cols
# part columns (64: 16 fp32 rows, 64 bf16 ones); above, the reference. One row stays on dense_gemv (1.00 of copy).
# H200 run 112, the head at 2 / 4 / 8 / 16 fp32 rows and 64 bf16 ones: 273 / 272 / 275 / 278 / 264 us (0.90-0.94 of
# copy); six other tiles were within 3% at up to 8 rows and worse at 16-64.
DENSE_MMA = {"on": True, "max_cols": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}


def x_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """x [M, K] as `parts` bf16 rows each ([M * parts, K], row m's at m * parts ..) whose sum is x: each part is
    what the ones before left, truncated to its top 8 significant bits (exact in bf16, and never rounded up to
    inf), so 3 parts hold any finite float32 exactly while every part stays a normal bf16 (|x| >= 2^-100 or 0;
    below, the last bits fall under bf16's subnormals); a 4th, zero, makes the count a power of two."""
    out, rest = [], x.float()
    for _ in range(parts):
        head = (rest.view(torch.int32) & -65536).view(torch.float32)
        out.append(head.to(torch.bfloat16))
        rest = rest - head
    return torch.stack(out, 1).reshape(-1, x.shape[-1])


def _dense_mma_on(x2: torch.Tensor, wd: torch.Tensor) -> bool:
    """A GPU with bf16 dots (ROCm, CUDA sm_80+), bf16 W wider than DENSE_GEMV_NARROW with unit-stride, 16-byte
    aligned rows (read in place: no copy of the head), bf16 or fp32 x of 2+ rows whose parts fit DENSE_MMA's
    columns."""
    m, k = x2.shape
    return (bool(DENSE_MMA["on"]) and wd.dtype == torch.bfloat16 and x2.dtype in (torch.bfloat16, torch.float32)
            and (_rocm(x2.device) or _cuda_cc(x2.device) >= (8, 0))
            and m >= 2 and m * (1 if x2.dtype == torch.bfloat16 else 4) <= DENSE_MMA["max_cols"]
            and _wide(wd) and k % 8 == 0
            and wd.stride(-1) == 1 and wd.stride(0) % 8 == 0 and wd.data_ptr() % 16 == 0)


def _dense_mma(x2: torch.Tensor, wd: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y = x2 @ W^T by dense_mma_kernel: bf16 x2 is its own one part, fp32 x2 four bf16 parts (a CPU test's fp32
    W holds bf16 values; the parts are widened to fp32 there and dotted in IEEE fp32)."""
    m, k = x2.shape
    n = wd.shape[0]
    parts = 1 if x2.dtype == torch.bfloat16 else 4
    xp = x_parts(x2, parts).to(wd.dtype) if parts > 1 else x2
    y = _empty(m, n, dtype=out_dtype, device=x2.device)
    cfg = DENSE_MMA
    _Launch(x2)("dense_mma_kernel", (triton_cdiv(n, cfg["BLOCK_N"]),), xp, wd, y, m, n, k, xp.stride(0),
                wd.stride(0), y.stride(0), PARTS=parts, BLOCK_N=cfg["BLOCK_N"], BLOCK_C=_pow2(m * parts),
                BLOCK_K=cfg["BLOCK_K"], IEEE=wd.dtype == torch.float32, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    return y


_LOCKS: dict[torch.device, torch.Tensor] = {}
# Split launches have fewer tiles than their split targets (MIN_PROGRAMS, DENSE_GEMV["PROGRAMS"]), but the MoE's
# tensor-core kernels have one counter per pair tile: 64 tokens x 6 pairs x 4096 rows / 16 (2 MB for all branches)
LOCKS = 1 << 17


def _split_tile_ok(device: torch.device, values: int, table: str) -> None:
    """A split launch's tile of partials (`_split_sum`) on ROCm: at most one wavefront's worth (64), since there the
    barrier before the arrival counter does not wait for other wavefronts' partial stores (kernels/__init__.py)."""
    if _rocm(device) and values > 64:
        raise ValueError(f"{table}: a split-K tile of {values} partials on ROCm, where one wavefront must store them "
                         f"all (at most 64): use a narrower tile")


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the in-kernel split sums (`_split_sum` leaves them zero again): one
    row per decode branch (engine/streams.py: branches may run at once, launches within one run in order) of one
    buffer per device, made once and never freed (a captured CUDA graph keeps its address)."""
    if n > LOCKS:
        raise ValueError(f"a split launch with {n} tiles: more than the {LOCKS} arrival counters")
    if device not in _LOCKS:  # every branch's counters at once, so none is first made inside a graph capture
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-sum counters first needed inside a CUDA graph capture: run the step once "
                               "eagerly before capturing it (DecodeGraph does)")
        _LOCKS[device] = torch.zeros(BRANCHES, LOCKS, dtype=torch.int32, device=device)
    return _LOCKS[device][stream_key(device)]


def compress_step(kv: torch.Tensor, gate: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                  entries: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, ratio: int, eps: float) -> None:
    """One decode token through a compressor's fixed buffers (as reference.compress_step): two launches,
    the ring write + window pooling over (batch, channel blocks), then norm + RoPE per batch row. kv and
    gate are read in their own dtype (e.g. bf16 views of one joined projection)."""
    if _use_reference(entries, ring_kv) or ring_kv.dtype != torch.float32:
        return _ref.compress_step(kv, gate, ring_kv, ring_gate, entries, valid, ape, norm, cos, sin, pos, ratio, eps)
    b, ring, c = ring_kv.shape
    d, half = entries.shape[-1], cos.shape[-1]
    kv2, g2 = kv.reshape(b, c), gate.reshape(b, c)
    if kv2.stride() != g2.stride() or kv2.stride(-1) != 1:
        kv2, g2 = kv2.contiguous(), g2.contiguous()
    bc = 64 if ring > 16 else 128
    launch = _Launch(entries)
    launch("compress_pool_kernel", (b, triton_cdiv(d, bc)), kv2, g2, ring_kv, ring_gate, ape.float().contiguous(),
           entries, pos, c, d, kv2.stride(0), ring_kv.stride(0), ring_kv.stride(1), entries.stride(0),
           entries.stride(1), R=ratio, RING=ring, NSLOT=_pow2(ring, 2), BLOCK_C=bc, num_warps=4)
    v8 = valid.view(torch.uint8)
    launch("compress_finish_kernel", (b,), entries, v8, norm.contiguous(), cos.reshape(b, half).contiguous(),
           sin.reshape(b, half).contiguous(), pos, d, half, float(eps), entries.stride(0), entries.stride(1),
           v8.stride(0), R=ratio, BLOCK_D=_pow2(d), BLOCK_R=_pow2(half, 1), num_warps=4)


TOPK_MAX_K, TOPK_MAX_WIDTH = 16, 4096  # k passes up to TOPK_MAX_K (the router's 6), else one sort; wider rows:
# the reference's device sort (the indexer at long contexts)


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties to the lower index, and the k-th minus (k+1)-th margin (as
    reference.topk); one program per row: k passes for small k, else one in-register sort."""
    w = scores.shape[-1]
    if not 0 < k <= w or w > TOPK_MAX_WIDTH or scores.dtype != torch.float32 or not scores.numel() \
            or _use_reference(scores):
        return _ref.topk(scores, k)
    lead = scores.shape[:-1]
    s2 = scores.reshape(-1, w).contiguous()
    idx = _empty(s2.shape[0], k, dtype=torch.int64, device=scores.device)
    margin = _empty(s2.shape[0], dtype=torch.float32, device=scores.device)
    if k <= TOPK_MAX_K:
        _Launch(scores)("topk_kernel", (s2.shape[0],), s2, idx, margin, w, s2.stride(0), K=k, HAS_NEXT=w > k,
                        BLOCK_W=_pow2(w), num_warps=1)  # k passes of reductions: within one warp, no barriers
    else:
        _Launch(scores)("topk_sort_kernel", (s2.shape[0],), s2, idx, margin, idx, w, k, s2.stride(0), 0, IDX=True,
                        MASK=False, BLOCK_W=_pow2(w), num_warps=8)
    return idx.reshape(*lead, k), margin.reshape(lead)


def topk_mask(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The top-k set as a bool mask (as reference.topk_mask), one sort per row, into `out` when given."""
    w = scores.shape[-1]
    if w > TOPK_MAX_WIDTH or k > w or scores.dtype != torch.float32 or _use_reference(scores):
        return _ref.topk_mask(scores, k, out)
    mask = out if out is not None else _empty(*scores.shape, dtype=torch.bool, device=scores.device)
    if k == 0:
        return mask.zero_()
    s2 = scores.reshape(-1, w).contiguous()
    m2 = mask.view(torch.int8).reshape(-1, w)  # a view: `out` may be a strided slice of a bigger mask
    if m2.stride(-1) != 1 or (out is not None and m2.data_ptr() != mask.data_ptr()):
        raise ValueError("topk_mask: `out` must have a unit last stride")
    _Launch(scores)("topk_sort_kernel", (s2.shape[0],), s2, s2, s2, m2, w, k, s2.stride(0), m2.stride(0), IDX=False,
                    MASK=True, BLOCK_W=_pow2(w), num_warps=8)
    return mask


SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scoring: str, scale: float,
          fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing (as reference.route): one program per token for scores, top-k, weights and margin."""
    t, e = logits.shape
    if k > TOPK_MAX_K or e > TOPK_MAX_WIDTH or k > e or logits.dtype != torch.float32 or not t \
            or _use_reference(logits):
        return _ref.route(logits, bias, k, scoring, scale, fixed)
    lc = logits.contiguous()
    idx = _empty(t, k, dtype=torch.int64, device=lc.device)
    wts = _empty(t, k, dtype=torch.float32, device=lc.device)
    margin = _empty(t, dtype=torch.float32, device=lc.device)
    fx = lc if fixed is None else fixed.reshape(t, k).contiguous()
    _Launch(lc)("route_kernel", (t,), lc, lc if bias is None else bias.float().contiguous(), fx, idx, wts, margin,
                e, lc.stride(0), float(scale), K=k, KP=_pow2(k, 2), SCORING=SCORING[scoring], HAS_BIAS=bias is not None,
                FIXED=fixed is not None, HAS_NEXT=e > k, BLOCK_W=_pow2(e), num_warps=1)  # reductions in one warp
    return idx, wts, margin


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU (as reference.swiglu) in one launch; gate and up may be row-strided views of one tensor."""
    if _use_reference(gate, up):
        return _ref.swiglu(gate, up, limit)
    i = gate.shape[-1]
    g2, u2 = gate.reshape(-1, i), up.reshape(-1, i)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    y = _empty(g2.shape[0], i, dtype=gate.dtype, device=gate.device)
    bl = 1024
    _Launch(gate)("swiglu_kernel", (g2.shape[0], triton_cdiv(i, bl)), g2, u2, y, i, float(limit or 0.0), g2.stride(0),
                  u2.stride(0), y.stride(0), HAS_LIMIT=bool(limit and limit > 0), BLOCK=bl, num_warps=4)
    return y.reshape(gate.shape)


HC_BLOCK_D = 256  # mHC's collapse/expand: D blocks per row (V4-Flash: 16 programs for one decode token)
HC_MIX_BLOCK_D = 32  # the mix's D blocks (hc_post_pre's and hc_mix_partial's): each streams its [MIX, n x 32] slice
# of fn (at 256, 16 programs streamed the 1.5 MB fn at 9.6 us a call, run 17; 128 programs took 2.3 us)
# hc_post(_pre) programs to aim for: beyond HC_POST_PROGRAMS / (D / block) rows (a prefill) a program takes several
# D blocks in turn (STEPS), so 1024 rows are not 131k tiny programs and hc_pre adds 4 splits a row, not 128
# (decode, up to 32 rows at V4-Flash's 128 mix blocks, is unchanged; bench/NOTES.md run 139)
HC_POST_PROGRAMS = 4096
# From min_rows rows (a prefill) the mix's dots with fn leave hc_post_pre's and hc_mix_partial's row programs for
# hc_mix_dot_kernel, BLOCK_M rows a program sharing each fn tile: a row a program re-read the 1.5 MB fn from the L2
# for every row (NOTES run 139); those launches keep the per-row Gram matrix. The H200 (bench/probe_hc_prefill.py,
# NOTES run 157): hc_post_pre at 1024 / 4096 rows 391 / 1482 -> 127 / 466 us (16 x 128 tiles; 32 x 64: 206 / 776).
# split: the streams' dtypes whose dots take fn in three parts of that dtype (tensor cores): bf16 parts hold all of
# fp32's significand and range; fp16 ones would lose fn's bits below 2^-24 (1.7e-6 rel. at |fn| ~ 1e-2), so fp16
# and fp32 streams take an IEEE fp32 dot.
HC_MIX_DOT = {"min_rows": 64, "BLOCK_M": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
              "split": (torch.bfloat16,)}
HC_MIX_DOT_ROCM = {"BLOCK_K": 64}  # untuned there; the ISA tier at 3 stages: 171-183 VGPRs (2 waves a SIMD)


def _streams(h: torch.Tensor) -> torch.Tensor:
    """h [..., n, D] as [rows, n, D] without a copy where the strides allow (the first block's streams: one
    embedding broadcast n times, stream stride 0); D must be contiguous."""
    h3 = h.reshape(-1, *h.shape[-2:])
    return h3 if h3.stride(2) == 1 else h3.contiguous()


def _hc_mix(h3: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, int]:
    """mHC's split mix partials of the streams h3 [rows, n, D] with fn (one launch, split over D):
    [rows, split, MIX + n*n] fp64 (the dots with fn's rows, then the streams' Gram matrix)."""
    rows, n, d = h3.shape
    fn = fn.float().contiguous()
    mix, bd = fn.shape[0], HC_MIX_BLOCK_D
    chunk, split = _k_chunk(d, max(1, min(triton_cdiv(d, bd), MIN_PROGRAMS // rows)), bd)
    part = _empty(rows, split, mix + n * n, dtype=torch.float64, device=h3.device)
    dots = rows < HC_MIX_DOT["min_rows"]
    _Launch(h3)("hc_mix_partial_kernel", (rows, split), h3, fn, part, n, d, chunk, mix, h3.stride(0), fn.stride(0),
                part.stride(0), h3.stride(1), PW=part.shape[-1], NP=_pow2(n, 2), MIXP=_pow2(mix), BLOCK_D=bd,
                DOTS=dots, num_warps=4)
    if not dots:
        _hc_mix_dot(h3, fn, part, chunk)
    return part, split


def _hc_mix_dot(h3: torch.Tensor, fn: torch.Tensor, part: torch.Tensor, chunk: int) -> None:
    """part[:, s, :MIX] = the mix's dots over split s (`chunk` columns of D), BLOCK_M rows a program."""
    rows, n, d = h3.shape
    mix, c = fn.shape[0], {**HC_MIX_DOT, **(HC_MIX_DOT_ROCM if _rocm(h3.device) else {})}
    _Launch(h3)("hc_mix_dot_kernel", (triton_cdiv(rows, c["BLOCK_M"]), part.shape[1]), h3, fn, part, rows, n, d,
                chunk, mix, h3.stride(0), fn.stride(0), part.stride(0), h3.stride(1), PW=part.shape[-1],
                MIXP=max(16, _pow2(mix)), BLOCK_M=c["BLOCK_M"], BLOCK_K=c["BLOCK_K"],
                SPLIT_FN=h3.dtype in c["split"], num_warps=c["num_warps"],
                num_stages=c["num_stages"])


def _hc_collapse(part: torch.Tensor, split: int, h3: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 n: int, norm_eps: float, hc_eps: float, head: bool,
                 block_norm: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch over (row, D block): pre from the mix partials, the collapsed input and, with `block_norm`
    (weight, eps), its RMSNorm: (x, normed x or None) flattened over rows (the head's x is fp32)."""
    rows, d = h3.shape[0], h3.shape[2]
    x = _empty(rows, d, dtype=torch.float32 if head else h3.dtype, device=h3.device)  # the head's input: fp32
    xn = None if block_norm is None else _empty(*x.shape, dtype=x.dtype, device=x.device)
    norm = {} if block_norm is None else dict(NORM=True, nw_ptr=block_norm[0].contiguous(), xn_ptr=xn,
                                              BLOCK_EPS=float(block_norm[1]))
    bd = min(HC_BLOCK_D, _pow2(d))
    _Launch(h3)("hc_pre_kernel", (rows, triton_cdiv(d, bd)), part, h3, base.float().contiguous(),
                scale.float().contiguous(), x, x, x, n, d, split, 0, float(norm_eps), float(hc_eps), part.stride(0),
                h3.stride(0), x.stride(0), h3.stride(1), PW=part.shape[-1], NP=_pow2(n, 2),
                SPLITP=_pow2(split, 1), BLOCK_D=bd, num_warps=1, **norm)  # 1 warp: fastest (run 94)
    return x, xn


def _hc_out(h: torch.Tensor, part: torch.Tensor, x: torch.Tensor, xn: torch.Tensor | None) -> tuple:
    """hc_pre's results shaped as h's leading dims: the mix sums part [..., split, PW], x and xn when normed."""
    lead, d = h.shape[:-2], h.shape[-1]
    out = (part.reshape(*lead, *part.shape[-2:]), x.reshape(*lead, d))
    return out if xn is None else (*out, xn.reshape(*lead, d))


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float,
           hc_eps: float, block_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """mHC before a block (as reference.hc_pre): a launch of split mix partials (the sums), then the collapse
    and (`block_norm`) the block's RMSNorm over (row, D block) programs."""
    if _use_reference(h):
        return _ref.hc_pre(h, fn, base, scale, n, norm_eps, hc_eps, block_norm)
    h3 = _streams(h)
    part, split = _hc_mix(h3, fn)
    return _hc_out(h, part, *_hc_collapse(part, split, h3, base, scale, n, norm_eps, hc_eps, False, block_norm))


def hc_weights(sums: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, d: int, iters: int,
               norm_eps: float, hc_eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """mHC's post and comb (Sinkhorn) from the mix sums (as reference.hc_weights): one program a row, one warp
    (Sinkhorn's 40 tiny reductions without barriers)."""
    if _reference_dtype(dtype, sums.device):
        return _ref.hc_weights(sums, base, scale, n, d, iters, norm_eps, hc_eps, dtype)
    lead, (split, pw) = sums.shape[:-2], sums.shape[-2:]
    part = sums.reshape(-1, split, pw).double().contiguous()
    rows = part.shape[0]
    post = _empty(rows, n, dtype=torch.float32, device=sums.device)
    comb = _empty(rows, n, n, dtype=torch.float32, device=sums.device)
    _Launch(part)("hc_pre_kernel", (rows, 1), part, part, base.float().contiguous(), scale.float().contiguous(),
                  post, comb, post, n, d, split, iters, float(norm_eps), float(hc_eps), part.stride(0), 0, 0, 0,
                  PW=pw, NP=_pow2(n, 2), SPLITP=_pow2(split, 1), BLOCK_D=1, WEIGHTS=True, num_warps=1)
    return post.reshape(*lead, n), comb.reshape(*lead, n, n)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, block_norm: tuple[torch.Tensor, float] | None = None):
    """The model head's mHC collapse (as reference.hc_head): hc_pre's two launches (fn has n rows: pre only),
    with the final RMSNorm in the second when `block_norm` is given."""
    if _use_reference(h):
        return _ref.hc_head(h, fn, base, scale, norm_eps, hc_eps, block_norm)
    lead, (n, d) = h.shape[:-2], h.shape[-2:]
    h3 = _streams(h)
    x, xn = _hc_collapse(*_hc_mix(h3, fn), h3, base, scale, n, norm_eps, hc_eps, True, block_norm)
    return x.reshape(*lead, d) if xn is None else (x.reshape(*lead, d), xn.reshape(*lead, d))


def _hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             fn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hc_post's launch: the new streams [rows, n*D], and with `fn` the next hc_pre's mix partials as well."""
    n, d = h.shape[-2:]
    h3 = _streams(h)
    o2 = out.reshape(-1, d).contiguous()
    rows = h3.shape[0]
    y = _empty(rows, n * d, dtype=h.dtype, device=h.device)
    mix = 0 if fn is None else fn.shape[0]
    bd = min(HC_BLOCK_D if not mix else HC_MIX_BLOCK_D, _pow2(d))
    blocks = triton_cdiv(d, bd)
    steps = _pow2(triton_cdiv(blocks, max(1, HC_POST_PROGRAMS // rows)), 1)  # 1 up to HC_POST_PROGRAMS / blocks rows
    blocks = triton_cdiv(blocks, steps)
    fn = y if fn is None else fn.float().contiguous()
    part = _empty(rows, blocks, mix + n * n, dtype=torch.float64, device=h.device) if mix else y
    dots = rows < HC_MIX_DOT["min_rows"]
    _Launch(h)("hc_post_kernel", (rows, blocks), o2, h3, post.reshape(rows, n).float().contiguous(),
               comb.reshape(rows, n, n).float().contiguous(), y, fn, part, n, d, mix, o2.stride(0), h3.stride(0),
               y.stride(0), fn.stride(0), part.stride(0), h3.stride(1), NP=_pow2(n, 2), BLOCK_D=bd,
               MIXP=_pow2(max(mix, 1), 1), PW=mix + n * n, MIX_NEXT=mix > 0, STEPS=steps, DOTS=dots or not mix,
               num_warps=4)
    if mix and not dots:
        _hc_mix_dot(y.view(rows, n, d), fn, part, steps * bd)
    return y, (part if mix else None)


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a block (as reference.hc_post): one launch, rows x D blocks."""
    if _use_reference(out, h, post):
        return _ref.hc_post(out, h, post, comb)
    return _hc_post(out, h, post, comb)[0].reshape(h.shape)


def hc_post_pre(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float, hc_eps: float,
                block_norm: tuple[torch.Tensor, float] | None = None) -> tuple:
    """hc_post then the next block's hc_pre (as reference.hc_post_pre) in two launches instead of three: the
    post launch also writes the next mix's partials (the sums), one split per D block."""
    if _use_reference(out, h, post):
        return _ref.hc_post_pre(out, h, post, comb, fn, base, scale, n, norm_eps, hc_eps, block_norm)
    d = h.shape[-1]
    y, part = _hc_post(out, h, post, comb, fn)
    pre = _hc_collapse(part, part.shape[1], y.view(-1, n, d), base, scale, n, norm_eps, hc_eps, False, block_norm)
    return y.reshape(h.shape), *_hc_out(h, part, *pre)


# ----------------------------------------------------------------------------------------------------
# Norm, RoPE


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm, one row per program, fp32 statistics."""
    if _use_reference(x):
        return _ref.rms_norm(x, weight, eps)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = _empty(*x2.shape, dtype=x2.dtype, device=x2.device)
    w = weight.contiguous() if weight is not None else x2
    _Launch(x)("rms_norm_kernel", (x2.shape[0],), x2, w, y, d, float(eps), x2.stride(0), y.stride(0),
               HAS_W=weight is not None, BLOCK_D=_pow2(d), num_warps=4)
    return y.reshape(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE on the last 2*cos.shape[-1] dims of x [B, S, H, D]; inverse rotates by -angle."""
    if _use_reference(x):  # cos/sin arrive in float64 (positions up to 1M): the kernel reads them as they are
        return _ref.rope(x, cos, sin, inverse)
    return _rope(x, cos, sin, -1.0 if inverse else 1.0)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, ring: tuple | None = None) -> torch.Tensor:
    """RMSNorm of each head row of x [B, S, H, D] (weight [D] or None), then RoPE (as reference.norm_rope), in
    one launch, the window ring update (`ring`) included."""
    if _use_reference(x):
        return _ref.norm_rope(x, weight, eps, cos, sin, ring)
    return _rope(x, cos, sin, 1.0, (weight, eps), ring)


# At most this many head elements outside the rotated pairs (BLOCK_H x BLOCK_D) a RoPE program (decode up to 16
# tokens keeps its launches: their heads were already spread). A prefill's 64 heads x 512 in one program
# held [64, 512] fp32 rows: 200 VGPRs on gfx90a with Triton 3.9, 260 with 3.6 (AGPRs as spill room, all 64 KiB of
# LDS, one wave a SIMD; the ISA tier's launch set), and on the H200 q's norm_rope at 256 positions took 124 us;
# capped at 2048 (4 heads of 512) it takes 10.6 us (8192: 17.5, 4096: 12.9, 1024: 22.4; bench/probe_rope.py,
# bench/NOTES.md entry 137) and 60 VGPRs on gfx90a.
ROPE_TILE = 2048


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float, norm: tuple | None = None,
          ring: tuple | None = None):
    b, s, h, d = x.shape
    half = cos.shape[-1]
    xc = x.contiguous()
    y = _empty(*xc.shape, dtype=xc.dtype, device=xc.device)
    c = cos.expand(b, s, half).contiguous()
    sn = sin.expand(b, s, half).contiguous()
    bh, bd = _pow2(h, 1), _pow2(max(d - 2 * half, 1), 1)
    while bh > 1 and (b * s * triton_cdiv(h, bh) < MIN_PROGRAMS // 2 or bh * bd > ROPE_TILE):
        bh //= 2  # a decode token: its heads over many programs; a prefill: a bounded tile
    w, eps = norm or (None, 0.0)
    kw = {}
    if ring is not None:
        keys, ok, pos = _ring_args(x, ring)
        kw = dict(ring_ptr=keys, ok_ptr=ok.view(torch.uint8), pos_ptr=pos, W=keys.shape[1], stride_rb=keys.stride(0),
                  stride_rs=keys.stride(1), stride_ob=ok.stride(0), RING=True)
    _Launch(x)("rope_kernel", (b * s, triton_cdiv(h, bh)), xc, c, sn, y, xc if w is None else w.contiguous(), h, d,
               half, sign, float(eps), BLOCK_H=bh, BLOCK_D=bd, BLOCK_R=_pow2(half, 1),
               NORM=norm is not None, HAS_W=w is not None, num_warps=4, **kw)
    return y


def _ring_args(x: torch.Tensor, ring: tuple) -> tuple:
    """(keys, ok, pos) of a window ring after checking they fit one decode row of x [B, 1, 1, D]."""
    keys, ok, pos = ring
    b, s, h, d = x.shape
    if s != 1 or h != 1 or keys.shape[0] != b or keys.shape[2] != d or keys.stride(2) != 1 \
            or tuple(ok.shape) != tuple(keys.shape[:2]) or pos.numel() != 1:
        raise ValueError(f"norm_rope ring: x {tuple(x.shape)} must be one row [B, 1, 1, D] for keys [B, W, D] "
                         f"{tuple(keys.shape)}, flags [B, W] {tuple(ok.shape)} and one position")
    return keys, ok, pos


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., half] (float64) of positions [...] x inv_freq [half] (as reference.rope_cos_sin), one launch
    (the rounding to `align` included)."""
    if not positions.numel():
        return _ref.rope_cos_sin(positions, inv_freq, align)
    pos = positions.reshape(-1).contiguous()
    n, half = pos.numel(), inv_freq.numel()
    cos = _empty(n, half, dtype=torch.float64, device=pos.device)
    sin = _empty(n, half, dtype=torch.float64, device=pos.device)
    bn = 16
    _Launch(pos)("rope_cos_sin_kernel", (triton_cdiv(n, bn),), pos, inv_freq.to(torch.float64).contiguous(), cos, sin,
                 n, half, align, BLOCK_N=bn, BLOCK_R=_pow2(half, 1), num_warps=4)
    return cos.reshape(*positions.shape, half), sin.reshape(*positions.shape, half)


# ----------------------------------------------------------------------------------------------------
# Attention, indexer


def _attention_tiles(launch: _Launch, device: torch.device, d: int) -> tuple[dict, dict]:
    """(unsplit, split) programs' tiles: ATTN_WIDE and ATTN_WIDE_SPLIT for heads over 256 wide on a GPU (with
    ATTN_WIDE_ROCM on ROCm); narrower heads, and the CPU interpreter, one tile for both."""
    if d <= 256:
        return ({"BLOCK_H": 32, "BLOCK_L": 16 if launch.cpu else 32, "num_warps": 4},) * 2
    if launch.cpu:
        return ({"BLOCK_H": 16, "BLOCK_L": 16, "num_warps": 4},) * 2
    rocm = ATTN_WIDE_ROCM if _rocm(device) else {}
    return {**ATTN_WIDE, **rocm}, {**ATTN_WIDE_SPLIT, **rocm}


def attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor, scale: float,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shared-KV attention with sinks (as reference.attention): a query position x head block per program.
    rotary = (cos, sin): the output's inverse RoPE in the same launches (the combine's, or the unsplit kernel's)."""
    if _use_reference(q, kv):
        return _ref.attention(q, kv, sink, mask, scale, rotary)
    if rotary is not None and (q.shape[-1] - 2 * rotary[0].shape[-1]) % 2:  # the kernels rotate even-aligned pairs
        return rope(attention(q, kv, sink, mask, scale), *rotary, inverse=True)
    b, s, h, d = q.shape
    ln = kv.shape[1]
    q = q.contiguous()
    kv = kv.contiguous()
    m8 = mask.expand(b, s, ln).contiguous().view(torch.uint8)
    o = _empty(*q.shape, dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    launch = _Launch(q)
    whole, parts = _attention_tiles(launch, q.device, d)
    few = b * s * triton_cdiv(h, min(_pow2(h), whole["BLOCK_H"])) < MIN_PROGRAMS // 2  # too few to fill the GPU
    chunk = ATTN_CHUNK or 256
    if few and not ATTN_CHUNK:  # split the keys into enough programs, at most 256 keys each
        bl = parts["BLOCK_L"]
        per = triton_cdiv(MIN_PROGRAMS // 2, b * s * triton_cdiv(h, min(_pow2(h), parts["BLOCK_H"])))
        chunk = min(256, triton_cdiv(triton_cdiv(ln, per), bl) * bl)
    n_split = triton_cdiv(ln, chunk)
    split = bool(ATTN_CHUNK or few) and n_split > 1
    tile = parts if split else whole
    bh = min(_pow2(h), tile["BLOCK_H"])
    hb = triton_cdiv(h, bh)
    args = (q, kv, sink.contiguous().float(), m8, o, s, h, ln, d, float(scale),
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), m8.stride(0), m8.stride(1),
            o.stride(0), o.stride(1), o.stride(2))
    meta = dict(BLOCK_H=bh, BLOCK_L=tile["BLOCK_L"], BLOCK_D=_pow2(d), IEEE=ieee, num_warps=tile["num_warps"])
    rot = {}
    if rotary is not None:
        cos, sin = rotary
        half = cos.shape[-1]
        rot = dict(ROPE=True, cos_ptr=cos.expand(b, s, half).contiguous(), sin_ptr=sin.expand(b, s, half).contiguous(),
                   HALF=half)
    if split:
        part = _empty(b, s, n_split, h, d, dtype=torch.float32, device=q.device)
        ml = _empty(b, s, n_split, 2, h, dtype=torch.float32, device=q.device)
        launch("attention_kernel", (s * n_split, b, hb), *args, SPLIT=True, CHUNK=chunk, part_ptr=part,
               ml_ptr=ml, SCAN=min(_pow2(ATTN_SCAN), _pow2(chunk)), GATHER=ln >= ATTN_GATHER_KEYS, **meta)
        bd = min(_pow2(d), 32)
        launch("attention_combine_kernel", (s, b, hb * triton_cdiv(d, bd)), part, ml, args[2], o, s, h, d, n_split,
               o.stride(0), o.stride(1), o.stride(2), BLOCK_H=bh, BLOCK_D=bd, BLOCK_S=min(16, _pow2(n_split, 2)),
               num_warps=4, **rot)
    else:
        launch("attention_kernel", (s, b, hb), *args, SCAN=_pow2(ATTN_SCAN), **meta, **rot)  # one compile for any ln
    return o


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """Lightning-indexer scores [B, S, T] in fp32: relu(q.k) weighted per head, heads summed in fp32; -inf where
    `visible` (bool, broadcast to [B, S, T]) is False, in the same launch."""
    if _use_reference(q, k, weights):
        return _ref.index_scores(q, k, weights, scale, visible)
    b, s, h, d = q.shape
    t = k.shape[1]
    q = q.contiguous()
    k = k.contiguous()
    w = weights.contiguous()
    o = _empty(b, s, t, dtype=torch.float32, device=q.device)
    kw = {}
    if visible is not None:
        vis = visible.expand(b, s, t).view(torch.uint8)
        kw = dict(vis_ptr=vis, stride_vb=vis.stride(0), stride_vs=vis.stride(1), stride_vt=vis.stride(2),
                  VISIBLE=True)
    bt = 32
    _Launch(q)("index_scores_kernel", (s, b, triton_cdiv(t, bt)),
               q, k, w, o, s, h, t, d, float(scale),
               q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
               o.stride(0), o.stride(1),
               BLOCK_H=_pow2(h), BLOCK_T=bt, BLOCK_D=_pow2(d), IEEE=q.dtype == torch.float32, num_warps=4, **kw)
    return o


__all__ = ["linear", "grouped_linear", "rms_norm", "hc_pre", "hc_post", "hc_post_pre", "hc_weights", "hc_head",
           "compress_step", "rope", "norm_rope", "rope_cos_sin", "attention", "topk", "topk_mask", "route", "swiglu",
           "index_scores", "moe_experts", "moe_blocks"]
