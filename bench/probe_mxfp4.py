"""Where does the one-token MXFP4 stream lose its bandwidth? Variants of one kernel on one MXFP4 matrix at the
V4-Flash volumes (gate_up: 6 experts x (w1|w3) = 24576 rows x 4096, 50 MB + 3 MB scales; down: 24576 x 2048),
each timed in a CUDA graph over inputs rotated beyond the L2, against the copy ceiling measured in the same run
(`--what`, a comma list):

  reads  a plain read of 53 MB in several chunkings: the ceiling for a read-only kernel of this size
  rows   skel (the stream's loads alone, an xor instead of the decode) and cur (the engine's _mxfp4_stream, x split
         per nibble slot through shared memory; run 20 also tried x handed in pre-split per slot: 0.39 at best)
  tiled  tskel / tiled: the same over tile-major weights (each step of a program one contiguous tile)
  ds     tl.dot_scaled (e2m1 weights as the lhs, x as a bf16 rhs column): Triton's MX path
  mma    mma / mma2: the weights as the A operand of a tensor-core dot, decoded in registers (sm_90 inline PTX)
  abl    ablations of cur: no per-step x, no scale loads, both (timing only)
  rowk   rows over the loop, K over the threads, x in registers for the whole launch
  wide   cur, its no-x ablation and x pre-split read by inline-asm loads, at tiles that read 512 B-2 KB of a row a
         step; with `rows` variants: the skeleton's dependence on the run per row

    python bench/probe_mxfp4.py --what reads,rows,tiled,ds [--out DIR]   # on the GPU machine
    TRITON_INTERPRET=1 python bench/probe_mxfp4.py --small --what rows   # CPU smoke test (rows, tiled only)

Results of 2026-11-30 (H200): bench/results/probe_mxfp4_run{20,21,22,29,30,31,32,33}.json, bench/NOTES.md runs 20-38.
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

from cdna2_engine.ops.triton.kernels import moe as K_  # noqa: E402


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


@triton.jit
def _e2m1_bf16_scaled(w, s2):
    """sm_90 (PTX): the 8 codes of a uint32 word -> 8 bf16 values times the bf16x2 scale s2, exact. Magnitudes by
    byte lookup (prmt over the bf16 high and low bytes of 0..6), paired (code j, code j+4) so one shift puts both
    signs; one bf16x2 multiply applies the group scale (a power of two: exact)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, ms, mh, h, l, p, s, th, tl;
        mov.u32 th, %laneid;
        shr.u32 th, th, 5;
        or.b32 tl, th, 0xC0800000;
        or.b32 th, th, 0x3F3F3F00;
        and.b32 m, $8, 0x77777777;
        prmt.b32 ms, m, 0, 0x3120;
        shr.b32 mh, ms, 16;
        prmt.b32 h, th, 0x40404040, ms;
        prmt.b32 l, tl, 0xC0804000, ms;
        prmt.b32 p, l, h, 0x6240;
        shl.b32 s, $8, 12;
        lop3.b32 p, p, s, 0x80008000, 0xf8;
        mul.rn.bf16x2 p, p, $9;
        mov.b32 {$0, $4}, p;
        prmt.b32 p, l, h, 0x7351;
        shl.b32 s, $8, 8;
        lop3.b32 p, p, s, 0x80008000, 0xf8;
        mul.rn.bf16x2 p, p, $9;
        mov.b32 {$1, $5}, p;
        prmt.b32 h, th, 0x40404040, mh;
        prmt.b32 l, tl, 0xC0804000, mh;
        prmt.b32 p, l, h, 0x6240;
        shl.b32 s, $8, 4;
        lop3.b32 p, p, s, 0x80008000, 0xf8;
        mul.rn.bf16x2 p, p, $9;
        mov.b32 {$2, $6}, p;
        prmt.b32 p, l, h, 0x7351;
        lop3.b32 p, p, $8, 0x80008000, 0xf8;
        mul.rn.bf16x2 p, p, $9;
        mov.b32 {$3, $7}, p;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, s2], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _a_tile(q0, q1, q2, q3, q4, q5, q6, q7, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """The 8 decoded code slots [BN, G, 4] of a step -> the A tile [BN, G * 32] in the order k' = 32 g + 8 j + 2 i +
    c (word i's code j + 4c): joins and a permute within each thread, landing in the A fragment layout."""
    p0 = tl.join(q0, q4)
    p1 = tl.join(q1, q5)
    p2 = tl.join(q2, q6)
    p3 = tl.join(q3, q7)  # [BN, G, 4(i), 2(c)]
    t = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [BN, G, i, c, b, a]: code j = 2a + b
    return tl.reshape(tl.permute(t, (0, 1, 5, 4, 2, 3)), (BLOCK_N, GROUPS * 32))


@triton.jit
def mma_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """Weights as the A operand of a tensor-core dot (sm_90 wgmma, A in registers): y[BN] = W[BN, K] x.
    A step's [BN, G, 4] words decode (inline PTX) into 8 bf16 slot tensors that tl.join/permute/reshape arrange,
    with no data movement, as k' = 32 g + 8 j + 2 i + c for word i's code j + 4c: the order in which each thread's
    word lands in its own A fragment; x is loaded in the same order as column 0 of a [G * 32, 16] B tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_w
    srow = s_ptr + offs_n.to(tl.int64)[:, None] * stride_s
    gi = tl.arange(0, GROUPS)
    wi = gi[:, None] * 4 + tl.arange(0, 4)[None, :]
    col = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        w = tl.load(wrow + (g0 * 4 + wi)[None, :, :]).to(tl.uint32, bitcast=True)
        sb = tl.load(srow + g0 + gi[None, :]).to(tl.uint32) << 7
        q0, q1, q2, q3, q4, q5, q6, q7 = _e2m1_bf16_scaled(w, (sb | (sb << 16))[:, :, None] + tl.zeros_like(w))
        a = _a_tile(q0, q1, q2, q3, q4, q5, q6, q7, BLOCK_N, GROUPS)
        xv = tl.load(x_ptr + g0 * 32 + tl.arange(0, GROUPS * 32))
        xv = tl.permute(tl.reshape(xv, (GROUPS, 4, 2, 2, 2)), (0, 3, 4, 1, 2))  # (g, i, c, a, b) -> (g, a, b, i, c)
        xt = tl.where(col[None, :] == 0, tl.reshape(xv, (GROUPS * 32, 1)), 0.0).to(tl.bfloat16)
        acc = tl.dot(a, xt, acc)
    tl.store(y_ptr + offs_n, tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1))


@triton.jit
def _e2m1_bf16_tiny(w):
    """sm_90 (PTX): the 8 codes of a uint32 word -> 8 bf16 values E2M1 x 2^-126, exact (the 0.5 code a bf16
    subnormal): the code's magnitude bits shifted into the bf16 exponent/mantissa boundary, pairs (j, j + 4)
    built by one shift of the word (16 bits apart), so 4 integer instructions make 2 values."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, p;
        and.b32 t, $8, 0x00070007;
        shl.b32 p, $8, 12;
        shl.b32 t, t, 6;
        lop3.b32 p, t, p, 0x80008000, 0xf8;
        mov.b32 {$0, $4}, p;
        shr.b32 t, $8, 4;
        and.b32 t, t, 0x00070007;
        shl.b32 p, $8, 8;
        shl.b32 t, t, 6;
        lop3.b32 p, t, p, 0x80008000, 0xf8;
        mov.b32 {$1, $5}, p;
        shr.b32 t, $8, 8;
        and.b32 t, t, 0x00070007;
        shl.b32 p, $8, 4;
        shl.b32 t, t, 6;
        lop3.b32 p, t, p, 0x80008000, 0xf8;
        mov.b32 {$2, $6}, p;
        shr.b32 t, $8, 12;
        and.b32 t, t, 0x00070007;
        shl.b32 t, t, 6;
        lop3.b32 p, t, $8, 0x80008000, 0xf8;
        mov.b32 {$3, $7}, p;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def mma2_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """mma_kernel with the group scales applied to the accumulator instead of the operand: B is block-diagonal
    (column c holds group c's x, times 2^100, zero elsewhere), so one dot leaves each group's partial sum in its
    own column and one FMA per accumulator element scales it; A is E2M1 x 2^-126 (no multiply at all)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_w
    srow = s_ptr + offs_n.to(tl.int64)[:, None] * stride_s
    gi = tl.arange(0, GROUPS)
    wi = gi[:, None] * 4 + tl.arange(0, 4)[None, :]
    col = tl.arange(0, 16)
    kg = tl.arange(0, GROUPS * 32) // 32
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        w = tl.load(wrow + (g0 * 4 + wi)[None, :, :]).to(tl.uint32, bitcast=True)
        q0, q1, q2, q3, q4, q5, q6, q7 = _e2m1_bf16_tiny(w)
        a = _a_tile(q0, q1, q2, q3, q4, q5, q6, q7, BLOCK_N, GROUPS)
        xv = tl.load(x_ptr + g0 * 32 + tl.arange(0, GROUPS * 32)).to(tl.float32) * 1.2676506002282294e30  # 2^100
        xv = tl.permute(tl.reshape(xv, (GROUPS, 4, 2, 2, 2)), (0, 3, 4, 1, 2))  # (g, i, c, a, b) -> (g, a, b, i, c)
        xb = tl.where(col[None, :] == kg[:, None], tl.reshape(xv, (GROUPS * 32, 1)), 0.0).to(tl.bfloat16)
        part = tl.dot(a, xb)
        sc = tl.load(srow + g0 + col[None, :], mask=col[None, :] < GROUPS, other=0)
        acc += part * tl.where(col[None, :] < GROUPS, _e8m0_probe(sc, 26), 0.0)
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1))


@triton.jit
def _e8m0_probe(s_u8, EXTRA: tl.constexpr):
    return ((s_u8.to(tl.int32) + EXTRA) << 23).to(tl.float32, bitcast=True)


@triton.jit
def abl_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
               NOSCALE: tl.constexpr, NOX: tl.constexpr, XPRE: tl.constexpr):  # gate_up only (always the pair)
    """Ablations of the engine's one-token stream (PREFETCH + PRMT, pair): NOSCALE drops the scale loads (a
    constant scale), NOX loads x once before the loop (wrong sums: timing only), XPRE reads x pre-split in fp32
    (each group's 32 values slot-major: element 8i + p at 4p + i), one 16 B load per slot, no layout change."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_n < N
    w1 = w_ptr + offs_n.to(tl.int64) * stride_w
    s1 = s_ptr + offs_n.to(tl.int64) * stride_s
    w3 = w1 + N.to(tl.int64) * stride_w
    s3 = s1 + N * stride_s
    n_groups = K // 32
    acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    if XPRE:
        x = tl.zeros((GROUPS * 32,), dtype=tl.float32)
    else:
        x = K_._mxfp4_stream_x(x_ptr, 0, K, GROUPS)
    xs = K_._mxfp4_stream_xs(x, GROUPS)
    a1 = K_._mxfp4_stream_words(w1, 0, n_groups, r_ok, GROUPS)
    a3 = K_._mxfp4_stream_words(w3, 0, n_groups, r_ok, GROUPS)
    if XPRE:
        b1 = _ld_u8(s1[:, None] + tl.arange(0, GROUPS)[None, :]).to(tl.uint8)
        b3 = _ld_u8(s3[:, None] + tl.arange(0, GROUPS)[None, :]).to(tl.uint8)
    else:
        b1 = K_._mxfp4_stream_scales(s1, 0, n_groups, r_ok, GROUPS)
        b3 = K_._mxfp4_stream_scales(s3, 0, n_groups, r_ok, GROUPS)
    for g0 in range(0, n_groups, GROUPS):
        if not NOX and not XPRE:
            nx = K_._mxfp4_stream_x(x_ptr, g0 + GROUPS, K, GROUPS)
        na1 = K_._mxfp4_stream_words(w1, g0 + GROUPS, n_groups, r_ok, GROUPS)
        na3 = K_._mxfp4_stream_words(w3, g0 + GROUPS, n_groups, r_ok, GROUPS)
        if XPRE:
            gg = g0 + GROUPS + tl.arange(0, GROUPS)
            nb1 = _ld_u8(s1[:, None] + tl.minimum(gg, n_groups - 1)[None, :]).to(tl.uint8)
            nb3 = _ld_u8(s3[:, None] + tl.minimum(gg, n_groups - 1)[None, :]).to(tl.uint8)
        elif not NOSCALE:
            nb1 = K_._mxfp4_stream_scales(s1, g0 + GROUPS, n_groups, r_ok, GROUPS)
            nb3 = K_._mxfp4_stream_scales(s3, g0 + GROUPS, n_groups, r_ok, GROUPS)
        if XPRE:  # inline-asm loads (not layout anchors): x lands in the words' layout, no shared memory
            xo = x_ptr + (g0 + tl.arange(0, GROUPS))[:, None] * 32 + tl.arange(0, 4)[None, :]
            xs = (_ld_f32x4(xo), _ld_f32x4(xo + 4), _ld_f32x4(xo + 8), _ld_f32x4(xo + 12), _ld_f32x4(xo + 16),
                  _ld_f32x4(xo + 20), _ld_f32x4(xo + 24), _ld_f32x4(xo + 28))
        elif not NOX:
            xs = K_._mxfp4_stream_xs(x, GROUPS)
        if NOSCALE:
            acc1 += K_._mxfp4_stream_sum(a1, xs, True)
            acc3 += K_._mxfp4_stream_sum(a3, xs, True)
        else:
            acc1 += K_._mxfp4_stream_sum(a1, xs, True) * K_._e8m0(b1, 0)
            acc3 += K_._mxfp4_stream_sum(a3, xs, True) * K_._e8m0(b3, 0)
            b1, b3 = nb1, nb3
        a1, a3 = na1, na3
        if not NOX and not XPRE:
            x = nx
    tl.store(y_ptr + offs_n, (tl.sum(acc1, axis=1) + tl.sum(acc3, axis=1)) * 16384.0, mask=r_ok)


@triton.jit
def _ld_u8(ptr):
    """A byte load in whatever layout its consumer has (an inline-asm load is not a layout anchor, tl.load is)."""
    return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _ld_f32x4(ptr):
    """Four consecutive fp32 (16 B, one vector load) in the consumer's layout: pack=4 hands the asm 4 elements
    that sit in one thread; only the first pointer is used."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,l,l,l", [ptr],
                                     dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def rowk_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_w, stride_s, ROWS: tl.constexpr, R: tl.constexpr,
                SUB: tl.constexpr, PARTS: tl.constexpr, PAIR: tl.constexpr, PREFETCH: tl.constexpr):
    """Rows over the loop, K over the threads: a program streams ROWS whole rows (R a step, each step R contiguous
    rows of 2 KB) while every thread keeps its own K slice of x in registers, split by nibble slot once before
    the loop: no per-step x traffic or layout change. The K groups are [SUB, PARTS, 32] (group = sub * PARTS * 32
    + part * 32 + lane): the lanes reduce by shuffles, SUB in-thread, and each of the PARTS warps leaves its
    partial in y[row, part] (summed by the consumer): no cross-warp reduction in the loop.
    y: [N, PARTS] fp32 partials (W1 and, PAIR, W3 rows in y[:, :] and y[N:, :])."""
    gl = (tl.arange(0, SUB)[:, None, None] * (PARTS * 32) + tl.arange(0, PARTS)[None, :, None] * 32
          + tl.arange(0, 32)[None, None, :])  # [SUB, PARTS, 32] group index
    kx = gl[:, :, :, None] * 32 + tl.arange(0, 4)[None, None, None, :] * 8  # element 8i of group g's word i
    xs0 = tl.load(x_ptr + kx).to(tl.float32)
    xs1 = tl.load(x_ptr + kx + 1).to(tl.float32)
    xs2 = tl.load(x_ptr + kx + 2).to(tl.float32)
    xs3 = tl.load(x_ptr + kx + 3).to(tl.float32)
    xs4 = tl.load(x_ptr + kx + 4).to(tl.float32)
    xs5 = tl.load(x_ptr + kx + 5).to(tl.float32)
    xs6 = tl.load(x_ptr + kx + 6).to(tl.float32)
    xs7 = tl.load(x_ptr + kx + 7).to(tl.float32)
    word = gl[None, :, :, :, None] * 4 + tl.arange(0, 4)[None, None, None, None, :]  # [1, SUB, PARTS, 32, 4]
    rr = tl.arange(0, R)
    row0 = tl.program_id(0) * ROWS
    parts = tl.arange(0, PARTS)
    if PREFETCH:
        rows = (row0 + rr).to(tl.int64)
        w1 = tl.load(w_ptr + rows[:, None, None, None, None] * stride_w + word).to(tl.uint32, bitcast=True)
        s1 = _ld_u8(s_ptr + rows[:, None, None, None] * stride_s + gl[None])
        if PAIR:
            w3 = tl.load(w_ptr + (rows + N)[:, None, None, None, None] * stride_w + word).to(tl.uint32, bitcast=True)
            s3 = _ld_u8(s_ptr + (rows + N)[:, None, None, None] * stride_s + gl[None])
    out1 = tl.zeros((ROWS, PARTS), dtype=tl.float32)
    out3 = tl.zeros((ROWS, PARTS), dtype=tl.float32)
    ro = tl.arange(0, ROWS)
    for r0 in range(0, ROWS, R):
        rows = (row0 + r0 + rr).to(tl.int64)
        if PREFETCH:
            nrows = (row0 + tl.minimum(r0 + R, ROWS - R) + rr).to(tl.int64)
            nw1 = tl.load(w_ptr + nrows[:, None, None, None, None] * stride_w + word).to(tl.uint32, bitcast=True)
            ns1 = _ld_u8(s_ptr + nrows[:, None, None, None] * stride_s + gl[None])
            if PAIR:
                nw3 = tl.load(w_ptr + (nrows + N)[:, None, None, None, None] * stride_w + word).to(tl.uint32,
                                                                                                  bitcast=True)
                ns3 = _ld_u8(s_ptr + (nrows + N)[:, None, None, None] * stride_s + gl[None])
        else:
            w1 = tl.load(w_ptr + rows[:, None, None, None, None] * stride_w + word).to(tl.uint32, bitcast=True)
            s1 = _ld_u8(s_ptr + rows[:, None, None, None] * stride_s + gl[None])
            if PAIR:
                w3 = tl.load(w_ptr + (rows + N)[:, None, None, None, None] * stride_w + word).to(tl.uint32,
                                                                                                 bitcast=True)
                s3 = _ld_u8(s_ptr + (rows + N)[:, None, None, None] * stride_s + gl[None])
        v = K_._e2m1_word_prmt(w1)
        part = v[0] * xs0[None] + v[1] * xs1[None] + v[2] * xs2[None] + v[3] * xs3[None]
        part += v[4] * xs4[None] + v[5] * xs5[None] + v[6] * xs6[None] + v[7] * xs7[None]
        y1 = tl.sum(tl.sum(tl.sum(part, axis=4) * K_._e8m0(s1, 14), axis=3), axis=1)  # [R, PARTS]
        if R == 1:
            out1 = tl.where(ro[:, None] == r0, y1, out1)
        else:
            tl.store(y_ptr + rows[:, None] * PARTS + parts[None, :], y1)
        if PAIR:
            v = K_._e2m1_word_prmt(w3)
            part = v[0] * xs0[None] + v[1] * xs1[None] + v[2] * xs2[None] + v[3] * xs3[None]
            part += v[4] * xs4[None] + v[5] * xs5[None] + v[6] * xs6[None] + v[7] * xs7[None]
            y3 = tl.sum(tl.sum(tl.sum(part, axis=4) * K_._e8m0(s3, 14), axis=3), axis=1)
            if R == 1:
                out3 = tl.where(ro[:, None] == r0, y3, out3)
            else:
                tl.store(y_ptr + (rows + N)[:, None] * PARTS + parts[None, :], y3)
        if PREFETCH:
            w1, s1 = nw1, ns1
            if PAIR:
                w3, s3 = nw3, ns3
    if R == 1:
        tl.store(y_ptr + (row0 + ro)[:, None] * PARTS + parts[None, :], out1)
        if PAIR:
            tl.store(y_ptr + (row0 + N + ro)[:, None] * PARTS + parts[None, :], out3)


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
    if name == "rowk":
        rows_, r_, parts_ = bn, g, nw  # tile = (ROWS, R, warps); SUB from K
        sub = k // 32 // (parts_ * 32)
        return lambda w, s, x, y: rowk_kernel[(n // rows_,)](w, s, x, y, n, k, k // 8, k // 32, rows_, r_, sub,
                                                              parts_, pair, stages == 1, num_warps=nw)
    if name.startswith("abl"):  # always the pair: the w3 rows sit N rows on (the down shape has none: skipped)
        flags = ("noscale" in name, "nox" in name, "xpre" in name)
        if "xpre" in name:  # x pre-split per group: element 8i + p at 4p + i, fp32
            return lambda w, s, x, y: abl_kernel[grid](w, s, x.float().view(-1, 4, 8).transpose(1, 2).contiguous(),
                                                       y, n, k, k // 8, k // 32, bn, g, *flags, num_warps=nw)
        return lambda w, s, x, y: abl_kernel[grid](w, s, x, y, n, k, k // 8, k // 32, bn, g, *flags, num_warps=nw)
    if name == "mma2":
        return lambda w, s, x, y: mma2_kernel[grid](w, s, x, y, n, k, k // 8, k // 32, bn, g, num_warps=nw,
                                                        num_stages=stages)
    if name == "mma":
        return lambda w, s, x, y: mma_kernel[grid](w, s, x, y, n, k, k // 8, k // 32, bn, g, num_warps=nw,
                                                       num_stages=stages)
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
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
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
    if "wide" in what:
        variants += [("cur", True, True), ("abl_nox", True, True), ("abl_xpre", True, True)]
        tiles = [(4, 32, 2), (2, 32, 1), (4, 32, 1), (2, 32, 2), (8, 16, 2), (4, 16, 1), (4, 64, 4), (2, 64, 2),
                 (8, 32, 4), (16, 8, 4)]
    if "rowk" in what:
        variants += [("rowk", True, False), ("rowk", False, False)]
        tiles = [(rows_, r_, nw) for rows_, r_, nw in ((16, 1, 2), (32, 1, 2), (16, 2, 2), (32, 2, 2), (64, 2, 2),
                                                      (16, 1, 4), (32, 2, 4), (8, 1, 2), (64, 4, 2))]
    if "abl" in what:
        variants += [("cur", True, True), ("abl", True, True), ("abl_noscale", True, True), ("abl_nox", True, True),
                     ("abl_noscale_nox", True, True), ("skel", False, False)]
        tiles = [(8, 16, 2), (16, 8, 4), (32, 8, 4), (64, 8, 8)]
    if "mma" in what:
        variants += [("mma", False, False), ("mma2", False, False), ("cur", True, True)]
        tiles = [(bn, g, nw, 3) for bn, g, nw in ((64, 2, 4), (64, 4, 4), (128, 2, 4), (128, 4, 4), (128, 2, 8),
                                                  (64, 8, 4))] + [(8, 16, 2), (16, 8, 4)]
    if a.small:
        shapes = [("gate_up", 64, 256, True), ("down", 64, 128, False)]
        tiles = [(16, 2, 4), (32, 128, 2, 2)]  # (BLOCK_N, GROUPS, warps) for the streams, + stages for ds
        variants = [v for v in variants if not v[2] and v[0] not in ("mma", "mma2", "rowk")]  # inline PTX: GPU only
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
        want_all = reference(data[0][0].view(torch.uint8), data[0][1], data[0][2], False)
        for (bn, g, nw, *st), (name, pf, prmt) in itertools.product(tiles, variants):
            if name == "rowk" and k // 32 < nw * 32:
                continue  # fewer groups than lanes x warps
            if name.startswith("abl") and not pair:
                continue  # abl_kernel reads the pair (runs 30, 32-33 timed it on down too, past the end: void)
            if (name in ("ds", "mma", "mma2")) != bool(st):
                continue  # ds and mma tiles carry num_stages; the streams' do not
            cfg = {"BLOCK_N": bn, "GROUPS": g, "num_warps": nw, "PREFETCH": pf, "PRMT": prmt}
            if name in ("mma", "mma2"):
                cfg = {"BLOCK_N": bn, "GROUPS": g, "num_warps": nw, "num_stages": st[0]}
            if name == "ds":
                cfg = {"BLOCK_N": bn, "BLOCK_K": g, "num_warps": nw, "num_stages": st[0]}
            n_out = rows if name.startswith("mma") else n  # mma: every row (w1 and w3 rows alike), not the pair sums
            launch = _launcher(name, bn, g, nw, st[0] if st else (1 if pf else 0), pf, prmt, n_out, k, pair,
                               a.small)
            if name in ("tskel", "tiled"):
                inputs = [(*tile_major(d[0], d[1], bn, g), d[2]) for d in data]
            else:
                inputs = data
            y = torch.full((n_out,), float("nan"), device=dev)
            if name == "rowk":  # [rows, warps] partials of every row (pair: w1 rows then w3 rows)
                y = torch.full((rows * nw,), float("nan"), device=dev)
            launch(*inputs[0], y)
            if name == "rowk":
                y = y.view(rows, nw).sum(1)
                y = y[: rows // 2] + y[rows // 2:] if pair else y
            ref_y = want_all if name.startswith("mma") else want
            err = None if "skel" in name or "no" in name else ((y.double() - ref_y).norm() / ref_y.norm()).item()
            n_y = rows * nw if name == "rowk" else n_out
            ms = B.time_graph_ms(launch, [(*d, torch.empty(n_y, device=dev)) for d in inputs])
            frac = nbytes / (ms * 1e-3) / 1e12 / copy if copy else 0.0
            out["runs"].append({"shape": shape, "kernel": name, "cfg": cfg, "us": ms * 1e3, "frac": frac,
                                "rel_err": err})
            print(f"{shape:8s} {name:5s} {cfg}  {ms * 1e3:7.1f} us  {frac:.3f} of copy  err {err}", flush=True)
    with open(os.path.join(a.out, "probe_mxfp4.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
