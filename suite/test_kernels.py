"""Kernel tier: every op of the chosen backend against the float64 reference on fresh random inputs over a
shape grid (batch 1 and 2, sizes that are not multiples of any tile), and numerics-policy checks that fail
on a violation: fp16/bf16 accumulation, fp16 softmax statistics, router tie order, nondeterministic sums.
With the reference backend only the policy checks run (their expected values are worked out by hand): its ops
are the float64 reference's own formulas, so comparing them with it would test nothing.

Operand dtypes: float32 on the CPU (Triton's interpreter cannot run bf16), bf16 and float32 on a GPU.
Limits: the profile's [kernel] rtol_fro_<dtype> (DESIGN.md section 5).
"""

from __future__ import annotations

import pytest
import torch

from cdna2_engine import formats
from cdna2_engine.ops import QWeight, get_ops, reference
from pytest_cdna2.compare import assert_tensors_close

pytestmark = pytest.mark.kernel

SHAPES = [(1, 1), (1, 7), (2, 5)]  # (batch, tokens)


@pytest.fixture(scope="module")
def backend_ops(cdna2_settings):
    """The backend's op table, with every kernel output buffer poisoned (NaN) before the kernel writes it,
    so an element a kernel never writes shows up as NaN. The numerics-policy checks use it directly: their
    expected values are worked out by hand, so they hold on either backend."""
    if cdna2_settings.engine != "bundled":
        pytest.skip("the kernel tier checks the bundled engine's ops; your engine is judged by the token tier")
    mp = pytest.MonkeyPatch()
    if cdna2_settings.backend == "triton":
        import cdna2_engine.ops.triton as tri

        mp.setattr(tri, "POISON", True)
    table = get_ops(cdna2_settings.backend, reference_ops=[])  # every kernel, whatever CDNA2_REFERENCE_OPS says
    assert table.backend == "reference" or not table.reference_ops, table.reference_ops
    yield table
    mp.undo()


@pytest.fixture(scope="module")
def ops(backend_ops, cdna2_settings):
    """backend_ops, for the tests that compare an op with the float64 reference (reference.py's formulas in
    float64): the reference backend's ops are those formulas, so there the comparison would be with itself."""
    if cdna2_settings.backend == "reference":
        pytest.skip("the reference backend is this tier's float64 yardstick: run --cdna2-backend=triton to check "
                    "kernels (the token tier judges the reference against the goldens)")
    return backend_ops


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request, cdna2_device):
    if request.param == "bfloat16" and cdna2_device.type == "cpu":
        pytest.skip("bf16 operands on the CPU: Triton's interpreter cannot run them (DESIGN.md section 7)")
    return getattr(torch, request.param)


def rnd(*shape, dev, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dev, dtype)


def fp8_weight(n, k, dev):
    """Random E4M3 bytes (every code but NaN: subnormals and the largest values too) and random scales."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN codes -> 1.0
    nb = ((n + 127) // 128, (k + 127) // 128)
    scale = torch.randint(127 - 12, 127 - 6, nb, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return QWeight(codes.view(torch.float8_e4m3fn).to(dev), scale.to(dev), "fp8")


def mxfp4_stack(e, n, k, dev):
    """Random E2M1 nibbles (all 16 codes) and random UE8M0 scales per 32."""
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8).view(torch.int8)
    scale = torch.randint(127 - 6, 127 - 2, (e, n, k // 32), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return QWeight(packed.to(dev), scale.to(dev), "mxfp4")


def f64(t):
    return t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def check(name, out, ref, dtype, tol, record):
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    limit = tol.kernel.rtol_for(dtype)
    m = assert_tensors_close(out.cpu(), ref.cpu(), rtol_fro=limit, what=f"{name} {dtype}")
    record(f"{name}_rtol_fro", m.rel_fro, limit, what=str(dtype))


@pytest.mark.parametrize("n,k", [(136, 200), (144, 256)], ids=["ragged", "tiled"])
@pytest.mark.parametrize("B,S", SHAPES)
def test_linear_fp8(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, n, k):
    """ragged: W's rows and K end inside a scale block; tiled: 16-row tiles and whole 128-column steps, the shape
    the few-token tensor-core form takes on CUDA (7 tokens here)."""
    torch.manual_seed(B * 100 + S + n)
    x, w = rnd(B, S, k, dev=cdna2_device, dtype=dtype), fp8_weight(n, k, cdna2_device)
    check("linear", ops.linear(x, w), reference.linear(f64(x), w), dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("n,k", [(77, 300), (37, 8200)], ids=["narrow", "wide"])
@pytest.mark.parametrize("B,S", SHAPES)
def test_linear_dense(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, n, k):
    """Unquantized weights (head, router, compressors): bf16 as stored on a GPU, fp16 in the interpreter. wide: longer
    rows than the narrow plan takes, so the head's plans run (on a GPU, 7 and 10 rows on the tensor cores)."""
    torch.manual_seed(B * 100 + S + 7 + n)
    wdt = torch.float16 if cdna2_device.type == "cpu" else torch.bfloat16
    x, w = rnd(B, S, k, dev=cdna2_device, dtype=dtype), QWeight(rnd(n, k, dev=cdna2_device, dtype=wdt, scale=k**-0.5),
                                                                None, "dense")
    check("linear_dense", ops.linear(x, w), reference.linear(f64(x), w), dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("B,S", SHAPES)
def test_hc_pre_post(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, n):
    """mHC around a block: the collapsed (and normed) input, post and Sinkhorn comb from the mix sums
    (hc_weights, which the decode step runs beside the block), then the new streams."""
    torch.manual_seed(B * 100 + S + n)
    D = 300
    h, out = rnd(B, S, n, D, dev=cdna2_device, dtype=dtype), rnd(B, S, D, dev=cdna2_device, dtype=dtype)
    fn = rnd(2 * n + n * n, n * D, dev=cdna2_device, scale=3 / (n * D) ** 0.5)
    base, scale = rnd(2 * n + n * n, dev=cdna2_device), torch.rand(3, device=cdna2_device) + 0.5
    nw = 1 + 0.1 * rnd(D, dev=cdna2_device, dtype=dtype)  # the block's RMSNorm, applied by the mHC op
    sums, x, xn = ops.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-6))
    post, comb = ops.hc_weights(sums, base, scale, n, D, 20, 1e-6, 1e-6, dtype)
    rsums, rx, rxn = reference.hc_pre(f64(h), f64(fn), f64(base), f64(scale), n, 1e-6, 1e-6, (f64(nw), 1e-6))
    rpost, rcomb = reference.hc_weights(rsums, f64(base), f64(scale), n, D, 20, 1e-6, 1e-6, torch.float64)
    check("hc_weights", torch.cat([post, comb.flatten(-2)], -1), torch.cat([rpost, rcomb.flatten(-2)], -1),
          torch.float32, cdna2_tolerance, cdna2_record)  # computed in fp32 from any h
    check("hc_pre_input", x, rx, dtype, cdna2_tolerance, cdna2_record)
    check("hc_pre_normed_input", xn, rxn, dtype, cdna2_tolerance, cdna2_record)
    y = ops.hc_post(out, h, rpost.float(), rcomb.float())
    check("hc_post", y, reference.hc_post(f64(out), f64(h), rpost, rcomb), dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("n", [2, 4])
def test_hc_post_pre(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, n):
    """A block's mHC post fused with the next block's pre (the decode path): streams, input, and post and
    comb from the mix sums (split over the post launch's D blocks)."""
    torch.manual_seed(n + 11)
    D, dev = 300, cdna2_device
    h, out = rnd(1, 1, n, D, dev=dev, dtype=dtype), rnd(1, 1, D, dev=dev, dtype=dtype)
    post, comb = torch.rand(1, 1, n, device=dev) * 2, torch.rand(1, 1, n, n, device=dev)
    fn = rnd(2 * n + n * n, n * D, dev=dev, scale=3 / (n * D) ** 0.5)
    base, scale = rnd(2 * n + n * n, dev=dev), torch.rand(3, device=dev) + 0.5
    nw = 1 + 0.1 * rnd(D, dev=dev, dtype=dtype)
    y, sums, x, xn = ops.hc_post_pre(out, h, post, comb, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-6))
    weights = ops.hc_weights(sums, base, scale, n, D, 20, 1e-6, 1e-6, dtype)
    # the reference reads the streams as the kernel stores them (in dtype): the weights are then fp32 math
    ry = reference.hc_post(f64(out), f64(h), f64(post), f64(comb))
    rsums, rx, rxn = reference.hc_pre(f64(ry.to(dtype)), f64(fn), f64(base), f64(scale), n, 1e-6, 1e-6,
                                      (f64(nw), 1e-6))
    rweights = reference.hc_weights(rsums, f64(base), f64(scale), n, D, 20, 1e-6, 1e-6, torch.float64)
    check("hc_post_pre_streams", y, ry, dtype, cdna2_tolerance, cdna2_record)
    check("hc_post_pre_weights", torch.cat([weights[0], weights[1].flatten(-2)], -1),
          torch.cat([rweights[0], rweights[1].flatten(-2)], -1), torch.float32, cdna2_tolerance, cdna2_record)
    check("hc_post_pre_input", x, rx, dtype, cdna2_tolerance, cdna2_record)
    check("hc_post_pre_normed_input", xn, rxn, dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route(ops, cdna2_device, scoring):
    """MoE routing in one kernel: the same experts as the reference (discrete logits: exact ties broken by the
    lower id in any precision), weights within fp32 rounding, hash routing (given experts) too, also of experts
    whose logits lie where e^v is 1e-4..1e-2 (log(1 + e^v) in fp32 is up to 6e-4 off there; log1p is not)."""
    torch.manual_seed(len(scoring))
    logits = (torch.randint(-8, 9, (5, 256)).float() / 2).to(cdna2_device)
    bias = (torch.randint(0, 3, (256,)).float() / 4).to(cdna2_device)
    fixed = torch.randint(0, 256, (5, 6), dtype=torch.int32, device=cdna2_device)
    band = (-4.6 - torch.rand(5, 256) * 5).to(cdna2_device)
    for lg, b, fx in ((logits, bias, None), (logits, None, fixed), (band, None, fixed)):
        idx, w, _ = ops.route(lg, b, 6, scoring, 2.5, fx)
        ridx, rw, _ = reference.route(f64(lg), f64(b), 6, scoring, 2.5, fx)
        assert torch.equal(idx.cpu(), ridx.cpu()), f"route({scoring}) picked other experts than the reference"
        assert torch.allclose(w.double().cpu(), rw.cpu(), rtol=1e-5, atol=0), f"route({scoring}) weights differ"


@pytest.mark.parametrize("weighted", [False, True])
def test_norm_rope(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, weighted):
    """q's per-head RMSNorm (unweighted) and kv's (weighted), each fused with RoPE."""
    torch.manual_seed(17 + weighted)
    x = rnd(2, 3, 5, 40, dev=cdna2_device, dtype=dtype, scale=3)
    w = (torch.rand(40, device=cdna2_device) + 0.5).to(dtype) if weighted else None
    ang = torch.rand(2, 3, 8, dtype=torch.float64, device=cdna2_device) * 100
    out = ops.norm_rope(x, w, 1e-6, ang.cos(), ang.sin())
    check("norm_rope", out, reference.norm_rope(f64(x), f64(w), 1e-6, ang.cos(), ang.sin()), dtype,
          cdna2_tolerance, cdna2_record)
    small = x * 0.03  # rows' mean square ~1e-2: an eps of that size moves every output by ~30%
    out = ops.norm_rope(small, w, 1e-2, ang.cos(), ang.sin())
    check("norm_rope (eps)", out, reference.norm_rope(f64(small), f64(w), 1e-2, ang.cos(), ang.sin()), dtype,
          cdna2_tolerance, cdna2_record)


def test_norm_rope_window_ring(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record):
    """A decode step's K=V row into the sliding window's ring: slot pos % W of each batch row gets the row and
    its visibility flag; every other slot and flag keeps its value."""
    torch.manual_seed(23)
    x = rnd(2, 1, 1, 40, dev=cdna2_device, dtype=dtype, scale=3)
    w = (torch.rand(40, device=cdna2_device) + 0.5).to(dtype)
    ang = torch.rand(2, 1, 8, dtype=torch.float64, device=cdna2_device) * 100
    keys = rnd(2, 8 + 3, 40, dev=cdna2_device, dtype=dtype)  # the window, then compressed-entry slots
    flags = torch.rand(2, 8 + 3, device=cdna2_device) < 0.3
    before_keys, before_flags = keys.clone(), flags.clone()
    pos = torch.tensor([13], device=cdna2_device)
    out = ops.norm_rope(x, w, 1e-6, ang.cos(), ang.sin(), (keys[:, :8], flags[:, :8], pos))
    ref = reference.norm_rope(f64(x), f64(w), 1e-6, ang.cos(), ang.sin())
    check("norm_rope(ring) output", out, ref, dtype, cdna2_tolerance, cdna2_record)
    check("norm_rope(ring) slot", keys[:, 13 % 8], ref[:, 0, 0], dtype, cdna2_tolerance, cdna2_record)
    others = [i for i in range(8 + 3) if i != 13 % 8]
    assert torch.equal(keys[:, others], before_keys[:, others]), "norm_rope(ring) wrote outside slot pos % W"
    assert bool(flags[:, 13 % 8].all()), "norm_rope(ring) left the written slot invisible"
    assert torch.equal(flags[:, others], before_flags[:, others]), "norm_rope(ring) changed other slots' flags"


def test_swiglu(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record):
    torch.manual_seed(19)
    g, u = rnd(3, 2 * 700, dev=cdna2_device, dtype=dtype, scale=6).split(700, -1)
    check("swiglu", ops.swiglu(g, u, 7.0), reference.swiglu(f64(g), f64(u), 7.0), dtype, cdna2_tolerance,
          cdna2_record)


@pytest.mark.parametrize("T, k", [(21, 21), (300, 100)])
def test_topk_mask(ops, cdna2_device, T, k):
    """The indexer's pick as a mask: the top-k set with ties to the lower index, hidden (-inf) entries never in."""
    torch.manual_seed(T)
    s = (torch.randint(0, 6, (2, 1, T)).float() / 4).to(cdna2_device)
    s[1, :, ::3] = float("-inf")
    assert torch.equal(ops.topk_mask(s, k).cpu(), reference.topk_mask(s.cpu(), k)), "topk_mask picked another set"


@pytest.mark.parametrize("ratio, d, pos", [(4, 40, 9), (4, 40, 11), (128, 24, 130), (128, 24, 127)])
def test_compress_step(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, ratio, d, pos):
    """One decode token through a compressor's fixed buffers (CSA ring of two windows, HCA of one): the ring
    row is a copy, the entry of its window is pooled, normed and rotated like the reference's."""
    torch.manual_seed(ratio + pos)
    dev, B, half = cdna2_device, 2, 8
    c, ring = (2 * d, 2 * ratio) if ratio == 4 else (d, ratio)
    kv, gate = rnd(B, 1, c, dev=dev), rnd(B, 1, c, dev=dev)
    bufs = [rnd(B, ring, c, dev=dev), rnd(B, ring, c, dev=dev), rnd(B, pos // ratio + 2, d, dev=dev, dtype=dtype),
            torch.rand(B, pos // ratio + 2, device=dev) < 0.5]  # valid flags: random, so a write either way shows
    ape, norm = rnd(ratio, c, dev=dev), torch.rand(d, device=dev) + 0.5
    ang = torch.rand(B, 1, half, dtype=torch.float64, device=dev) * 50
    p = torch.tensor([pos], device=dev)
    want = [t.clone() if t.dtype == torch.bool else f64(t.clone()) for t in bufs]
    reference.compress_step(f64(kv), f64(gate), *want, f64(ape), norm, ang.cos(), ang.sin(), p, ratio, 1e-6)
    ops.compress_step(kv, gate, *bufs, ape, norm, ang.cos(), ang.sin(), p, ratio, 1e-6)
    assert torch.equal(bufs[0].double(), want[0]), "compress_step: the kv ring row is not the projected row"
    # the gate row is gate + ape, one fp32 rounding of a sum the float64 reference computes exactly
    assert torch.allclose(bufs[1].double(), want[1], rtol=1e-6, atol=1e-6), "compress_step: gate ring row wrong"
    w = pos // ratio
    assert torch.equal(bufs[3], want[3]), "compress_step: the entry's valid flag is not set iff its window closed"
    check("compress_step", bufs[2][:, w], want[2][:, w], dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("B,S", SHAPES)
def test_grouped_linear(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S):
    torch.manual_seed(B * 100 + S + 1)
    x, w = rnd(B, S, 4, 72, dev=cdna2_device, dtype=dtype), fp8_weight(4 * 40, 72, cdna2_device)
    out = ops.grouped_linear(x, w, 4)
    check("grouped_linear", out, reference.grouped_linear(f64(x), w, 4), dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("B,S", SHAPES)
def test_rms_norm(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, weighted):
    torch.manual_seed(B * 100 + S + 2)
    x = rnd(B, S, 3, 97, dev=cdna2_device, dtype=dtype, scale=5.0)
    w = rnd(97, dev=cdna2_device, dtype=torch.bfloat16) if weighted else None
    check("rms_norm", ops.rms_norm(x, w, 1e-6), reference.rms_norm(f64(x), w, 1e-6), dtype, cdna2_tolerance,
          cdna2_record)
    small = x * 0.02  # rows' mean square ~1e-2: an eps of that size moves every output by ~30%
    check("rms_norm (eps)", ops.rms_norm(small, w, 1e-2), reference.rms_norm(f64(small), w, 1e-2), dtype,
          cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("B,S", SHAPES)
def test_rope(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, inverse):
    torch.manual_seed(B * 100 + S + 3)
    x = rnd(B, S, 3, 40, dev=cdna2_device, dtype=dtype)
    ang = torch.rand(B, S, 8, dtype=torch.float64, device=cdna2_device) * 100
    out = ops.rope(x, ang.cos(), ang.sin(), inverse)
    check("rope", out, reference.rope(f64(x), ang.cos(), ang.sin(), inverse), dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("B,S,L", [(1, 1, 37), (1, 9, 50), (2, 5, 130)])
def test_attention(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, L, rotary):
    """rotary: V4's form, which the model runs (the output's inverse RoPE in the op)."""
    torch.manual_seed(B * 100 + S + L)
    q, kv = rnd(B, S, 3, 40, dev=cdna2_device, dtype=dtype), rnd(B, L, 40, dev=cdna2_device, dtype=dtype)
    sink = rnd(3, dev=cdna2_device)
    mask = torch.rand(B, S, L, device=cdna2_device) < 0.7
    mask[0, 0] = False  # a row that sees nothing: the sink takes all the mass, output 0
    rot = None
    if rotary:
        ang = torch.rand(B, S, 8, dtype=torch.float64, device=cdna2_device) * 100
        rot = (ang.cos(), ang.sin())
    out = ops.attention(q, kv, sink, mask, 40**-0.5, rot)
    ref = reference.attention(f64(q), f64(kv), sink, mask, 40**-0.5, rot)
    check("attention", out, ref, dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_sparse_attention(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, case):
    """V4's compressed sparse attention at its head width (512), 8 heads, the model's form (sinks, the output
    un-rotated): each query sees its sliding window (128) and at most 512 picked compressed entries. decode: one
    token per sequence over a long buffer (the window ring then 8064 entry slots, 512 picked at random); prefill:
    144 positions over the prompt and its 36 entries, the window causal, every entry a position has closed picked.
    At these lengths a backend that reads only the visible keys does so (the bundled one from 6144 keys in a
    decode, always in a prefill's programs), so its compaction of the mask is checked on the device itself."""
    torch.manual_seed(1 if case == "decode" else 2)
    h, d, win = 8, 512, 128
    if case == "decode":
        b, s, ln = 2, 1, 8192
        mask = torch.zeros(b, s, ln, dtype=torch.bool)
        mask[..., :win] = True
        for i in range(b):
            mask[i, 0, win + torch.randperm(ln - win)[:512]] = True
    else:
        b, s = 1, 144  # 144 programs a launch: past the bundled backend's split threshold (132), as a prefill runs
        pos = torch.arange(s)
        window = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - win)
        entries = torch.arange(s // 4)[None] < ((pos + 1) // 4)[:, None]
        mask, ln = torch.cat([window, entries], 1)[None], s + s // 4
    mask = mask.to(cdna2_device)
    q, kv = rnd(b, s, h, d, dev=cdna2_device, dtype=dtype), rnd(b, ln, d, dev=cdna2_device, dtype=dtype)
    sink = rnd(h, dev=cdna2_device)
    ang = torch.rand(b, s, 32, dtype=torch.float64, device=cdna2_device) * 100
    rot = (ang.cos(), ang.sin())
    out = ops.attention(q, kv, sink, mask, d**-0.5, rot)
    ref = reference.attention(f64(q), f64(kv), sink, mask, d**-0.5, rot)
    check("attention", out, ref, dtype, cdna2_tolerance, cdna2_record)


@pytest.mark.parametrize("B,S,T", [(1, 1, 9), (2, 6, 33)])
def test_index_scores(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, B, S, T):
    torch.manual_seed(B * 100 + S + T)
    q, k = rnd(B, S, 16, 24, dev=cdna2_device, dtype=dtype), rnd(B, T, 24, dev=cdna2_device, dtype=dtype)
    w = rnd(B, S, 16, dev=cdna2_device)
    out = ops.index_scores(q, k, w, 24**-0.5)
    check("index_scores", out, reference.index_scores(f64(q), f64(k), f64(w), 24**-0.5), dtype, cdna2_tolerance,
          cdna2_record)
    visible = torch.rand(B, 1, T, device=cdna2_device) < 0.5  # a decode step's closed compressed entries
    hidden = ops.index_scores(q, k, w, 24**-0.5, visible)
    shown = visible.expand(B, S, T)
    assert torch.equal(hidden.isneginf(), ~shown), "index_scores(visible): hidden entries must score -inf, only they"
    assert torch.equal(hidden[shown], out[shown]), "index_scores(visible) changed a visible entry's score"


@pytest.mark.parametrize("T", [1, 3, 11])
def test_moe_experts(ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record, T):
    torch.manual_seed(T)
    E, D, I, k = 6, 96, 64, 2
    x = rnd(T, D, dev=cdna2_device, dtype=dtype)
    w1, w3, w2 = mxfp4_stack(E, I, D, cdna2_device), mxfp4_stack(E, I, D, cdna2_device), \
        mxfp4_stack(E, D, I, cdna2_device)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(cdna2_device)
    wts = torch.rand(T, k, device=cdna2_device)
    out = ops.moe_experts(x, w1, w3, w2, idx, wts, 10.0)
    ref = reference.moe_experts(f64(x), w1, w3, w2, idx, f64(wts), 10.0)
    check("moe_experts", out, ref, dtype, cdna2_tolerance, cdna2_record)


# ---------------------------------------------------------------------------------------- numerics policy


def test_accumulation_is_fp32(backend_ops, dtype, cdna2_device):
    """8192 products of 1 x 1: an fp32 accumulator gives 8192 exactly; fp16 stalls at 2048, bf16 at 256."""
    x = torch.ones(1, 1, 8192, device=cdna2_device, dtype=dtype)
    w8, s = formats.fp8_block_quantize(torch.ones(5, 8192))
    out = backend_ops.linear(x, QWeight(w8.to(cdna2_device), s.to(cdna2_device), "fp8")).float()
    assert (out == 8192).all(), f"linear accumulates in low precision: sum of 8192 ones = {out.flatten()[0]:.0f}"


def test_softmax_statistics_are_fp32(backend_ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record):
    """Logits near 81920 overflow fp16 (max 65504): fp32 running max and sum still give the right output. Every
    key shares 40 dimensions of 128 (q . k / 8 = 81920); the two key levels differ by 1 in logit (dimension 40)
    and carry +1 or -1 in dimensions 48-63, so those outputs, (1 - e) / (1 + e) = -0.46, hold the softmax
    weights: uniform weights give 0, one level alone +-1 (the other dimensions are the same for every key)."""
    L, D = 300, 64
    q = torch.zeros(1, 1, 2, D, device=cdna2_device, dtype=dtype)
    q[..., :40], q[..., 40] = 128.0, 1.0
    kv = torch.zeros(1, L, D, device=cdna2_device, dtype=dtype)
    kv[..., :40] = 128.0
    kv[0, 0::2, 48:] = 1.0
    kv[0, 1::2, 40], kv[0, 1::2, 48:] = 8.0, -1.0
    mask = torch.ones(1, 1, L, dtype=torch.bool, device=cdna2_device)
    sink = torch.zeros(2, device=cdna2_device)  # exp(0 - 81921): nothing next to the keys' weights
    out = backend_ops.attention(q, kv, sink, mask, D**-0.5).double()
    assert torch.isfinite(out).all(), "attention overflowed: softmax statistics are not kept in fp32"
    e = torch.e  # closed form: key weights 1 : e between the two levels, 150 keys each
    want = torch.zeros_like(out)
    want[..., :40], want[..., 40], want[..., 48:] = 128.0, 8 * e / (1 + e), (1 - e) / (1 + e)
    check("softmax_stats", out[..., 40:], want[..., 40:], dtype, cdna2_tolerance, cdna2_record)


def test_swiglu_clamps_at_the_limit(backend_ops, dtype, cdna2_device, cdna2_tolerance, cdna2_record):
    """V4's clamped SwiGLU (swiglu_limit; DeepSeek's inference/model.py): the gate is clamped from above only, the
    up branch to [-limit, limit], then silu(gate) * up. Values worked by hand at limit 10 (the bundled model's
    activations stay under it, so only this check sees a clamp dropped or put on the wrong side):
    gate -20 (unclamped below), up 30 -> 10: silu(-20) * 10 = -20 / (1 + e^20) * 10 = -4.1223e-7;
    gate -1, up -30 -> -10: -1 / (1 + e) * -10 = 2.6894142; gate 0.5, up 2: 0.5 / (1 + e^-0.5) * 2 = 0.6224593;
    gate 20 -> 10, up 5: 10 / (1 + e^-10) * 5 = 49.9977301."""
    gate = torch.tensor([[-20.0, -1.0, 0.5, 20.0]], device=cdna2_device, dtype=dtype)
    up = torch.tensor([[30.0, -30.0, 2.0, 5.0]], device=cdna2_device, dtype=dtype)
    out = backend_ops.swiglu(gate, up, 10.0).double().cpu()
    want = torch.tensor([[-4.1223072e-7, 2.6894142, 0.6224593, 49.9977301]], dtype=torch.float64)
    check("swiglu_clamp", out, want, dtype, cdna2_tolerance, cdna2_record)


def test_topk_ties_go_to_the_lower_index(backend_ops, cdna2_device):
    scores = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0, 2.0, 0.0, 2.0]], device=cdna2_device).repeat(4, 1)
    idx, _ = backend_ops.topk(scores, 3)
    assert idx.sort(-1).values.tolist() == [[1, 2, 4]] * 4, f"ties broken by memory order: {idx.tolist()}"


def test_reductions_are_deterministic(backend_ops, dtype, cdna2_device):
    torch.manual_seed(5)
    x = rnd(7, 96, dev=cdna2_device, dtype=dtype)
    w1, w3, w2 = (mxfp4_stack(4, 64, 96, cdna2_device), mxfp4_stack(4, 64, 96, cdna2_device),
                  mxfp4_stack(4, 96, 64, cdna2_device))
    idx = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2], [0, 2], [1, 3], [0, 3]], device=cdna2_device)
    wts = torch.rand(7, 2, device=cdna2_device)
    a = backend_ops.moe_experts(x, w1, w3, w2, idx, wts, 10.0)
    b = backend_ops.moe_experts(x, w1, w3, w2, idx, wts, 10.0)
    assert torch.equal(a, b), "moe_experts is not bit-reproducible (float atomics or unordered sums?)"
