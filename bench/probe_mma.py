"""Can a one-token MXFP4 GEMV reach 0.8 of copy on the H200 when the weights are repacked for the tensor cores?

The engine's stream decodes each E2M1 code and multiplies it in fp32: ~4.8 instructions a code, where 0.8 of copy
allows ~4.9 (NOTES, runs 29-33). Triton's own tl.dot forms lost to it (run 29: x through shared memory each step).
This probe takes the Marlin route instead: the weights are repacked once (at load time in an engine) so that each
lane's 16-byte loads hold exactly its mma.sync m16n8k16 A fragments, with each code's bits placed so that a shift
and a mask make a bf16 E2M1 x 2^-126 value (12 integer instructions per 8 codes, exact); x is the B operand,
block-diagonal over the 4 scale groups of a 128-wide K tile and split hi + lo in bf16 (16 bits of x's mantissa);
one FMA per accumulator and tile applies the group scales. The kernel is written per thread (SIMT): every address
comes from the hardware lane and warp ids, so it does not depend on how Triton lays tensors out over threads.

    python bench/probe_mma.py [--out DIR]          # on the GPU machine (sm_80+: inline PTX)

Results of 2026-11-30 (H200): bench/results/probe_mma_run51.json, bench/NOTES.md run 51. The engine's kernels
(kernels/mma.py `moe_mma_*`) grew from this one: two row tiles (gate, up) a warp, K split, in-launch sums.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

from cdna2_engine.ops.triton.kernels import mma as ek  # noqa: E402
from cdna2_engine.ops.triton.mma_layout import mma_repack  # noqa: E402


@triton.jit
def _tid(like):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _ldw(HINT: tl.constexpr, ptr):
    """The engine's 16-byte load, or (HINT) the same with an L2 256-byte prefetch hint."""
    if HINT:
        return tl.inline_asm_elementwise("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];",
                                         "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    else:
        return ek._ld16(ptr)


@triton.jit
def _bpair(x_ptr, k, part):
    """x[k], x[k + 1] -> the bf16x2 B register: x * 2^64 split hi + lo in bf16, the lane's part."""
    v0 = tl.load(x_ptr + k).to(tl.float32) * 18446744073709551616.0
    v1 = tl.load(x_ptr + k + 1).to(tl.float32) * 18446744073709551616.0
    h0 = v0.to(tl.bfloat16)
    h1 = v1.to(tl.bfloat16)
    q0 = tl.where(part == 0, h0, (v0 - h0.to(tl.float32)).to(tl.bfloat16))
    q1 = tl.where(part == 0, h1, (v1 - h1.to(tl.float32)).to(tl.bfloat16))
    return q0.to(tl.uint16, bitcast=True).to(tl.uint32) | (q1.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _tile_x(x_ptr, i, gg, t, part, XBF16: tl.constexpr):
    """The lane's 4 B registers for tile i (its active steps 2 gg, 2 gg + 1): bf16 x as the engine's gate/up reads
    it, or fp32 x split hi + lo here (the engine's down kernel reads that split already made)."""
    kb = i * 128 + gg * 32 + 2 * t
    if XBF16:
        return ek._mma_x(x_ptr + kb, part)
    return _bpair(x_ptr, kb, part), _bpair(x_ptr, kb + 8, part), _bpair(x_ptr, kb + 16, part), \
        _bpair(x_ptr, kb + 24, part)


@triton.jit
def mma_gemv_kernel(w_ptr, s_ptr, x_ptr, y_ptr, K, NW: tl.constexpr, XBF16: tl.constexpr, SPLIT: tl.constexpr,
                    HINT: tl.constexpr):
    """y[16 rows per warp] = W x for one token: each warp one 16-row tile, all of K, two tiles an iteration,
    the next two prefetched (weights, scales and x's B registers)."""
    tid = _tid(tl.zeros((32 * NW,), dtype=tl.int32))  # one element per thread: no replicated (unstored) copies
    lane = tid % 32
    rt = tl.program_id(0) * NW + tid // 32
    sk = tl.program_id(1)  # this warp's K part (partials to y[sk]: the probe sums them)
    g = lane // 4
    t = lane % 4
    gg = g // 2
    part = g % 2
    KT = K // 128 // SPLIT
    k0 = sk * KT * 128
    wp = w_ptr + ((rt.to(tl.int64) * SPLIT + sk) * KT * 256 + lane * 4)  # this lane's first word of tile 0
    sp = s_ptr + ((rt.to(tl.int64) * SPLIT + sk) * KT * 64 + lane * 2)
    n0, n1, n2, n3 = _ldw(HINT, wp)
    n4, n5, n6, n7 = _ldw(HINT, wp + 128)  # a tile: two [32 lanes x 4 words] halves (mma_repack)
    m0, m1, m2, m3 = _ldw(HINT, wp + 256)
    m4, m5, m6, m7 = _ldw(HINT, wp + 384)
    ns0 = tl.load(sp)
    ns1 = tl.load(sp + 1)
    ms0 = tl.load(sp + 64)
    ms1 = tl.load(sp + 65)
    nb0, nb1, nb2, nb3 = _tile_x(x_ptr, k0 // 128, gg, t, part, XBF16)
    mb0, mb1, mb2, mb3 = _tile_x(x_ptr, k0 // 128 + 1, gg, t, part, XBF16)
    top = tl.zeros((32 * NW,), dtype=tl.float32)
    bot = tl.zeros((32 * NW,), dtype=tl.float32)
    for i in range(0, KT, 2):
        w0, w1, w2, w3, w4, w5, w6, w7 = n0, n1, n2, n3, n4, n5, n6, n7
        v0, v1, v2, v3, v4, v5, v6, v7 = m0, m1, m2, m3, m4, m5, m6, m7
        s0, s1, r0, r1 = ns0, ns1, ms0, ms1
        b0, b1, b2, b3 = nb0, nb1, nb2, nb3
        c0, c1, c2, c3 = mb0, mb1, mb2, mb3
        j = tl.minimum(i + 2, KT - 2)  # the last iteration reloads its own tiles (L2 hits, unused)
        n0, n1, n2, n3 = _ldw(HINT, wp + j * 256)
        n4, n5, n6, n7 = _ldw(HINT, wp + j * 256 + 128)
        m0, m1, m2, m3 = _ldw(HINT, wp + j * 256 + 256)
        m4, m5, m6, m7 = _ldw(HINT, wp + j * 256 + 384)
        ns0 = tl.load(sp + j * 64)
        ns1 = tl.load(sp + j * 64 + 1)
        ms0 = tl.load(sp + j * 64 + 64)
        ms1 = tl.load(sp + j * 64 + 65)
        nb0, nb1, nb2, nb3 = _tile_x(x_ptr, k0 // 128 + j, gg, t, part, XBF16)
        mb0, mb1, mb2, mb3 = _tile_x(x_ptr, k0 // 128 + j + 1, gg, t, part, XBF16)
        ct, cb = ek._mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, b0, b1, b2, b3, gg, s0, s1)
        top += ct
        bot += cb
        ct, cb = ek._mma_tile(v0, v1, v2, v3, v4, v5, v6, v7, c0, c1, c2, c3, gg, r0, r1)
        top += ct
        bot += cb
    top = ek._quad_sum(top)
    bot = ek._quad_sum(bot)
    row = rt * 16 + g + sk * (tl.num_programs(0) * NW * 16)
    tl.store(y_ptr + row, top, mask=t == 0)
    tl.store(y_ptr + row + 8, bot, mask=t == 0)


def launch(words: torch.Tensor, sc: torch.Tensor, x: torch.Tensor, y: torch.Tensor, nw: int, split: int = 1,
           hint: bool = False) -> None:
    """y [split * rows] fp32: each K part's partial rows (split > 1: the caller sums them)."""
    rt, kt = words.shape[0], words.shape[1]
    mma_gemv_kernel[(rt // nw, split)](words, sc, x, y, kt * 128, nw, x.dtype == torch.bfloat16, split, hint,
                                       num_warps=nw)


VARIANTS = [(1, 1, False), (2, 1, False), (1, 2, False), (1, 4, False), (2, 4, False), (1, 1, True), (1, 4, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    copy = B.copy_tbps()
    out: dict = {"copy_TBps": copy, "runs": []}
    print(f"copy {copy:.3f} TB/s", flush=True)
    shapes = [("gate_up", 24576, 4096), ("down", 24576, 2048)]
    for shape, rows, k in shapes:
        data = []
        for _ in range(4):  # 4 x 53 MB rotated: beyond the 60 MB L2
            w = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device=dev, generator=gen)
            s = torch.randint(118, 130, (rows, k // 32), dtype=torch.uint8, device=dev, generator=gen)
            x = torch.randn(k, device=dev, generator=gen)
            x = x if shape == "down" else x.to(torch.bfloat16)  # down reads the fp32 SwiGLU output
            data.append((w, s, x))
        W = B.ref.dequantize(B.QWeight(data[0][0].view(torch.int8), data[0][1].view(torch.float8_e8m0fnu),
                                       "mxfp4"), torch.float64)
        packed = [(*mma_repack(w, s), x) for w, s, x in data]
        for xs in (1.0, 1e-30, 1e20):  # tiny and large x: past the kernels' range (|x| < 2^64, products above
            # ~2^-87), so 1e-30 flushes to zero (rel err 1) and 1e20 overflows (nan), as in runs 51 and 78
            x = (data[0][2].double() * xs).to(data[0][2].dtype)
            want = W @ x.double()
            y = torch.full((rows,), float("nan"), device=dev)
            launch(packed[0][0], packed[0][1], x, y, 4)
            err = ((y.double() - want).norm() / want.norm()).item()
            print(f"{shape} x*{xs:g}: rel err {err:.2e}", flush=True)
            out["runs"].append({"shape": shape, "check": xs, "rel_err": err})
        if a.check_only:
            continue
        nbytes = rows * k // 2 + rows * k // 32
        for nw, split, hint in VARIANTS:
            if (k // 128) % (2 * split):
                continue
            y = torch.full((rows * split,), float("nan"), device=dev)
            launch(packed[0][0], packed[0][1], packed[0][2], y, nw, split, hint)
            want = W @ packed[0][2].double()
            err = ((y.view(split, rows).double().sum(0) - want).norm() / want.norm()).item()
            ms = B.time_graph_ms(lambda wd, sc, x, y, nw=nw, sp=split, h=hint: launch(wd, sc, x, y, nw, sp, h),
                                 [(*p, torch.empty(rows * split, device=dev)) for p in packed])
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            print(f"{shape:8s} mma num_warps={nw} split={split} hint={hint} {ms * 1e3:7.1f} us  {frac:.3f} of copy"
                  f"  err {err:.1e}", flush=True)
            out["runs"].append({"shape": shape, "num_warps": nw, "split": split, "hint": hint, "us": ms * 1e3,
                                "frac": frac, "rel_err": err})
    with open(os.path.join(a.out, "probe_mma.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
