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
    assert {"fp8_matmul", "fp8_matmul_scaled_steps", "dense_matmul", "dense_matmul_parts", "fp8_stream",
            "moe_gate_up_dot", "moe_down_dot", "moe_gate_up_stream", "moe_down_stream", "attention",
            "index_scores"} <= names
    assert "fp8_stream_hw" in sm90_only and not names & sm90_only
    assert {(a.name, a.target) for a in audits} == (
        {(n, t) for n in names for t in ("gfx90a", "sm_90")} | {(n, "sm_90") for n in sm90_only})
    failed = [a.row() for a in audits if not a.compiled]
    assert not failed, "\n".join(failed)


def test_no_kernel_is_left_out_of_the_audit():
    """A kernel added to a module of the kernels package without an ISA spec would silently skip the gfx90a audit,
    and one the package does not export could not be launched (the launchers look kernels up by name there)."""
    import importlib
    import pkgutil

    from cdna2_engine.ops.triton import kernels as k

    defined = {n for m in pkgutil.iter_modules(k.__path__)
               for n in dir(importlib.import_module(f"{k.__name__}.{m.name}")) if n.endswith("_kernel")}
    assert len(defined) > 20  # the walk found the modules' kernels
    assert defined - set(k.__all__) == set(), f"add to kernels/__init__.py: {sorted(defined - set(k.__all__))}"
    audited = {spec[1].fn.__name__ for spec in k.ISA_SPECS + k.ISA_SPECS_SM90}
    assert defined - audited == set(), f"kernels without an ISA spec: {sorted(defined - audited)}"


def test_specs_compile_at_the_launches_pipelining_depth():
    """A dot kernel's LDS grows with its software-pipelining stages: a spec compiled at Triton's default (2 on HIP)
    while the engine launches it at 3 or 4 under-reports LDS (fp32 x's FP8 tile: 48 KiB at 2 stages, 64 KiB at 3),
    so a deeper launch would pass the audit and fail on an MI250. Each such spec carries its launch's stages."""
    from cdna2_engine.ops import triton as tri
    from cdna2_engine.ops.triton import kernels as k

    launched = {"fp8_matmul": tri.FP8_DOT, "fp8_matmul_scaled_steps": tri.FP8_DOT, "dense_matmul": tri.FP8_DOT,
                "dense_matmul_parts": tri.FP8_DOT, "moe_gate_up_dot": tri.MOE_DOT_M1, "moe_down_dot": tri.MOE_DOT_M1,
                "dense_mma": tri.DENSE_MMA, "hc_mix_dot": tri.HC_MIX_DOT, "moe_gate_up_dot_swap": tri.MOE_DOT,
                "moe_down_dot_swap": tri.MOE_DOT}
    rocm_up = {**tri.MOE_DOT, **tri.MOE_DOT_ROCM}
    rocm_down = {**tri.MOE_DOT, **tri.MOE_DOT_DOWN, **tri.MOE_DOT_ROCM}
    for m in (32, 64):
        launched.update({f"moe_gate_up_dot_rocm_{m}": rocm_up, f"moe_down_dot_rocm_{m}": rocm_down})
    specs = {s[0]: s[2][1] for s in k.ISA_SPECS + k.ISA_SPECS_SM90}
    assert {n: specs[n].get("num_stages") for n in launched} == {n: c["num_stages"] for n, c in launched.items()}
    for cfg in (tri.MOE_DOT_ROCM, tri.HC_MIX_DOT_ROCM):  # ROCm's overrides keep the stages the specs compile
        assert "num_stages" not in cfg


def test_rocm_moe_dot_specs_are_rocms_prefill_tiles():
    """A prefill's MoE on ROCm groups tokens into blocks of up to MOE_DOT_ROCM's row cap with MOE_DOT's tile and
    ROCm's overrides: the specs compile those tiles (row blocks above 16 up to the cap), so a tile change there is
    audited for gfx90a (the launch audit's prefills reach only the smaller blocks)."""
    from cdna2_engine.ops import triton as tri
    from cdna2_engine.ops.triton import kernels as k

    specs = {s[0]: s for s in k.ISA_SPECS}
    for down in (False, True):
        tile = {**tri.MOE_DOT, **(tri.MOE_DOT_DOWN if down else {}), **tri.MOE_DOT_ROCM}
        rows = [m for m in (32, 64, 128) if m <= tile["BLOCK_M_MAX"]]
        assert rows == [32, 64]
        for m in rows:
            _, _, (_, const), warps, matmul = specs[f"moe_{'down' if down else 'gate_up'}_dot_rocm_{m}"]
            assert matmul and warps == tile["num_warps"]
            assert (const["BLOCK_M"], const["BLOCK_N"], const["GROUPS"], const["SWAP"]) == (
                m, tile["BLOCK_N"], tile["GROUPS"], tile["SWAP"])


def test_num_stages_reaches_the_compile():
    """The audit passes a spec's stages to the compiler (more stages, more LDS), not as a kernel argument."""
    from cdna2_engine.ops.triton import kernels as k

    name, fn, (sig, const), warps, matmul = next(s for s in k.ISA_SPECS if s[0] == "fp8_matmul_scaled_steps")
    lds = {n: isa.audit_kernel(name, fn, sig, dict(const, num_stages=n), warps, matmul).lds_bytes for n in (2, 3)}
    assert lds[3] > lds[2] > 0, lds


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


def test_occupancy_lds_limit():
    """64 KiB of LDS a CU in 512-byte blocks; a workgroup's waves spread over 4 SIMDs (values worked by hand)."""
    assert isa.occupancy_gfx90a(64, lds_bytes=49152, num_warps=4) == 1  # one 48 KiB workgroup a CU
    assert isa.occupancy_gfx90a(64, lds_bytes=49152, num_warps=8) == 2
    assert isa.occupancy_gfx90a(64, lds_bytes=16384, num_warps=4) == 4  # four workgroups
    assert isa.occupancy_gfx90a(64, lds_bytes=16385, num_warps=4) == 3  # 33 blocks of 512 B: three fit
    assert isa.occupancy_gfx90a(200, lds_bytes=16384, num_warps=4) == 2  # registers are the lower limit
    assert isa.occupancy_gfx90a(64, lds_bytes=65536, num_warps=1) == 1  # one wave, on one SIMD
    assert isa.occupancy_gfx90a(64, lds_bytes=2048, num_warps=1) == 8  # 32 one-wave groups: registers cap it
    assert isa.occupancy_gfx90a(64, lds_bytes=65537, num_warps=4) == 0  # does not fit: cannot launch
    assert isa.occupancy_gfx90a(64, lds_bytes=0, num_warps=8) == 8  # no LDS: no limit from it


def test_occupancy_sgpr_limit():
    """GFX9's scalar register file: up to 100 SGPRs (VCC, FLAT_SCRATCH, XNACK included, as `.sgpr_count` counts
    them) leave gfx90a's 8 waves a SIMD, 101 or more 7 (LLVM's getOccupancyWithNumSGPRs; values by hand)."""
    assert isa.occupancy_gfx90a(64, sgpr_count=100) == 8
    assert isa.occupancy_gfx90a(64, sgpr_count=101) == 7
    assert isa.occupancy_gfx90a(64, num_warps=8, sgpr_count=101) == 6  # 28 slots a CU hold three 8-wave groups
    assert isa.occupancy_gfx90a(96, sgpr_count=101) == 5  # the VGPRs are the lower limit


def test_occupancy_counts_whole_workgroups():
    """A CU takes a workgroup's waves all at once (as HIP's occupancy API counts them: the CU's register-limited
    waves divided by the workgroup's), so an 8-warp kernel loses the SIMD slots that cannot hold a whole group
    (values worked by hand)."""
    assert isa.occupancy_gfx90a(96, num_warps=8) == 4  # 5 waves a SIMD = 20 a CU: two 8-wave groups = 16 waves
    assert isa.occupancy_gfx90a(96, num_warps=4) == 5  # five 4-wave groups fill the 20 slots
    assert isa.occupancy_gfx90a(96, num_warps=1) == 5
    assert isa.occupancy_gfx90a(160, num_warps=8) == 2  # 3 a SIMD = 12 a CU: one group
    assert isa.occupancy_gfx90a(96, lds_bytes=20480, num_warps=8) == 4  # LDS allows 3 groups, registers 2
    assert isa.occupancy_gfx90a(264, num_warps=8) == 0  # 1 a SIMD = 4 a CU: an 8-wave group never fits


def test_bad_spec_is_reported():
    """An fp8 matmul tile of 256 x 256 x 128 on 4 warps: the 256 x 256 fp32 accumulator spills (scratch)."""
    from cdna2_engine.ops.triton import kernels as k

    sig, const = next(s[2] for s in k.ISA_SPECS if s[0] == "fp8_matmul")
    big = dict(const, BLOCK_M=256, BLOCK_N=256, BLOCK_K=128)
    a = isa.audit_kernel("fp8_matmul_huge", k.matmul_kernel, sig, big, 4, True)
    assert a.violations(), a.row()


def test_unread_metadata_is_a_violation(monkeypatch):
    """A Triton whose amdgcn output no longer carries the keys the audit reads (simulated: the reader finds
    nothing) must fail the audit, not pass every rule it could not read."""
    from cdna2_engine.ops.triton import kernels as k

    name, fn, (sig, const), warps, matmul = next(s for s in k.ISA_SPECS if s[0] == "rms_norm")
    assert not isa.audit_kernel(name, fn, sig, const, warps, matmul).violations()
    monkeypatch.setattr(isa, "_meta", lambda text, key: None)
    bad = isa.audit_kernel(name, fn, sig, const, warps, matmul).violations()
    assert len(bad) == 1 and "private_segment_fixed_size, vgpr_count, amdhsa_float_denorm_mode_32" in bad[0]


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
    pinned = isa.audit_kernel("axpb", axpb, sig, {}, 1, False, isa.GFX90A)
    assert pinned.compiled, pinned.error
    assert pinned.extra["fp32_fma"]
    monkeypatch.setattr(tri, "COMPILE_OPTIONS", {"enable_fp_fusion": False})  # the audit can tell the difference
    unpinned = isa.audit_kernel("axpb", axpb, sig, {}, 1, False, isa.GFX90A)
    assert unpinned.compiled, unpinned.error
    assert not unpinned.extra["fp32_fma"]

    seen = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    monkeypatch.setattr(tri, "COMPILE_OPTIONS", {"enable_fp_fusion": True})
    launch = tri._Launch(torch.empty(1))
    launch.mod, launch.cpu = type("M", (), {"k": Fake()})(), False
    launch("k", (1,), num_warps=4)
    assert seen == [{"enable_fp_fusion": True, "num_warps": 4}]


def test_specialize_is_tritons_launch_rule():
    """What a launch compiles: a 16-byte aligned pointer and an integer divisible by 16 are marked divisible, an
    integer equal to 1 becomes a constant, others stay plain (Triton's JIT, runtime/jit.py), on both targets."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, n, m, one, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(a_ptr + i * n * m * one, i.to(tl.float32))

    t = torch.empty(64, dtype=torch.float32, device="meta")
    for target in (isa.GFX90A, isa.SM90):
        sig, const, attrs, opts = isa.specialize(probe, (t, 32, 8, 1), {"BLOCK": 16, "num_warps": 2}, target)
        assert sig == {"a_ptr": "*fp32", "n": "i32", "m": "i32", "one": "constexpr", "BLOCK": "constexpr"}
        assert const == {(3,): 1, (4,): 16} and opts["num_warps"] == 2
        assert ["tt.divisibility", 16] in attrs[(0,)] and attrs[(1,)] == [["tt.divisibility", 16]]
        assert not attrs.get((2,))  # m = 8
        _, _, attrs, _ = isa.specialize(probe, (t[1:], 8, 8, 2), {"BLOCK": 16}, target)  # 4 bytes in: not aligned
        assert ["tt.divisibility", 16] not in attrs.get((0,), []) and not attrs.get((1,))


@pytest.fixture(scope="module")
def recorded() -> dict[str, list]:
    return {"gfx90a": isa.record_launches(isa.GFX90A), "sm_90": isa.record_launches(isa.SM90)}


def test_launches_are_recorded_as_each_target_dispatches(recorded):
    """The V4-Flash slice's launches, on meta tensors, take each target's paths: no PTX kernels and the E4M3 bit
    decode for gfx90a, the tensor-core MXFP4/FP8 kernels and the hardware conversion for sm_90; a prefill's MoE
    dots and mix dots in each target's tiles (MOE_DOT / MOE_DOT_ROCM, HC_MIX_DOT / HC_MIX_DOT_ROCM)."""
    import torch

    rocm, cuda = recorded["gfx90a"], recorded["sm_90"]
    for calls in (rocm, cuda):
        assert all(a.device.type == "meta" for c in calls for a in c.args if isinstance(a, torch.Tensor))
        assert all(c.where.startswith("model.py:") for c in calls)
        assert {"fp8_stream_kernel", "moe_gate_up_kernel", "moe_down_kernel", "attention_kernel",
                "attention_combine_kernel", "index_scores_kernel", "compress_pool_kernel", "route_kernel",
                "hc_pre_kernel", "hc_post_kernel", "dense_mma_kernel"} <= {c.kernel for c in calls}
    ptx_only = {"moe_mma_gate_up_kernel", "moe_mma_down_kernel", "fp8_mma_kernel"}
    assert not ptx_only & {c.kernel for c in rocm} and ptx_only <= {c.kernel for c in cuda}
    assert {c.kwargs["HW"] for c in rocm if c.kernel == "fp8_stream_kernel"} == {False}
    assert {c.kwargs["HW"] for c in cuda if c.kernel == "fp8_stream_kernel"} == {True}
    assert all(c.kwargs["num_warps"] >= 1 and c.kwargs["enable_fp_fusion"] for c in rocm)

    def kw(calls, kernel, key):  # the values `key` takes in the launches of `kernel` that pass it
        return {c.kwargs[key] for c in calls if c.kernel == kernel and key in c.kwargs}

    assert kw(rocm, "moe_down_kernel", "SWAP") == {False} and kw(cuda, "moe_down_kernel", "SWAP") == {True}
    assert kw(rocm, "hc_mix_dot_kernel", "BLOCK_K") == {64} and kw(cuda, "hc_mix_dot_kernel", "BLOCK_K") == {128}


def test_inline_ptx_follows_the_target(monkeypatch):
    """With the tensor-core MoE off, one token takes the MXFP4 stream, whose PTX decode (PRMT) only sm_90 gets."""
    from cdna2_engine.ops import triton as tri

    monkeypatch.setitem(tri.MOE_MMA, "on", False)
    for target, prmt in ((isa.GFX90A, False), (isa.SM90, True)):
        calls = isa.record_launches(target, prompts=(8,), batches=(1,))
        assert {c.kwargs["PRMT"] for c in calls if c.kernel == "moe_gate_up_kernel" and c.kwargs["STREAM"]} == {prmt}


def test_gfx90a_refuses_split_tiles_over_one_wavefront(monkeypatch):
    """On gfx90a the split-K sum's barrier does not wait for other wavefronts' partial stores, so one wavefront must
    store a split tile's partials: the one-token MoE down's in-launch sum over 128-row tiles is refused there, and
    launched for sm_90 (where the barrier and the release are cumulative)."""
    from cdna2_engine.ops import triton as tri

    monkeypatch.setitem(tri.MOE_STREAM_DOWN, "BLOCK_N", 128)
    monkeypatch.setitem(tri.MOE_MMA, "on", False)  # sm_90 takes the stream too
    with pytest.raises(ValueError, match="MOE_STREAM_DOWN: a split-K tile of 128 partials on ROCm"):
        isa.record_launches(isa.GFX90A, prompts=(8,), batches=(1,))
    calls = isa.record_launches(isa.SM90, prompts=(8,), batches=(1,))
    assert {c.kwargs["BLOCK_N"] for c in calls if c.kernel == "moe_down_kernel" and c.kwargs["SUM"]} == {128}


def test_recording_restores_the_engine_even_when_it_fails(monkeypatch):
    """The launch recorder swaps three engine functions for the target's answers and puts them back, also when
    the model raises midway (later real runs in the process must launch for real, on their own device)."""
    from cdna2_engine.model import Model
    from cdna2_engine.ops import triton as tri

    before = tri._Launch.__call__, tri._cuda_cc, tri._rocm

    def broken(self, *a, **kw):
        assert tri._rocm(None) and tri._cuda_cc(None) == (0, 0)  # inside: answered for gfx90a
        raise RuntimeError("model failed midway")

    monkeypatch.setattr(Model, "step", broken)
    with pytest.raises(RuntimeError, match="midway"):
        isa.record_launches(isa.GFX90A, prompts=(8,), batches=(1,))
    assert (tri._Launch.__call__, tri._cuda_cc, tri._rocm) == before


def test_v4_flash_launches_compile_clean_on_gfx90a(recorded):
    """Every distinct launch, specialized as at launch time, compiles clean for gfx90a, and decode's one-token
    FP8 stream is compiled for M = 1 (a constant), which the unspecialized spec is not."""
    from cdna2_engine.ops.triton import kernels

    audits = isa.audit_launches(isa.GFX90A, recorded["gfx90a"])
    print("\n" + isa.report(audits))
    bad = [f"{a.name}: {v}" for a in audits for v in a.violations()]
    assert not bad, "\n".join(bad)
    assert {a.name.split(" @ ")[0] + "_kernel" for a in audits} == {c.kernel for c in recorded["gfx90a"]}
    assert all(a.vgpr and 1 <= a.waves_per_simd <= 8 for a in audits)
    rope = [a for a in audits if a.name.startswith("rope @")]
    assert rope and min(a.waves_per_simd for a in rope) >= 4  # prefill's q RoPE took 200-260 VGPRs (NOTES 137)
    stream = next(c for c in recorded["gfx90a"] if c.kernel == "fp8_stream_kernel")
    sig, _, _, _ = isa.specialize(kernels.fp8_stream_kernel, stream.args, stream.kwargs, isa.GFX90A)
    assert sig["M"] == "constexpr"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="compares with what the JIT compiled on a real launch: needs a GPU (run on the H200)")
def test_specialize_matches_the_jits_own_compile_gpu(tmp_path):
    """On a GPU, for every launch of a tiny model's prefill and decode, specialize() gives the signature,
    constants and attributes of the kernel the JIT compiled and ran (odd tiny dims: a mix of marked and not)."""
    import torch
    import triton

    import cdna2_engine
    from cdna2_engine.ops import triton as tri

    from tiny_configs import make_checkpoint, make_config

    cfg = make_config("mixed")
    model = cdna2_engine.load_model(make_checkpoint(tmp_path, cfg, seed=3), dtype=torch.bfloat16, device="cuda",
                                    backend="triton")
    calls, launch = [], tri._Launch.__call__

    def passthrough(self, name, grid, *args, **kwargs):
        calls.append((name, grid, args, {**tri.COMPILE_OPTIONS, **kwargs}))
        launch(self, name, grid, *args, **kwargs)

    tri._Launch.__call__ = passthrough
    try:
        model.generate(torch.randint(0, cfg.vocab_size, (1, 40), device="cuda"), 3, graph=False)
    finally:
        tri._Launch.__call__ = launch
    t = triton.runtime.driver.active.get_current_target()  # CUDA or ROCm, as the JIT compiled for it
    target = (t.backend, t.arch, t.warp_size)
    assert len(calls) > 50
    for name, grid, args, kwargs in calls:
        fn = getattr(tri._compiled, name)
        compiled = fn.warmup(*args, grid=grid, **kwargs).src  # the JIT's cached kernel for these arguments
        sig, const, attrs, _ = isa.specialize(fn, args, kwargs, target)
        assert (sig, const, attrs) == (compiled.signature, compiled.constants, compiled.attrs), name


def test_violations_name_the_fix():
    """Each rule's message says what to change and where, not only what is wrong."""
    a = isa.KernelAudit("k", "gfx90a", True, vgpr=512, agpr=256, scratch_bytes=896, lds_bytes=81920, has_mfma=False,
                        denorm_f16=0, denorm_f32=0, matmul=True)
    v = a.violations()
    assert len(v) == 5, v
    scratch, lds, mfma, f16, f32 = v
    for msg in (scratch, lds, mfma):
        assert "engine/ops/triton/__init__.py" in msg and "engine/ops/triton/kernels/specs.py" in msg, msg
    assert "num_warps" in scratch and "num_stages" in lds and "matmul=False" in mfma
    assert all("allow_flush_denorm" in m and "COMPILE_OPTIONS" in m for m in (f16, f32))
