"""ISA tier: compile every Triton kernel ahead of time, with no GPU, and read what the compiler produced.

For gfx90a (wave64) the amdgcn text carries `.vgpr_count`, `.agpr_count`, `.sgpr_count` and
`.private_segment_fixed_size` (scratch bytes: 0 means nothing spilled to memory) and `metadata.shared` is
the LDS bytes; a bf16/fp16 `tl.dot` shows up as `v_mfma_*`. The kernels decode E2M1/E4M3 through fp32
(and fp16) subnormal bit patterns (engine/ops/triton/kernels/base.py; the fp16 word decode in kernels/moe.py), so
`.amdhsa_float_denorm_mode_32` and `_16_64` must stay 3 (denormals kept on input and output).
For sm_90 the PTX/cubin are produced and `metadata.shared` is the shared-memory bytes (DESIGN.md
section 7).

Occupancy estimate on gfx90a, from three limits counted in whole workgroups (a CU takes a workgroup's
num_warps waves all at once, spread over its 4 SIMDs; HIP's own hipOccupancyMaxActiveBlocksPerMultiprocessor
divides the CU's register-limited waves by the workgroup's the same way). Registers (CDNA2 ISA guide: each SIMD
has 512 unified 32-bit registers per lane, shared by a wave's VGPRs and AGPRs, allocated in granules of 8, at
most 8 waves per SIMD; on gfx90a the `.vgpr_count` the compiler writes is already the unified total, arch VGPRs
aligned plus AGPRs: a kernel using 256 + 256 reports 512). LDS (64 KiB per CU, allocated to a workgroup in
blocks of 128 dwords, LLVM AMDGPUUsage's LDS_SIZE granularity for GFX7-GFX10, which includes gfx90a). SGPRs
(LLVM's getOccupancyWithNumSGPRs for GFX8-GFX9: at most 100 allow 8 waves, more allow 7; `.sgpr_count` already
counts VCC, FLAT_SCRATCH and XNACK_MASK, AMDGPUUsage):

    regs      = ceil(vgpr_count / 8) * 8
    by_regs   = min(8, floor(512 / regs), 8 if sgpr_count <= 100 else 7)   (waves a SIMD)
    groups    = floor(4 * by_regs / num_warps)                         (workgroups a CU by registers)
    groups    = min(groups, floor(65536 / (ceil(lds_bytes / 512) * 512)))   (and by LDS; no LDS: no limit)
    waves     = ceil(groups * num_warps / 4)                           (the busiest SIMD; 0: cannot launch)

A kernel whose pipelined tiles take 48 KiB of LDS runs one workgroup a CU however few registers it holds: at 4
warps that is one wave a SIMD, at 8 warps two. And an 8-warp kernel whose registers allow 5 waves a SIMD runs 4:
the CU's 20 wave slots hold two whole 8-wave workgroups, not two and a half.

Two sets are audited. `audit_all`: every kernel in kernels.ISA_SPECS at a representative tile, unspecialized
(every variant, including ones no decode step launches; MFMA is required of the matmul specs). `audit_launches`:
the launches the V4-Flash slice (config.FLASH_SLICE) makes in prefills of 256 and 257 tokens and a decode step
at batch 1 and at batch 4 after each, recorded with no GPU (`record_launches`) and specialized as Triton's JIT
specializes them at launch (`specialize`): 16-byte aligned pointers and integers divisible by 16 are marked so
and integers equal to 1 become constants, which decides vectorized loads, layouts and so registers
(bench/NOTES.md entry 134: the decode FP8 streams take 60-67 VGPRs as launched, 145 unspecialized).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

LDS_LIMIT = 65536
SGPRS_FOR_8_WAVES = 100  # gfx90a (GFX9): more SGPRs than this leave 7 waves a SIMD (LLVM getOccupancyWithNumSGPRs)
_TILES = ("the launch's tile table (engine/ops/triton/__init__.py) or the spec (engine/ops/triton/kernels/specs.py) "
          "that set it")
GFX90A = ("hip", "gfx90a", 64)
SM90 = ("cuda", 90, 32)


@dataclass
class KernelAudit:
    """What one kernel compiled to on one target, and the rules it breaks (empty list: clean)."""

    name: str
    target: str
    compiled: bool
    error: str = ""
    vgpr: int | None = None
    agpr: int | None = None
    sgpr: int | None = None
    scratch_bytes: int | None = None
    lds_bytes: int | None = None
    has_mfma: bool | None = None
    waves_per_simd: int | None = None
    denorm_f16: int | None = None
    denorm_f32: int | None = None
    matmul: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    def violations(self) -> list[str]:
        """Rules of the ISA tier this kernel breaks on its target (DESIGN.md section 5, isa row)."""
        if not self.compiled:
            return [f"does not compile: {self.error}"]
        out = []
        if self.target.startswith("gfx"):
            unread = [k for k, v in (("private_segment_fixed_size", self.scratch_bytes), ("vgpr_count", self.vgpr),
                                     ("amdhsa_float_denorm_mode_32", self.denorm_f32),
                                     ("amdhsa_float_denorm_mode_16_64", self.denorm_f16)) if v is None]
            if unread:  # a Triton/LLVM that renamed them: an unread rule must not pass as kept
                out.append(f"amdgcn metadata {', '.join(unread)} not found: this Triton's output cannot be audited "
                           "(pytest_cdna2/isa.py reads those keys)")
            if self.scratch_bytes:
                out.append(f"scratch {self.scratch_bytes} B (registers spilled to memory): shrink its BLOCK_* tile or "
                           f"raise num_warps in {_TILES}")
            if self.lds_bytes is not None and self.lds_bytes > LDS_LIMIT:
                out.append(f"LDS {self.lds_bytes} B > {LDS_LIMIT} (cannot launch on gfx90a): lower num_stages or its "
                           f"BLOCK_* tile in {_TILES}")
            if self.matmul and not self.has_mfma:
                out.append("matmul kernel without v_mfma (its tl.dot fell back to FMAs): give the dot bf16/fp16/fp32 "
                           f"operands and at least 16 x 16 tiles in {_TILES}, or mark a dot-free spec matmul=False")
            for bits, mode in (("fp16", self.denorm_f16), ("fp32", self.denorm_f32)):
                if mode is not None and mode != 3:
                    out.append(f"{bits} denormals not kept (mode {mode}): the E2M1/E4M3 decode needs them; the compile "
                               "options (COMPILE_OPTIONS in engine/ops/triton/__init__.py, a launch's keywords) must "
                               "not flush them (Triton's allow_flush_denorm=True does)")
        return out

    def row(self) -> str:
        """One line for a test report."""
        if not self.compiled:
            return f"{self.name:14s} {self.target:7s} FAILED {self.error[:80]}"
        return (f"{self.name:14s} {self.target:7s} vgpr={self.vgpr} agpr={self.agpr} sgpr={self.sgpr} "
                f"scratch={self.scratch_bytes} lds={self.lds_bytes} mfma={self.has_mfma} "
                f"waves/SIMD={self.waves_per_simd} denorm32/16={self.denorm_f32}/{self.denorm_f16}")


def occupancy_gfx90a(vgpr_count: int, lds_bytes: int = 0, num_warps: int = 4, sgpr_count: int = 0) -> int:
    """Waves per SIMD on gfx90a allowed by vector and scalar registers and by LDS (formula in the module
    docstring)."""
    regs = -(-vgpr_count // 8) * 8
    by_regs = min(8, 512 // max(regs, 8), 8 if sgpr_count <= SGPRS_FOR_8_WAVES else 7)
    groups = 4 * by_regs // num_warps  # whole workgroups a CU by registers
    if lds_bytes > 0:
        groups = min(groups, LDS_LIMIT // (-(-lds_bytes // 512) * 512))
    return -(-groups * num_warps // 4)


def _meta(text: str, key: str) -> int | None:
    m = re.search(rf"\.{key}:?\s+(\d+)", text)
    return int(m.group(1)) if m else None


def with_defaults(fn: object, signature: dict[str, str], constexprs: dict[str, object]) -> tuple[dict, dict]:
    """A spec's signature and constexprs with the kernel's defaulted parameters that the spec leaves out fixed
    to their defaults (as a launch that omits them does)."""
    raw = getattr(fn, "fn", None)
    if raw is None:
        return signature, constexprs
    signature, constexprs = dict(signature), dict(constexprs)
    for pname, par in inspect.signature(raw).parameters.items():
        if pname not in signature and par.default is not inspect.Parameter.empty:
            signature[pname] = "constexpr"
            constexprs[pname] = par.default
    return signature, constexprs


def triton_too_old() -> str | None:
    """The engine's one-line refusal of the installed Triton when its kernels need a newer one (the ISA tier
    fails on it once, instead of once per kernel), else None."""
    import triton

    from cdna2_engine.ops import triton_check

    try:
        triton_check(triton.__version__)
    except RuntimeError as e:
        return str(e)
    return None


def audit_kernel(name: str, fn: object, signature: dict[str, str], constexprs: dict[str, object],
                 num_warps: int, matmul: bool, target: tuple = GFX90A) -> KernelAudit:
    """Compile one kernel for `target` (a (backend, arch, warp_size) triple) and read its resources."""
    from triton.compiler import ASTSource

    from cdna2_engine.ops.triton import COMPILE_OPTIONS

    constexprs = dict(constexprs)
    stages = constexprs.pop("num_stages", None)  # the launch's pipelining depth (specs.py `_sig`): an option
    signature, constexprs = with_defaults(fn, signature, constexprs)
    options = {"num_warps": num_warps, **COMPILE_OPTIONS, **({} if stages is None else {"num_stages": stages})}
    return _compile_and_read(name, lambda: ASTSource(fn, signature, constexprs), options, matmul, target)


def _compile_and_read(name: str, source: Callable[[], object], options: dict, matmul: bool,
                      target: tuple) -> KernelAudit:
    import triton
    from triton.backends.compiler import GPUTarget

    tname = str(target[1]) if target[0] == "hip" else f"sm_{target[1]}"
    try:
        k = triton.compile(source(), target=GPUTarget(*target), options=options)
    except Exception as exc:  # the audit reports a failing compile instead of raising, its root cause first
        root = exc
        while root.__cause__ or root.__context__:
            root = root.__cause__ or root.__context__
        error = f"{type(exc).__name__}: {exc}"
        if root is not exc:
            error = f"{type(root).__name__}: {root} (raised in {error})"
        return KernelAudit(name, tname, False, error=error[:2000], matmul=matmul)
    a = KernelAudit(name, tname, True, lds_bytes=int(k.metadata.shared), matmul=matmul)
    if "amdgcn" in k.asm:
        text = k.asm["amdgcn"]
        a.vgpr, a.sgpr = _meta(text, "vgpr_count"), _meta(text, "sgpr_count")
        a.agpr = _meta(text, "agpr_count") or 0
        a.scratch_bytes = _meta(text, "private_segment_fixed_size")
        a.has_mfma = "v_mfma" in text
        a.denorm_f16 = _meta(text, "amdhsa_float_denorm_mode_16_64")
        a.denorm_f32 = _meta(text, "amdhsa_float_denorm_mode_32")
        a.extra["vgpr_spill_count"] = _meta(text, "vgpr_spill_count")
        a.extra["fp32_fma"] = bool(re.search(r"\bv_(fma|fmac|pk_fma)_f32", text))  # also v_fmac_f32_e32
        if a.vgpr is not None:
            a.waves_per_simd = occupancy_gfx90a(a.vgpr, a.lds_bytes or 0, int(options.get("num_warps", 4)),
                                                a.sgpr or 0)
    else:
        ptx = k.asm.get("ptx", "")
        a.has_mfma = "mma" in ptx
        local = re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx)
        a.extra["ptx_local_bytes"] = sum(int(x) for x in local)
        a.extra["n_regs"] = getattr(k, "n_regs", None)
    return a


def audit_all(targets: tuple[tuple, ...] = (GFX90A, SM90)) -> list[KernelAudit]:
    """Every kernel in cdna2_engine.ops.triton.kernels.ISA_SPECS, compiled for each target, and those in
    ISA_SPECS_SM90 (hardware-FP8 variants) for sm_90 only."""
    from cdna2_engine.ops.triton import kernels

    out = []
    for name, fn, (sig, const), warps, matmul in kernels.ISA_SPECS:
        for tgt in targets:
            out.append(audit_kernel(name, fn, sig, const, warps, matmul, tgt))
    for name, fn, (sig, const), warps, matmul in getattr(kernels, "ISA_SPECS_SM90", []):
        if SM90 in targets:
            out.append(audit_kernel(name, fn, sig, const, warps, matmul, SM90))
    return out


@dataclass
class Launch:
    """One kernel launch as the engine issued it: the kernel's name in the kernels package, its arguments and options,
    the engine line that issued it."""

    kernel: str
    args: tuple
    kwargs: dict
    where: str


def _meta_weights(cfg: object) -> dict:
    """The official checkpoint's tensors for `cfg` on the meta device: shapes and dtypes, no data."""
    import torch

    from cdna2_engine.checkpoint import stored_shapes, tensor_specs
    from cdna2_engine.ops import QWeight

    def empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    w = {}
    for sp in tensor_specs(cfg):
        if sp.kind in ("fp8", "mxfp4"):
            ws, ss = stored_shapes(sp.kind, sp.shape)
            codes = torch.float8_e4m3fn if sp.kind == "fp8" else torch.int8
            w[sp.name] = QWeight(empty(ws, codes), empty(ss, torch.float8_e8m0fnu), sp.kind)
        elif sp.kind == "int32":
            w[sp.name] = empty(sp.shape, torch.int32)
        else:
            t = empty(sp.shape, torch.bfloat16 if sp.kind == "bf16" else torch.float32)
            w[sp.name] = QWeight(t, None, "dense") if sp.linear else t
    return w


@contextmanager
def _dispatch_as(target: tuple, calls: list[Launch]) -> Iterator[None]:
    """Launches record instead of running, and the two questions they ask of the device (`_cuda_cc`, `_rocm`)
    are answered for `target`: a ROCm GPU for gfx90a, an sm_XY CUDA GPU for ("cuda", XY, 32)."""
    from cdna2_engine.launches import issuing_line
    from cdna2_engine.ops import triton as tri

    cc = (target[1] // 10, target[1] % 10) if target[0] == "cuda" else (0, 0)
    saved = tri._Launch.__call__, tri._cuda_cc, tri._rocm

    def record(self: object, name: str, grid: tuple, *args: object, **kwargs: object) -> None:
        calls.append(Launch(name, args, {**tri.COMPILE_OPTIONS, **kwargs}, issuing_line()))

    tri._Launch.__call__, tri._cuda_cc, tri._rocm = record, lambda device: cc, lambda device: target[0] == "hip"
    try:
        yield
    finally:
        tri._Launch.__call__, tri._cuda_cc, tri._rocm = saved


def record_launches(target: tuple = GFX90A, prompts: tuple[int, ...] = (256, 257),
                    batches: tuple[int, ...] = (1, 4)) -> list[Launch]:
    """Every Triton launch of the V4-Flash slice's prefill of each prompt length, then one decode step, at each
    batch, as a `target` GPU would issue them, with no GPU and in seconds: the weights and activations are meta
    tensors (shapes, strides and storage offsets, no data; a meta tensor's data_ptr is its byte offset, and real
    allocations are 256-byte aligned, so alignment comes out as on a device) and the kernels are not run. The
    prompts pass the sliding window (128) and the HCA block (128), so every attention path launches; one is a
    multiple of 16 and one is not, as the lengths a prefill's arguments take their divisibility from."""
    import torch

    from cdna2_engine.config import FLASH_SLICE, Config
    from cdna2_engine.model import Model
    from cdna2_engine.ops import get_ops

    cfg = Config(**FLASH_SLICE)
    calls: list[Launch] = []
    with torch.no_grad(), _dispatch_as(target, calls):
        model = Model(cfg, _meta_weights(cfg), device=torch.device("meta"), dtype=torch.bfloat16,
                      ops=get_ops("triton", reference_ops=[]))  # every op on its kernel, whatever the env says
        for prompt in prompts:
            for batch in batches:
                ids = torch.zeros((batch, prompt), dtype=torch.long, device="meta")
                cache = model.new_cache()
                model.step(ids, cache)
                model.decode(ids[:, -1:], model.static_cache(cache, prompt + 2))
    return calls


def specialize(fn: object, args: tuple, kwargs: dict, target: tuple) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a launch of JIT function `fn` on `target`, computed by the
    binder Triton's JIT itself builds for a launch (runtime/jit.py, the same in Triton 3.5-3.9), so the
    specialization is Triton's rule and not a copy of it; no device needed."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(GPUTarget(*target))
    make, pack = getattr(jit, "create_function_from_signature", None), getattr(fn, "_pack_args", None)
    if make is None or pack is None:
        import triton

        raise RuntimeError(f"Triton {triton.__version__}'s JIT binder is not where pytest_cdna2/isa.py specialize() "
                           "looks for it (runtime/jit.py): specialize() needs updating to this Triton")
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug}  # as JITFunction.run
    bound, spec, options = make(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = pack(backend, kwargs, bound, spec, options)
    return signature, constexprs, attrs, options.__dict__


def audit_launches(target: tuple = GFX90A, calls: list[Launch] | None = None) -> list[KernelAudit]:
    """Each distinct specialization among `calls` (default: `record_launches(target)`) compiled for `target`;
    the audit's name is the kernel and the engine line of its first launch (#2, #3.. for other specializations
    from the same line). MFMA is not required here (the
    specs hold that rule; a launch does not say whether its kernel is a matmul)."""
    from triton.compiler import ASTSource

    from cdna2_engine.ops.triton import kernels

    out, seen, names = [], set(), {}
    for c in record_launches(target) if calls is None else calls:
        fn = getattr(kernels, c.kernel)
        signature, constexprs, attrs, options = specialize(fn, c.args, c.kwargs, target)
        key = (c.kernel, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=repr)),
               repr(sorted(attrs.items(), key=repr)), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        name = f"{c.kernel.removesuffix('_kernel')} @ {c.where.split(' ')[0]}"
        names[name] = names.get(name, 0) + 1
        out.append(_compile_and_read(name if names[name] == 1 else f"{name} #{names[name]}",
                                     lambda fn=fn, s=signature, k=constexprs, a=attrs: ASTSource(fn, s, k, a),
                                     options, False, target))
    return out


def report(audits: list[KernelAudit]) -> str:
    """The per-kernel table a test prints (VGPRs, occupancy, LDS, MFMA, and any violation)."""
    lines = []
    for a in audits:
        v = a.violations()
        lines.append(a.row() + (f"  VIOLATES: {'; '.join(v)}" if v else ""))
    return "\n".join(lines)
