"""The few-token tensor-core FP8 linear (kernels/mma.py `fp8_mma_kernel`) against independent readings of it.

The kernel is inline PTX (the GPU tests below and bench/probe_fp8.py --mma run it; tests/test_mma_emulated.py in the
interpreter). On the CPU:
- the E4M3 -> bf16 decode is executed from the kernel's own PTX text (tests/ptx_emulator.py: prmt with sign
  replication, shl, and), for all 256 codes, against torch's float8_e4m3fn;
- the operand mapping (which bytes and which tokens' x values a lane feeds to which mma step) is replayed through
  the PTX ISA's m16n8k16 fragment tables and must give W @ x for each token exactly;
- the kernel assembles for sm_80, where the path turns on.
Also on the GPU: the one-token FP8 stream with q's norm fused, under its register cap.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
from ptx_emulator import run_block

from cdna2_engine.ops import QWeight
from cdna2_engine.ops import reference as ref
from cdna2_engine.ops import triton as tri
from cdna2_engine.ops.triton import kernels as K
from cdna2_engine.ops.triton.kernels import mma


def run_decode_ptx(words: list[int]) -> tuple[list[int], list[int]]:
    """Execute `_e4m3_bf16x2`'s PTX text (tests/ptx_emulator.py: prmt with sign replication, shl, and) on words
    (outputs $0, $1)."""
    asm = re.search(r'"\{(.*?)\}"', inspect.getsource(mma._e4m3_bf16x2.fn).replace('"\n        "', ""), re.S).group(1)
    regs = {"$2": np.array(words, dtype=np.uint32)}
    run_block(asm, regs, len(words))
    return regs["$0"].tolist(), regs["$1"].tolist()


def bf16_halves(reg: int) -> tuple[float, float]:
    t = torch.tensor([(reg & 0xFFFF) << 16, (reg >> 16) << 16], dtype=torch.int64).to(torch.int32)
    lo, hi = t.view(torch.float32).double().tolist()
    return lo, hi


def test_decode_ptx_is_exact_for_every_code():
    """Bytes (b0, b1, b2, b3) -> pairs (b0, b1), (b2, b3) of bf16 value x 2^-120, exactly, for all 256 codes in
    each byte position, beside codes of other signs (the two NaN codes decode as finite values, as the portable
    bit decode does: checkpoints carry none)."""
    g = torch.Generator().manual_seed(5)
    lanes = torch.stack([torch.arange(256), torch.arange(255, -1, -1), torch.randperm(256, generator=g),
                         torch.randperm(256, generator=g)], dim=1)  # [256 words, 4 bytes]: each code at each byte
    want = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).double()
    words = [c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24 for c in lanes.tolist()]
    for codes, p, q in zip(lanes.tolist(), *run_decode_ptx(words), strict=True):
        for c, v in zip(codes, (*bf16_halves(p), *bf16_halves(q)), strict=True):
            v *= 2.0**120
            if c & 0x7F == 0x7F:
                assert v == (-1) ** (c >> 7) * 480.0  # NaN's bits read as 2^8 x 1.875
            else:
                assert v == want[c].item(), (hex(c), v, want[c].item())


def test_tensor_core_fp8_is_off_on_the_cpu():
    x = torch.zeros(4, 1, 1024, dtype=torch.bfloat16)
    assert not tri._fp8_mma_on(x, torch.zeros(256, 1024, dtype=torch.uint8), 256, 1024)


def test_fp8_mma_compiles_for_sm80():
    """The path is on from sm_80 (`_fp8_mma_on`), so its PTX must assemble there, not only on the ISA tier's sm_90."""
    import warnings

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pytest_cdna2.isa import with_defaults

    _, fn, (sig, const), warps, _ = next(s for s in K.ISA_SPECS_SM90 if s[0] == "fp8_mma")
    sig, const = with_defaults(fn, dict(sig), dict(const))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 80, 32), options={"num_warps": warps})
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in k.asm["ptx"] and k.asm["cubin"]


def _fp8(n: int, k: int, gen: torch.Generator, dev: torch.device, top: int = 187) -> QWeight:
    """Random E4M3 codes (no NaN), subnormals included, scales spread over 2^-20..2^20 with some bytes near
    the top (2^60, and `top`: products there must not wrap an exponent; 200 = 2^73: the scale must not meet the
    kernel's 2^56 before the partial does)."""
    b = torch.randint(0, 256, (n, k), generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x38
    s = torch.randint(107, 148, (n // 128, k // 128), generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)
    s[::3, ::2] = 187
    s[1::3, 1::2] = top
    return QWeight(b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX mma.sync: needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("m", [2, 3, 8])
@pytest.mark.parametrize("r,k,groups,min_warps", [(32768, 1024, 1, 2048), (1024, 4096, 8, 2048),
                                                  (4096, 8192, 1, 2048), (384, 256, 1, 1)])
def test_fp8_linear_tensor_core_gpu(r, k, groups, min_warps, m, monkeypatch):
    """V4-Flash shapes (wq_b, the grouped wo_a, wo_b split along K, and an unsplit small one) at m tokens against
    the float64 reference, fp32 output (so only the fp32 sums' rounding remains: 1e-5, the fp32 activation bound of
    DESIGN.md section 5) also with x scaled by 2^50 and 2^-40 (inside the documented range: no overflow, no
    flushed products), and bf16 output (its own rounding: relative 2^-9 a value on average, 2^-8 at most, so 5e-3
    over the output); each token on its own (a token read as another's
    would fail it); NaN-poisoned outputs; bit-reproducible; the split counters left zero."""
    monkeypatch.setattr(tri, "POISON", True)
    monkeypatch.setitem(tri.FP8_MMA, "min_warps", min_warps)
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(r + k + m)
    w = _fp8(r * groups, k, gen, dev)
    x = (torch.randn(m, groups, k, generator=gen, device=dev) * 3).to(torch.bfloat16)
    if not tri._fp8_mma_on(x, w.data.view(torch.uint8), r, k):
        pytest.skip("this GPU does not take the tensor-core FP8 path (needs sm_80+)")
    want = torch.einsum("mgk,grk->mgr", x.double(), ref.dequantize(w, torch.float64).view(groups, r, k))
    for scale in (1.0, 2.0**50, 2.0**-40):
        got32 = tri._fp8_grouped(x * scale, w, groups, torch.float32).double() / scale
        for t in range(m):
            err32 = ((got32[t] - want[t]).norm() / want[t].norm()).item()
            assert err32 <= 1e-5, (scale, t, err32)
    got = tri._fp8_grouped(x, w, groups)
    assert got.dtype == torch.bfloat16
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= 5e-3, err
    assert torch.equal(got, tri._fp8_grouped(x, w, groups)), "not bit-reproducible"
    assert not tri._locks(dev, 0).any()
    w = _fp8(r * groups, k, gen, dev, top=200)  # x at 2^50 would take these outputs past fp32's range: x as drawn
    want = torch.einsum("mgk,grk->mgr", x.double(), ref.dequantize(w, torch.float64).view(groups, r, k))
    got32 = tri._fp8_grouped(x, w, groups, torch.float32).double()
    for t in range(m):
        assert ((got32[t] - want[t]).norm() / want[t].norm()).item() <= 1e-5, t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="register cap (maxnreg): a CUDA compile option, needs a GPU")
@pytest.mark.parametrize("r", [32768, 8192])
def test_fp8_stream_fused_norm_register_cap_gpu(r, monkeypatch):
    """wq_b's and the indexer's wq_b shapes (1024 -> r) with q's RMSNorm fused into the one-token stream, launched
    with its registers capped (FP8_STREAM["NORM_MAXNREG"], so the launch fits one wave): the same bits as uncapped,
    the same values as rms_norm then linear (fp32 output, both from the same bf16-rounded normed x: only the fp32
    sums' order differs, 1e-5 as DESIGN.md section 5's fp32 bound), and within bf16's 1e-2 of the float64 reference
    (which does not round the normed x); NaN-poisoned outputs."""
    if torch.version.hip is not None:
        pytest.skip("maxnreg is a CUDA compile option: ROCm launches the stream uncapped")
    monkeypatch.setattr(tri, "POISON", True)
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(r)
    w = _fp8(r, 1024, gen, dev)
    x = (torch.randn(1, 1024, generator=gen, device=dev) * 3).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(1024, generator=gen, device=dev)).to(torch.bfloat16)
    cap, seen = tri.FP8_STREAM["NORM_MAXNREG"], []

    def spy(self, name, grid, *args, **kw):  # the launch as the backend makes it, and the kernel it compiled
        k = getattr(self.mod, name)[grid](*args, **{**tri.COMPILE_OPTIONS, **kw})
        seen.append((name, kw.get("maxnreg"), k.n_regs))

    with monkeypatch.context() as m:
        m.setattr(tri._Launch, "__call__", spy)
        capped = tri.linear(x, w, torch.float32, x_norm=(nw, 1e-6))
    assert cap and seen and all(name == "fp8_stream_kernel" and mr == cap and 0 < regs <= cap
                                for name, mr, regs in seen), seen
    monkeypatch.setitem(tri.FP8_STREAM, "NORM_MAXNREG", None)
    assert torch.equal(capped, tri.linear(x, w, torch.float32, x_norm=(nw, 1e-6)))
    apart = tri.linear(tri.rms_norm(x, nw, 1e-6), w, torch.float32)
    assert ((capped - apart).norm() / apart.norm()).item() <= 1e-5
    want = ref.linear(x.double(), w, x_norm=(nw.double(), 1e-6))
    assert ((capped.double() - want).norm() / want.norm()).item() <= 1e-2
