"""ISA tier: every Triton kernel compiled ahead of time for gfx90a (wave64) and sm_90, no GPU needed (the
CUDA-only forms, hardware FP8 conversion and inline-PTX tensor-core kernels, for sm_90 alone).
On gfx90a: no scratch (nothing spilled), LDS <= 64 KiB, v_mfma in matmul kernels; the report lists
registers and waves per SIMD per kernel (pytest -rA or the JUnit properties show them).
Two sets: each kernel at a representative tile as written (every variant), and the launches a V4-Flash
prefill and decode step issue on gfx90a, specialized as Triton's JIT specializes them at launch (what a device
runs)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.isa
triton = pytest.importorskip("triton", reason="the ISA tier compiles Triton kernels: pip install triton")

from cdna2_engine.ops.triton.kernels import ISA_SPECS, ISA_SPECS_SM90  # noqa: E402
from pytest_cdna2.isa import GFX90A, SM90, audit_kernel, audit_launches, triton_too_old  # noqa: E402

TOO_OLD = triton_too_old()


@pytest.fixture(autouse=True)
def _bundled_only(cdna2_settings):
    """The tier audits the bundled engine's kernels: with your own engine it would pass for code you do not run."""
    if cdna2_settings.engine != "bundled":
        pytest.skip("the isa tier compiles the bundled engine's Triton kernels; your engine is judged by the token "
                    "tier")


def test_triton_compiles_these_kernels():
    """A Triton older than the kernels need fails here, once, instead of once per kernel below."""
    assert TOO_OLD is None, TOO_OLD


@pytest.mark.skipif(TOO_OLD is not None, reason="the Triton installed is too old: test_triton_compiles_these_kernels")
@pytest.mark.parametrize("spec, target", [(s, t) for s in ISA_SPECS for t in (GFX90A, SM90)]
                         + [(s, SM90) for s in ISA_SPECS_SM90],  # hardware FP8 and inline-PTX forms: CUDA only
                         ids=[f"{s[0]}-{t}" for s in ISA_SPECS for t in ("gfx90a", "sm_90")]
                         + [f"{s[0]}-sm_90" for s in ISA_SPECS_SM90])
def test_kernel_compiles_clean(spec, target, request, cdna2_record):
    name, fn, (sig, const), warps, matmul = spec
    audit = audit_kernel(name, fn, sig, const, warps, matmul, target)
    request.node.user_properties.append(("isa", audit.row()))  # JUnit properties as cdna2_record writes them
    print(audit.row())
    if audit.waves_per_simd is not None:
        cdna2_record("waves_per_simd", audit.waves_per_simd, 1, higher_is_better=True, what=f"{name} {audit.target}")
    assert not audit.violations(), f"{name} on {audit.target}: " + "; ".join(audit.violations())


@pytest.mark.skipif(TOO_OLD is not None, reason="the Triton installed is too old: test_triton_compiles_these_kernels")
def test_v4_flash_launches_compile_clean_on_gfx90a(request, cdna2_record):
    """The V4-Flash slice's prefills (256, 257 tokens) and decode steps (batch 1 and 4) as a ROCm device issues them,
    recorded with no GPU (pytest_cdna2.isa.record_launches), each distinct launch compiled as the JIT compiles
    it. (sm_90's launch set: tools/isa_versions.py; on a Hopper the JIT compiles it at the first run anyway.)"""
    audits = audit_launches(GFX90A)
    for a in audits:
        request.node.user_properties.append((f"isa {a.name}", a.row()))
        print(a.row())
        if a.waves_per_simd is not None:
            cdna2_record("waves_per_simd", a.waves_per_simd, 1, higher_is_better=True, what=f"{a.name} {a.target}")
    bad = [f"{a.name} on {a.target}: {v}" for a in audits for v in a.violations()]
    assert not bad, "\n".join(bad)
