"""Does the one-token FP8 stream lose to a read-only launch (0.74 against 0.82-0.84 of copy at wq_b's 33.6 MB) by
its weight layout, by its work or by its load structure? One small stream kernel, timed in two layouts of the same
bytes and five modes, beside the engine's own launch at the same tile (which narrows row tiles to 16 where fewer
than MIN_PROGRAMS programs would run, as on wo_a's 8192 rows: its rows are then not the same tile):

- layout `row`: the checkpoint's row-major W, each step reading BLOCK_N pieces of BLOCK_K bytes a row apart (as
  the engine does); `blocked`: W stored tile by tile, [R / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K], so each step
  reads one contiguous BLOCK_N x BLOCK_K run (the read probe's best shapes: 2-16 KB a step);
- mode `full`: decode, x * block scale, fp32 FMAs, LOCAL adjacent products summed in the thread (the engine's
  work); `no_x`: the same with x = 1 (no x load; the scales still change layout a step); `x_same`: x's first
  BLOCK_K values at every step (the same lines); `bytes`: the weight bytes widened to int32 and summed as the full
  work sums its products (no decode or x, but a byte unpack a code); `words`: the weight loaded as int32 words and
  summed as they are (the read probe's own work, the loads nearly alone);
- PIPE 1: the next step's loads before this step's work; PIPE 2: only its x and scales;
- `--rows`: other structures, whole rows a step with x times the scales loaded once a program (`rows_kernel`, a
  reduction a step; `rows_defer_kernel`, 2 or 4 steps reduced once).
Every form's output is checked (against float64, or the integer row sums). NOTES runs 214-224.

    python bench/probe_fp8_blocked.py [--out DIR]      # on the GPU machine (~1 min)
    python bench/probe_fp8_blocked.py --tiles 8,256,1 4,512,1 --modes full,words --pipe 0,2 --shapes wq_b
    python bench/probe_fp8_blocked.py --layouts row --modes full --tiles 32,256,4 --rows 8,4,4 2,4,1
    TRITON_INTERPRET=1 python bench/probe_fp8_blocked.py --small --out /tmp/p   # CPU smoke run, checks only
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

from cdna2_engine.ops.triton.kernels.base import _e8m0  # noqa: E402

SHAPES = [("wq_b", 32768, 1024), ("wo_a flat", 8192, 4096)]  # (name, R, K): the two one-token FP8 goals' bytes
if B.SMALL:  # CPU smoke run (--small): the interpreter, small shapes
    SHAPES = [("wq_b", 256, 512), ("wo_a flat", 128, 1024)]
TILES = [(32, 256, 4), (16, 512, 4), (8, 1024, 4), (64, 256, 8), (32, 512, 8), (16, 1024, 8)]
LOCAL = 16
MODES = {"full": 0, "no_x": 1, "bytes": 2, "words": 3, "x_same": 4}


@triton.jit
def _step(w_at, x_ptr, s_at, i, n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WK: tl.constexpr,
          MODE: tl.constexpr, step, MASK: tl.constexpr):
    """Step i's raw loads (MASK: nothing from step n on): W bytes (MODE 3: int32 words), and for MODEs 0-1 the
    block scales of its columns and (MODE 0) x."""
    okw = ((i * WK + tl.arange(0, WK)) < n * WK)[None, :] & (tl.arange(0, BLOCK_N) >= 0)[:, None]
    if MASK:
        wb = tl.load(w_at + i * step, mask=okw, other=0)
    else:
        wb = tl.load(w_at + i * step)
    s, x = _xs_step(x_ptr, s_at, i, n, BLOCK_K, MODE, MASK)
    return wb, s, x


@triton.jit
def _xs_step(x_ptr, s_at, i, n, BLOCK_K: tl.constexpr, MODE: tl.constexpr, MASK: tl.constexpr):
    """Step i's block scales (MODEs 0, 1, 4) and x (MODE 0; MODE 4: x's first BLOCK_K values at every step)."""
    k = i * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (k < n * BLOCK_K) | (not MASK)  # MASK False: all true, folded away
    if MODE <= 1 or MODE == 4:
        s = tl.load(s_at + k // 128, mask=ok, other=0)
    else:
        s = tl.zeros((BLOCK_K,), dtype=tl.uint8)
    if MODE == 0:
        x = tl.load(x_ptr + k, mask=ok, other=0.0)
    elif MODE == 4:
        x = tl.load(x_ptr + tl.arange(0, BLOCK_K))
    else:
        x = tl.zeros((BLOCK_K,), dtype=tl.bfloat16)
    return s, x


@triton.jit
def _use(acc, wb, s, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOCAL: tl.constexpr, MODE: tl.constexpr):
    if MODE == 2:
        acc += tl.sum(tl.reshape(wb.to(tl.int32), (BLOCK_N, BLOCK_K // LOCAL, LOCAL)), axis=2)
    elif MODE == 3:
        acc += wb
    else:
        xs = _e8m0(s, 0)
        if MODE == 0 or MODE == 4:
            xs = xs * x.to(tl.float32)
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc += tl.sum(tl.reshape(w * xs[None, :], (BLOCK_N, BLOCK_K // LOCAL, LOCAL)), axis=2)
    return acc


@triton.jit
def stream_kernel(x_ptr, w_ptr, s_ptr, y_ptr, K, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  LOCAL: tl.constexpr, BLOCKED: tl.constexpr, MODE: tl.constexpr, PIPE: tl.constexpr):
    """y[r] = sum_k W[r, k] * x[k] * scale for program p's BLOCK_N rows (MODE 0); MODE 1 leaves x out, MODE 2
    sums the bytes, MODE 3 the int32 words (w_ptr then addresses words: the read probe's work), MODE 4 reads x's
    first BLOCK_K values at every step (the same lines, x = x[:BLOCK_K] tiled). BLOCKED: program p's rows are
    stored as K / BLOCK_K contiguous tiles. PIPE 1: step i + 1's loads issued before step i's work; PIPE 2: only
    its x and scales (a few registers: x in its 1-D layout, BLOCK_K / (32 x warps) values a thread)."""
    p = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    WK: tl.constexpr = BLOCK_K // 4 if MODE == 3 else BLOCK_K  # W elements a row a step
    c = tl.arange(0, WK)
    KW = K // 4 if MODE == 3 else K
    if BLOCKED:
        w_at = w_ptr + p.to(tl.int64) * BLOCK_N * KW + r[:, None] * WK + c[None, :]
        step = BLOCK_N * WK
    else:
        w_at = w_ptr + (p * BLOCK_N + r).to(tl.int64)[:, None] * KW + c[None, :]
        step = WK
    s_at = s_ptr + (p * BLOCK_N // 128) * stride_sn
    if MODE == 3:
        acc = tl.zeros((BLOCK_N, WK), dtype=tl.int32)
    elif MODE == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_K // LOCAL), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // LOCAL), dtype=tl.float32)
    n = K // BLOCK_K
    if PIPE == 2:
        s, x = _xs_step(x_ptr, s_at, 0, n, BLOCK_K, MODE, False)
        for i in range(0, n):
            wb = tl.load(w_at + i * step)
            ns, nx = _xs_step(x_ptr, s_at, i + 1, n, BLOCK_K, MODE, True)
            acc = _use(acc, wb, s, x, BLOCK_N, BLOCK_K, LOCAL, MODE)
            s, x = ns, nx
    elif PIPE:
        wb, s, x = _step(w_at, x_ptr, s_at, 0, n, BLOCK_N, BLOCK_K, WK, MODE, step, False)
        for i in range(0, n):
            nwb, ns, nx = _step(w_at, x_ptr, s_at, i + 1, n, BLOCK_N, BLOCK_K, WK, MODE, step, True)
            acc = _use(acc, wb, s, x, BLOCK_N, BLOCK_K, LOCAL, MODE)
            wb, s, x = nwb, ns, nx
    else:
        for i in range(0, n):
            wb, s, x = _step(w_at, x_ptr, s_at, i, n, BLOCK_N, BLOCK_K, WK, MODE, step, False)
            acc = _use(acc, wb, s, x, BLOCK_N, BLOCK_K, LOCAL, MODE)
    tl.store(y_ptr + p * BLOCK_N + r, tl.sum(acc, axis=1).to(tl.float32))


@triton.jit
def rows_kernel(x_ptr, w_ptr, s_ptr, y_ptr, stride_sn, K: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr,
                MODE: tl.constexpr):
    """Whole rows a step, several steps a program: program p's ROWS x STEPS rows (inside one 128-row scale block)
    in STEPS steps of ROWS whole rows, each step one contiguous ROWS x K run; x times the block scales (the same
    for every row of the block) loaded once before the loop, so a step only loads, decodes and sums W (MODE 0).
    MODE 3: the int32 words summed (w_ptr addresses words), the loads alone."""
    p = tl.program_id(0)
    row0 = p * ROWS * STEPS
    r = tl.arange(0, ROWS)
    if MODE == 3:
        kw = tl.arange(0, K // 4)
        for i in range(STEPS):
            rows = row0 + i * ROWS + r
            wb = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (K // 4) + kw[None, :])
            tl.store(y_ptr + rows, tl.sum(wb, axis=1).to(tl.float32))
    else:
        kk = tl.arange(0, K)
        xs = _e8m0(tl.load(s_ptr + (row0 // 128) * stride_sn + kk // 128), 0) * tl.load(x_ptr + kk).to(tl.float32)
        for i in range(STEPS):
            rows = row0 + i * ROWS + r
            wb = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :])
            w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            tl.store(y_ptr + rows, tl.sum(w * xs[None, :], axis=1))


@triton.jit
def _rows_part(w_ptr, rows, kk, xs, K: tl.constexpr, ROWS: tl.constexpr, LOCAL: tl.constexpr):
    """One step of rows_defer_kernel: ROWS whole rows decoded and times xs, LOCAL adjacent products summed."""
    wb = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :])
    w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(tl.reshape(w * xs[None, :], (ROWS, K // LOCAL, LOCAL)), axis=2)


@triton.jit
def rows_defer_kernel(x_ptr, w_ptr, s_ptr, y_ptr, stride_sn, K: tl.constexpr, ROWS: tl.constexpr,
                      STEPS: tl.constexpr, LOCAL: tl.constexpr):
    """rows_kernel's steps (whole rows, x times the scales loaded once) written out, STEPS = 2 or 4, each step's
    in-thread partial kept apart and all reduced across threads once at the end (tl.join stacks them)."""
    p = tl.program_id(0)
    row0 = p * ROWS * STEPS
    r = tl.arange(0, ROWS)
    kk = tl.arange(0, K)
    xs = _e8m0(tl.load(s_ptr + (row0 // 128) * stride_sn + kk // 128), 0) * tl.load(x_ptr + kk).to(tl.float32)
    a0 = _rows_part(w_ptr, row0 + r, kk, xs, K, ROWS, LOCAL)
    a1 = _rows_part(w_ptr, row0 + ROWS + r, kk, xs, K, ROWS, LOCAL)
    tl.static_assert(STEPS == 2 or STEPS == 4)
    if STEPS == 4:
        a2 = _rows_part(w_ptr, row0 + 2 * ROWS + r, kk, xs, K, ROWS, LOCAL)
        a3 = _rows_part(w_ptr, row0 + 3 * ROWS + r, kk, xs, K, ROWS, LOCAL)
        y = tl.sum(tl.join(tl.join(a0, a1), tl.join(a2, a3)), axis=1)  # [ROWS, i, j]: step 2 j + i
        i = tl.arange(0, 2)[None, :, None]
        j = tl.arange(0, 2)[None, None, :]
        tl.store(y_ptr + row0 + (2 * j + i) * ROWS + r[:, None, None], y)
    else:
        y = tl.sum(tl.join(a0, a1), axis=1)  # [ROWS, i]: step i
        tl.store(y_ptr + row0 + tl.arange(0, 2)[None, :] * ROWS + r[:, None], y)


def blocked(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """W [R, K] bytes stored tile by tile: [R / bn, K / bk, bn, bk] contiguous."""
    r, k = w.shape
    return w.view(r // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiles", nargs="*", help="BLOCK_N,BLOCK_K,warps each (default: TILES)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default: all)")
    ap.add_argument("--shapes", help="comma-separated shape names (default: all)")
    ap.add_argument("--layouts", default="row,blocked", help="comma-separated layouts (default: row,blocked)")
    ap.add_argument("--pipe", default="0", help="comma-separated PIPE values (0: none, 1: the next step's loads "
                                                 "first, 2: only its x and scales)")
    ap.add_argument("--small", action="store_true", help="CPU smoke run: interpreter, small shapes (read at import)")
    ap.add_argument("--rows", nargs="*", default=[], help="ROWS,STEPS,warps each: rows_kernel's forms (full and "
                                                            "words; rows_defer_kernel's at 2, 4 steps) after the tiles")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles] if a.tiles else TILES
    modes = {m: MODES[m] for m in a.modes.split(",")}
    shapes = [s for s in SHAPES if s[0] in a.shapes.split(",")] if a.shapes else SHAPES
    tri = B.tri
    copy = B.copy_tbps()
    saved, saved_long = dict(tri.FP8_STREAM), tri.FP8_STREAM_LONG["min_k"]
    tri.FP8_STREAM_LONG["min_k"] = 1 << 62  # the engine's launch at each tile as given
    runs = []
    for name, r, k in shapes:
        copies = 2 if B.SMALL else max(2, -(-240_000_000 // (r * k)))
        ws = [B.fp8_weight(r, k) for _ in range(copies)]
        xs = [torch.randn(1, k, device=B.DEV, dtype=B.ACT) for _ in range(copies)]
        nbytes = ws[0].nbytes() + k * 2 + r * 4
        wf = B.ref.dequantize(ws[0], torch.float64)
        wb0 = ws[0].data.view(torch.uint8)
        wants = {0: (xs[0].double() @ wf.T).flatten(), 1: wf.sum(1),  # no_x: x = 1
                 2: wb0.sum(1, dtype=torch.int64).double(),
                 3: wb0.view(torch.int32).sum(1, dtype=torch.int64).remainder(1 << 32).double()}  # int32 wraps
        # MODE 4 (x's first BLOCK_K values at every step) depends on the tile: its check is made per tile below

        def measure(tile, form, fn, args, want, words=False, name=name, nbytes=nbytes):
            """One probe form: run once on poisoned outputs, checked (fp32 sums of the same products, or an integer
            rounded once to fp32: far inside 1e-5), then timed and recorded."""
            fn(*args[0])
            got = args[0][3].double()
            if words:  # the int32 sum as fp32, read back to its residue mod 2^32
                got = got.remainder(1 << 32)
            err = B.rel(got, want)
            if not err <= 1e-5:
                raise SystemExit(f"{name} {tile} {form}: rel err {err} against its check")
            ms = B.time_graph_ms(fn, args)
            row = {"shape": name, "tile": list(tile), "form": form, "us": ms * 1e3,
                   "frac": nbytes / (ms * 1e-3) / 1e12 / copy, "rel_err": err}
            runs.append(row)
            print(f"{name:10s} {tile} {form:23s} {row['us']:7.2f} us {row['frac']:.3f}", flush=True)
        for bn, bk, nw in tiles:
            tri.FP8_STREAM.update(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, LOCAL=LOCAL, PREFETCH=False, UNROLL=1)
            ms = B.time_graph_ms(tri.linear, list(zip(xs, ws, strict=True)))
            err = B.rel(tri.linear(xs[0], ws[0]).flatten(), wants[0])
            row = {"shape": name, "tile": [bn, bk, nw], "form": "engine", "us": ms * 1e3,
                   "frac": nbytes / (ms * 1e-3) / 1e12 / copy, "rel_err": err}
            runs.append(row)
            print(f"{name:10s} {(bn, bk, nw)} {'engine':23s} {row['us']:7.2f} us {row['frac']:.3f}  err {err:.1e}",
                  flush=True)
            for lay in a.layouts.split(","):
                wl = [blocked(w.data.view(torch.uint8), bn, bk) if lay == "blocked" else w.data.view(torch.uint8)
                      for w in ws]
                ys = [torch.full((r,), float("nan"), device=B.DEV) for _ in ws]
                for (mode, m), pipe in ((mm, int(pp)) for mm in modes.items() for pp in a.pipe.split(",")):
                    def fn(x, w, s, y, m=m, lay=lay, bn=bn, bk=bk, nw=nw, r=r, k=k, pipe=pipe):
                        stream_kernel[(r // bn,)](x, w, s, y, k, s.stride(0), BLOCK_N=bn, BLOCK_K=bk, LOCAL=LOCAL,
                                                  BLOCKED=lay == "blocked", MODE=m, PIPE=pipe, num_warps=nw)

                    args = [(x, w2.view(torch.int32) if m == 3 else w2, w.scale.view(torch.uint8), y)
                            for x, w2, w, y in zip(xs, wl, ws, ys, strict=True)]
                    if m == 4:
                        wants[4] = (xs[0].double()[:, :bk].repeat(1, k // bk) @ wf.T).flatten()
                    measure((bn, bk, nw), f"{lay} {mode}" + ("", " pipe", " xpipe")[pipe], fn, args, wants[m], m == 3)
                del wl
        for rows, steps, nw in (tuple(int(v) for v in t.split(",")) for t in a.rows):
            if 128 % (rows * steps):
                raise SystemExit(f"--rows {rows},{steps}: a program's rows must divide the 128-row scale block")
            ys = [torch.full((r,), float("nan"), device=B.DEV) for _ in ws]
            forms = (("full", 0), ("words", 3)) + ((("defer", 5),) if steps in (2, 4) else ())
            for mode, m in forms:
                def fn(x, w, s, y, m=m, rows=rows, steps=steps, nw=nw, r=r, k=k):
                    if m == 5:
                        rows_defer_kernel[(r // (rows * steps),)](x, w, s, y, s.stride(0), K=k, ROWS=rows,
                                                                 STEPS=steps, LOCAL=LOCAL, num_warps=nw)
                    else:
                        rows_kernel[(r // (rows * steps),)](x, w, s, y, s.stride(0), K=k, ROWS=rows, STEPS=steps,
                                                           MODE=m, num_warps=nw)

                args = [(x, w.data.view(torch.int32) if m == 3 else w.data.view(torch.uint8),
                         w.scale.view(torch.uint8), y) for x, w, y in zip(xs, ws, ys, strict=True)]
                measure((rows, steps, nw), f"rows {rows}x{steps} {mode}", fn, args, wants[0 if m == 5 else m], m == 3)
    tri.FP8_STREAM.clear()
    tri.FP8_STREAM.update(saved)
    tri.FP8_STREAM_LONG["min_k"] = saved_long
    with open(os.path.join(a.out, "probe_fp8_blocked.json"), "w") as f:
        json.dump({"copy_TBps": copy, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
