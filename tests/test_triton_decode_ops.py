"""The decode-step kernels outside the weight formats, in Triton's interpreter against float64 references:
the unquantized linear at decode sizes (the head, the router, the compressors; reference would copy W to
float32 on every call) and mHC's pre/post/Sinkhorn split. Fresh random inputs per case, kernel outputs
poisoned with NaN first. Tolerance: fp32 arithmetic against float64, rel. Frobenius 1e-5 (DESIGN.md
section 5, kernel tier, fp32 operands); the Sinkhorn split is elementwise in fp32, so 1e-6 per element.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

pytest.importorskip("triton")

from cdna2_engine.ops import QWeight  # noqa: E402
from cdna2_engine.ops import reference as ref  # noqa: E402
from cdna2_engine.ops import triton as tri  # noqa: E402


@pytest.fixture(autouse=True)
def _poison(monkeypatch, kernels_launched):
    """Every output buffer starts as NaN, and every test must launch a kernel (`kernels_launched`)."""
    monkeypatch.setattr(tri, "POISON", True)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in output (an element the kernel never wrote?)"
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "split"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 37, 300), (3, 130, 64), (4, 5, 1000), (9, 37, 300)])
def test_dense_linear_at_decode_sizes(m, n, k, wdtype, narrow, monkeypatch):
    """Both plans: all of K in one load per program (narrow W), and the K split with its in-launch sum; 9 rows:
    three row blocks of DENSE_GEMV_BLOCK_M, the last ragged."""
    monkeypatch.setattr(tri, "DENSE_GEMV_MAX_M", max(m, tri.DENSE_GEMV_MAX_M))
    if not narrow:
        monkeypatch.setitem(tri.DENSE_GEMV_NARROW, "MAX_N", 0)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, 1, k, generator=g)
    w = QWeight((torch.randn(n, k, generator=g) / k**0.5).to(wdtype), None, "dense")
    y = tri.linear(x, w)
    assert y.dtype == x.dtype
    assert rel(y, ref.linear(x.double(), QWeight(w.data.double(), None, "dense"))) <= 1e-5
    assert torch.equal(tri.linear(x, w), y)  # again: the split sum left its arrival counters at zero
    assert not tri._locks(x.device, 0).any()
    x16 = x.half()  # the router's form: half-width activations, fp32 logits written directly
    y32 = tri.linear(x16, w, torch.float32)
    assert y32.dtype == torch.float32
    assert rel(y32, ref.linear(x16.double(), QWeight(w.data.double(), None, "dense"))) <= 1e-5


@pytest.mark.no_kernel
def test_dense_linear_above_decode_size_and_bf16_on_cpu_use_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(tri, "_dense_linear", lambda *a: calls.append(a))
    x = torch.randn(tri.DENSE_GEMV_MAX_M + 1, 16)
    tri.linear(x, QWeight(torch.randn(8, 16), None, "dense"))
    tri.linear(x[:1], QWeight(torch.randn(8, 16, dtype=torch.bfloat16), None, "dense"))  # interpreter: no bf16
    assert calls == []


@pytest.mark.parametrize("lead, n, k", [((2, 20), 130, 300), ((17,), 64, 128)])
def test_dense_linear_at_prefill_sizes_takes_the_tile_kernel(lead, n, k, monkeypatch):
    """Above DENSE_GEMV_MAX_M rows, 16-bit x with W of its dtype runs matmul_kernel (ragged row, column and K
    tiles here), within fp16's output rounding (<= 2^-11 relative) plus fp32 sums of float64: 1e-3. fp32 logits,
    fp32 x and W of another dtype keep the reference."""
    taken = []
    real = tri._tile_matmul
    monkeypatch.setattr(tri, "_tile_matmul", lambda *a: taken.append(a[1].shape) or real(*a))
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(*lead, k, generator=g).half()
    w = QWeight((torch.randn(n, k, generator=g) / k**0.5).half(), None, "dense")
    y = tri.linear(x, w)
    assert taken == [(n, k)] and y.shape == (*lead, n) and y.dtype == torch.float16
    assert rel(y, ref.linear(x.double(), QWeight(w.data.double(), None, "dense"))) <= 1e-3
    tri.linear(x, w, torch.float32)
    tri.linear(x.float(), w)
    tri.linear(x, QWeight(w.data.float(), None, "dense"))
    assert taken == [(n, k)]


@pytest.mark.no_kernel
def test_dense_tile_routing():
    """Which dense linears above DENSE_GEMV_MAX_M rows take the tile kernel (`_dense_tile_on`, shapes and dtypes
    only: meta tensors): 16-bit x with W and output of its dtype; fp32 x in parts only against a wide bf16 W (the
    head); the router's fp32 logits from bf16 x or from fp32 x (its W is narrow) keep the reference."""
    def on(x_dtype, w_dtype, out_dtype, n=256, k=4096):
        x = torch.empty(40, k, dtype=x_dtype, device="meta")
        return tri._dense_tile_on(x, torch.empty(n, k, dtype=w_dtype, device="meta"), out_dtype)

    bf, h, f = torch.bfloat16, torch.float16, torch.float32
    assert on(bf, bf, bf) and on(h, h, h) and on(f, bf, f, n=129280)
    assert not on(bf, bf, f)  # the router's logits in a bf16 run
    assert not on(f, bf, f)  # the router in a float32 run
    assert not on(f, f, f, n=129280) and not on(h, bf, h) and not on(bf, f, bf)


def test_tile_matmul_dots_fp32_x_in_parts():
    """fp32 x against narrower W (bf16 on a GPU: the head at a prefill; fp16 here, the interpreter has no bf16) is
    dotted as three parts of W's dtype: within 1e-5 of float64 (fp32 sums; x rounded to fp16 whole would be
    ~2^-11 off), rows 2^-6..2^6 apart, ragged tiles."""
    g = torch.Generator().manual_seed(5)
    m, n, k = 37, 70, 200
    x = torch.randn(m, k, generator=g) * torch.logspace(-1.8, 1.8, m)[:, None]
    w = (torch.randn(n, k, generator=g) / k**0.5).half()
    y = torch.full((m, 1, n), float("nan"))
    tri._tile_matmul(x.unsqueeze(1), w, None, y)
    want = x.double() @ w.double().T
    assert ((y[:, 0].double() - want).norm(dim=1) / want.norm(dim=1)).max() <= 1e-5


@pytest.mark.parametrize("parts, exact", [(4, True), (3, True), (2, False)])
@pytest.mark.no_kernel
def test_x_parts_sum_to_x(parts, exact):
    """dense_mma's premise: bf16 parts whose sum is x, so their products with bf16 W are exact. Three hold any
    finite float32 from 2^-100 up (here 2^-100..2^127, and fp32's largest, which rounds to inf as a bf16); two
    cannot (16 of fp32's 24 bits)."""
    g = torch.Generator().manual_seed(parts)
    x = torch.randn(7, 512, generator=g) * torch.exp2(torch.randint(-100, 127, (7, 512), generator=g).float())
    x[0, :4] = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 3.3961e38, 2.0**-100])
    p = tri.x_parts(x, parts)
    assert torch.isfinite(p).all()
    assert p.dtype == torch.bfloat16 and p.shape == (7 * parts, 512)
    total = p.double().reshape(7, parts, 512).sum(1)
    assert torch.equal(total, x.double()) == exact
    if parts == 4:
        assert not p.reshape(7, 4, 512)[:, 3].any()  # the power-of-two filler


@pytest.mark.parametrize("m, n, k", [(2, 200, 96), (5, 130, 64), (16, 37, 300), (3, 4100, 72)])
def test_dense_mma_in_the_interpreter(m, n, k):
    """The kernel's tiling, masks and the parts' sum after the K loop, with fp32 W holding bf16 values (the
    interpreter has no bf16) and rows of x 2^-20..2^20 apart: each row within 1e-5 of float64 (fp32 sums), and the
    same bits again."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, m)[:, None]
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().float()
    y = tri._dense_mma(x, w, torch.float32)
    want = x.double() @ w.double().T
    assert not torch.isnan(y).any()
    assert ((y.double() - want).norm(dim=1) / want.norm(dim=1)).max() <= 1e-5
    assert torch.equal(tri._dense_mma(x, w, torch.float32), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200)")
@pytest.mark.parametrize("dtype, m", [(torch.float32, 2), (torch.float32, 7), (torch.float32, 16),
                                      (torch.bfloat16, 2), (torch.bfloat16, 33), (torch.bfloat16, 64)])
def test_dense_mma_takes_the_head_on_a_gpu(dtype, m, monkeypatch):
    """linear() routes a wide bf16 W at 2+ rows to dense_mma; each row within 1e-5 of float64 (fp32 sums of
    exact products), fp32 logits from bf16 x too, and the same bits on a second call."""
    taken = []
    real = tri._dense_mma
    monkeypatch.setattr(tri, "_dense_mma", lambda *a: taken.append(a[0].shape) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 8192 + 3, 4096
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = QWeight((torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16(), None, "dense")
    y = tri.linear(x, w, torch.float32)
    assert taken == [(m, k)]
    want = x.double() @ w.data.double().T
    assert not torch.isnan(y).any()
    assert ((y.double() - want).norm(dim=1) / want.norm(dim=1)).max() <= 1e-5
    assert torch.equal(tri.linear(x, w, torch.float32), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200)")
@pytest.mark.parametrize("k, r", [(8192, 4096), (4096, 1536), (1024, 32768)])  # wo_b, wq_a|wkv, wq_b
def test_fp8_tile_fp32_x_is_a_two_level_sum_on_a_gpu(k, r):
    """fp32 x of 64 rows against FP8 W on the prefill tile: each row within u * sqrt(BLOCK_K + K / BLOCK_K) of
    float64 (u = 2^-24), the probabilistic bound of a sum taken in BLOCK_K-term steps then over the steps. The folded
    form's one FMA chain over all of K came 1.2-1.7e-6 at K 4096-8192 (over this bound by 1.8-2x; 1.1x at K 1024)
    and the two-level sum 1.7-2.6e-7, 0.3x of it (NOTES runs 175-181): the chain took the flash slice's float32
    prefill past its 1e-5 gate."""
    g = torch.Generator(device="cuda").manual_seed(k + r)
    w = QWeight(torch.randint(0, 256, (r, k), device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
                torch.randint(116, 124, (r // 128, k // 128), device="cuda", generator=g,
                              dtype=torch.uint8).view(torch.float8_e8m0fnu), "fp8")
    w.data.view(torch.uint8)[(w.data.view(torch.uint8) & 0x7F) == 0x7F] = 0x38  # no NaN codes
    x = torch.randn(64, k, device="cuda", generator=g)
    want = x.double() @ ref.dequantize(w, torch.float64).T
    y = tri.linear(x, w)
    bk = tri.FP8_DOT["BLOCK_K"]
    assert ((y.double() - want).norm(dim=1) / want.norm(dim=1)).max() <= 2.0**-24 * (bk + k / bk) ** 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200)")
@pytest.mark.parametrize("dtype, m", [(torch.bfloat16, 17), (torch.bfloat16, 300), (torch.bfloat16, 1024),
                                      (torch.float32, 17), (torch.float32, 1024)])
def test_dense_tile_takes_a_prefill_on_a_gpu(dtype, m, monkeypatch):
    """bf16 W of 4096 columns at prefill rows runs matmul_kernel: bf16 x (a CSA compressor's joined W, 2048 rows)
    within bf16's output rounding (<= 2^-8 relative) of float64; fp32 x (a wide W, the head's form, 8195 rows;
    dotted in three bf16 parts) each row within 1e-5 (fp32 sums, as dense_mma); the same bits on a second call."""
    taken = []
    real = tri._tile_matmul
    monkeypatch.setattr(tri, "_tile_matmul", lambda *a: taken.append(a[0].shape) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g).to(dtype)
    n = 2048 if dtype == torch.bfloat16 else 8195
    w = QWeight((torch.randn(n, 4096, device="cuda", generator=g) / 64).bfloat16(), None, "dense")
    y = tri.linear(x, w)
    assert taken == [(m, 1, 4096)] and y.dtype == dtype
    want = x.double() @ w.data.double().T
    if dtype == torch.bfloat16:
        assert rel(y, want) <= 2.0**-8
    else:
        assert ((y.double() - want).norm(dim=1) / want.norm(dim=1)).max() <= 1e-5
    assert torch.equal(tri.linear(x, w), y)


def _hc_case(g: torch.Generator, n: int, d: int, dtype: torch.dtype) -> tuple:
    """mHC weights for n streams of width d: fn [2n + n*n, n*d], base, scale, and a block RMSNorm weight."""
    fn = torch.randn(2 * n + n * n, n * d, generator=g) / (n * d) ** 0.5 * 3
    base, scale = torch.randn(2 * n + n * n, generator=g), torch.rand(3, generator=g) + 0.5
    return fn, base, scale, (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)


def _f64(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() for t in ts]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("rows, d", [(1, 64), (5, 40), (3, 1100)])  # d > one 1024 block; K split or not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("broadcast", [False, True], ids=["streams", "embedding"])
def test_hc_pre_and_weights(n, rows, d, dtype, broadcast):
    """hc_pre's collapse (and the block's RMSNorm in the same launch) and hc_weights' post and comb from its mix
    sums, against float64. `embedding`: the first block's streams, one row broadcast (stream stride 0)."""
    g = torch.Generator().manual_seed(n * 10 + rows + d)
    h = (torch.randn(rows, 1, n, d, generator=g) * 2).to(dtype)
    if broadcast:
        h = h[:, :, :1].expand(rows, 1, n, d)
        assert h.stride(2) == 0
    fn, base, scale, nw = _hc_case(g, n, d, dtype)
    sums, x, xn = tri.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-6))
    rsums, rx, rxn = ref.hc_pre(*_f64(h, fn, base, scale), n, 1e-6, 1e-6, (nw.double(), 1e-6))
    assert sums.shape[:2] == (rows, 1) and sums.shape[-1] == 2 * n + 2 * n * n
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # x is rounded to fp16: the kernel tier's fp16 limit
    assert rel(x, rx) <= tol and rel(xn, rxn) <= tol
    plain = tri.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6)  # without the norm: the same two, no third
    assert len(plain) == 2 and torch.equal(plain[0], sums) and torch.equal(plain[1], x)
    post, comb = tri.hc_weights(sums, base, scale, n, d, 20, 1e-6, 1e-6, h.dtype)
    rpost, rcomb = ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64)
    assert post.dtype == comb.dtype == torch.float32  # fp32 from any streams' dtype but fp64
    assert rel(post, rpost) <= 1e-5 and rel(comb, rcomb) <= 1e-5  # the kernel tier's fp32 limit (DESIGN.md s. 5)
    # Sinkhorn ends on a column normalization: columns sum to 1 (rows only approach it in 20 iterations); an fp32
    # column of n terms sums to 1 within ~n * 2^-24, and 1e-4 still fails a column that was not normalized last
    assert torch.allclose(comb.double().sum(-2), torch.ones(rows, 1, n, dtype=torch.float64), atol=1e-4)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("rows, d", [(1, 64), (3, 1100)])
def test_hc_mix_sums_are_shared_by_the_backends(n, rows, d):
    """Either backend's hc_weights reads either backend's sums (the triton ones split over D blocks, the
    reference's one split), so CDNA2_REFERENCE_OPS can switch hc_pre or hc_weights alone; and the reference's
    post and comb from the sums equal those of the mix computed directly (the normalized streams times fn)."""
    g = torch.Generator().manual_seed(n * 3 + rows + d)
    h = torch.randn(rows, 1, n, d, generator=g) * 2
    fn, base, scale, _ = _hc_case(g, n, d, torch.float32)
    tsums, rsums = tri.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6)[0], ref.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6)[0]
    assert tsums.shape[-2] > 1 and rsums.shape[-2] == 1  # triton: split; reference: one split
    for wf in (tri.hc_weights, ref.hc_weights):
        for sums in (tsums, rsums):
            got = wf(sums, base, scale, n, d, 20, 1e-6, 1e-6, torch.float32)
            want = ref.hc_weights(rsums.double(), *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64)
            assert rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5
    flat = h.double().flatten(-2)  # the mix as the paper writes it: RMS-normalized streams times fn
    mix = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6) @ fn.double().T
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1].double() + base[n:2 * n].double())
    got = ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64)
    assert rel(got[0], post) <= 1e-12


@pytest.mark.parametrize("delta", [1e-1, 1e-2, 1e-3])
def test_hc_block_norm_where_the_streams_cancel(delta):
    """The block norm's sum of squares comes from the streams' Gram matrix (pre^T G pre): with streams that
    cancel (h2 = -h1 + delta, equal pre), ||h||^2 / ||x||^2 reaches 1e6 and an fp32 G would lose that much (1e-3
    at delta 1e-2); the fp64 G matches the norm of the kernel's own x (the two-launch form) to fp32 accuracy,
    through hc_pre's mix launch and hc_post_pre's. Against float64, x itself carries fp32's cancellation error
    (2^-24 ||h|| / ||x||), so that check stops at delta 1e-2."""
    g = torch.Generator().manual_seed(17)
    rows, n, d = 2, 2, 300
    h1 = torch.randn(rows, 1, 1, d, generator=g)
    h = torch.cat([h1, -h1 + delta * torch.randn(rows, 1, 1, d, generator=g)], 2)  # [rows, 1, 2, d] fp32
    fn, base = torch.zeros(2 * n + n * n, n * d), torch.zeros(2 * n + n * n)  # pre = sigmoid(0) + eps for both
    scale, nw = torch.ones(3), 1 + 0.1 * torch.randn(d, generator=g)
    _, x, got = tri.hc_pre(h, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-12))
    two_launch = tri.rms_norm(x, nw, 1e-12)
    assert rel(got, two_launch) <= 1e-6
    want = ref.hc_pre(*_f64(h, fn, base, scale), n, 1e-6, 1e-6, (nw.double(), 1e-12))[2]
    if delta >= 1e-2:
        assert rel(got, want) <= 1e-5
    post, comb = torch.zeros(rows, 1, n), torch.eye(n).expand(rows, 1, n, n)  # hc_post returns h itself
    got = tri.hc_post_pre(torch.zeros(rows, 1, d), h, post, comb, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-12))
    assert rel(got[3], tri.rms_norm(got[2], nw, 1e-12)) <= 1e-6


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("rows, d", [(1, 64), (4, 1100)])
@pytest.mark.parametrize("programs", [4096, 2, 8])  # 2, 8: several D blocks a program (STEPS, a prefill's form)
def test_hc_post(n, rows, d, programs, monkeypatch):
    monkeypatch.setattr(tri, "HC_POST_PROGRAMS", programs)
    g = torch.Generator().manual_seed(n * 100 + rows + d)
    h, out = torch.randn(rows, 1, n, d, generator=g), torch.randn(rows, 1, d, generator=g)
    post, comb = torch.rand(rows, 1, n, generator=g) * 2, torch.rand(rows, 1, n, n, generator=g)
    got = tri.hc_post(out, h, post, comb)
    assert rel(got, ref.hc_post(out.double(), h.double(), post.double(), comb.double())) <= 1e-5
    x = h[:, :, :1].expand(rows, 1, n, d)  # the first block's streams: one row broadcast, stream stride 0
    got = tri.hc_post(out, x, post, comb)
    assert rel(got, ref.hc_post(out.double(), x.double(), post.double(), comb.double())) <= 1e-5


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("rows, d", [(1, 64), (3, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("programs", [4096, 2, 24])  # 2, 24: several D blocks a program (STEPS), partial last
def test_hc_post_pre(n, rows, d, dtype, programs, monkeypatch):
    """A block's mHC post and the next block's pre in two launches (the post launch writes the next mix's
    partials from the streams as rounded to their dtype): the streams, input, normed input, and post and comb
    from the sums, match the reference's composition, with one D block a program and with several."""
    monkeypatch.setattr(tri, "HC_POST_PROGRAMS", programs)
    g = torch.Generator().manual_seed(n * 7 + rows + d)
    h, out = (torch.randn(rows, 1, n, d, generator=g) * 2).to(dtype), torch.randn(rows, 1, d, generator=g).to(dtype)
    post, comb = torch.rand(rows, 1, n, generator=g) * 2, torch.rand(rows, 1, n, n, generator=g)
    fn, base, scale, nw = _hc_case(g, n, d, dtype)
    y, sums, x, xn = tri.hc_post_pre(out, h, post, comb, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-5))
    ry, rsums, rx, rxn = ref.hc_post_pre(*_f64(out, h, post, comb, fn, base, scale), n, 1e-6, 1e-6,
                                         (nw.double(), 1e-5))
    got = (y, x, xn, *tri.hc_weights(sums, base, scale, n, d, 20, 1e-6, 1e-6, dtype))
    want = (ry, rx, rxn, *ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64))
    # fp16: the new streams are rounded to fp16 (2^-11) before the next mix reads them, as stored streams are; the
    # float64 reference keeps them exact, so the weights differ by that rounding (the kernel tier's fp16 limit 1e-2
    # for the streams, the input and the normed input, 1e-3 for post and comb); fp32 against float64: 1e-5
    tols = (1e-5,) * 5 if dtype == torch.float32 else (1e-2, 1e-2, 1e-2, 1e-3, 1e-3)
    for a, b, t in zip(got, want, tols, strict=True):
        assert a.shape == b.shape
        assert rel(a, b) <= t


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp16 split"])
@pytest.mark.parametrize("programs", [4096, 60])  # 60: 4 D blocks a program, so 4 per split
def test_hc_mix_dots_at_many_rows(n, dtype, programs, monkeypatch):
    """From HC_MIX_DOT's min_rows (lowered here to reach it at CPU sizes) the mix's dots come from
    hc_mix_dot_kernel, BLOCK_M rows sharing each fn tile, and the row launches keep the Gram matrix: hc_pre
    (streams, and the first block's broadcast embedding) and hc_post_pre against float64 at the row form's
    tolerances, and their sums within fp32 rounding (1e-6) of the row form's own, the dots (sums[..., :mix]) apart
    from the much larger Gram entries. `fp16 split`: fn in three fp16 parts and three dots, the form bf16 streams
    take on a GPU (the interpreter cannot run bf16); fp16 parts drop fn's bits below 2^-24 (2.5e-7 rel. at this
    fn's scale), so those dots are held to 1e-5 of the row form's (bf16 parts are exact)."""
    split = dtype == "fp16 split"
    dtype = torch.float16 if split else dtype
    monkeypatch.setattr(tri, "HC_POST_PROGRAMS", programs)
    monkeypatch.setitem(tri.HC_MIX_DOT, "BLOCK_M", 16)
    monkeypatch.setitem(tri.HC_MIX_DOT, "BLOCK_K", 32)  # several K steps in every split
    monkeypatch.setitem(tri.HC_MIX_DOT, "split", (torch.bfloat16, torch.float16) if split else (torch.bfloat16,))
    sums_tol = 1e-5 if split else 1e-6
    mix = 2 * n + n * n

    def close(a, b):  # the dots and the Gram matrix each within sums_tol of the row form's
        return rel(a[..., :mix], b[..., :mix]) <= sums_tol and rel(a[..., mix:], b[..., mix:]) <= 1e-6
    g = torch.Generator().manual_seed(n * 5 + programs)
    rows, d = 20, 300  # two row blocks, the second ragged; d ragged for BLOCK_K, split over D
    h, out = (torch.randn(rows, 1, n, d, generator=g) * 2).to(dtype), torch.randn(rows, 1, d, generator=g).to(dtype)
    post, comb = torch.rand(rows, 1, n, generator=g) * 2, torch.rand(rows, 1, n, n, generator=g)
    fn, base, scale, nw = _hc_case(g, n, d, dtype)
    tols = (1e-5,) * 5 if dtype == torch.float32 else (1e-2, 1e-2, 1e-2, 1e-3, 1e-3)  # as test_hc_post_pre's
    emb = h[:, :, :1].expand(rows, 1, n, d)
    launched, launch = [], tri._Launch.__call__

    def spy(self, name, grid, *args, **kw):  # hc_mix_dot_kernel's launches and their form
        if name == "hc_mix_dot_kernel":
            launched.append(kw["SPLIT_FN"])
        return launch(self, name, grid, *args, **kw)

    monkeypatch.setattr(tri._Launch, "__call__", spy)

    def both(op, *args):  # (dot form, row form)
        monkeypatch.setitem(tri.HC_MIX_DOT, "min_rows", 1)
        dot = op(*args)
        monkeypatch.setitem(tri.HC_MIX_DOT, "min_rows", 1 << 30)
        return dot, op(*args)

    for streams in (h, emb):
        (sums, x, xn), (rsums_rows, _, _) = both(tri.hc_pre, streams, fn, base, scale, n, 1e-6, 1e-6, (nw, 1e-5))
        assert close(sums, rsums_rows)
        rsums, rx, rxn = ref.hc_pre(*_f64(streams, fn, base, scale), n, 1e-6, 1e-6, (nw.double(), 1e-5))
        got = (x, xn, *tri.hc_weights(sums, base, scale, n, d, 20, 1e-6, 1e-6, dtype))
        want = (rx, rxn, *ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64))
        for a, b, t in zip(got, want, tols[1:], strict=True):
            assert rel(a, b) <= t
    (y, sums, x, xn), (_, sums_rows, _, _) = both(tri.hc_post_pre, out, h, post, comb, fn, base, scale, n, 1e-6,
                                                  1e-6, (nw, 1e-5))
    assert sums.shape[-2] == sums_rows.shape[-2] and close(sums, sums_rows)
    ry, rsums, rx, rxn = ref.hc_post_pre(*_f64(out, h, post, comb, fn, base, scale), n, 1e-6, 1e-6,
                                         (nw.double(), 1e-5))
    got = (y, x, xn, *tri.hc_weights(sums, base, scale, n, d, 20, 1e-6, 1e-6, dtype))
    want = (ry, rx, rxn, *ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64))
    for a, b, t in zip(got, want, tols, strict=True):
        assert rel(a, b) <= t
    assert launched == [split] * 3  # the dot form ran in each op's first call (not the row form's), split or not


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the H200)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_at_prefill_rows_on_a_gpu(dtype):
    """A V4-Flash prefill's hc_post_pre (1024 rows, 4 streams of 4096: several D blocks a program, the mix's dots
    by hc_mix_dot_kernel) against
    float64; bf16 streams are rounded before the next mix reads them (the CPU test's fp16 limits, loosened to
    bf16's 2^-8: 3e-2 and 3e-3)."""
    g = torch.Generator().manual_seed(31)
    n, rows, d = 4, 1024, 4096
    h, out = (torch.randn(rows, 1, n, d, generator=g) * 2).to(dtype), torch.randn(rows, 1, d, generator=g).to(dtype)
    post, comb = torch.rand(rows, 1, n, generator=g) * 2, torch.rand(rows, 1, n, n, generator=g)
    fn, base, scale, nw = _hc_case(g, n, d, dtype)
    args = [t.cuda() for t in (out, h, post, comb, fn, base, scale)]
    y, sums, x, xn = tri.hc_post_pre(*args, n, 1e-6, 1e-6, (nw.cuda(), 1e-5))
    assert sums.shape[-2] < d // tri.HC_MIX_BLOCK_D  # the prefill form: fewer splits than D blocks
    ry, rsums, rx, rxn = ref.hc_post_pre(*_f64(out, h, post, comb, fn, base, scale), n, 1e-6, 1e-6,
                                         (nw.double(), 1e-5))
    got = (y, x, xn, *tri.hc_weights(sums, args[5], args[6], n, d, 20, 1e-6, 1e-6, dtype))
    want = (ry, rx, rxn, *ref.hc_weights(rsums, *_f64(base, scale), n, d, 20, 1e-6, 1e-6, torch.float64))
    tols = (1e-5,) * 5 if dtype == torch.float32 else (3e-2, 3e-2, 3e-2, 3e-3, 3e-3)
    for a, b, t in zip(got, want, tols, strict=True):
        assert rel(a.cpu(), b) <= t


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("rows, d", [(1, 64), (3, 1100)])
def test_hc_head(n, rows, d):
    """The head's mHC collapse (pre weights only) in fp32 against float64; its output stays fp32."""
    g = torch.Generator().manual_seed(n * 1000 + rows + d)
    h = torch.randn(rows, 1, n, d, generator=g) * 2
    fn = torch.randn(n, n * d, generator=g) / (n * d) ** 0.5 * 3
    base, scale = torch.randn(n, generator=g), torch.rand(1, generator=g) + 0.5
    got = tri.hc_head(h, fn, base, scale, 1e-6, 1e-6)
    assert got.dtype == torch.float32
    assert rel(got, ref.hc_head(h.double(), fn.double(), base.double(), scale.double(), 1e-6, 1e-6)) <= 1e-5
    nw = 1 + 0.1 * torch.randn(d, generator=g)  # with the model's final RMSNorm in the same launch
    got2, normed = tri.hc_head(h, fn, base, scale, 1e-6, 1e-6, (nw, 1e-6))
    assert torch.equal(got2, got) and normed.dtype == torch.float32
    want = ref.hc_head(h.double(), fn.double(), base.double(), scale.double(), 1e-6, 1e-6, (nw.double(), 1e-6))[1]
    assert rel(normed, want) <= 1e-5


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("t, e, k", [(3, 256, 6), (2, 37, 5), (1, 8, 8)])
@pytest.mark.parametrize("bias, fixed", [(True, False), (False, False), (True, True)])
def test_route_matches_the_reference(scoring, t, e, k, bias, fixed):
    """Scores, top-k with ties to the lower id (heavy ties on purpose, through the bias), weights normalized
    and scaled, margin; with `fixed` experts (hash routing, a repeat included) only the weights."""
    g = torch.Generator().manual_seed(e * 10 + k + t)
    logits = torch.randint(-8, 9, (t, e), generator=g).float() / 2  # discrete: exact ties in any precision
    if scoring == "sqrtsoftplus":  # (softmax would squash the others below fp32's resolution of the bias)
        logits[:, 3::7] = 25.0  # softplus' pass-through branch (above 20)
    b = (torch.randint(0, 3, (e,), generator=g).float() / 4) if bias else None
    fx = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32) if fixed else None
    if fixed:
        fx[:, 1] = fx[:, 0]
    got = tri.route(logits, b, k, scoring, 2.5, fx)
    want = ref.route(logits.double(), None if b is None else b.double(), k, scoring, 2.5, fx)
    assert torch.equal(got[0], want[0])
    assert rel(got[1], want[1]) <= 1e-6  # fp32 elementwise and one sum of k
    if fixed:
        assert got[2].isinf().all()
    else:  # a difference of two fp32 sums score + bias: a few ulps of the largest
        ulp = (logits.abs().max() + (0 if b is None else b.abs().max())).item() * 2.0**-23
        assert torch.allclose(got[2].double(), want[2], rtol=0, atol=8 * ulp)


@pytest.mark.parametrize("lo, hi", [(-9.6, -4.6), (-30.0, 30.0), (-0.5, 0.5)])
def test_route_sqrtsoftplus_weights_keep_fp32_accuracy(lo, hi):
    """Hash-routed experts may have any logit: the weights of given experts must stay within fp32 rounding of
    the float64 reference over the whole range, also where e^v is 1e-4..1e-2 (there log(1 + e^v) in fp32 is up to
    6e-4 off and the weights were up to ~3e-4 off, before log1p became a series)."""
    g = torch.Generator().manual_seed(int(hi - lo))
    logits = lo + torch.rand(4, 64, generator=g) * (hi - lo)
    fx = torch.randint(0, 64, (4, 6), generator=g, dtype=torch.int32)
    got = tri.route(logits, None, 6, "sqrtsoftplus", 2.5, fx)[1].double()
    want = ref.route(logits.double(), None, 6, "sqrtsoftplus", 2.5, fx)[1]
    assert ((got - want).abs() / want.abs()).max() <= 2e-6  # a few fp32 roundings of exp, the series and the sum


def test_swiglu_on_views_of_one_projection():
    g = torch.Generator().manual_seed(5)
    both = torch.randn(3, 1, 2 * 1100, generator=g) * 6
    gate, up = both.split(1100, -1)
    for limit in (7.0, 0.0):
        got = tri.swiglu(gate, up, limit)
        assert got.shape == gate.shape
        assert rel(got, ref.swiglu(gate.double(), up.double(), limit)) <= 1e-6  # fp32 silu * up: ~10 roundings


def test_rope_cos_sin_in_float64():
    """The angles of positions up to 1M in float64 (an fp32 angle is off by radians there)."""
    pos = torch.tensor([[0, 1, 77, 999_999], [5, 65_536, 300_000, 3]])
    inv = torch.rand(13, dtype=torch.float64) ** 4
    cos, sin = tri.rope_cos_sin(pos, inv)
    rc, rs = ref.rope_cos_sin(pos, inv)
    assert cos.dtype == torch.float64 and cos.shape == (2, 4, 13)
    # both take the float64 angle pos * inv_freq the same way: 1e-12 allows a reordered evaluation, while an fp32
    # angle would be off by radians at position 1M
    assert torch.allclose(cos, rc, rtol=0, atol=1e-12) and torch.allclose(sin, rs, rtol=0, atol=1e-12)
    cos4, _ = tri.rope_cos_sin(pos, inv, 4)  # a compressed entry's angle: its window's first position
    assert torch.allclose(cos4, ref.rope_cos_sin(pos // 4 * 4, inv)[0], rtol=0, atol=1e-12)
    assert not torch.allclose(cos4, cos, rtol=0, atol=1e-6)


@pytest.mark.parametrize("w, k", [(21, 21), (37, 20), (1000, 512)])
def test_topk_mask_is_the_top_k_set_without_hidden_entries(w, k):
    """The indexer's pick as a mask, written into a slice of a bigger mask (the decode's key mask): ties to
    the lower index, entries scored -inf (hidden) never in it even when k reaches them."""
    g = torch.Generator().manual_seed(w + k)
    s = torch.randint(0, 6, (3, 1, w), generator=g).float() / 4
    s[1, :, ::2] = float("-inf")
    s[2] = torch.where(torch.arange(w) % 2 == 0, -0.0, 0.0)  # -0.0 ties +0.0 (as in a sort): the k-th falls
    s[2, :, :3] = 1.0  # among the zeros, so a key that split the signs would pick another set
    for fill in (True, False):  # a buffer all True, then all False: every entry of the slice must be written
        big = torch.full((3, 1, w + 5), fill, dtype=torch.bool)
        got = tri.topk_mask(s, k, out=big[..., 5:])
        assert got.data_ptr() == big[..., 5:].data_ptr() and (big[..., :5] == fill).all()
        assert torch.equal(big[..., 5:], ref.topk_mask(s, k))
        assert not big[1, :, 5::2].any()
    assert torch.equal(tri.topk_mask(s, k), ref.topk_mask(s, k))
    assert not tri.topk_mask(s, 0).any()


def test_moe_one_token_with_a_repeated_expert():
    """Decode's one-token path builds its block tables without sorting: a hash layer may route a token to
    the same expert twice, and each pair must still be computed and weighted on its own."""
    g = torch.Generator().manual_seed(21)
    e, d, inter = 6, 64, 32
    w1, w3 = (QWeight(torch.randint(-128, 128, (e, inter, d // 2), generator=g, dtype=torch.int32).to(torch.int8),
                      torch.randint(118, 128, (e, inter, d // 32), generator=g, dtype=torch.int32).to(torch.uint8)
                      .view(torch.float8_e8m0fnu), "mxfp4") for _ in range(2))
    w2 = QWeight(torch.randint(-128, 128, (e, d, inter // 2), generator=g, dtype=torch.int32).to(torch.int8),
                 torch.randint(118, 128, (e, d, inter // 32), generator=g, dtype=torch.int32).to(torch.uint8)
                 .view(torch.float8_e8m0fnu), "mxfp4")
    x = torch.randn(1, d, generator=g)
    idx, wts = torch.tensor([[3, 3, 0, 5]]), torch.rand(1, 4, generator=g)
    got = tri.moe_experts(x, w1, w3, w2, idx, wts, 7.0)
    assert rel(got, ref.moe_experts(x.double(), w1, w3, w2, idx, wts.double(), 7.0)) <= 1e-5


@pytest.mark.parametrize("ratio, overlap, d, half", [(4, True, 40, 8), (128, False, 24, 4), (4, True, 130, 16)])
@pytest.mark.parametrize("pos", [0, 3, 5, 127, 130, 517])  # first window, windows' last tokens, wrapped rings
@pytest.mark.parametrize("entry_dtype", [torch.float32, torch.float16])
def test_compress_step(ratio, overlap, d, half, pos, entry_dtype):
    """One decode token through a compressor's fixed buffers: the ring row written (gate + position bias),
    the entry slot of its window (pooled, normed, rotated) and that slot's valid flag (set iff the token
    closes the window) match the reference; nothing else moves. kv and gate are views of one projection."""
    g = torch.Generator().manual_seed(ratio + d + pos)
    b, c = 2, (2 * d if overlap else d)
    ring = 2 * ratio if overlap else ratio
    kv, gate = torch.randn(b, 1, 2 * c, generator=g).split(c, -1)
    rkv, rg = torch.randn(b, ring, c, generator=g), torch.randn(b, ring, c, generator=g)
    rg[:, :2] = float("-inf")  # slots never written yet (first windows)
    ent = torch.randn(b, pos // ratio + 3, d, generator=g).to(entry_dtype)
    valid = torch.rand(b, ent.shape[1], generator=g) < 0.5
    ape, norm = torch.randn(ratio, c, generator=g), torch.rand(d, generator=g) + 0.5
    ang = torch.rand(b, 1, half, dtype=torch.float64, generator=g) * 50
    p = torch.tensor([pos])
    want = [t.clone() for t in (rkv, rg, ent, valid)]
    ref.compress_step(kv, gate, *want, ape, norm, ang.cos(), ang.sin(), p, ratio, 1e-6)
    got = [t.clone() for t in (rkv, rg, ent, valid)]
    tri.compress_step(kv, gate, *got, ape, norm, ang.cos(), ang.sin(), p, ratio, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the ring write is a copy
    w = pos // ratio
    others = torch.ones(ent.shape[1], dtype=torch.bool)
    others[w] = False
    assert torch.equal(got[2][:, others], ent[:, others])
    assert torch.equal(got[3][:, others], valid[:, others])
    assert got[3][:, w].tolist() == [(pos + 1) % ratio == 0] * b
    # the pooled, normed and rotated entry against the reference run in float64 (the ring checks above hold the
    # kernel to the fp32 reference bit for bit: a copy and one fp32 add)
    hi = [t.clone().double() if t.is_floating_point() else t.clone() for t in (rkv, rg, ent, valid)]
    ref.compress_step(kv.double(), gate.double(), *hi, ape.double(), norm.double(), ang.cos(), ang.sin(), p, ratio,
                      1e-6)
    tol = 1e-5 if entry_dtype == torch.float32 else 2e-3  # fp16: the norm output is rounded before RoPE
    assert rel(got[2][:, w], hi[2][:, w]) <= tol


@pytest.mark.parametrize("w, k", [(256, 6), (37, 5), (8, 8), (300, 16), (37, 20), (300, 100), (1000, 512)])
def test_topk_kernel_matches_the_stable_sort(w, k):
    """Router-sized top-k (k passes) and indexer-sized (one sort, k > 16): ties (many, on purpose), -inf
    entries and a row with nothing competing after the k-th must give the reference's indices in its order
    and its margins."""
    g = torch.Generator().manual_seed(w + k)
    s = torch.randint(0, 6, (5, w), generator=g).float() / 4  # heavy ties
    s[1, ::3] = float("-inf")
    s[2] = float("-inf")  # all equal: the k lowest indices
    s[3, 1::4], s[3, 2::5] = float("nan"), float("inf")  # NaN ranks above +inf, as in a descending sort
    s[4] = torch.where(torch.arange(w) % 2 == 0, -0.0, 0.0)  # -0.0 ties +0.0: the k-th falls among the zeros
    got_i, got_m = tri.topk(s, k)
    want_i, want_m = ref.topk(s, k)
    assert torch.equal(got_i, want_i)
    assert torch.equal(torch.nan_to_num(got_m, nan=-1.0), torch.nan_to_num(want_m, nan=-1.0))


@pytest.mark.parametrize("tv, nv, ok", [("3.6.0", "2.4.6", False), ("3.6.0", "2.3.5", True), ("3.7.1", "2.4.6", True),
                                        ("3.6.0+rocm7.0", "2.4.0", False), ("3.9.0", "2.4.6", True)])
@pytest.mark.no_kernel
def test_interpreter_refuses_the_triton_numpy_pair_that_breaks_it(tv, nv, ok):
    """Triton 3.6's interpreter with NumPy 2.4 fails every kernel with a runtime loop bound (checked here with both
    installed); the engine says so in one line instead of 126 TypeErrors."""
    if ok:
        tri._interpreter_check(tv, nv)
    else:
        with pytest.raises(RuntimeError, match="numpy<2.4"):
            tri._interpreter_check(tv, nv)


@pytest.mark.parametrize("tv, ok", [("3.5.0", True), ("3.6.0+rocm7.0", True), ("3.6.0.dev20251101", True),
                                    ("3.9.0", True), ("3.4.0", False), ("3.2.0+git1a2b3c", False), ("unknown", False)])
@pytest.mark.no_kernel
def test_backend_refuses_a_triton_its_kernels_do_not_compile_with(tv, ok, monkeypatch):
    """Triton 3.4's own griddepcontrol helpers do not compile and 3.2-3.3 fail on several kernels (checked here
    with each installed, 2026-11-30): the backend and the ISA tier say so in one line, before any kernel."""
    import triton

    from cdna2_engine.ops import get_ops
    from pytest_cdna2 import isa

    monkeypatch.setattr(triton, "__version__", tv)
    refusal = isa.triton_too_old()  # the ISA tier's gate
    if ok:
        assert get_ops("triton").backend == "triton" and refusal is None, refusal
    else:
        with pytest.raises(RuntimeError, match=re.escape(f"needs Triton >= 3.5, found {tv} (its kernels do not "
                                                          "compile with it): pip install 'triton>=3.5'")):
            get_ops("triton")
        assert refusal is not None and f"needs Triton >= 3.5, found {tv}" in refusal


@pytest.mark.no_kernel
def test_backend_without_triton_says_so(monkeypatch):
    """No triton at all: the same one line, naming the install and the reference backend."""
    import sys

    from cdna2_engine.ops import get_ops

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton then raises ImportError
    with pytest.raises(RuntimeError, match=re.escape("needs Triton >= 3.5, which is not installed: pip install "
                                                      "'triton>=3.5', or use the reference backend")):
        get_ops("triton")


@pytest.mark.no_kernel
def test_interpreted_kernels_are_a_second_copy_of_every_module():
    """The CPU's kernels are the package loaded again under TRITON_INTERPRET=1, each module with it: a helper
    imported from a sibling module must be the interpreted copy too, not the compiled one."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from cdna2_engine.ops.triton import kernels

    interp = tri._interpreted()
    assert interp is not kernels and interp.__name__.endswith("._kernels_interp")
    for module, helper in (("fp8", "_split_sum"), ("mma", "_e8m0"), ("attention", "_rotate")):
        mine = getattr(importlib.import_module(f"{interp.__name__}.{module}"), helper)
        assert isinstance(mine, InterpretedFunction), (module, helper)
        assert isinstance(getattr(importlib.import_module(f"{kernels.__name__}.{module}"), helper),
                          triton.runtime.JITFunction)
    assert isinstance(interp.fp8_stream_kernel, InterpretedFunction)
