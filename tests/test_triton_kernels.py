"""Triton kernels in Triton's interpreter (CPU) against the reference ops computed in float64.

The backend runs CPU tensors through an interpreted copy of its kernels (engine/ops/triton/__init__.py),
so no TRITON_INTERPRET is needed in this process and nothing leaks into other tests. Every case draws
fresh random inputs from its own seed, poisons every kernel-written buffer with NaN first, uses sizes that
are not multiples of the blocks, and batch 1 and 2. Tolerances (DESIGN.md section 5, kernel tier): fp32
operands (dots in IEEE fp32, no tf32) rel. Frobenius <= 1e-5; fp16 operands <= 1e-2. The interpreter
cannot run bf16 (DESIGN.md section 7), so bf16 is checked on the GPU by bench/bench_kernels.py.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from cdna2_engine.ops import QWeight, get_ops  # noqa: E402
from cdna2_engine.ops import reference as ref  # noqa: E402
from cdna2_engine.ops import triton as tri  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _poison(monkeypatch, kernels_launched):
    """Every output buffer starts as NaN, and every test must launch a kernel (`kernels_launched`)."""
    monkeypatch.setattr(tri, "POISON", True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in output (an element the kernel never wrote?)"
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def fp8_weight(n: int, k: int, g: torch.Generator) -> QWeight:
    """Random E4M3 codes (subnormals included, NaN codes 0x7F/0xFF avoided) and UE8M0 scales."""
    b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    s = torch.randint(118, 128, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.int32).to(torch.uint8)
    return QWeight(b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "fp8")


def fp4_weight(e: int, n: int, k: int, g: torch.Generator) -> QWeight:
    """Random packed E2M1 bytes (every code, both nibbles) and UE8M0 scales, one per 32 along K."""
    b = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int32).to(torch.int8)
    s = torch.randint(118, 128, (e, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return QWeight(b, s.view(torch.float8_e8m0fnu), "mxfp4")


# M = B*S rows: 1 takes the stream kernel (split along K here), 3 and 2*11 = 22 the dot kernel. hw: the stream
# kernel's E4M3 decode by fp8 conversion (the hardware path on sm_90; the interpreter emulates it) or by bit ops.
# prefetch: the register double-buffered stream (W as uint32 words; K = 298 is not a multiple of 4 and falls back;
# its hardware conversion is inline PTX, so the interpreter runs the bit decode there). long: K counts as long
# (FP8_STREAM_LONG's narrow row tiles, 4 x 256 in the interpreter: K = 600 is a split of 512 columns, 5 scale
# blocks wide, and one of 88; 202 rows leave the last tile ragged). local: products summed in the thread before the
# accumulator (FP8_STREAM's LOCAL, 16 by default; 1 and 4: one accumulator a product, or a word's four).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,hw,unroll,prefetch,k,long,local", [
    (1, 1, False, 1, False, 300, False, 16), (1, 1, True, 2, False, 300, False, 16),
    (1, 1, False, 1, True, 300, False, 16), (1, 1, False, 2, True, 300, False, 16),
    (1, 1, False, 1, True, 298, False, 16), (1, 3, False, 1, False, 300, False, 16),
    (2, 11, False, 1, False, 300, False, 16), (1, 1, False, 1, False, 600, True, 16),
    (1, 1, True, 1, False, 600, True, 16), (1, 1, False, 1, True, 600, True, 16),
    (1, 1, False, 1, False, 300, False, 1), (1, 1, False, 1, False, 300, False, 4),
    (1, 1, False, 1, True, 300, False, 4), (1, 1, False, 1, True, 300, False, 32),
    (1, 1, True, 1, False, 600, True, 32)])
def test_fp8_linear(dtype, b, s, hw, unroll, prefetch, k, long, local, monkeypatch):
    monkeypatch.setitem(tri.FP8_STREAM, "LOCAL", local)
    monkeypatch.setitem(tri.FP8_STREAM_LONG, "min_k", 512 if long else 1 << 30)
    monkeypatch.setitem(tri.FP8_STREAM, "HW", hw)
    monkeypatch.setitem(tri.FP8_STREAM, "UNROLL", unroll)
    monkeypatch.setitem(tri.FP8_STREAM, "PREFETCH", prefetch)
    g = gen(100 + 10 * b + s)
    w = fp8_weight(202 if long else 200, k, g)
    x = torch.randn(b, s, k, generator=g).to(dtype)
    assert rel(tri.linear(x, w), ref.linear(x.double(), w)) <= TOL[dtype]
    assert not tri._locks(x.device, 0).any()  # a split-K launch (K 300 at the CPU's 64-wide steps) reset them
    y32 = tri.linear(x, w, torch.float32)  # fp32 out from any x: written from the fp32 sums, not via x's dtype
    assert y32.dtype == torch.float32 and rel(y32, ref.linear(x.double(), w)) <= TOL[torch.float32]
    stream = b * s <= 2  # the interpreter's stream path, where the norm and swiglu are fused into the load
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)  # q_norm applied by the stream as it reads x
    normed = tri.linear(x * 3, w, x_norm=(nw, 1e-6))
    assert rel(normed, ref.linear(x.double() * 3, w, x_norm=(nw.double(), 1e-6))) <= TOL[dtype]
    if stream:  # the fused form against the two-launch one (elsewhere they are the same calls)
        assert rel(normed, tri.linear(tri.rms_norm(x * 3, nw, 1e-6), w)) <= TOL[torch.float32]
    gu = torch.randn(b, s, 2 * k, generator=g).to(dtype) * 4  # [gate | up] through swiglu as w reads it
    for limit in (7.0, 0.0):  # clamped (|values| reach 7), unclamped
        got = tri.linear(gu, w, glu=limit)
        assert rel(got, ref.linear(gu.double(), w, glu=limit)) <= TOL[dtype]
        if stream:
            assert rel(got, tri.linear(tri.swiglu(gu[..., :k], gu[..., k:], limit), w)) <= TOL[torch.float32]
    both = tri.linear(gu, w, x_norm=(nw, 1e-6), glu=7.0)  # swiglu first, then the norm (one of them fused)
    assert rel(both, ref.linear(gu.double(), w, x_norm=(nw.double(), 1e-6), glu=7.0)) <= TOL[dtype]


@pytest.mark.parametrize("dtype, scales, x_scale, fold, m", [
    (dtype, scales, x_scale, False, m) for dtype, scales, x_scale in
    [(torch.float32, [100, 135, 140, 127], 1.0), (torch.float16, [100, 102, 104, 107], 2.0**10)] for m in (1, 5)] + [
    (torch.float32, [100, 135, 140, 127], 1.0, True, 5)])
def test_fp8_linear_extreme_scales(dtype, scales, x_scale, fold, m, monkeypatch):
    """Block scales far from the usual 2^-9..2^0, which the loader accepts (UE8M0 bytes, one per 128 x 128 block
    of the 2 x 2): 2^-27..2^13 with fp32 x, 2^-27..2^-20 with fp16 x (x near 2^10 keeps y in fp16's range). Every
    dequantized weight is an fp32 number, so the result is within fp32 sums (1e-5) or fp16's output rounding
    (2^-11, with fp32 sums: 1e-3) of float64. Caught: 2^120 times a scale from 2^8 up overflowing fp32, and weight
    times scale rounded to fp16 below 2^-15. `fold`: fp32 stands in for bf16 (which the interpreter cannot run) in
    the tile's folded form (m = 5 takes the tile; one row, the stream)."""
    if fold:
        monkeypatch.setattr(tri, "FOLD_DTYPES", (torch.bfloat16, torch.float32))
    g = gen(300 + scales[0] + m)
    w = fp8_weight(130, 256, g)
    w = QWeight(w.data, torch.tensor(scales, dtype=torch.uint8).view(2, 2).view(torch.float8_e8m0fnu), "fp8")
    x = (torch.randn(m, 256, generator=g) * x_scale).to(dtype)
    want = ref.linear(x.double(), w)
    assert torch.isfinite(want).all()
    assert rel(tri.linear(x, w), want) <= (1e-5 if dtype == torch.float32 else 1e-3)


def test_fp8_stream_local_reaches_the_kernel(monkeypatch):
    """LOCAL changes the order of the fp32 sums, so the bits of a float32 stream (K = 512: two 256-column steps of the
    interpreter's long tile) differ between LOCAL 1 and 16 while both stay within float32's tolerance of float64;
    a LOCAL that is no power of two dividing BLOCK_K is refused in one line."""
    monkeypatch.setitem(tri.FP8_STREAM_LONG, "min_k", 256)
    g = gen(7)
    w = fp8_weight(64, 512, g)
    x = torch.randn(1, 512, generator=g)
    want = ref.linear(x.double(), w)
    ys = {}
    for local in (1, 16):
        monkeypatch.setitem(tri.FP8_STREAM, "LOCAL", local)
        ys[local] = tri.linear(x, w)
        assert rel(ys[local], want) <= TOL[torch.float32]
    assert not torch.equal(ys[1], ys[16])
    for bad in (0, 3, 512):
        monkeypatch.setitem(tri.FP8_STREAM, "LOCAL", bad)
        with pytest.raises(ValueError, match="FP8_STREAM LOCAL"):
            tri.linear(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,hw,prefetch,long", [(1, 1, False, False, False), (2, 1, True, False, False),
                                                  (2, 1, False, True, False), (2, 5, False, False, False),
                                                  (1, 1, False, False, True)])
def test_fp8_grouped_linear(dtype, b, s, hw, prefetch, long, monkeypatch):
    """M = 1 and 2 take the stream kernel with per-row scales (72-row groups straddle the 128-row blocks); long:
    FP8_STREAM_LONG's narrow row tiles (the grouped wo_a has K = 4096 on V4-Flash)."""
    monkeypatch.setitem(tri.FP8_STREAM_LONG, "min_k", 128 if long else 1 << 30)
    monkeypatch.setitem(tri.FP8_STREAM, "HW", hw)
    monkeypatch.setitem(tri.FP8_STREAM, "PREFETCH", prefetch)
    g = gen(200 + 10 * b + s)
    rows, k = (74, 300) if long else (72, 136)  # long: 4-row tiles end ragged in each group, K splits
    w = fp8_weight(4 * rows, k, g)  # 4 groups: row blocks of 128 straddle the groups
    x = torch.randn(b, s, 4, k, generator=g).to(dtype)
    y = tri.grouped_linear(x, w, 4)
    assert rel(y, ref.grouped_linear(x.double(), w, 4)) <= TOL[dtype]
    assert torch.equal(tri.grouped_linear(x, w, 4), y)  # deterministic, and the split sums' counters were reset


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,k,limit,variant", [(1, 2, 7.0, "dot"), (3, 3, 0.0, "dot"), (9, 3, 1.5, "dot"), (40, 3, 7.0, "dot"),
                          (70, 3, 0.0, "dot"), (120, 3, 7.0, "dot"), (40, 3, 7.0, "dot_noswap"),
                          (70, 3, 0.0, "dot_noswap"), (1, 3, 7.0, "stream"),
                          (1, 2, 0.0, "stream"), (1, 3, 7.0, "stream_prefetch"), (4, 3, 7.0, "stream"),
                          (3, 2, 0.0, "stream_prefetch")])
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_experts(dtype, t, k, limit, variant, with_shared, monkeypatch):
    """variant: the tl.dot form (pair rows gathered into blocks of 16 rows, 32 at 40 tokens, 64 at 70, 128 at 120;
    its accumulator transposed (MOE_DOT SWAP) or, dot_noswap, not) or the dot-free stream, one program row per
    (token, slot) pair (for one token its down launch also sums the k rows, and the shared expert's output when
    given), also with register double buffering (the PRMT decode is inline PTX: GPU only, checked by
    bench_kernels.py)."""
    monkeypatch.setitem(tri.MOE_STREAM, "on", variant.startswith("stream"))
    monkeypatch.setitem(tri.MOE_STREAM, "PREFETCH", variant == "stream_prefetch")
    monkeypatch.setitem(tri.MOE_DOT, "SWAP", variant != "dot_noswap")
    g = gen(300 + t)
    e, d, inter = 5, 96, 160
    w1, w3, w2 = fp4_weight(e, inter, d, g), fp4_weight(e, inter, d, g), fp4_weight(e, d, inter, g)
    x = (torch.randn(t, d, generator=g) * 0.2).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wt = torch.rand(t, k, generator=g)
    shared = None
    if with_shared:  # as large as the routed sum, so a dropped or doubled add is far beyond the tolerance
        routed = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), limit)
        shared = (torch.randn(t, d, generator=g, dtype=torch.float64) * routed.std()).to(dtype)
    got = tri.moe_experts(x, w1, w3, w2, idx, wt, limit, shared)
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), limit,
                           None if shared is None else shared.double())
    assert rel(got, want) <= TOL[dtype]
    assert torch.equal(got, tri.moe_experts(x, w1, w3, w2, idx, wt, limit, shared)), "not bit-reproducible"
    assert not tri._locks(x.device, 0).any()
    assert (tri.moe_prepare(x, idx, e)[0] == 1) == variant.startswith("stream")  # the form named ran
    if variant.startswith("dot"):
        bm = tri.moe_prepare(x, idx, e)[0]
        assert bm == (16 if t < 27 else 32 if t < 54 else 64 if t < 107 else 128)
        assert tri._moe_cfg(tri._Launch(x), x, bm, t)[2]["SWAP"] == (variant == "dot")


@pytest.mark.no_kernel
def test_moe_dot_tiles_on_rocm(monkeypatch):
    """ROCm takes MOE_DOT_ROCM over MOE_DOT (no SWAP, 64-row blocks at most, 4-warp down: the forms whose gfx90a
    ISA holds 1-2 waves); a BLOCK_M_MAX that is not a row block is a ValueError naming it."""
    monkeypatch.setattr(tri, "_rocm", lambda device: True)
    down = tri._moe_dot_tile(torch.device("cpu"), down=True)
    assert (down["SWAP"], down["BLOCK_M_MAX"], down["num_warps"], down["BLOCK_N"]) == (False, 64, 4, 128)
    idx = torch.zeros(400, 2, dtype=torch.int64)  # 200 pairs an expert: 128 rows on CUDA, 64 here
    assert tri.moe_prepare(torch.zeros(400, 8), idx, 4)[0] == 64
    monkeypatch.setattr(tri, "_rocm", lambda device: False)
    assert tri.moe_prepare(torch.zeros(400, 8), idx, 4)[0] == 128
    monkeypatch.setitem(tri.MOE_DOT, "BLOCK_M_MAX", 48)
    with pytest.raises(ValueError, match="MOE_DOT BLOCK_M_MAX=48"):
        tri.moe_prepare(torch.zeros(400, 8), idx, 4)


@pytest.mark.no_kernel
def test_fp8_dot_block_k_must_divide_the_scale_block(monkeypatch):
    """FP8_DOT's BLOCK_K applies one 128 x 128 scale per K step: a tile that straddles two is a ValueError (as an
    sm_90 GPU would launch a prefill's GEMM: meta tensors, launches recorded, nothing run)."""
    from pytest_cdna2.isa import SM90, _dispatch_as

    monkeypatch.setitem(tri.FP8_DOT, "BLOCK_K", 96)
    w = QWeight(torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(2, 2, dtype=torch.float8_e8m0fnu, device="meta"), "fp8")
    x = torch.empty(100, 256, dtype=torch.bfloat16, device="meta")
    with _dispatch_as(SM90, []), pytest.raises(ValueError, match="FP8_DOT BLOCK_K=96 straddles"):
        tri.linear(x, w)


@pytest.mark.no_kernel
def test_moe_pairs_up_to_a_few_tokens(monkeypatch):
    """Up to MOE_PAIRS_MAX_T tokens (the stream's bound here: no tensor cores on the CPU) each (token, slot) pair is
    a block of its own, token-major; beyond, the pairs are grouped by expert into dot blocks."""
    monkeypatch.setitem(tri.MOE_PAIRS_MAX_T, "stream", 4)
    idx = torch.tensor([[3, 1], [1, 0], [2, 3], [0, 2], [1, 2]])
    x = torch.zeros(5, 8)
    bm, tok, pid, blk_e, lo, hi, rows, k = tri.moe_prepare(x[:4], idx[:4], 4)
    assert (bm, k, rows) == (1, 2, None) and tok.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and pid.tolist() == list(range(8))
    assert blk_e.tolist() == idx[:4].reshape(-1).tolist() and (hi - lo).tolist() == [1] * 8
    assert tri.moe_prepare(x, idx, 4)[0] == 16
    for t, bm in ((32, 16), (33, 32), (64, 32), (65, 64), (128, 64), (129, 128), (400, 128)):  # 4 experts, 2 a
        # token: the block holds an expert's mean share of pairs (t / 2), up to 128 rows
        assert tri.moe_prepare(torch.zeros(t, 8), torch.zeros(t, 2, dtype=torch.int64), 4)[0] == bm


@pytest.mark.no_kernel
def test_moe_blocks_cover_every_pair_once():
    g = gen(7)
    idx = torch.randint(0, 6, (13, 3), generator=g)
    pair_tok, pair_id, blk_e, lo, hi = tri.moe_blocks(idx, 6, 2)
    seen = []
    for e, a, z in zip(blk_e.tolist(), lo.tolist(), hi.tolist(), strict=True):
        if e < 0:
            continue
        rows = list(range(a, min(a + 2, z)))
        assert all(idx.reshape(-1)[pair_id[r]] == e for r in rows)
        seen += [pair_id[r].item() for r in rows]
    assert sorted(seen) == list(range(idx.numel()))
    assert torch.equal(pair_tok.long(), pair_id.long() // 3)


# (x scale, eps): V4's eps under rows of RMS 3, and an eps as large as the rows' mean square, where leaving eps
# out (or scaling it) changes every output by ~30% or more: the first alone cannot see eps.
NORM_SCALES = [(3.0, 1e-6), (0.1, 1e-2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,d,weighted", [(1, 37, True), (2, 37, False), (2, 130, True)])
@pytest.mark.parametrize("scale,eps", NORM_SCALES)
def test_rms_norm(dtype, b, d, weighted, scale, eps):
    g = gen(400 + d + b)
    x = (torch.randn(b, 3, d, generator=g) * scale).to(dtype)
    w = torch.randn(d, generator=g).to(dtype) if weighted else None
    want = ref.rms_norm(x.double(), None if w is None else w.double(), eps)
    assert rel(tri.rms_norm(x, w, eps), want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("b,h,d,half", [(1, 3, 24, 4), (2, 5, 10, 5)])
@pytest.mark.parametrize("min_programs", [tri.MIN_PROGRAMS, 2])  # heads one per program, or in blocks of 4 and 8
def test_rope(dtype, inverse, b, h, d, half, min_programs, monkeypatch):
    monkeypatch.setattr(tri, "MIN_PROGRAMS", min_programs)
    g = gen(500 + b * 7 + d)
    x = torch.randn(b, 3, h, d, generator=g).to(dtype)
    ang = torch.rand(b, 3, half, generator=g) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    want = ref.rope(x.double(), cos.double(), sin.double(), inverse)
    assert rel(tri.rope(x, cos, sin, inverse), want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("b,h,d,half", [(1, 3, 24, 4), (2, 5, 10, 5)])
@pytest.mark.parametrize("min_programs", [tri.MIN_PROGRAMS, 2])
@pytest.mark.parametrize("scale,eps", NORM_SCALES)
def test_norm_rope(dtype, weighted, b, h, d, half, min_programs, scale, eps, monkeypatch):
    """RMSNorm per head row then RoPE in one launch (q's unweighted norm, kv's weighted one)."""
    monkeypatch.setattr(tri, "MIN_PROGRAMS", min_programs)
    g = gen(550 + b * 7 + d + weighted)
    x = (torch.randn(b, 3, h, d, generator=g) * scale).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype) if weighted else None
    ang = torch.rand(b, 3, half, dtype=torch.float64, generator=g) * 6
    want = ref.norm_rope(x.double(), None if w is None else w.double(), eps, ang.cos(), ang.sin())
    assert rel(tri.norm_rope(x, w, eps, ang.cos(), ang.sin()), want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [5, 13])
def test_norm_rope_ring(dtype, pos):
    """The decode step's window update inside norm_rope: the row lands in ring slot pos % W of a strided keys
    view (the window part of a larger key buffer), only that slot's flag turns on, and nothing else moves."""
    b, w_len, slots, d, half = 2, 8, 3, 24, 4
    g = gen(570 + pos)
    x = (torch.randn(b, 1, 1, d, generator=g) * 3).to(dtype)
    wt = (torch.rand(d, generator=g) + 0.5).to(dtype)
    ang = torch.rand(b, 1, half, dtype=torch.float64, generator=g) * 6
    buf = torch.randn(b, w_len + slots, d, generator=g).to(dtype)  # window then entry slots, as StaticLayer
    flags = torch.rand(b, 1, w_len + slots, generator=g) < 0.3
    p = torch.tensor([pos])
    want_buf, want_flags = buf.double(), flags.clone()
    want = ref.norm_rope(x.double(), wt.double(), 1e-6, ang.cos(), ang.sin(),
                         (want_buf[:, :w_len], want_flags[:, 0, :w_len], p))
    got = tri.norm_rope(x, wt, 1e-6, ang.cos(), ang.sin(), (buf[:, :w_len], flags[:, 0, :w_len], p))
    slot = pos % w_len
    assert rel(got, want) <= TOL[dtype]
    assert rel(buf[:, slot], want_buf[:, slot]) <= TOL[dtype] and rel(buf[:, slot], want[:, 0, 0]) <= TOL[dtype]
    others = [i for i in range(w_len + slots) if i != slot]
    assert torch.equal(buf[:, others], want_buf[:, others].to(dtype))
    assert torch.equal(flags, want_flags) and bool(flags[:, 0, slot].all())
    with pytest.raises(ValueError, match="one row"):
        tri.norm_rope(x.expand(b, 2, 1, d), wt, 1e-6, ang.cos(), ang.sin(), (buf[:, :w_len], flags[:, 0, :w_len], p))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,d,ln,chunk", [(1, 1, 5, 24, 37, 0), (2, 3, 5, 24, 37, 0), (2, 2, 40, 20, 19, 0),
                                               (1, 1, 5, 24, 37, 16), (2, 3, 5, 24, 70, 16), (2, 3, 5, 24, 37, -1),
                                               (2, 2, 40, 20, 19, -1), (1, 2, 5, 24, 300, 16), (1, 2, 3, 40, 50, 16),
                                               (1, 1, 3, 17, 37, 16)])
@pytest.mark.parametrize("rotary", [False, True])
def test_attention(dtype, b, s, h, d, ln, chunk, rotary, monkeypatch):
    """chunk > 0 forces the split-key (flash-decoding) path and its fixed-order combine (ln 300: 19 splits, more
    than one combine step of 16); 0 splits as a decode would (few programs at these sizes); -1 never splits
    (enough programs, as a prefill). rotary: the output's inverse RoPE in the same launches (the RoPE pairs end
    the combine's one D block at d 24, fill it at d 20, sit in its second at d 40; at d 17 they start at an odd
    column and a launch of its own rotates them), equal to the separate launches bit for bit. Splits read only
    the visible keys at odd ln (37, 19) and every key at even ln (the two forms of ATTN_GATHER_KEYS)."""
    monkeypatch.setattr(tri, "ATTN_CHUNK", max(chunk, 0))
    monkeypatch.setattr(tri, "ATTN_GATHER_KEYS", 0 if ln % 2 else 10**9)
    if chunk < 0:
        monkeypatch.setattr(tri, "MIN_PROGRAMS", 1)
    g = gen(600 + b * 13 + s + h + ln)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    kv = torch.randn(b, ln, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    mask = torch.rand(b, s, ln, generator=g) > 0.3
    mask[0, 0, :16] = False  # with chunk 16, a split whose keys are all hidden
    if b * s > 1:
        mask[-1, -1] = False  # a row with no visible key: the sink takes everything, output 0
    rot = None
    if rotary:
        ang = torch.rand(b, s, 4, generator=g, dtype=torch.float64) * 6.3
        rot = (ang.cos(), ang.sin())
    got = tri.attention(q, kv, sink, mask, d**-0.5, rot)
    want = ref.attention(q.double(), kv.double(), sink.double(), mask, d**-0.5, rot)
    assert rel(got, want) <= TOL[dtype]
    if rotary and (d - 8) % 2 == 0:  # fused (at d 17 the op is these launches): rounded, then un-rotated by the
        # one formula, as the launches apart do it
        assert torch.equal(got, tri.rope(tri.attention(q, kv, sink, mask, d**-0.5), *rot, inverse=True))
    if b * s > 1:
        assert torch.equal(got[-1, -1], torch.zeros_like(got[-1, -1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk,scan,gather", [(-1, 32, True), (16, 32, True), (16, 32, False), (48, 256, True),
                                               (48, 256, False), (64, 16, True), (64, 16, False)])
def test_attention_scans_and_splits(dtype, chunk, scan, gather, monkeypatch):
    """The key loop's shapes at 100 keys (16 a block on the CPU): unsplit rows over several scans of 32 (-1);
    splits of 16 keys in one scan; splits of 48 whose scan (64) reaches past them, 3 blocks a scan, the last split
    4 keys; splits of 64 over 4 scans of 16. Gathering (unsplit programs always do), keys hidden from every query
    (a random third, not whole blocks) hold NaN and the output is still the reference's over the others: a hidden
    key that was read would meet the dot (0 x NaN). The dense form (splits only) reads every key."""
    monkeypatch.setattr(tri, "ATTN_CHUNK", max(chunk, 0))
    monkeypatch.setattr(tri, "ATTN_SCAN", scan)
    monkeypatch.setattr(tri, "ATTN_GATHER_KEYS", 0 if gather else 10**9)
    monkeypatch.setattr(tri, "MIN_PROGRAMS", 1)
    b, s, h, d, ln = 2, 3, 5, 24, 100
    g = gen(640 + chunk + scan + gather)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    kv = torch.randn(b, ln, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    hidden = torch.rand(ln, generator=g) < 0.35
    mask = (torch.rand(b, s, ln, generator=g) > 0.3) & ~hidden
    mask[0, 0, 48:96] = False  # with splits of 48, one whose keys are all hidden
    want = ref.attention(q.double(), kv.double(), sink.double(), mask, d**-0.5)
    if gather or chunk < 0:
        kv[:, hidden] = float("nan")
    got = tri.attention(q, kv, sink, mask, d**-0.5)
    assert not got.isnan().any()
    assert rel(got, want) <= TOL[dtype]


@pytest.fixture
def mi200_fp16_dot(monkeypatch):
    """Triton's interpreter with MI200's matrix-unit rule: fp16 dot operands under 2^-14 (subnormals) read as zero
    (AMD: MI200's FP16 and BF16 MFMA instructions flush subnormal inputs; CUDA's tensor cores keep them)."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    base, fp16_dots = InterpreterBuilder.create_dot, []

    def flush(h):
        if h.data.dtype != np.float16:
            return h
        fp16_dots.append(1)
        return TensorHandle(np.where(np.abs(h.data) < 2.0**-14, np.float16(0), h.data), h.dtype)

    monkeypatch.setattr(InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: base(self, flush(a), flush(b), *rest))
    yield fp16_dots  # the fp16 operands it saw: a test asserts the emulation was reached


@pytest.mark.parametrize("chunk", [-1, 512])
def test_fp16_attention_keeps_small_weights_on_mi200(chunk, mi200_fp16_dot, monkeypatch):
    """One key at logit 0 and 4000 at -10: each of those weights, e^-10 = 4.5e-5, is an fp16 subnormal, together
    15% of the softmax mass. With fp16 operands on a matrix unit that flushes subnormals (MI200, emulated), the
    kernel still counts them: its weights enter the dot times 2^15 (unscaled, the flushed numerator against the
    fp32 sum put the output 29% off unsplit, 3.6% with splits of 512 keys). Unsplit (-1) and split forms."""
    monkeypatch.setattr(tri, "ATTN_CHUNK", max(chunk, 0))
    if chunk < 0:
        monkeypatch.setattr(tri, "MIN_PROGRAMS", 1)  # one program over every key
    g = gen(660 + chunk)
    ln, d = 4001, 32
    kv = torch.randn(1, ln, d, generator=g)
    kv[0, 0, 0], kv[0, 1:, 0] = 0.0, -10.0
    q = torch.zeros(1, 1, 2, d)
    q[..., 0] = 1.0  # logits q . k = kv[:, 0] exactly (scale 1)
    sink = torch.full((2,), -30.0)
    mask = torch.ones(1, 1, ln, dtype=torch.bool)
    got = tri.attention(q.half(), kv.half(), sink, mask, 1.0)
    want = ref.attention(q.double(), kv.half().double(), sink.double(), mask, 1.0)
    assert mi200_fp16_dot, "the kernel's fp16 dots did not reach the emulated matrix unit"
    assert rel(got, want) <= TOL[torch.float16], rel(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,t", [(1, 1, 5, 37), (2, 3, 17, 40)])
def test_index_scores(dtype, b, s, h, t):
    g = gen(700 + b + s + h)
    q = torch.randn(b, s, h, 24, generator=g).to(dtype)
    k = torch.randn(b, t, 24, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g).to(dtype)
    got = tri.index_scores(q, k, w, 0.3)
    assert got.dtype == torch.float32
    want = ref.index_scores(q.double(), k.double(), w.double(), 0.3)
    assert rel(got, want) <= TOL[dtype]
    for visible in (torch.rand(b, 1, t, generator=g) < 0.5, torch.rand(s, t, generator=g) < 0.5):  # decode, prefill
        hid = tri.index_scores(q, k, w, 0.3, visible)
        shown = visible.expand(b, s, t)
        assert torch.equal(hid.isneginf(), ~shown) and torch.equal(hid[shown], got[shown])


def test_backend_table_and_no_leak(monkeypatch):
    """get_ops('triton') takes every op by name from the triton module, and interpreting leaves neither
    TRITON_INTERPRET nor a patched JITFunction, InterpretedFunction or language attribute behind (the launch
    patches the language once, `_interpreting`), also when a launch fails midway."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def state():
        return (os.environ.get("TRITON_INTERPRET"), JITFunction.__call__, InterpretedFunction.__call__,
                tl.core.arange, tl.arange, tl.core.add, tl.range, getattr(tl.core.tensor, "__index__", None),
                tl.tensor.__add__)

    before = state()
    ops = get_ops("triton")
    from cdna2_engine.ops import OP_NAMES

    for name in OP_NAMES:
        assert getattr(ops, name) is getattr(tri, name), f"{name} is not the triton backend's"
    tri.rms_norm(torch.randn(2, 5), None, 1e-6)  # tl.sum inside: a triton.language @jit helper
    tri.linear(torch.randn(1, 256), fp8_weight(128, 256, gen(0)))  # the package's helpers (_e8m0, _split_sum)
    assert state() == before

    def fails(self, *args, **kwargs):
        raise RuntimeError("helper failed")

    monkeypatch.setattr(tri, "_helper_call_interpreted", fails)
    with pytest.raises(Exception, match="helper failed"):
        tri.linear(torch.randn(1, 256), fp8_weight(128, 256, gen(0)))
    assert state() == before
    assert isinstance(tri.kernels.rms_norm_kernel, JITFunction)  # the compiled copy stays compiled


@pytest.mark.no_kernel
def test_cpu_bf16_and_float64_fall_back_to_reference():
    g = gen(9)
    x = torch.randn(3, 16, generator=g)
    for dt in (torch.bfloat16, torch.float64):
        assert torch.equal(tri.rms_norm(x.to(dt), None, 1e-6), ref.rms_norm(x.to(dt), None, 1e-6))


@pytest.mark.no_kernel  # (it launches one, but checks the count itself)
def test_kernels_launched_tells_a_kernel_from_the_reference_fallback(kernels_launched):
    """The guard every test here runs under: a float64 call takes the reference op and launches nothing; a
    float32 call launches the kernel."""
    tri.rms_norm(torch.randn(2, 8, dtype=torch.float64), None, 1e-6)
    assert kernels_launched == []
    tri.rms_norm(torch.randn(2, 8), None, 1e-6)
    assert kernels_launched == ["rms_norm_kernel"]


@pytest.mark.no_kernel
def test_poison_fills_every_output_buffer():
    """What every test here relies on to see an unwritten element: with POISON on (the autouse fixture), output
    buffers start as NaN, integers at their minimum, masks all picked."""
    assert torch.isnan(tri._empty(2, 3, dtype=torch.float32, device="cpu")).all()
    assert torch.isnan(tri._empty(4, dtype=torch.float16, device="cpu")).all()
    assert (tri._empty(5, dtype=torch.int64, device="cpu") == torch.iinfo(torch.int64).min).all()
    assert tri._empty(3, dtype=torch.bool, device="cpu").all()
