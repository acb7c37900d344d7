"""Inline-PTX tensor-core kernels (CUDA sm_80+ only; gfx90a takes the portable forms): the MXFP4 MoE at a few
tokens and the FP8 linear at 2-8 rows."""

from __future__ import annotations

import triton
import triton.language as tl

from .base import _e8m0, gdc_launch_dependents, gdc_wait

# MXFP4 at a few tokens (up to 64) on the tensor cores (CUDA sm_80+, inline PTX mma.sync m16n8k16 bf16 -> fp32)
#
# The weights are repacked once (ops: `mma_repack`) so that each lane's two 16-byte loads of a [16 rows x 128 K]
# tile hold exactly its A fragments for the tile's 8 mma steps, with each code's bits placed so that shifts and
# masks (`_a_regs`: 12 integer instructions a word of 8 codes) make bf16 pairs of E2M1 x 2^-126 values (bf16
# subnormals for the 0.5 code: exact on the tensor cores). x is the B operand times 2^64 (so products of ordinary
# activations stay fp32 normals), block-diagonal over the tile's 4 scale groups and split hi + lo in bf16 (columns
# 2q, 2q + 1 hold group q's two parts); so each accumulator column holds one group's partial sum, and per tile the
# lane undoes the 2^-62 and applies the group scales. These kernels are written per thread: every address comes
# from the hardware lane id and each program is one warp, so they do not depend on how Triton lays tensors over
# threads; the split-K sums and the epilogues are ordinary Triton code over the tile's rows (fixed-order trees).
# Limits: |x| < 2^64 (bf16 x 2^64 must not overflow); a product |code x x| below about 2^-87 flushes to zero.


@triton.jit
def _lane_roles():
    """This thread's (lane, g, t, gg, part): fragment row group g = lane // 4, column pair t = lane % 4, and for
    the B operand its column's scale group gg = g // 2 and hi/lo part g % 2 (one [32] element per lane)."""
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((32,), dtype=tl.int32)],
                                     dtype=tl.int32, is_pure=True, pack=1)
    g = lane // 4
    return lane, g, lane % 4, g // 2, g % 2


@triton.jit
def _ld16(ptr):
    """16 bytes as 4 words (streamed once: no L1 allocation)."""
    return tl.inline_asm_elementwise("ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                     [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True,
                                     pack=1)


@triton.jit
def _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _quad_sum(v):
    """Sum over the 4 lanes of a fragment row (lane xor 1, 2)."""
    v += tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, 0xffffffff;", "=f,f", [v], dtype=tl.float32,
                                   is_pure=True, pack=1)
    return v + tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;", "=f,f", [v],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _a_regs(w):
    """A word's 8 codes -> the lane's 4 A registers (see `mma_repack` for where each code's bits sit)."""
    p0 = w & 0x81C081C0
    p1 = ((w >> 3) & 0x01C001C0) | ((w << 1) & 0x80008000)
    p2 = ((w << 3) & 0x01C001C0) | ((w << 2) & 0x80008000)
    p3 = ((w << 6) & 0x01C001C0) | ((w << 3) & 0x80008000)
    return p0, p1, p2, p3


@triton.jit
def _mma_step(w, b0, b1, act, c0, c1, c2, c3):
    a0, a1, a2, a3 = _a_regs(w)
    z = tl.zeros_like(b0)
    return _mma_bf16(a0, a1, a2, a3, tl.where(act, b0, z), tl.where(act, b1, z), c0, c1, c2, c3)


@triton.jit
def _mma_acc(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg):
    """One [16 rows x 128 K] tile: 8 mma steps; the lane's B registers (xb*) are live in steps 2 gg, 2 gg + 1
    (its column's group). Returns the accumulator: rows g (c0, c1) and g + 8 (c2, c3) of columns 2t, 2t + 1."""
    c0 = tl.zeros_like(gg).to(tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    c0, c1, c2, c3 = _mma_step(w0, xb0, xb1, gg == 0, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w1, xb2, xb3, gg == 0, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w2, xb0, xb1, gg == 1, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w3, xb2, xb3, gg == 1, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w4, xb0, xb1, gg == 2, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w5, xb2, xb3, gg == 2, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w6, xb0, xb1, gg == 3, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma_step(w7, xb2, xb3, gg == 3, c0, c1, c2, c3)
    return c0, c1, c2, c3


@triton.jit
def _mma_apply(ca, cb, s):
    """Columns 2t and 2t + 1 of one accumulator row added, times 2^62 (undoes E2M1 x 2^-126 and x x 2^64; applied
    before the scale, so scales from 2^66 up do not overflow) and the row's group scale."""
    two62 = 4611686018427387904.0
    return (ca + cb) * two62 * _e8m0(s, 0)


@triton.jit
def _mma_tile_cols(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg, s0, s1):
    """One tile against a B whose column 2q holds one pair's x and 2q + 1 another's (both bf16, so no lo parts):
    (top, bottom) of the first pair, then of the second."""
    c0, c1, c2, c3 = _mma_acc(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg)
    z = tl.zeros_like(c0)
    return _mma_apply(c0, z, s0), _mma_apply(c2, z, s1), _mma_apply(c1, z, s0), _mma_apply(c3, z, s1)


@triton.jit
def _add4(a, b, c, d, p, q, r, s):
    """Two pairs' (top, bottom) running sums plus one tile's."""
    return a + p, b + q, c + r, d + s


@triton.jit
def _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg, s0, s1):
    """One tile's contribution to rows g and g + 8, group scales applied (column 2t + 1 is x's lo part)."""
    c0, c1, c2, c3 = _mma_acc(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg)
    return _mma_apply(c0, c1, s0), _mma_apply(c2, c3, s1)


@triton.jit
def _mma_step2(w, b0, b1, d0, d1, act, c0, c1, c2, c3, e0, e1, e2, e3):
    """One decoded A, two mma: against B registers b (accumulator c) and d (accumulator e)."""
    a0, a1, a2, a3 = _a_regs(w)
    z = tl.zeros_like(b0)
    c0, c1, c2, c3 = _mma_bf16(a0, a1, a2, a3, tl.where(act, b0, z), tl.where(act, b1, z), c0, c1, c2, c3)
    e0, e1, e2, e3 = _mma_bf16(a0, a1, a2, a3, tl.where(act, d0, z), tl.where(act, d1, z), e0, e1, e2, e3)
    return c0, c1, c2, c3, e0, e1, e2, e3


@triton.jit
def _mma_tile2(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, yb0, yb1, yb2, yb3, gg, s0, s1):
    """`_mma_tile` for two B operands (two pairs of one expert) from one decode of the tile: (top, bottom) of
    each."""
    c0 = tl.zeros_like(gg).to(tl.float32)
    c1, c2, c3, e0, e1, e2, e3 = c0, c0, c0, c0, c0, c0, c0
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w0, xb0, xb1, yb0, yb1, gg == 0, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w1, xb2, xb3, yb2, yb3, gg == 0, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w2, xb0, xb1, yb0, yb1, gg == 1, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w3, xb2, xb3, yb2, yb3, gg == 1, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w4, xb0, xb1, yb0, yb1, gg == 2, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w5, xb2, xb3, yb2, yb3, gg == 2, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w6, xb0, xb1, yb0, yb1, gg == 3, c0, c1, c2, c3, e0, e1, e2, e3)
    c0, c1, c2, c3, e0, e1, e2, e3 = _mma_step2(w7, xb2, xb3, yb2, yb3, gg == 3, c0, c1, c2, c3, e0, e1, e2, e3)
    return _mma_apply(c0, c1, s0), _mma_apply(c2, c3, s1), _mma_apply(e0, e1, s0), _mma_apply(e2, e3, s1)


@triton.jit
def _x_2_64(v0, v1, v2, v3):
    """4 bf16 pairs times 2^64 (x * 2^64 + -0 by fma.bf16x2: exact, which sm_80 has and mul.bf16x2 needs sm_90)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 c, z; mov.b32 c, 0x5F805F80; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $4, c, z; "
        "fma.rn.bf16x2 $1, $5, c, z; fma.rn.bf16x2 $2, $6, c, z; fma.rn.bf16x2 $3, $7, c, z; }",
        "=r,=r,=r,=r,r,r,r,r", [v0, v1, v2, v3],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _mma_x(x_ptr, part, LO_ZERO: tl.constexpr = True):
    """The lane's 4 B registers of a tile from its first x pair: bf16 x times 2^64 (hi part; LO_ZERO: lanes of the
    lo part get zero, else they hold a second pair's x, their own x_ptr)."""
    p = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    v0, v1, v2, v3 = _x_2_64(tl.load(p), tl.load(p + 4), tl.load(p + 8), tl.load(p + 12))
    if LO_ZERO:
        z = tl.zeros_like(v0)
        hi = part == 0
        v0, v1, v2, v3 = tl.where(hi, v0, z), tl.where(hi, v1, z), tl.where(hi, v2, z), tl.where(hi, v3, z)
    return v0, v1, v2, v3


@triton.jit
def _mma_h(ptr):
    """The lane's 4 B registers of a tile of the split h, stored in lane order (`_hb_index`): one 16-byte load
    (through L1: every row tile's programs read the same h). Not pure: h is written by the launch before, so the
    compiler must keep this load after the programmatic dependent launch's wait (a pure asm may be hoisted)."""
    return tl.inline_asm_elementwise("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)


@triton.jit
def _mma_program(rows_ptr, K, SPLIT: tl.constexpr, TWO: tl.constexpr):
    """A one-warp program's place: (row-tile program, pair j, second pair j2, K part sk, row-tile programs, the K
    tiles of a row tile, those of one part). Program row i is pair i, or with TWO the pairs of row i of
    `moe_pair_rows_kernel`'s table (two of one expert; j2 = -1: none; j = -1: an empty row)."""
    ktt = K // 128
    if TWO:
        j = tl.load(rows_ptr + 2 * tl.program_id(1))
        j2 = tl.load(rows_ptr + 2 * tl.program_id(1) + 1)
    else:
        j = tl.program_id(1)
        j2 = -1
    return tl.program_id(0), j, j2, tl.program_id(2), tl.num_programs(0), ktt, ktt // SPLIT


@triton.jit
def _mma_tile_load(wp, sp, n):
    """The lane's 8 words and 2 scale bytes of tile n from its tile-0 addresses (wp: the lane's first word of a
    tile stored as [2, 32 lanes, 4 words], so each 16-byte load of a warp reads 512 consecutive bytes; sp: its
    scale pair, read as one 16-bit load)."""
    w0, w1, w2, w3 = _ld16(wp + n * 256)
    w4, w5, w6, w7 = _ld16(wp + n * 256 + 128)
    sv = tl.load((sp + n * 64).to(tl.pointer_type(tl.uint16), bitcast=True))
    return w0, w1, w2, w3, w4, w5, w6, w7, sv & 0xFF, sv >> 8


@triton.jit
def _hb_index(ch):
    """Where h's channel ch (hi part; lo: + 32) sits in hb: per 128-channel tile, in the order the down kernel's
    lanes read their B registers (lane = 4 (2 gg + part) + t holds pairs 2t, 2t + 8, 2t + 16, 2t + 24 of group gg:
    8 consecutive bf16, one 16-byte load)."""
    kk = ch % 128
    r = kk % 32
    return (ch // 128) * 256 + (8 * (kk // 32) + (r % 8) // 2) * 8 + (r // 8) * 2 + r % 2


@triton.jit
def _gate_up_parts(part_ptr, j, sk, I, c, g, t, gt, gb, ut, ub, ok, SPLIT: tl.constexpr):
    """Pair j's K-part partials of the gate and up rows of tile c (fp32, [pairs x SPLIT, 2, I])."""
    pp = part_ptr + (j * SPLIT + sk) * 2 * I + c * 16 + g
    keep = tl.where(ok, t == 0, False)  # not `& ok`: the interpreter's & of a block and a scalar is no bool mask
    tl.store(pp, _quad_sum(gt), mask=keep)
    tl.store(pp + 8, _quad_sum(gb), mask=keep)
    tl.store(pp + I, _quad_sum(ut), mask=keep)
    tl.store(pp + I + 8, _quad_sum(ub), mask=keep)


@triton.jit
def _gate_up_finish(part_ptr, lock_ptr, hb_ptr, j, c, n_ct, I, limit, HAS_LIMIT: tl.constexpr,
                    SPLIT: tl.constexpr, SPLITP: tl.constexpr):
    """The last K part of pair j's tile c to arrive adds the SPLIT partials (a fixed tree), applies the clamped
    SwiGLU and writes h x 2^64 split hi + lo in bf16 where down's lanes read it (`_hb_index`)."""
    lock_at = lock_ptr + j * n_ct + c
    if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
        q = tl.arange(0, SPLITP)[:, None]
        ch = c * 16 + tl.arange(0, 16)[None, :]
        at = part_ptr + (j * SPLIT + q) * 2 * I + ch
        ok = q < SPLIT
        gs = tl.sum(tl.load(at, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        us = tl.sum(tl.load(at + I, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        if HAS_LIMIT:
            gs = tl.minimum(gs, limit)
            us = tl.minimum(tl.maximum(us, -limit), limit)
        h = gs / (1.0 + tl.exp(-gs)) * us * 18446744073709551616.0  # x 2^64: exact
        hi = h.to(tl.bfloat16)
        lo = (h - hi.to(tl.float32)).to(tl.bfloat16)
        at = hb_ptr + j * 2 * I + _hb_index(c * 16 + tl.arange(0, 16))
        tl.store(at, hi)
        tl.store(at + 32, lo)  # part 1: the lanes 4 x 2 further on
        tl.atomic_xchg(lock_at, 0)


@triton.jit
def _gate_up_stream(wg, sg, wu, su, xp, part, gg, kt, TWO: tl.constexpr):
    """The gate and up row tiles of a K part (kt tiles from wg / wu, the scales from sg / su) against x from xp, the
    next tile's loads issued before this one's mma: the running (top, bottom) rows of gate and up, and with TWO
    those of the second pair (x in the B columns of the first's lo parts)."""
    a0, a1, a2, a3, a4, a5, a6, a7, gs0, gs1 = _mma_tile_load(wg, sg, 0)
    b0, b1, b2, b3, b4, b5, b6, b7, us0, us1 = _mma_tile_load(wu, su, 0)
    x0, x1, x2, x3 = _mma_x(xp, part, not TWO)
    gt = tl.zeros_like(gg).to(tl.float32)
    gb = gt
    ut = gt
    ub = gt
    gt2 = gt
    gb2 = gt
    ut2 = gt
    ub2 = gt
    for i in range(kt):
        w0, w1, w2, w3, w4, w5, w6, w7 = a0, a1, a2, a3, a4, a5, a6, a7
        v0, v1, v2, v3, v4, v5, v6, v7 = b0, b1, b2, b3, b4, b5, b6, b7
        cg0, cg1, cu0, cu1 = gs0, gs1, us0, us1
        y0, y1, y2, y3 = x0, x1, x2, x3
        n = tl.minimum(i + 1, kt - 1)  # the last step reloads its own tile (unused)
        a0, a1, a2, a3, a4, a5, a6, a7, gs0, gs1 = _mma_tile_load(wg, sg, n)
        b0, b1, b2, b3, b4, b5, b6, b7, us0, us1 = _mma_tile_load(wu, su, n)
        x0, x1, x2, x3 = _mma_x(xp + n * 128, part, not TWO)
        if TWO:
            gt, gb, gt2, gb2 = _add4(gt, gb, gt2, gb2, *_mma_tile_cols(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2,
                                                                       y3, gg, cg0, cg1))
            ut, ub, ut2, ub2 = _add4(ut, ub, ut2, ub2, *_mma_tile_cols(v0, v1, v2, v3, v4, v5, v6, v7, y0, y1, y2,
                                                                       y3, gg, cu0, cu1))
        else:
            top, bot = _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2, y3, gg, cg0, cg1)
            gt += top
            gb += bot
            top, bot = _mma_tile(v0, v1, v2, v3, v4, v5, v6, v7, y0, y1, y2, y3, gg, cu0, cu1)
            ut += top
            ub += bot
    return gt, gb, ut, ub, gt2, gb2, ut2, ub2


@triton.jit
def moe_mma_gate_up_kernel(x_ptr, w_ptr, s_ptr, e_ptr, rows_ptr, part_ptr, lock_ptr, hb_ptr, I, D, TOPK, limit,
                           HAS_LIMIT: tl.constexpr, SPLIT: tl.constexpr, SPLITP: tl.constexpr,
                           TWO: tl.constexpr = False, PDL: tl.constexpr = False):
    """A few tokens, one warp a program: (16-channel tile c, pair j = token j // TOPK's slot, K part sk) streams
    the gate and the up row tiles of expert e_ptr[j] (repacked, interleaved per 16 rows) over D / SPLIT against
    that token's x. TWO: program row i takes the two pairs of one expert in row i of rows_ptr, the second pair's x
    in the B columns of the first's (zero) lo parts, so one decode of the weights serves both. The last K part of
    a pair's tile to arrive adds the SPLIT partials (a fixed tree), applies the clamped SwiGLU and writes h times
    2^64 split hi + lo in bf16: hb [pairs, I / 128, 256] (the down kernel's B operand as it is, `_hb_index`). PDL
    (sm_90): the down launch may start once every program of this one has started (it waits for this launch's end
    before it reads h)."""
    if PDL:
        gdc_launch_dependents()
    c, j, j2, sk, n_ct, ktt, kt = _mma_program(rows_ptr, D, SPLIT, TWO)
    if TWO:
        if j < 0:  # an empty row of the pair table
            return
    e = tl.load(e_ptr + j).to(tl.int64)
    lane, g, t, gg, part = _lane_roles()
    tile0 = (e * n_ct + c) * 2 * ktt + sk * kt  # the gate row tile's first tile of this part; up: + ktt
    wg = w_ptr + (tile0 * 256 + lane * 4)
    wu = wg + ktt * 256
    sg = s_ptr + (tile0 * 64 + lane * 2)
    su = sg + ktt * 64
    tok = j // TOPK
    if TWO:  # lanes of the lo part read the second pair's token (the first's again when there is none)
        tok = tl.where(part == 0, tok, tl.where(j2 < 0, tok, j2 // TOPK))
    xp = x_ptr + (tok.to(tl.int64) * D + sk * kt * 128 + gg * 32 + 2 * t)
    gt, gb, ut, ub, gt2, gb2, ut2, ub2 = _gate_up_stream(wg, sg, wu, su, xp, part, gg, kt, TWO)
    _gate_up_parts(part_ptr, j, sk, I, c, g, t, gt, gb, ut, ub, True, SPLIT)
    if TWO:
        _gate_up_parts(part_ptr, j2, sk, I, c, g, t, gt2, gb2, ut2, ub2, j2 >= 0, SPLIT)
    tl.debug_barrier()
    _gate_up_finish(part_ptr, lock_ptr, hb_ptr, j, c, n_ct, I, limit, HAS_LIMIT, SPLIT, SPLITP)
    if TWO:
        if j2 >= 0:
            _gate_up_finish(part_ptr, lock_ptr, hb_ptr, j2, c, n_ct, I, limit, HAS_LIMIT, SPLIT, SPLITP)


@triton.jit
def _down_parts(part_ptr, j, sk, D, r, g, t, top, bot, ok, SPLIT: tl.constexpr):
    """Pair j's K-part partials of row tile r (fp32, [pairs x SPLIT, D])."""
    pp = part_ptr + (j * SPLIT + sk) * D + r * 16 + g
    keep = tl.where(ok, t == 0, False)  # as `_gate_up_parts`
    tl.store(pp, _quad_sum(top), mask=keep)
    tl.store(pp + 8, _quad_sum(bot), mask=keep)


@triton.jit
def _down_finish(part_ptr, lock_ptr, wt_ptr, out_ptr, add_ptr, j, r, n_rt, D, TOPK, SPLIT: tl.constexpr,
                 TOPKP: tl.constexpr, SUM: tl.constexpr, HAS_ADD: tl.constexpr):
    """The last arrival at pair j's row tile r adds the partials by fixed trees: SUM: out[t, rows] = sum_j wt[j]
    sum_sk part (+ add[t]) over the TOPK pairs of token t = j // TOPK, else out[j, rows] = wt[j] sum_sk part."""
    rows = r * 16 + tl.arange(0, 16)
    if SUM:
        tok = j // TOPK
        lock_at = lock_ptr + tok * n_rt + r
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == TOPK * SPLIT - 1:
            slot = tl.arange(0, TOPKP)
            jj = tok * TOPK + slot[:, None, None]
            ss = tl.arange(0, SPLIT)[None, :, None]
            ok = slot[:, None, None] < TOPK
            parts = tl.load(part_ptr + (jj * SPLIT + ss) * D + rows[None, None, :], mask=ok, other=0.0,
                            cache_modifier=".cg")
            wts = tl.load(wt_ptr + tok * TOPK + slot, mask=slot < TOPK, other=0.0).to(tl.float32)
            tot = tl.sum(tl.sum(parts, axis=1) * wts[:, None], axis=0)
            out_at = tok.to(tl.int64) * D + rows
            if HAS_ADD:
                tot += tl.load(add_ptr + out_at).to(tl.float32)
            tl.store(out_ptr + out_at, tot.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(lock_at, 0)
    else:
        lock_at = lock_ptr + j * n_rt + r
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
            ss = tl.arange(0, SPLIT)[:, None]
            parts = tl.load(part_ptr + (j * SPLIT + ss) * D + rows[None, :], cache_modifier=".cg")
            tot = tl.sum(parts, axis=0) * tl.load(wt_ptr + j).to(tl.float32)
            tl.store(out_ptr + j * D + rows, tot)
            tl.atomic_xchg(lock_at, 0)


@triton.jit
def moe_mma_down_kernel(hb_ptr, w_ptr, s_ptr, e_ptr, rows_ptr, wt_ptr, part_ptr, lock_ptr, out_ptr, add_ptr, D, I,
                        TOPK, SPLIT: tl.constexpr, TOPKP: tl.constexpr, SUM: tl.constexpr, HAS_ADD: tl.constexpr,
                        TWO: tl.constexpr = False, PDL: tl.constexpr = False):
    """A few tokens, one warp a program: (16-row tile r of D, pair j, K part sk) streams expert e_ptr[j]'s down
    rows over I / SPLIT (a power of two), two tiles a step, with hb (the gate/up kernel's split h) as B; TWO: the
    two pairs of row i of rows_ptr (one expert), a second mma from each decoded tile. Then `_down_finish`. PDL
    (sm_90, launched as a programmatic dependent of the launch before it, gate/up or a kernel after it): the first
    step's weights, the pair table and the pairs' experts are read before the wait in the source, so they must have
    been written before gate/up began (the host launches without PDL right after a repack); everything else is read
    and written after it. (In the sm_90 SASS only the scales and experts load before it: ptxas sinks the words' .nc
    loads below the wait. Loads kept above it, up to all of a part's tiles, were no faster: NOTES run 118.)"""
    r, j, j2, sk, n_rt, ktt, kt = _mma_program(rows_ptr, I, SPLIT, TWO)
    if TWO:
        if j < 0:  # an empty row of the pair table
            return
    e = tl.load(e_ptr + j).to(tl.int64)
    lane, g, t, gg, part = _lane_roles()
    tile0 = (e * n_rt + r) * ktt + sk * kt
    wp = w_ptr + (tile0 * 256 + lane * 4)
    sp = s_ptr + (tile0 * 64 + lane * 2)
    xp = hb_ptr + (j * 2 * I + sk * kt * 256 + lane * 8)
    a0, a1, a2, a3, a4, a5, a6, a7, as0, as1 = _mma_tile_load(wp, sp, 0)
    b0, b1, b2, b3, b4, b5, b6, b7, bs0, bs1 = _mma_tile_load(wp + 256, sp + 64, 0)  # tile 1
    if PDL:
        gdc_wait()  # gate/up (and every earlier launch) done and its writes visible: hb, the shared expert
    x0, x1, x2, x3 = _mma_h(xp)
    x4, x5, x6, x7 = _mma_h(xp + 256)
    if TWO:
        xq = hb_ptr + (tl.where(j2 < 0, j, j2) * 2 * I + sk * kt * 256 + lane * 8)  # the second pair's h
        z0, z1, z2, z3 = _mma_h(xq)
        z4, z5, z6, z7 = _mma_h(xq + 256)
    else:
        z0, z1, z2, z3, z4, z5, z6, z7 = x0, x1, x2, x3, x4, x5, x6, x7  # unused
    top = tl.zeros((32,), dtype=tl.float32)
    bot = top
    top2 = top
    bot2 = top
    for i in range(0, kt, 2):
        w0, w1, w2, w3, w4, w5, w6, w7 = a0, a1, a2, a3, a4, a5, a6, a7
        v0, v1, v2, v3, v4, v5, v6, v7 = b0, b1, b2, b3, b4, b5, b6, b7
        ca0, ca1, cb0, cb1 = as0, as1, bs0, bs1
        y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        u0, u1, u2, u3, u4, u5, u6, u7 = z0, z1, z2, z3, z4, z5, z6, z7
        n = tl.minimum(i + 2, kt - 2)  # the last step reloads its own tiles (unused)
        a0, a1, a2, a3, a4, a5, a6, a7, as0, as1 = _mma_tile_load(wp, sp, n)
        b0, b1, b2, b3, b4, b5, b6, b7, bs0, bs1 = _mma_tile_load(wp + 256, sp + 64, n)  # n + 1
        x0, x1, x2, x3 = _mma_h(xp + n * 256)
        x4, x5, x6, x7 = _mma_h(xp + n * 256 + 256)
        if TWO:
            z0, z1, z2, z3 = _mma_h(xq + n * 256)
            z4, z5, z6, z7 = _mma_h(xq + n * 256 + 256)
            top, bot, top2, bot2 = _add4(top, bot, top2, bot2, *_mma_tile2(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1,
                                                                           y2, y3, u0, u1, u2, u3, gg, ca0, ca1))
            top, bot, top2, bot2 = _add4(top, bot, top2, bot2, *_mma_tile2(v0, v1, v2, v3, v4, v5, v6, v7, y4, y5,
                                                                           y6, y7, u4, u5, u6, u7, gg, cb0, cb1))
        else:
            p, q = _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2, y3, gg, ca0, ca1)
            top += p
            bot += q
            p, q = _mma_tile(v0, v1, v2, v3, v4, v5, v6, v7, y4, y5, y6, y7, gg, cb0, cb1)
            top += p
            bot += q
    _down_parts(part_ptr, j, sk, D, r, g, t, top, bot, True, SPLIT)
    if TWO:
        _down_parts(part_ptr, j2, sk, D, r, g, t, top2, bot2, j2 >= 0, SPLIT)
    tl.debug_barrier()
    _down_finish(part_ptr, lock_ptr, wt_ptr, out_ptr, add_ptr, j, r, n_rt, D, TOPK, SPLIT, TOPKP, SUM, HAS_ADD)
    if TWO:
        if j2 >= 0:
            _down_finish(part_ptr, lock_ptr, wt_ptr, out_ptr, add_ptr, j2, r, n_rt, D, TOPK, SPLIT, TOPKP, SUM,
                         HAS_ADD)


# MXFP4 at one token, split by channels instead of by phase (MOE_MMA_ONE): a program owns one pair's chunk of 64
# channels and does gate/up over all of K for them, the clamped SwiGLU, and down's 64 columns of those channels for
# every row of D, writing an fp32 partial; `moe_mma_one_sum_kernel` adds the chunks and the pairs. No program waits for
# another (the per-phase pair above: down waits for gate/up's end, and each phase's K parts for their last arrival).
# A program is CT x KS warps; its per-thread tensors are [32 CT KS], one element a thread, every address from the
# hardware thread id (`_thread_roles`), as the one-warp kernels above.


@triton.jit
def _thread_roles(W: tl.constexpr):
    """(lane, warp, g, t, gg, part) of this thread in a program of W warps (`_lane_roles` per warp)."""
    tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [tl.zeros((32 * W,), dtype=tl.int32)],
                                    dtype=tl.int32, is_pure=True, pack=1)
    lane = tid % 32
    g = lane // 4
    return lane, tid // 32, g, lane % 4, g // 2, g % 2


@triton.jit
def _down_load(wp, sp, FULL: tl.constexpr):
    """A down tile's 8 words (FULL) or its half's 4 (2 scale groups: 512 consecutive bytes a warp; the other 4 are
    zeros), and the lane's scale pair."""
    w0, w1, w2, w3 = _ld16(wp)
    if FULL:
        w4, w5, w6, w7 = _ld16(wp + 128)
    else:
        w4 = tl.zeros_like(w0)
        w5, w6, w7 = w4, w4, w4
    return w0, w1, w2, w3, w4, w5, w6, w7, tl.load(sp.to(tl.pointer_type(tl.uint16), bitcast=True))


@triton.jit
def _down_rows(w0, w1, w2, w3, w4, w5, w6, w7, sv, xb0, xb1, xb2, xb3, gg, q0, FULL: tl.constexpr):
    """Rows g and g + 8 of one 16-row tile against h's B registers, scales applied, summed over the quad: FULL, the
    tile's 4 scale groups (8 mma steps); else groups q0, q0 + 1 from the half's 4 words (lanes of the other groups
    hold zeros: their B columns are inactive)."""
    if FULL:
        top, bot = _mma_tile(w0, w1, w2, w3, w4, w5, w6, w7, xb0, xb1, xb2, xb3, gg, sv & 0xFF, sv >> 8)
    else:
        c0 = tl.zeros_like(gg).to(tl.float32)
        c1 = c0
        c2 = c0
        c3 = c0
        c0, c1, c2, c3 = _mma_step(w0, xb0, xb1, gg == q0, c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma_step(w1, xb2, xb3, gg == q0, c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma_step(w2, xb0, xb1, gg == q0 + 1, c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma_step(w3, xb2, xb3, gg == q0 + 1, c0, c1, c2, c3)
        top, bot = _mma_apply(c0, c1, sv & 0xFF), _mma_apply(c2, c3, sv >> 8)
    return _quad_sum(top), _quad_sum(bot)


@triton.jit
def _down_store(op, at, top, bot, wt, keep):
    tl.store(op + at, top * wt, mask=keep)
    tl.store(op + at + 8, bot * wt, mask=keep)


@triton.jit
def moe_mma_one_kernel(x_ptr, wu_ptr, su_ptr, wd_ptr, sd_ptr, e_ptr, wt_ptr, hx_ptr, hb_ptr, part_ptr, I, D, limit,
                       HAS_LIMIT: tl.constexpr, CT: tl.constexpr, KS: tl.constexpr, PDL: tl.constexpr = False):
    """One token, program (chunk c of 16 CT channels, CT = 4 or 8; pair j), CT KS warps. Warp (ct, ks) streams the
    gate and up row tiles CT c + ct of expert e_ptr[j] (repacked as for `moe_mma_gate_up_kernel`) over K part ks of
    D; the parts meet in hx [programs, KS, 2, 16 CT] and are added in order, and the clamped SwiGLU gives h x 2^64
    split hi + lo in bf16, in hb [programs, 256] where down's lanes read it (`_hb_index`). Then warp w takes the
    16-row tiles w, w + CT KS, .. of D, each against down's K tile of the chunk (CT = 4: half the tile, its 2 scale
    groups), and writes wt[j] times its rows to part [programs, D] (program j I / (16 CT) + c). PDL: the sum launch
    may start at once (it waits for this one's end)."""
    if PDL:
        gdc_launch_dependents()
    W: tl.constexpr = CT * KS
    C: tl.constexpr = 16 * CT  # channels a program
    FULL: tl.constexpr = CT == 8
    c = tl.program_id(0)
    j = tl.program_id(1)
    pid = j * tl.num_programs(0) + c
    e = tl.load(e_ptr + j).to(tl.int64)
    lane, warp, g, t, gg, part = _thread_roles(W)
    ct = warp % CT
    ks = warp // CT
    ktt = D // 128
    kt = ktt // KS
    tile0 = (e * (I // 16) + c * CT + ct) * 2 * ktt + ks * kt  # the gate row tile's first tile of this part
    wg = wu_ptr + (tile0 * 256 + lane * 4)
    wu = wg + ktt * 256
    sg = su_ptr + (tile0 * 64 + lane * 2)
    su = sg + ktt * 64
    xp = x_ptr + (ks * kt * 128 + gg * 32 + 2 * t)
    gt, gb, ut, ub, _, _, _, _ = _gate_up_stream(wg, sg, wu, su, xp, part, gg, kt, False)
    # down's first 4 row tiles, loaded before the K parts meet (they need no h)
    q0 = 0 if FULL else (c % 2) * 2  # the chunk's first scale group in its down K tile
    n_rt = D // 16
    ktd = I // 128
    tile = (e * n_rt + warp) * ktd + c * CT // 8
    wp = wd_ptr + (tile * 256 + (q0 // 2) * 128 + lane * 4)
    sp = sd_ptr + (tile * 64 + lane * 2)
    step = W * ktd  # tiles from one of the warp's row tiles to its next
    steps = n_rt // W
    a0, a1, a2, a3, a4, a5, a6, a7, sa = _down_load(wp, sp, FULL)
    b0, b1, b2, b3, b4, b5, b6, b7, sb = _down_load(wp + step * 256, sp + step * 64, FULL)
    c0, c1, c2, c3, c4, c5, c6, c7, sc = _down_load(wp + 2 * step * 256, sp + 2 * step * 64, FULL)
    d0, d1, d2, d3, d4, d5, d6, d7, sd = _down_load(wp + 3 * step * 256, sp + 3 * step * 64, FULL)
    hp = hx_ptr + (pid * KS + ks) * 2 * C + ct * 16 + g
    keep = t == 0
    tl.store(hp, _quad_sum(gt), mask=keep)
    tl.store(hp + 8, _quad_sum(gb), mask=keep)
    tl.store(hp + C, _quad_sum(ut), mask=keep)
    tl.store(hp + C + 8, _quad_sum(ub), mask=keep)
    tl.debug_barrier()
    # the K parts added in order (fresh tensors: the thread-role ones must keep one element a thread)
    q = tl.arange(0, KS)[:, None]
    at = hx_ptr + (pid * KS + q) * 2 * C + tl.arange(0, C)[None, :]
    gs = tl.sum(tl.load(at, cache_modifier=".cg"), axis=0)
    us = tl.sum(tl.load(at + C, cache_modifier=".cg"), axis=0)
    if HAS_LIMIT:
        gs = tl.minimum(gs, limit)
        us = tl.minimum(tl.maximum(us, -limit), limit)
    h = gs / (1.0 + tl.exp(-gs)) * us * 18446744073709551616.0  # x 2^64: exact
    hi = h.to(tl.bfloat16)
    lo = (h - hi.to(tl.float32)).to(tl.bfloat16)
    hbp = hb_ptr + pid * 256 + _hb_index(q0 * 32 + tl.arange(0, C))
    tl.store(hbp, hi)
    tl.store(hbp + 32, lo)
    tl.debug_barrier()
    xb0, xb1, xb2, xb3 = _mma_h(hb_ptr + (pid * 256 + lane * 8))  # CT = 4: the other 2 groups' lanes never active
    op = part_ptr + (pid * D + warp * 16 + g)
    wt = tl.load(wt_ptr + j).to(tl.float32)
    for i in range(0, steps, 4):  # 4 row tiles a step, the next 4 loaded first
        p0, p1, p2, p3, p4, p5, p6, p7, sp0 = a0, a1, a2, a3, a4, a5, a6, a7, sa
        q0_, q1, q2, q3, q4, q5, q6, q7, sq = b0, b1, b2, b3, b4, b5, b6, b7, sb
        r0, r1, r2, r3, r4, r5, r6, r7, sr = c0, c1, c2, c3, c4, c5, c6, c7, sc
        u0, u1, u2, u3, u4, u5, u6, u7, su_ = d0, d1, d2, d3, d4, d5, d6, d7, sd
        n = tl.minimum(i + 4, steps - 4)  # the last step reloads its own tiles (unused)
        a0, a1, a2, a3, a4, a5, a6, a7, sa = _down_load(wp + n * step * 256, sp + n * step * 64, FULL)
        b0, b1, b2, b3, b4, b5, b6, b7, sb = _down_load(wp + (n + 1) * step * 256, sp + (n + 1) * step * 64, FULL)
        c0, c1, c2, c3, c4, c5, c6, c7, sc = _down_load(wp + (n + 2) * step * 256, sp + (n + 2) * step * 64, FULL)
        d0, d1, d2, d3, d4, d5, d6, d7, sd = _down_load(wp + (n + 3) * step * 256, sp + (n + 3) * step * 64, FULL)
        top, bot = _down_rows(p0, p1, p2, p3, p4, p5, p6, p7, sp0, xb0, xb1, xb2, xb3, gg, q0, FULL)
        _down_store(op, i * W * 16, top, bot, wt, keep)
        top, bot = _down_rows(q0_, q1, q2, q3, q4, q5, q6, q7, sq, xb0, xb1, xb2, xb3, gg, q0, FULL)
        _down_store(op, (i + 1) * W * 16, top, bot, wt, keep)
        top, bot = _down_rows(r0, r1, r2, r3, r4, r5, r6, r7, sr, xb0, xb1, xb2, xb3, gg, q0, FULL)
        _down_store(op, (i + 2) * W * 16, top, bot, wt, keep)
        top, bot = _down_rows(u0, u1, u2, u3, u4, u5, u6, u7, su_, xb0, xb1, xb2, xb3, gg, q0, FULL)
        _down_store(op, (i + 3) * W * 16, top, bot, wt, keep)


@triton.jit
def moe_mma_one_sum_kernel(part_ptr, out_ptr, add_ptr, D, N, HAS_ADD: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """out[0, d] = the N partials of `moe_mma_one_kernel` (already weighted) added in a fixed order, ROWS at a time
    by one tree (+ add[0, d])."""
    if PDL:
        gdc_wait()  # the channel kernel (and every launch before it) done
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    q = tl.arange(0, ROWS)[:, None]
    tot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for q0 in range(0, N, ROWS):
        tot += tl.sum(tl.load(part_ptr + (q0 + q) * D + d[None, :], mask=q0 + q < N, other=0.0), axis=0)
    if HAS_ADD:
        tot += tl.load(add_ptr + d).to(tl.float32)
    tl.store(out_ptr + d, tot.to(out_ptr.dtype.element_ty))


# FP8 at a few tokens (2-8 rows: a batched decode step) on the tensor cores (CUDA sm_80+, bf16 x). The checkpoint's
# own layout, no repack: lane (g, t) loads 32 consecutive bytes of W rows g and g + 8 a step of 128 columns (one scale
# block); its word i is mma step i's A registers (bytes 0-1: A columns 2t, 2t + 1; bytes 2-3: 2t + 8, 2t + 9), and its
# B registers are the same 4 x values of token g (B column g), so the mma's K order, free as long as A and B agree,
# is the bytes' own. E4M3 -> bf16 x 2^-120 in 3 integer instructions a pair, x x 2^64 as in the MXFP4 kernels; the
# accumulator's column n is token n: lane (g, t) ends with rows g, g + 8 of tokens 2t, 2t + 1. At one token the
# stream is as fast (NOTES run 61) and fuses x's norm or SwiGLU, so it keeps M = 1. Limits as the MXFP4 kernels'.


@triton.jit
def _ld16x(ptr):
    """16 bytes as 4 words, cached (x: every program of the launch reads it)."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _e4m3_bf16x2(w):
    """A word's 4 E4M3 bytes -> bf16 pairs (bytes 0, 1) and (2, 3) of value x 2^-120: each byte with its sign
    replicated into the byte above (prmt), shifted left 4 and masked, puts s at bit 15 and eeee|mmm at 10..4."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; prmt.b32 a, $2, $2, 0x9180; prmt.b32 b, $2, $2, 0xB3A2; shl.b32 a, a, 4; "
        "shl.b32 b, b, 4; and.b32 $0, a, 0x87F087F0; and.b32 $1, b, 0x87F087F0; }",
        "=r,=r,r", [w], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _fp8_mma_load(wp, wp8, k):
    """The lane's 16 words of the step at column k: 32 bytes of row g (wp) and of row g + 8 (wp8), the pointers
    already at the lane's 32 t bytes."""
    return _ld16(wp + k) + _ld16(wp + k + 16) + _ld16(wp8 + k) + _ld16(wp8 + k + 16)


@triton.jit
def _fp8_mma_x(xp, keep):
    """The lane's 16 B registers of a step: its token's 32 x values at xp times 2^64, zero where not keep."""
    r = ()
    for j in tl.static_range(4):
        x0, x1, x2, x3 = _x_2_64(*_ld16x(xp + 8 * j))
        z = tl.zeros_like(x0)
        r = r + (tl.where(keep, x0, z), tl.where(keep, x1, z), tl.where(keep, x2, z), tl.where(keep, x3, z))
    return r


@triton.jit
def _fp8_mma_store(y_ptr, at, stride_ym, m, M, v):
    tl.store(y_ptr + m * stride_ym + at, v.to(y_ptr.dtype.element_ty), mask=m < M)


@triton.jit
def fp8_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr, M, R, K, stride_xm, stride_xg, stride_wn,
                   stride_sn, stride_ym, stride_yg, stride_ps, K_CHUNK, SPLIT: tl.constexpr, SPLITP: tl.constexpr):
    """M <= 8 tokens, one warp a program: (16-row tile c, K part sk, group grp) streams W's rows grp * R + 16 c ..
    over [sk K_CHUNK, +K_CHUNK) in steps of 128 columns, the next step's loads issued before this one's mma.
    y[m, grp, rows] in y's dtype; SPLIT > 1: the partials ([SPLIT, M, G, R] fp32 at part_ptr, y's strides after
    the first) are added by the last to arrive."""
    c = tl.program_id(0)
    sk = tl.program_id(1)
    grp = tl.program_id(2)
    lane, g, t, _, _ = _lane_roles()
    row0 = grp * R + c * 16
    k_lo = sk * K_CHUNK
    steps = (tl.minimum(K - k_lo, K_CHUNK)) // 128
    wp = w_ptr + ((row0 + g).to(tl.int64) * stride_wn + k_lo + t * 32)
    wp8 = wp + 8 * stride_wn
    keep = g < M  # B column g is token g
    xp = x_ptr + (tl.minimum(g, M - 1).to(tl.int64) * stride_xm + grp * stride_xg + k_lo + t * 32)
    sp = s_ptr + ((row0 // 128) * stride_sn + k_lo // 128)
    nxt = _fp8_mma_load(wp, wp8, 0)
    z = tl.zeros((32,), dtype=tl.float32)
    top0, top1, bot0, bot1 = z, z, z, z
    two56 = 72057594037927936.0  # undoes E4M3 x 2^-120 and x x 2^64 before the scale: no exponent wraps
    for i in range(steps):
        cur = nxt
        nxt = _fp8_mma_load(wp, wp8, tl.minimum(i + 1, steps - 1) * 128)  # the last step reloads (unused)
        xb = _fp8_mma_x(xp + i * 128, keep)
        q0, q1, q2, q3 = z, z, z, z
        for j in tl.static_range(8):
            a0, a2 = _e4m3_bf16x2(cur[j])
            a1, a3 = _e4m3_bf16x2(cur[8 + j])
            q0, q1, q2, q3 = _mma_bf16(a0, a1, a2, a3, xb[2 * j], xb[2 * j + 1], q0, q1, q2, q3)
        sc = _e8m0(tl.load(sp + i), 0)  # applied after two56 (folded first, scales from 2^72 up would overflow)
        top0 += q0 * two56 * sc
        top1 += q1 * two56 * sc
        bot0 += q2 * two56 * sc
        bot1 += q3 * two56 * sc
    at = grp * stride_yg + c * 16 + g
    dst = y_ptr if SPLIT == 1 else part_ptr + sk * stride_ps  # y, or this part's fp32 partials
    _fp8_mma_store(dst, at, stride_ym, 2 * t, M, top0)
    _fp8_mma_store(dst, at, stride_ym, 2 * t + 1, M, top1)
    _fp8_mma_store(dst, at + 8, stride_ym, 2 * t, M, bot0)
    _fp8_mma_store(dst, at + 8, stride_ym, 2 * t + 1, M, bot1)
    if SPLIT > 1:
        tl.debug_barrier()
        lock_at = lock_ptr + c + tl.num_programs(0) * grp
        if tl.atomic_add(lock_at, 1, sem="acq_rel") == SPLIT - 1:
            # the last K part to arrive adds the partials by one fixed tree. Its tensors are made afresh (not from
            # the lane-role ones, whose layout must stay one element a lane: a 2-D use would re-lay them)
            q = tl.arange(0, SPLITP)[:, None, None]
            m = tl.arange(0, 8)[None, :, None]
            rows = grp * stride_yg + c * 16 + tl.arange(0, 16)[None, None, :]
            ok = (q < SPLIT) & (m < M)
            parts = tl.load(part_ptr + q * stride_ps + m * stride_ym + rows, mask=ok, other=0.0, cache_modifier=".cg")
            m2 = tl.arange(0, 8)[:, None]
            tl.store(y_ptr + m2 * stride_ym + grp * stride_yg + c * 16 + tl.arange(0, 16)[None, :],
                     tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=m2 < M)
            tl.atomic_xchg(lock_at, 0)
