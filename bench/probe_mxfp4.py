"""Where does the one-token MXFP4 stream lose its bandwidth? Variants of one kernel on one MXFP4 matrix at the
V4-Flash volumes (gate_up: 6 experts x (w1|w3) = 24576 rows x 4096, 50 MB + 3 MB scales; down: 24576 x 2048),
each timed in a CUDA graph over inputs rotated beyond the L2, against the copy ceiling measured in the same run
(`--what`, a comma list):

  reads  a plain read of 53 MB in several chunkings: the ceiling for a read-only kernel of this size
  rows   skel (the stream's loads alone, an xor instead of the decode) and cur (the engine's _mxfp4_stream, x split
         per nibble slot through shared memory; run 20 also tried x handed in pre-split per slot: 0.39 at best)
  tiled  tskel / tiled: the same over tile-major weights (each step of a program one contiguous tile)
  ds     tl.dot_scaled (e2m1 weights as the lhs, x as a bf16 rhs column): Triton's MX path

    python bench/probe_mxfp4.py --what reads,rows,tiled,ds [--out DIR]   # on the GPU machine
    TRITON_INTERPRET=1 python bench/probe_mxfp4.py --small --what rows   # CPU smoke test

Results of 2026-11-30 (H200): bench/results/probe_mxfp4_run2{0,1,2}.json and bench/NOTES.md runs 20-22.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

from cdna2_engine.ops.triton import kernels as K_  # noqa: E402


@triton.jit
def skel_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                PAIR: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_n < N
    n_groups = K // 32
    w1 = w_ptr + offs_n.to(tl.int64) * stride_w
    s1 = s_ptr + offs_n.to(tl.int64) * stride_s
    half = N.to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_N, GROUPS, 4), dtype=tl.uint32)
    sacc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.uint8)
    for g0 in range(0, n_groups, GROUPS):
        acc ^= K_._mxfp4_stream_words(w1, g0, n_groups, r_ok, GROUPS)
        sacc ^= K_._mxfp4_stream_scales(s1, g0, n_groups, r_ok, GROUPS)
        if PAIR:
            acc ^= K_._mxfp4_stream_words(w1 + half, g0, n_groups, r_ok, GROUPS)
            sacc ^= K_._mxfp4_stream_scales(s1 + N * stride_s, g0, n_groups, r_ok, GROUPS)
    y = tl.sum(tl.sum(acc, axis=2) + sacc.to(tl.uint32), axis=1)
    tl.store(y_ptr + offs_n, y.to(tl.float32), mask=r_ok)


@triton.jit
def cur_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
               PAIR: tl.constexpr, PREFETCH: tl.constexpr, PRMT: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_n < N
    w1 = w_ptr + offs_n.to(tl.int64) * stride_w
    s1 = s_ptr + offs_n.to(tl.int64) * stride_s
    a, b = K_._mxfp4_stream(w1, s1, w1 + N.to(tl.int64) * stride_w, s1 + N * stride_s, x_ptr, K, r_ok,
                            BLOCK_N, GROUPS, PAIR, PREFETCH, PRMT)
    tl.store(y_ptr + offs_n, a + b, mask=r_ok)


@triton.jit
def read_kernel(w_ptr, y_ptr, n_words, STEPS: tl.constexpr, U: tl.constexpr, INTERLEAVE: tl.constexpr,
                num_warps_: tl.constexpr):
    """Plain read of a flat word array: each program STEPS steps of U 16-byte loads per thread, from its own
    contiguous chunk or (INTERLEAVE) from every program's block of each step in turn (a copy kernel's order)."""
    T: tl.constexpr = num_warps_ * 32 * 4 * U
    pid = tl.program_id(0)
    offs = tl.arange(0, T)
    acc = tl.zeros((T,), dtype=tl.uint32)
    for j in range(STEPS):
        if INTERLEAVE:
            base = (j * tl.num_programs(0) + pid).to(tl.int64) * T
        else:
            base = (pid.to(tl.int64) * STEPS + j) * T
        acc ^= tl.load(w_ptr + base + offs, mask=base + offs < n_words, other=0).to(tl.uint32, bitcast=True)
    tl.store(y_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def tiled_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PAIR: tl.constexpr,
                 PREFETCH: tl.constexpr, PRMT: tl.constexpr, SKEL: tl.constexpr):
    """The stream over tile-major weights: row block rb's step j is one contiguous [BN, G, 4]-word tile (and a
    [BN, G] scale tile), so each step of a program reads one contiguous run instead of BN rows 2 KB apart."""
    rb = tl.program_id(0)
    n_steps = K // (32 * GROUPS)
    TW: tl.constexpr = BLOCK_N * GROUPS * 4
    TS: tl.constexpr = BLOCK_N * GROUPS
    in_w = tl.arange(0, BLOCK_N)[:, None, None] * (GROUPS * 4) + tl.arange(0, GROUPS)[None, :, None] * 4 + \
        tl.arange(0, 4)[None, None, :]
    in_s = tl.arange(0, BLOCK_N)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    w1 = w_ptr + rb.to(tl.int64) * n_steps * TW + in_w
    s1 = s_ptr + rb.to(tl.int64) * n_steps * TS + in_s
    w3 = w1 + (N // BLOCK_N).to(tl.int64) * n_steps * TW
    s3 = s1 + (N // BLOCK_N).to(tl.int64) * n_steps * TS
    acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    sk = tl.zeros((BLOCK_N, GROUPS, 4), dtype=tl.uint32)
    if PREFETCH:
        a1 = tl.load(w1).to(tl.uint32, bitcast=True)
        b1 = tl.load(s1)
        a3 = tl.load(w3).to(tl.uint32, bitcast=True)
        b3 = tl.load(s3)
    for j in range(n_steps):
        if PREFETCH:
            nxt = tl.minimum(j + 1, n_steps - 1)
            na1 = tl.load(w1 + nxt * TW).to(tl.uint32, bitcast=True)
            nb1 = tl.load(s1 + nxt * TS)
            if PAIR:
                na3 = tl.load(w3 + nxt * TW).to(tl.uint32, bitcast=True)
                nb3 = tl.load(s3 + nxt * TS)
        else:
            a1 = tl.load(w1 + j * TW).to(tl.uint32, bitcast=True)
            b1 = tl.load(s1 + j * TS)
            if PAIR:
                a3 = tl.load(w3 + j * TW).to(tl.uint32, bitcast=True)
                b3 = tl.load(s3 + j * TS)
        if SKEL:
            sk ^= a1 ^ b1[:, :, None].to(tl.uint32)
            if PAIR:
                sk ^= a3 ^ b3[:, :, None].to(tl.uint32)
        else:
            xs = K_._mxfp4_stream_xs(K_._mxfp4_stream_x(x_ptr, j * GROUPS, K, GROUPS), GROUPS)
            acc1 += K_._mxfp4_stream_sum(a1, xs, PRMT) * K_._e8m0(b1, 0)
            if PAIR:
                acc3 += K_._mxfp4_stream_sum(a3, xs, PRMT) * K_._e8m0(b3, 0)
        if PREFETCH:
            a1, b1 = na1, nb1
            if PAIR:
                a3, b3 = na3, nb3
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    if SKEL:
        tl.store(y_ptr + offs_n, tl.sum(tl.sum(sk, axis=2), axis=1).to(tl.float32))
    else:
        tl.store(y_ptr + offs_n, (tl.sum(acc1, axis=1) + tl.sum(acc3, axis=1)) * 16384.0)


@triton.jit
def ds_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PAIR: tl.constexpr, SPLIT_X: tl.constexpr):
    """tl.dot_scaled with the weights as the e2m1 lhs [BN, BK] and x as the bf16 rhs [BK, 16]: column 0 holds x
    rounded to bf16 and (SPLIT_X) column 1 the rest x - bf16(x), so fp32 x keeps 16 bits. Triton decodes the
    weights and software-pipelines their loads (num_stages) because they feed a dot."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_n < N
    col = tl.arange(0, 16)
    w1 = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + tl.arange(0, BLOCK_K // 2)[None, :]
    s1 = s_ptr + offs_n.to(tl.int64)[:, None] * stride_s + tl.arange(0, BLOCK_K // 32)[None, :]
    w3 = w1 + N.to(tl.int64) * stride_w
    s3 = s1 + N.to(tl.int64) * stride_s
    acc1 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        hi = x.to(tl.bfloat16)
        xt = tl.where(col[None, :] == 0, hi[:, None], 0.0)
        if SPLIT_X >= 2:  # the rest of x in columns 1 (and 2): 16 (24) bits of fp32 x
            r = x - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            xt = tl.where(col[None, :] == 1, mid[:, None], xt)
            if SPLIT_X >= 3:
                xt = tl.where(col[None, :] == 2, (r - mid.to(tl.float32)).to(tl.bfloat16)[:, None], xt)
        xt = xt.to(tl.bfloat16)
        acc1 = tl.dot_scaled(tl.load(w1 + k0 // 2), tl.load(s1 + k0 // 32), "e2m1", xt, None, "bf16", acc1)
        if PAIR:
            acc3 = tl.dot_scaled(tl.load(w3 + k0 // 2), tl.load(s3 + k0 // 32), "e2m1", xt, None, "bf16", acc3)
    y = tl.sum(tl.where(col[None, :] < SPLIT_X, acc1 + acc3, 0.0), axis=1)
    tl.store(y_ptr + offs_n, y, mask=r_ok)


def tile_major(w: torch.Tensor, s: torch.Tensor, bn: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K/8] words and [R, K/32] scales -> tile-major copies: [R/bn, steps, bn, g, 4] and [R/bn, steps, bn, g]."""
    r, kw = w.shape
    steps = kw // (4 * g)
    wt = w.view(r // bn, bn, steps, g, 4).permute(0, 2, 1, 3, 4).contiguous()
    st = s.view(r // bn, bn, steps, g).permute(0, 2, 1, 3).contiguous()
    return wt, st


def _read(w, grid, y, n_words, steps, u, inter, nw):
    read_kernel[grid](w, y, n_words, steps, u, inter, nw, num_warps=nw)


def reads(out: dict, copy: float, dev: torch.device, small: bool) -> None:
    """Plain reads of the gate_up volume (53 MB) in different orders: the ceiling for a read-only kernel."""
    n_words = (64 * 128 * 4 * 8) if small else 13_271_040
    bufs = [torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, device=dev)
            for _ in range(1 if small else 4)]
    cases = [(1, 32, 4), (2, 16, 4), (4, 8, 4), (8, 4, 4), (1, 4, 4), (4, 1, 4), (4, 8, 8), (2, 4, 8)]
    for (u, steps, nw), inter in itertools.product(cases[:1] if small else cases, (False, True)):
        per = nw * 32 * 4 * u * steps
        grid = (triton.cdiv(n_words, per),)
        y = torch.empty(grid[0], dtype=torch.int32, device=dev)
        launch = functools.partial(_read, grid=grid, y=y, n_words=n_words, steps=steps, u=u, inter=inter, nw=nw)
        ms = B.time_graph_ms(launch, [(b,) for b in bufs])
        frac = n_words * 4 / (ms * 1e-3) / 1e12 / copy if copy else 0.0
        cfg = {"U": u, "STEPS": steps, "num_warps": nw, "INTERLEAVE": inter, "programs": grid[0]}
        out["runs"].append({"shape": "read", "kernel": "read", "cfg": cfg, "us": ms * 1e3, "frac": frac})
        print(f"read     {cfg}  {ms * 1e3:7.1f} us  {frac:.3f} of copy", flush=True)


def reference(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor, pair: bool) -> torch.Tensor:
    """float64 W x for the packed [R, K/2] codes and [R, K/32] scales; rows r and r + R/2 summed when pair."""
    W = B.ref.dequantize(B.QWeight(w.view(torch.int8), s.view(torch.float8_e8m0fnu), "mxfp4"), torch.float64)
    y = W @ x.double()
    return y[: len(y) // 2] + y[len(y) // 2:] if pair else y


def _launcher(name, bn, g, nw, stages, pf, prmt, n, k, pair, small):
    """launch(w, s, x, y) for one variant (w: int32 words, or tile-major words for tskel/tiled)."""
    grid = (triton.cdiv(n, bn),)
    if name == "ds":
        return lambda w, s, x, y: ds_kernel[grid](w.view(torch.uint8), s, x, y, n, k, k // 2, k // 32, bn, g,
                                                      pair, 3 if small else 1, num_warps=nw, num_stages=stages)
    if name in ("tskel", "tiled"):
        return lambda w, s, x, y: tiled_kernel[grid](w, s, x, y, n, k, bn, g, pair, pf, prmt, name == "tskel",
                                                         num_warps=nw)
    if name == "skel":
        return lambda w, s, x, y: skel_kernel[grid](w, s, y, n, k, k // 8, k // 32, bn, g, pair, num_warps=nw)
    return lambda w, s, x, y: cur_kernel[grid](w, s, x, y, n, k, k // 8, k // 32, bn, g, pair, pf, prmt,
                                                num_warps=nw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--small", action="store_true", help="CPU interpreter smoke test (numbers mean nothing)")
    ap.add_argument("--what", default="reads,tiled", help="comma list of: reads, tiled, rows")
    a = ap.parse_args()
    what = a.what.split(",")
    dev = torch.device("cpu" if a.small else "cuda")
    gen = torch.Generator(dev).manual_seed(0)
    copy = 0.0 if a.small else B.copy_tbps()
    out: dict = {"copy_TBps": copy, "runs": []}
    if "reads" in what:
        reads(out, copy, dev, a.small)
    shapes = [("gate_up", 24576, 4096, True), ("down", 24576, 2048, False)]  # 6 experts x (w1|w3) / w2
    tiles = [(16, 8, 4), (32, 8, 4), (8, 16, 2), (16, 4, 2), (32, 4, 4), (64, 8, 8)]
    variants = []
    if "rows" in what:
        variants += [("skel", False, False), ("cur", True, True), ("cur", False, False)]
    if "tiled" in what:
        variants += [("tskel", False, False), ("tskel", True, False), ("tiled", True, True), ("tiled", False, True),
                     ("tiled", False, False)]
        tiles = [(16, 8, 4), (8, 16, 2), (32, 8, 4), (16, 16, 4), (64, 4, 4), (32, 4, 2)]
    if "ds" in what:
        variants += [("ds", False, False)]
        tiles = [(bn, bk, nw, st) for bn, nw in ((16, 1), (32, 2), (64, 4), (128, 4), (32, 1), (64, 2))
                 for bk in (256, 512) for st in (3, 4)]
    if a.small:
        shapes = [("gate_up", 64, 256, True), ("down", 64, 128, False)]
        tiles = [(16, 2, 4), (32, 128, 2, 2)]  # (BLOCK_N, GROUPS, warps) for the streams, + stages for ds
        variants = [v for v in variants if not v[2]]  # no inline PTX in the interpreter
    for shape, rows, k, pair in shapes:
        data = []
        for _ in range(1 if a.small else 4):  # 4 x 53 MB rotated: beyond the 60 MB L2
            w = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device=dev, generator=gen)
            s = torch.randint(118, 130, (rows, k // 32), dtype=torch.uint8, device=dev, generator=gen)
            x = torch.randn(k, device=dev, generator=gen).to(torch.float16 if a.small else torch.bfloat16)
            data.append((w.view(torch.int32), s, x))
        nbytes = rows * k // 2 + rows * k // 32
        n = rows // 2 if pair else rows
        want = reference(data[0][0].view(torch.uint8), data[0][1], data[0][2], pair)
        for (bn, g, nw, *st), (name, pf, prmt) in itertools.product(tiles, variants):
            if (name == "ds") != bool(st):
                continue  # ds tiles carry num_stages; the streams' do not
            cfg = {"BLOCK_N": bn, "GROUPS": g, "num_warps": nw, "PREFETCH": pf, "PRMT": prmt}
            if name == "ds":
                cfg = {"BLOCK_N": bn, "BLOCK_K": g, "num_warps": nw, "num_stages": st[0]}
            launch = _launcher(name, bn, g, nw, st[0] if st else 1, pf, prmt, n, k, pair, a.small)
            if name in ("tskel", "tiled"):
                inputs = [(*tile_major(d[0], d[1], bn, g), d[2]) for d in data]
            else:
                inputs = data
            y = torch.full((n,), float("nan"), device=dev)
            launch(*inputs[0], y)
            err = None if "skel" in name else ((y.double() - want).norm() / want.norm()).item()
            ms = B.time_graph_ms(launch, [(*d, torch.empty(n, device=dev)) for d in inputs])
            frac = nbytes / (ms * 1e-3) / 1e12 / copy if copy else 0.0
            out["runs"].append({"shape": shape, "kernel": name, "cfg": cfg, "us": ms * 1e3, "frac": frac,
                                "rel_err": err})
            print(f"{shape:8s} {name:5s} {cfg}  {ms * 1e3:7.1f} us  {frac:.3f} of copy  err {err}", flush=True)
    with open(os.path.join(a.out, "probe_mxfp4.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
