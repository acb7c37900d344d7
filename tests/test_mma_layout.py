"""The tensor-core MXFP4 layout (engine/ops/triton/mma_layout.py) against an independent reading of it.

The kernels themselves are inline PTX (bench/probe_mma.py and the GPU tests below check them on a GPU,
tests/test_mma_emulated.py in the interpreter). Here the repacked words are read back the way mma.sync m16n8k16
consumes them, per the PTX ISA's fragment table: lane 4g + t's A register j holds (row g + 8 (j & 1), column
2t + 8 (j >> 1) + h) in its half h, and the accumulator lane 4g + t holds rows g, g + 8 of column pair (2t, 2t + 1),
here scale group t. Each register is made by the kernel's own bit recipe (`_a_regs`, its body run on torch
tensors), read as bf16, times 2^126. The product with x must equal the dequantized reference exactly (every value
and product is exact in float64).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from cdna2_engine.ops import QWeight
from cdna2_engine.ops import reference as ref
from cdna2_engine.ops import triton as tri
from cdna2_engine.ops.triton.kernels import mma
from cdna2_engine.ops.triton.mma_layout import interleave_rows, mma_repack

M32 = 0xFFFFFFFF


def a_regs(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' own `_a_regs` (its Python body: masks and shifts) on int64 holders of uint32 words; the masks
    drop every bit a shift moves past bit 31."""
    return mma._a_regs.fn(w)


def read_back(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dense float64 W [R, K] from the repacked words and scales, read where and as the kernels read them
    (`_mma_tile_load`: a tile's 256 words from lane * 4 and lane * 4 + 128, the scale pair as one little-endian
    16-bit load), through the fragment tables."""
    rt, kt = words.shape[:2]
    at = torch.arange(32)[:, None] * 4 + torch.tensor([0, 1, 2, 3, 128, 129, 130, 131])
    w = words.reshape(rt, kt, 256)[:, :, at].to(torch.int64) & M32  # [RT, KT, lane, step]
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    out = torch.zeros(rt * 16, kt * 128, dtype=torch.float64)
    rows_t = torch.arange(rt)[:, None, None, None] * 16
    cols_t = torch.arange(kt)[None, :, None, None] * 128 + torch.arange(8)[None, None, None, :] * 16
    for j, reg in enumerate(a_regs(w)):
        for h in range(2):
            bits = ((reg >> (16 * h)) & 0xFFFF).to(torch.int32) << 16
            v = bits.view(torch.float32).double() * 2.0**126
            row = rows_t + (g + 8 * (j & 1))[None, None, :, None]
            col = cols_t + (2 * t + 8 * (j >> 1) + h)[None, None, :, None]
            out[row.expand_as(v), col.expand_as(v)] = v
    # accumulator side: rows g, g + 8 and group t of each tile carry the lane's two scale bytes
    pair = scales.reshape(rt, kt, 64).view(torch.int16).to(torch.int64) & 0xFFFF  # [RT, KT, lane]
    s = torch.stack((pair & 0xFF, pair >> 8), dim=-1)  # [RT, KT, lane, 2]: bytes for rows g and g + 8
    scale = torch.zeros(rt * 16, kt * 4, dtype=torch.float64)
    for half in range(2):
        row = (rows_t[..., 0] + (g + 8 * half)[None, None, :]).expand(rt, kt, 32)
        grp = (torch.arange(kt)[None, :, None] * 4 + t[None, None, :]).expand(rt, kt, 32)
        scale[row, grp] = torch.pow(2.0, s[..., half].double() - 127)
    return out * scale.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("e,r,k", [(1, 16, 128), (2, 48, 256), (3, 32, 384)])
def test_repack_reads_back_as_the_reference(e, r, k):
    g = torch.Generator().manual_seed(1000 + r + k)
    data = torch.randint(-128, 128, (e, r, k // 2), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.randint(100, 150, (e, r, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    words, scales = mma_repack(data, scale)
    assert words.shape == (e, r // 16, k // 128, 2, 32, 4) and words.dtype == torch.int32
    assert scales.shape == (e, r // 16, k // 128, 32, 2)
    x = torch.randn(k, generator=g, dtype=torch.float64)
    for i in range(e):
        want = ref.dequantize(QWeight(data[i], scale[i].view(torch.float8_e8m0fnu), "mxfp4"), torch.float64)
        got = read_back(words[i], scales[i])
        assert torch.equal(got, want)  # every code and scale where the kernel reads it, exactly
        assert torch.equal(got @ x, want @ x)


def test_repack_chunks_agree(monkeypatch):
    """Rows repacked in several chunks give the same words as in one."""
    g = torch.Generator().manual_seed(7)
    data = torch.randint(-128, 128, (64, 128), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.randint(100, 150, (64, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    whole = mma_repack(data, scale)
    from cdna2_engine.ops.triton import mma_layout

    monkeypatch.setattr(mma_layout, "ROWS_PER_CHUNK", 16)
    parts = mma_repack(data, scale)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


def test_h_is_stored_in_the_order_down_lanes_read_it():
    """gate/up writes h (hi part at _hb_index, lo 32 further) where down's lane L = 4 (2 gg + part) + t reads its B
    registers with one 16-byte load at L * 8 of each 128-channel tile: pairs 2t, 2t + 8, 2t + 16, 2t + 24 of
    group gg (the m16n8k16 B fragment of steps 2 gg and 2 gg + 1). Every position once."""
    from cdna2_engine.ops.triton.kernels.mma import _hb_index

    ch = torch.arange(3 * 128)
    where = _hb_index.fn(ch)  # the jit function's Python body: integer arithmetic, run on torch tensors
    assert torch.equal(torch.cat((where, where + 32)).sort().values, torch.arange(3 * 256))
    lane = torch.arange(32)[:, None, None]
    g, t = lane // 4, lane % 4
    q, h = torch.arange(4)[None, :, None], torch.arange(2)[None, None, :]
    for tile in range(3):
        want_ch = tile * 128 + 32 * (g // 2) + 2 * t + 8 * q + h  # [lane, q, h]
        got = where[want_ch] + 32 * (g % 2)
        assert torch.equal(got, tile * 256 + lane * 8 + q * 2 + h)


def test_interleave_rows():
    a = torch.arange(32 * 3).reshape(32, 3)
    b = -a
    got = interleave_rows(a, b)
    assert torch.equal(got[:16], a[:16]) and torch.equal(got[16:32], b[:16]) and torch.equal(got[32:48], a[16:])


def test_repack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows % 16"):
        mma_repack(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 128"):
        mma_repack(torch.zeros(16, 32, dtype=torch.int8), torch.zeros(16, 2, dtype=torch.uint8))


def test_repacked_weights_follow_their_tensors():
    """The repacked copy is reused while its tensors stay the same, made again when a scale is replaced by a new
    tensor (faults.expert_scale_off_by_one does that), and refreshed in its own buffers (a captured graph may read
    them) when a tensor changes in place."""
    g = torch.Generator().manual_seed(3)
    data = torch.randint(-128, 128, (2, 32, 64), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.randint(110, 140, (2, 32, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    w = QWeight(data, scale.view(torch.float8_e8m0fnu), "mxfp4")
    first = tri._mma_weights(w)
    assert first[2] and not tri._mma_weights(w)[2]  # just repacked, then not
    assert tri._mma_weights(w)[0] is first[0]  # reused
    bumped = QWeight(data, (scale + 1).view(torch.float8_e8m0fnu), "mxfp4")
    again = tri._mma_weights(bumped)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1] + 1)
    before = first[1][0, 0, 0, 0, 0].item()
    scale[0, 0, 0] += 2  # in place, through the original QWeight's view
    third = tri._mma_weights(w)
    assert third[1] is first[1] and third[1][0, 0, 0, 0, 0] == before + 2  # the same buffers, new contents
    assert third[2]  # just repacked: the down launch right after it goes without PDL
    del bumped, again
    import gc

    gc.collect()
    assert all(entry[0][1]() is not None for entry in tri._MMA_PACKED.values())  # no entry outlives a tensor


@pytest.mark.parametrize("t,k,e", [(8, 6, 3), (13, 2, 5), (64, 6, 256), (64, 6, 16)])
def test_pair_rows_put_two_pairs_of_one_expert_in_a_row(t, k, e):
    """The tensor-core kernels' program rows (`moe_pair_rows_kernel`, in the interpreter): every pair once; a row's
    two pairs share their expert, in pair order; an expert of n pairs takes ceil(n / 2) rows, so only its last can
    hold one; empty rows are wholly empty."""
    g = torch.Generator().manual_seed(t * 100 + e)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] if k <= e else torch.randint(0, e, (k,), generator=g)
                       for _ in range(t)])
    rows = tri._pair_rows(idx)
    flat = idx.reshape(-1)
    assert rows.shape == (t * k, 2) and rows.dtype == torch.int32
    used = rows[rows >= 0]
    assert torch.equal(used.sort().values, torch.arange(t * k, dtype=torch.int32))  # every pair exactly once
    assert ((rows == -1) | (rows >= 0)).all()
    full = rows[:, 1] >= 0
    assert (rows[full, 0] >= 0).all() and (rows[full, 0] < rows[full, 1]).all()
    assert torch.equal(flat[rows[full, 0].long()], flat[rows[full, 1].long()])
    live = rows[:, 0] >= 0
    counts = torch.bincount(flat, minlength=e)
    assert live.sum().item() == ((counts + 1) // 2).sum().item()
    single = live & ~full
    assert torch.equal(torch.bincount(flat[rows[single, 0].long()], minlength=e), counts % 2)


def test_tensor_core_path_is_off_on_the_cpu():
    assert not tri._mma_on(torch.zeros(1, 4096, dtype=torch.bfloat16), 2048, 6)


def test_k_splits_follow_the_token_count_rows(monkeypatch):
    """MOE_MMA SPLITS: a call takes the last row whose token count it reaches (below the first row, the first)."""
    monkeypatch.setitem(tri.MOE_MMA, "SPLITS", ((2, 4, 2), (4, 8, 1), (9, 1, 1)))
    got = [tri._mma_splits(t) for t in (1, 2, 3, 4, 8, 9, 64)]
    assert got == [(4, 2), (4, 2), (4, 2), (8, 1), (8, 1), (1, 1), (1, 1)]


def rel_by_rows(got: torch.Tensor, want: torch.Tensor, w2: QWeight) -> float:
    """The larger of the relative errors over the output rows whose down weights hold a scale byte past 192 (2^65 and
    up: they dwarf the rest) and over the other rows, so an error in either set shows; inf for a non-finite output."""
    if not torch.isfinite(got).all():
        return math.inf
    big = (w2.scale.view(torch.uint8) > 192).any(dim=-1).any(dim=0).to(got.device)  # [D]
    err = 0.0
    for rows in (big, ~big):
        if rows.any():
            g, w = got.double()[..., rows], want[..., rows]
            err = max(err, ((g - w).norm() / w.norm()).item())
    return err


def gpu_moe_inputs(g: torch.Generator, e: int, k: int, scale_200: bool, t: int = 1) -> tuple:
    """Random MXFP4 expert stacks at V4-Flash widths (D 4096, I 2048) on g's GPU, t bf16 tokens, k distinct experts
    each and their weights. scale_200: some scale bytes past 192 (2^73), where a decode that folds 2^62 into the
    exponent wraps."""
    dev, d, inter = g.device, 4096, 2048

    def weight(n: int, kk: int) -> QWeight:
        b = torch.randint(-128, 128, (e, n, kk // 2), generator=g, device=dev, dtype=torch.int32).to(torch.int8)
        s = torch.randint(118, 128, (e, n, kk // 32), generator=g, device=dev, dtype=torch.int32).to(torch.uint8)
        if scale_200:
            s[:, ::97, ::5] = 200
        return QWeight(b, s.view(torch.float8_e8m0fnu), "mxfp4")

    w1, w3, w2 = weight(inter, d), weight(inter, d), weight(d, inter)
    x = (torch.randn(t, d, generator=g, device=dev) * 0.2).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g, device=dev)[:k] for _ in range(t)])
    return w1, w3, w2, x, idx, torch.rand(t, k, generator=g, device=dev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX mma.sync: needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("t,with_shared,pdl", [(1, False, True), (1, True, True), (1, True, False), (3, True, True),
                                                (5, False, False)])
def test_moe_experts_tensor_core_gpu(t, with_shared, pdl, monkeypatch):
    """The tensor-core kernels (one program row per (token, slot) pair; t tokens of 16 experts share some) against
    the reference at V4-Flash widths (bf16 x; h enters the down GEMV split hi + lo in bf16: ~2^-17 relative, far
    inside the bf16 tolerance 1e-2 of tests/test_triton_kernels)."""
    monkeypatch.setattr(tri, "POISON", True)  # every buffer the kernels write starts as NaN
    monkeypatch.setitem(tri.MOE_MMA, "PDL", pdl)  # down as a programmatic dependent of gate/up (sm_90) or not
    dev = torch.device("cuda")
    if not tri._mma_on(torch.zeros(1, 4096, dtype=torch.bfloat16, device=dev), 2048, 6):
        pytest.skip("this GPU does not take the tensor-core path (needs sm_80+)")
    g = torch.Generator(dev).manual_seed(11)
    e, d, k = 16, 4096, 6
    w1, w3, w2, x, idx, wt = gpu_moe_inputs(g, e, k, scale_200=True, t=t)
    shared = (torch.randn(t, d, generator=g, device=dev) * 0.05).to(torch.bfloat16) if with_shared else None
    got = tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0,
                           None if shared is None else shared.double())
    err = rel_by_rows(got, want, w2)
    assert err <= 5e-3, err  # the output's own bf16 rounding is ~2^-9 = 2e-3
    assert torch.equal(got, tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)), "not bit-reproducible"
    hb = tri.moe_gate_up(x, w1, w3, tri.moe_prepare(x, idx, e), 7.0)
    assert hb.dim() == 3 and hb.dtype == torch.bfloat16  # the tensor-core path ran
    assert not tri._locks(dev, 0).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch: needs a CUDA GPU (sm_90)")
def test_down_as_dependent_launch_is_bit_identical_gpu(monkeypatch):
    """Down launched as a programmatic dependent of gate/up (sm_90) reads its first weights before its wait: it
    must give the bits of a plain launch, on the first call (weights repacked just before: launched plainly),
    on repeats (gate/up and down adjacent: nothing poisoned in between) and after an in-place weight change."""
    dev = torch.device("cuda")
    if not (tri._mma_on(torch.zeros(1, 4096, dtype=torch.bfloat16, device=dev), 2048, 6)
            and tri._compiled.PDL_AVAILABLE and tri._cuda_cc(dev) >= (9, 0)):
        pytest.skip("needs the tensor-core path and griddepcontrol (sm_90, Triton 3.5+)")
    e = 16
    w1, w3, w2, x, idx, wt = gpu_moe_inputs(torch.Generator(dev).manual_seed(12), e, 6, scale_200=False)
    plan = tri.moe_prepare(x, idx, e)

    def run(pdl: bool) -> torch.Tensor:
        monkeypatch.setitem(tri.MOE_MMA, "PDL", pdl)
        return tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 7.0), w2, wt, plan)

    first = run(True)  # w2 repacked right before down
    plain = run(False)
    assert torch.equal(first, plain)
    for _ in range(3):
        assert torch.equal(run(True), plain)
    w2.scale.view(torch.uint8)[:, ::7] += 1  # in place: repacked into the same buffers at the next call
    changed = run(True)
    assert torch.equal(changed, run(False)) and not torch.equal(changed, plain)
    assert torch.equal(run(True), changed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX mma.sync: needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("t,e,with_shared", [(8, 16, True), (16, 256, False), (64, 16, True), (64, 256, True)])
def test_two_pairs_a_row_is_bit_identical_gpu(t, e, with_shared, monkeypatch):
    """Two pairs of one expert a program row (MOE_MMA TWO_MIN_T; at 16 experts most rows are full, at 256 a few)
    give the bits of one pair a row: each mma column and each partial sum is the same arithmetic. And both are
    within the bf16 bound of the reference."""
    monkeypatch.setattr(tri, "POISON", True)
    dev = torch.device("cuda")
    if not tri._mma_on(torch.zeros(t, 4096, dtype=torch.bfloat16, device=dev), 2048, 6):
        pytest.skip("this GPU does not take the tensor-core path (needs sm_80+)")
    g = torch.Generator(dev).manual_seed(13 + t + e)
    w1, w3, w2, x, idx, wt = gpu_moe_inputs(g, e, 6, scale_200=True, t=t)
    shared = (torch.randn(t, 4096, generator=g, device=dev) * 0.05).to(torch.bfloat16) if with_shared else None

    def run(two_min_t: int) -> torch.Tensor:
        monkeypatch.setitem(tri.MOE_MMA, "TWO_MIN_T", two_min_t)
        assert (tri.moe_prepare(x, idx, e)[-2] is not None) == (t >= two_min_t)
        return tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)

    two, one = run(8), run(1 << 30)
    assert torch.equal(two, one)
    assert torch.equal(run(8), two), "not bit-reproducible"
    monkeypatch.setitem(tri.MOE_MMA, "TWO_MIN_T", 8)
    plan = tri.moe_prepare(x, idx, e)
    hb = tri.moe_gate_up(x, w1, w3, plan, 7.0)
    unsummed = tri.moe_down(hb, w2, wt, plan)  # per pair, weighted (down's other epilogue)
    monkeypatch.setitem(tri.MOE_MMA, "TWO_MIN_T", 1 << 30)
    plan1 = tri.moe_prepare(x, idx, e)
    assert torch.equal(hb, tri.moe_gate_up(x, w1, w3, plan1, 7.0))
    assert torch.equal(unsummed, tri.moe_down(hb, w2, wt, plan1))
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0, None if shared is None else shared.double())
    assert rel_by_rows(two, want, w2) <= 5e-3  # as test_moe_experts_tensor_core_gpu
    assert not tri._locks(dev, 0).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX mma.sync: needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("t", [1, 32])
def test_no_room_for_the_repack_runs_as_with_the_path_off_gpu(t, monkeypatch):
    """Where the experts' repacked copy would not fit the free memory (here: a headroom larger than the GPU), the
    call runs as with MOE_MMA off, to the bit (at 32 tokens too, where the plan differs: dot blocks, not pairs),
    warns once per device, and repacks nothing; the layer keeps that path when room appears later (the two paths
    differ in the last bits); weights it has not refused take the tensor-core path when there is room."""
    monkeypatch.setattr(tri, "POISON", True)
    dev = torch.device("cuda")
    if not tri._mma_on(torch.zeros(t, 4096, dtype=torch.bfloat16, device=dev), 2048, 6):
        pytest.skip("this GPU does not take the tensor-core path (needs sm_80+)")
    monkeypatch.setattr(tri, "_MMA_NO_ROOM", set())
    monkeypatch.setattr(tri, "_MMA_NO_ROOM_STACKS", {})
    monkeypatch.setattr(tri, "MOE_MMA_HEADROOM", 1 << 50)
    e = 16
    w1, w3, w2, x, idx, wt = gpu_moe_inputs(torch.Generator(dev).manual_seed(14 + t), e, 6, scale_200=False, t=t)
    stacks = [[w1.data, w1.scale, w3.data, w3.scale], [w2.data, w2.scale]]
    with pytest.warns(UserWarning, match=r"cuda:\d+: the MXFP4 tensor-core path needs a repacked copy .* GB are free"):
        tight = tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0)
    assert all(tri._mma_cached(ts) is None for ts in stacks)  # nothing repacked
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert torch.equal(tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0), tight)
    monkeypatch.setitem(tri.MOE_MMA, "on", False)
    assert torch.equal(tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0), tight)
    monkeypatch.setitem(tri.MOE_MMA, "on", True)
    monkeypatch.setattr(tri, "MOE_MMA_HEADROOM", 0)
    assert torch.equal(tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0), tight)  # refused once: the same path
    assert all(tri._mma_cached(ts) is None for ts in stacks)
    w1, w3, w2 = (QWeight(w.data.clone(), w.scale.clone(), w.kind) for w in (w1, w3, w2))  # weights not refused
    stacks = [[w1.data, w1.scale, w3.data, w3.scale], [w2.data, w2.scale]]
    roomy = tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0)
    assert all(tri._mma_cached(ts) is not None for ts in stacks)  # the tensor-core path ran
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0)
    for got in (tight, roomy):
        assert rel_by_rows(got, want, w2) <= 5e-3  # as test_moe_experts_tensor_core_gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX mma.sync: needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("ct,ks,with_shared,pdl", [(4, 2, True, True), (4, 1, False, True), (4, 4, True, False),
                                                   (8, 2, True, True), (8, 1, False, False)])
def test_one_token_split_by_channels_gpu(ct, ks, with_shared, pdl, monkeypatch):
    """MOE_MMA_ONE (a program per chunk of 64 or 128 channels and pair, then a sum launch) within the bound of the
    per-phase pair against the reference, bit-reproducible, its scratch poisoned (a 64-channel chunk's h fills half
    of each hb row: the other half's lanes must stay inactive), at K splits of gate/up over a program's warps."""
    monkeypatch.setattr(tri, "POISON", True)
    monkeypatch.setitem(tri.MOE_MMA, "PDL", pdl)
    dev = torch.device("cuda")
    x1 = torch.zeros(1, 4096, dtype=torch.bfloat16, device=dev)
    if not tri._mma_on(x1, 2048, 6):
        pytest.skip("this GPU does not take the tensor-core path (needs sm_80+)")
    monkeypatch.setitem(tri.MOE_MMA_ONE, "on", True)
    monkeypatch.setitem(tri.MOE_MMA_ONE, "CT", ct)
    monkeypatch.setitem(tri.MOE_MMA_ONE, "KS", ks)
    assert tri._mma_one_on(x1, 2048)
    ran = []
    monkeypatch.setattr(tri, "_mma_one", lambda *a, _f=tri._mma_one, **kw: ran.append(1) or _f(*a, **kw))
    g = torch.Generator(dev).manual_seed(15 + ct + ks)
    e, d, k = 16, 4096, 6
    w1, w3, w2, x, idx, wt = gpu_moe_inputs(g, e, k, scale_200=True, t=1)
    shared = (torch.randn(1, d, generator=g, device=dev) * 0.05).to(torch.bfloat16) if with_shared else None
    got = tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)
    assert ran, "the channel-split path did not run"
    want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 7.0, None if shared is None else shared.double())
    err = rel_by_rows(got, want, w2)
    assert err <= 5e-3, err  # as test_moe_experts_tensor_core_gpu: the output's own bf16 rounding is ~2e-3
    f32 = tri._mma_one(x, w1, w3, w2, idx, wt, 7.0, shared, out=torch.empty(1, d, dtype=torch.float32, device=dev))
    assert rel_by_rows(f32, want, w2) <= 1e-4  # fp32 out: h's hi + lo split, ~2^-16 (tests/test_mma_emulated.py)
    assert torch.equal(got, tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)), "not bit-reproducible"
    monkeypatch.setitem(tri.MOE_MMA_ONE, "on", False)
    pair = tri.moe_experts(x, w1, w3, w2, idx, wt, 7.0, shared)
    assert rel_by_rows(got, pair.double(), w2) <= 5e-3


@pytest.mark.parametrize("name", ["moe_mma_gate_up", "moe_mma_down", "moe_mma_gate_up_8", "moe_mma_down_4",
                                  "moe_mma_gate_up_two", "moe_mma_down_two", "moe_mma_one", "moe_mma_one_128"])
def test_tensor_core_kernels_compile_for_sm80(name):
    """The path is enabled from sm_80 (`_mma_on`), so its inline PTX must assemble there, not only on the ISA tier's
    sm_90 (mul.bf16x2, for one, is sm_90-only). As sm_80 launches them: without the programmatic dependent launch
    (griddepcontrol is sm_90+, `_mma_pdl`)."""
    import warnings

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cdna2_engine.ops.triton.kernels import ISA_SPECS_SM90
    from pytest_cdna2.isa import with_defaults

    _, fn, (sig, const), warps, _ = next(s for s in ISA_SPECS_SM90 if s[0] == name)
    sig, const = with_defaults(fn, dict(sig), {**const, "PDL": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 80, 32), options={"num_warps": warps})
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in k.asm["ptx"]
    assert k.asm["cubin"]  # ptxas assembled it for sm_80
