"""ISA tier: compile every Triton kernel ahead of time, with no GPU, and read what the compiler produced.

For gfx90a (wave64) the amdgcn text carries `.vgpr_count`, `.agpr_count`, `.sgpr_count` and
`.private_segment_fixed_size` (scratch bytes: 0 means nothing spilled to memory) and `metadata.shared` is
the LDS bytes; a bf16/fp16 `tl.dot` shows up as `v_mfma_*`. The kernels decode E2M1/E4M3 through fp32
(and fp16) subnormal bit patterns (engine/ops/triton/kernels.py), so `.amdhsa_float_denorm_mode_32` and
`_16_64` must stay 3 (denormals kept on input and output).
For sm_90 the PTX/cubin are produced and `metadata.shared` is the shared-memory bytes (DESIGN.md
section 7).

Occupancy estimate on gfx90a (CDNA2 ISA guide: each SIMD has 512 unified 32-bit registers per lane,
shared by a wave's VGPRs and AGPRs, allocated in granules of 8, at most 8 waves per SIMD). On gfx90a
the `.vgpr_count` the compiler writes is already the unified total (arch VGPRs, aligned, plus AGPRs: a
kernel using 256 + 256 reports 512), so

    regs  = ceil(vgpr_count / 8) * 8
    waves = min(8, floor(512 / regs))      (0 means the wave cannot launch at all)

(LDS can lower it further: 64 KiB per CU shared by the workgroups on it; `waves_per_simd` reports the
register limit only, `lds_bytes` is listed beside it.)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

LDS_LIMIT = 65536
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
            if self.scratch_bytes:
                out.append(f"scratch {self.scratch_bytes} B (registers spilled to memory)")
            if self.lds_bytes is not None and self.lds_bytes > LDS_LIMIT:
                out.append(f"LDS {self.lds_bytes} B > {LDS_LIMIT}")
            if self.matmul and not self.has_mfma:
                out.append("matmul kernel without v_mfma")
            for bits, mode in (("fp16", self.denorm_f16), ("fp32", self.denorm_f32)):
                if mode is not None and mode != 3:
                    out.append(f"{bits} denormals not kept (mode {mode}): the E2M1/E4M3 decode needs them")
        return out

    def row(self) -> str:
        """One line for a test report."""
        if not self.compiled:
            return f"{self.name:14s} {self.target:7s} FAILED {self.error[:80]}"
        return (f"{self.name:14s} {self.target:7s} vgpr={self.vgpr} agpr={self.agpr} sgpr={self.sgpr} "
                f"scratch={self.scratch_bytes} lds={self.lds_bytes} mfma={self.has_mfma} "
                f"waves/SIMD={self.waves_per_simd} denorm32/16={self.denorm_f32}/{self.denorm_f16}")


def occupancy_gfx90a(vgpr_count: int) -> int:
    """Waves per SIMD allowed by registers on gfx90a (formula in the module docstring)."""
    regs = -(-vgpr_count // 8) * 8
    return min(8, 512 // max(regs, 8))


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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cdna2_engine.ops.triton import COMPILE_OPTIONS

    tname = str(target[1]) if target[0] == "hip" else f"sm_{target[1]}"
    signature, constexprs = with_defaults(fn, signature, constexprs)
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(*target),
                           options={"num_warps": num_warps, **COMPILE_OPTIONS})
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
            a.waves_per_simd = occupancy_gfx90a(a.vgpr)
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


def report(audits: list[KernelAudit]) -> str:
    """The per-kernel table a test prints (VGPRs, occupancy, LDS, MFMA, and any violation)."""
    lines = []
    for a in audits:
        v = a.violations()
        lines.append(a.row() + (f"  VIOLATES: {'; '.join(v)}" if v else ""))
    return "\n".join(lines)
