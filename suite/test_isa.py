"""ISA tier: every Triton kernel compiled ahead of time for gfx90a (wave64) and sm_90, no GPU needed.
On gfx90a: no scratch (nothing spilled), LDS <= 64 KiB, v_mfma in matmul kernels; the report lists
registers and waves per SIMD per kernel (pytest -rA or the JUnit properties show them)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.isa
triton = pytest.importorskip("triton", reason="the ISA tier compiles Triton kernels: pip install triton")

from cdna2_engine.ops.triton.kernels import ISA_SPECS  # noqa: E402
from pytest_cdna2.isa import GFX90A, SM90, audit_kernel, triton_too_old  # noqa: E402

TOO_OLD = triton_too_old()


def test_triton_compiles_these_kernels():
    """A Triton older than the kernels need fails here, once, instead of once per kernel below."""
    assert TOO_OLD is None, TOO_OLD


@pytest.mark.skipif(TOO_OLD is not None, reason="the Triton installed is too old: test_triton_compiles_these_kernels")
@pytest.mark.parametrize("target", [GFX90A, SM90], ids=["gfx90a", "sm_90"])
@pytest.mark.parametrize("spec", ISA_SPECS, ids=[s[0] for s in ISA_SPECS])
def test_kernel_compiles_clean(spec, target, record_property, cdna2_record):
    name, fn, (sig, const), warps, matmul = spec
    audit = audit_kernel(name, fn, sig, const, warps, matmul, target)
    record_property("isa", audit.row())
    print(audit.row())
    if audit.waves_per_simd is not None:
        cdna2_record("waves_per_simd", audit.waves_per_simd, 1, higher_is_better=True, what=f"{name} {audit.target}")
    assert not audit.violations(), f"{name} on {audit.target}: " + "; ".join(audit.violations())
