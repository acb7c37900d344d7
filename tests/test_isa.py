"""ISA tier, project side: every Triton kernel compiles ahead of time for gfx90a (wave64) and sm_90 without
a GPU, and on gfx90a has no scratch, LDS <= 64 KiB, MFMA in matmul kernels, denormals kept; a
deliberately bad spec is reported as a violation (so the audit can fail)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pytest_cdna2 import isa  # noqa: E402


@pytest.fixture(scope="module")
def audits() -> list[isa.KernelAudit]:
    return isa.audit_all()


def test_every_kernel_compiles_for_both_targets(audits):
    from cdna2_engine.ops.triton.kernels import ISA_SPECS, ISA_SPECS_SM90

    names = {spec[0] for spec in ISA_SPECS}
    sm90_only = {spec[0] for spec in ISA_SPECS_SM90}
    assert {"fp8_matmul", "fp8_stream", "moe_gate_up_dot", "moe_down_dot", "moe_gate_up_stream",
            "moe_down_stream", "attention", "index_scores"} <= names
    assert "fp8_stream_hw" in sm90_only and not names & sm90_only
    assert {(a.name, a.target) for a in audits} == (
        {(n, t) for n in names for t in ("gfx90a", "sm_90")} | {(n, "sm_90") for n in sm90_only})
    failed = [a.row() for a in audits if not a.compiled]
    assert not failed, "\n".join(failed)


def test_no_kernel_is_left_out_of_the_audit():
    """A kernel added to kernels.py without an ISA spec would silently skip the gfx90a audit."""
    from cdna2_engine.ops.triton import kernels as k

    defined = {n for n in dir(k) if n.endswith("_kernel")}
    audited = {spec[1].fn.__name__ for spec in k.ISA_SPECS + k.ISA_SPECS_SM90}
    assert defined - audited == set(), f"kernels without an ISA spec: {sorted(defined - audited)}"


def test_gfx90a_rules(audits):
    print("\n" + isa.report(audits))
    bad = [f"{a.name}: {v}" for a in audits for v in a.violations()]
    assert not bad, "\n".join(bad)
    for a in audits:
        if a.target == "gfx90a":
            assert a.scratch_bytes == 0 and a.vgpr is not None and 1 <= a.waves_per_simd <= 8
            assert a.has_mfma or not a.matmul
            assert a.denorm_f32 == 3 and a.denorm_f16 == 3  # the E4M3/E2M1 bit decode relies on subnormals


def test_occupancy_formula():
    assert isa.occupancy_gfx90a(3) == 8  # tiny kernels: capped at 8 waves per SIMD
    assert isa.occupancy_gfx90a(64) == 8
    assert isa.occupancy_gfx90a(128) == 4
    assert isa.occupancy_gfx90a(129) == 3  # granules of 8 -> 136 registers
    assert isa.occupancy_gfx90a(256) == 2
    assert isa.occupancy_gfx90a(512) == 1  # 256 arch VGPRs + 256 AGPRs: the unified file is full


def test_bad_spec_is_reported():
    """An fp8 matmul tile of 256 x 256 x 128 on 4 warps: the 256 x 256 fp32 accumulator spills (scratch)."""
    from cdna2_engine.ops.triton import kernels as k

    sig, const = next(s[2] for s in k.ISA_SPECS if s[0] == "fp8_matmul")
    big = dict(const, BLOCK_M=256, BLOCK_N=256, BLOCK_K=128)
    a = isa.audit_kernel("fp8_matmul_huge", k.fp8_matmul_kernel, sig, big, 4, True)
    assert a.violations(), a.row()


def test_compile_error_is_a_violation():
    a = isa.audit_kernel("broken", object(), {}, {}, 4, False)
    assert not a.compiled and a.violations()[0].startswith("does not compile")


@pytest.mark.parametrize("name", ["fp8_stream_hw", "fp8_stream_hw_prefetch", "fp8_stream_hw_long"])
def test_sm90_fp8_stream_uses_hardware_conversion(name):
    """The HW variants of the FP8 stream convert E4M3 with cvt.rn.f16x2.e4m3x2 (no bit decode)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cdna2_engine.ops.triton.kernels import ISA_SPECS_SM90

    _, fn, (sig, const), warps, _ = next(s for s in ISA_SPECS_SM90 if s[0] == name)
    sig, const = isa.with_defaults(fn, sig, const)
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget(*isa.SM90), options={"num_warps": warps})
    assert "e4m3x2" in k.asm["ptx"]


def test_fma_contraction_is_pinned_in_launches_and_the_audit(monkeypatch):
    """The engine passes enable_fp_fusion=True itself (COMPILE_OPTIONS): with Triton's default turned off, as
    Triton 3.10 does, a*b+c still compiles to one FMA on gfx90a, and every launch carries the option."""
    import torch
    import triton
    import triton.language as tl

    from cdna2_engine.ops import triton as tri

    @triton.jit
    def axpb(a_ptr, b_ptr, c_ptr, y_ptr):
        i = tl.arange(0, 64)
        tl.store(y_ptr + i, tl.load(a_ptr + i) * tl.load(b_ptr + i) + tl.load(c_ptr + i))

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    sig = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "y_ptr": "*fp32"}
    assert isa.audit_kernel("axpb", axpb, sig, {}, 1, False, isa.GFX90A).extra["fp32_fma"]
    monkeypatch.setattr(tri, "COMPILE_OPTIONS", {"enable_fp_fusion": False})  # the audit can tell the difference
    assert not isa.audit_kernel("axpb", axpb, sig, {}, 1, False, isa.GFX90A).extra["fp32_fma"]

    seen = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    monkeypatch.setattr(tri, "COMPILE_OPTIONS", {"enable_fp_fusion": True})
    launch = tri._Launch(torch.empty(1))
    launch.mod, launch.cpu = type("M", (), {"k": Fake()})(), False
    launch("k", (1,), num_warps=4)
    assert seen == [{"enable_fp_fusion": True, "num_warps": 4}]
