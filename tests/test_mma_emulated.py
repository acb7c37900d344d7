"""The inline-PTX tensor-core kernels (kernels/mma.py) in Triton's interpreter on the CPU, their PTX run by
tests/ptx_emulator.py (a reading of the PTX ISA), against the float64 reference at small shapes.

The per-phase MXFP4 pair and the FP8 kernel are the ones the H200 runs (tests/test_mma_layout.py `*_gpu`): passing
here they also check the emulator's reading. Outputs are fp32 (the interpreter converts fp32 to bf16 by truncation,
a whole bf16 ulp, which would hide errors the size of h's bf16 lo part), within 1e-4 of float64: the kernels' own
error is h split hi + lo in bf16 (~2^-16 relative, measured 1.2e-5), and dropping the lo part costs ~4e-3. Each
launch's num_warps must give the kernels' [32 W] per-thread tensors one element a thread (the interpreter ignores it).
"""

from __future__ import annotations

import pytest
import torch
from ptx_emulator import installed
from test_mma_layout import rel_by_rows

from cdna2_engine.ops import QWeight
from cdna2_engine.ops import reference as ref
from cdna2_engine.ops import triton as tri

TOL = 1e-4  # module docstring
WARPS = {"moe_mma_gate_up_kernel": 1, "moe_mma_down_kernel": 1, "fp8_mma_kernel": 1}  # one-warp programs


def moe_inputs(seed: int, d: int, inter: int, e: int = 4, k: int = 2, t: int = 1) -> tuple:
    """MXFP4 stacks (some scales past 192, where a decode folding 2^62 into the exponent wraps), t bf16 tokens, k
    distinct experts each, their weights and a shared-expert output."""
    g = torch.Generator().manual_seed(seed)

    def weight(n: int, kk: int) -> QWeight:
        b = torch.randint(-128, 128, (e, n, kk // 2), generator=g, dtype=torch.int32).to(torch.int8)
        s = torch.randint(118, 128, (e, n, kk // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        s[:, ::37, ::5] = 200
        return QWeight(b, s.view(torch.float8_e8m0fnu), "mxfp4")

    w1, w3, w2 = weight(inter, d), weight(inter, d), weight(d, inter)
    x = (torch.randn(t, d, generator=g) * 0.2).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    shared = (torch.randn(t, d, generator=g) * 0.05).to(torch.bfloat16)
    return w1, w3, w2, x, idx, torch.rand(t, k, generator=g), shared


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # SwiGLU's exp(-g) at large |g|


@pytest.fixture
def emulated(monkeypatch):
    """The emulator installed, every buffer the kernels write poisoned (NaN), and each inline-PTX launch's warps
    checked: the kernels' per-thread tensors are [32 W] for W = num_warps (channel split: CT KS)."""
    monkeypatch.setattr(tri, "POISON", True)
    launch = tri._Launch.__call__
    launched = []

    def checked(self, name, grid, *args, **kwargs):
        want = WARPS.get(name) or (kwargs["CT"] * kwargs["KS"] if name == "moe_mma_one_kernel" else None)
        assert want is None or kwargs["num_warps"] == want, (name, kwargs["num_warps"], want)
        launched.append(name)
        return launch(self, name, grid, *args, **kwargs)

    monkeypatch.setattr(tri._Launch, "__call__", checked)
    with installed():
        yield launched


@pytest.mark.parametrize("t", [1, 4])
def test_pair_in_the_interpreter(emulated, t, monkeypatch):
    """gate/up then down (`moe_mma_gate_up_kernel`, `moe_mma_down_kernel`; K split 4 x 2 at one token, 4 x 1 at
    four): each token's k pairs summed in the down launch with the shared expert."""
    inter = 512 if t == 1 else 256  # down's K split: 2 / 1 (`_mma_splits`)
    w1, w3, w2, x, idx, wt, shared = moe_inputs(21 + t, d=512, inter=inter, t=t)
    monkeypatch.setattr(tri, "_cuda_cc", lambda device: (9, 0))
    assert tri._mma_on(x, inter, 2)  # shapes the launches take
    monkeypatch.setattr(tri, "_cuda_cc", lambda device: (0, 0))  # no programmatic dependent launch
    plan = tri.moe_prepare(x, idx, 4, mma=True)
    hb = tri.moe_gate_up(x, w1, w3, plan, 7.0, mma=True)
    got = tri.moe_down(hb, w2, wt, plan, out=torch.empty(x.shape, dtype=torch.float32), add=shared)
    assert emulated == ["moe_mma_gate_up_kernel", "moe_mma_down_kernel"]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0, shared.double())
    assert rel_by_rows(got, want, w2) <= TOL


def test_two_pairs_a_row_in_the_interpreter(emulated, monkeypatch):
    """Program rows of two pairs of one expert (MOE_MMA TWO_MIN_T; `moe_pair_rows_kernel`'s table): the second
    pair's x in the B columns of the first's lo parts, a second mma from each decoded down tile."""
    monkeypatch.setitem(tri.MOE_MMA, "TWO_MIN_T", 2)
    w1, w3, w2, x, idx, wt, shared = moe_inputs(27, d=512, inter=512, e=3, t=2)
    plan = tri.moe_prepare(x, idx, 3, mma=True)
    assert (plan[-2][:, 1] >= 0).any()  # some row holds two pairs
    got = tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 7.0, mma=True), w2, wt, plan,
                       out=torch.empty(x.shape, dtype=torch.float32), add=shared)
    assert emulated == ["moe_pair_rows_kernel", "moe_mma_gate_up_kernel", "moe_mma_down_kernel"]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0, shared.double())
    assert rel_by_rows(got, want, w2) <= TOL


@pytest.mark.parametrize("ct,ks,d", [(4, 1, 512), (4, 2, 512), (4, 4, 1024), (8, 1, 512), (8, 2, 1024)])
def test_channel_split_in_the_interpreter(emulated, ct, ks, d, monkeypatch):
    """MOE_MMA_ONE's kernel and sum launch: 64 channels a program (h in half of each hb row: the poisoned other
    half must stay out) or 128, each K split of gate/up over a program's warps (their parts met through hx), the
    shared expert added."""
    monkeypatch.setitem(tri.MOE_MMA_ONE, "CT", ct)
    monkeypatch.setitem(tri.MOE_MMA_ONE, "KS", ks)
    w1, w3, w2, x, idx, wt, shared = moe_inputs(31 + ct + ks, d=d, inter=256)
    assert tri._mma_one_on(x, 256) is False  # off by default: the launch below is called directly
    monkeypatch.setitem(tri.MOE_MMA_ONE, "on", True)
    assert tri._mma_one_on(x, 256)
    f32 = torch.float32
    got = tri._mma_one(x, w1, w3, w2, idx, wt, 7.0, lambda: shared, out=torch.empty(x.shape, dtype=f32))
    assert emulated == ["moe_mma_one_kernel", "moe_mma_one_sum_kernel"]
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0, shared.double())
    assert rel_by_rows(got, want, w2) <= TOL
    plain = tri._mma_one(x, w1, w3, w2, idx, wt, 7.0, None, out=torch.empty(x.shape, dtype=f32))
    assert rel_by_rows(plain, ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0), w2) <= TOL
    bf16 = tri._mma_one(x, w1, w3, w2, idx, wt, 7.0, None)  # the default: x's dtype (truncated here, 1 ulp)
    assert bf16.dtype == x.dtype and rel_by_rows(bf16, plain.double(), w2) <= 2.0**-7


def test_fp8_mma_in_the_interpreter(emulated, monkeypatch):
    """`fp8_mma_kernel` (2-8 tokens, K split with the last arrival's sum), taken as on an sm_90 GPU, fp32 out."""
    monkeypatch.setattr(tri, "_cuda_cc", lambda device: (9, 0))
    g = torch.Generator().manual_seed(41)
    m, r, k = 3, 64, 512
    bits = torch.randint(0, 256, (r, k), generator=g, dtype=torch.int32).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x38  # no E4M3 NaN codes
    scale = torch.randint(120, 130, (1, k // 128), generator=g, dtype=torch.int32).to(torch.uint8)
    w = QWeight(bits.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), "fp8")
    x = (torch.randn(m, 1, k, generator=g) * 0.5).to(torch.bfloat16)
    assert tri._fp8_mma_on(x, tri._u8(w.data), r, k)
    got = tri._fp8_grouped(x, w, 1, torch.float32)
    want = ref.linear(x.double().reshape(m, k), w)
    assert emulated == ["fp8_mma_kernel"]
    assert rel(got.reshape(m, r), want) <= TOL
