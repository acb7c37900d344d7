"""Does a weight asked into the L2 while the decode chain is latency-bound read faster afterwards?

In a decode step the big FP8 weights (wq_b, wo_a, wo_b: 33.6 MB each) follow short latency-bound kernels
(attention, norms, mHC) during which DRAM is mostly idle. Here, in one CUDA graph per variant, a spin kernel of F
us (`torch.cuda._sleep`: no memory traffic) stands for that phase and wo_a's grouped FP8 stream follows it, over
weight sets rotated beyond the 60 MB L2:
  plain     sleep(F) -> wo_a
  prefetch  sleep(F) -> wo_a, with a side-stream kernel forked at the sleep's start that asks the L2 for wo_a's
            bytes (`cp.async.bulk.prefetch.L2.global`, sm_90: one instruction a 64 KB chunk, no registers)
  sleep     sleep(F) alone
wo_a's effective time is (variant - sleep). Also wo_a read twice in a row (the second from the L2). sm_90 only.

    python bench/probe_l2_prefetch.py [--out DIR]     # on the GPU machine (~1 min)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

CHUNK = 1 << 16


@triton.jit
def l2_prefetch_kernel(ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks the L2 for one CHUNK of the n_bytes at ptr (16-byte aligned, n_bytes a multiple of 16)."""
    off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - off, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_line_kernel(ptr, n_bytes, per_prog, out_ptr, MODE: tl.constexpr, LANES: tl.constexpr):
    """MODE 1 / 2: one `prefetch.global.L2::evict_last` / `prefetch.global.L2` a 128-byte line; MODE 3: read every
    byte (16 bytes a lane a step) and keep a sum, so the loads stay."""
    base = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros((LANES,), dtype=tl.int32)
    if MODE == 3:
        step = LANES * 16
    else:
        step = LANES * 128
    for o in range(0, per_prog, step):
        if MODE == 3:
            off = base + o + tl.arange(0, LANES).to(tl.int64) * 16
            p = (ptr + off).to(tl.pointer_type(tl.int32), bitcast=True)
            ok = off < n_bytes
            v = tl.load(p, mask=ok, other=0) + tl.load(p + 1, mask=ok, other=0) + tl.load(p + 2, mask=ok, other=0) \
                + tl.load(p + 3, mask=ok, other=0)
            acc += v
        else:
            off = base + o + tl.arange(0, LANES).to(tl.int64) * 128
            ok = (off < n_bytes).to(tl.int32)
            if MODE == 1:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [ptr + off, ok], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [ptr + off, ok], dtype=tl.int32, is_pure=False, pack=1)
    if MODE == 3:
        tot = tl.sum(acc, axis=0)
        tl.store(out_ptr, tot, mask=tot == 123456789)


SINK = {}


def prefetch(t: torch.Tensor, mode: int, programs: int) -> None:
    n = t.numel() * t.element_size()
    if mode == 0:
        lanes = 32
        l2_prefetch_kernel[(triton.cdiv(n, CHUNK * lanes),)](t, n, CHUNK=CHUNK, LANES=lanes, num_warps=1)
        return
    sink = SINK.setdefault(t.device, torch.zeros(1, dtype=torch.int32, device=t.device))
    per = triton.cdiv(triton.cdiv(n, programs), 1 << 14) << 14
    l2_line_kernel[(triton.cdiv(n, per),)](t, n, per, sink, MODE=mode, LANES=128, num_warps=4)


def graph_us(body, sets: int) -> float:
    """Median us per set of body(i), every set in one replayed graph (bench_kernels.time_graph_ms)."""
    return B.time_graph_ms(body, [(i,) for i in range(sets)]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fill-us", type=float, nargs="*", default=[4.0, 8.0, 12.0, 20.0])
    ap.add_argument("--modes", nargs="*", default=["0", "1:32", "2:32", "3:32", "3:132"],
                    help="MODE[:programs]: 0 bulk, 1 line evict_last, 2 line, 3 read")
    a = ap.parse_args()
    tri = B.tri
    sets = 8
    ws = [B.fp8_weight(8 * 1024, 4096) for _ in range(sets)]
    xs = [torch.randn(1, 8, 4096, device="cuda", generator=B.GEN).to(torch.bfloat16) for _ in range(sets)]
    side = torch.cuda.Stream()
    hz = torch.cuda.get_device_properties(0).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1.98e9
    copy = B.copy_tbps()
    nbytes = ws[0].data.numel() + ws[0].scale.numel()
    outs = {}

    def wo_a(i: int, key: str) -> None:
        outs[key, i] = tri.grouped_linear(xs[i], ws[i], 8)

    res = {"copy_TBps": copy, "bytes": nbytes, "rows": []}
    ref = [tri.grouped_linear(xs[i], ws[i], 8).float() for i in range(sets)]
    res["alone_us"] = graph_us(lambda i: wo_a(i, "alone"), sets)

    def twice(i: int) -> None:  # the second read finds the set's 33.6 MB in the L2 (60 MB)
        wo_a(i, "alone")
        wo_a(i, "twice")

    res["second_read_us"] = graph_us(twice, sets) - res["alone_us"]
    print(f"wo_a from DRAM {res['alone_us']:.2f} us, read again right after {res['second_read_us']:.2f} us", flush=True)

    def sleep(cycles: int, i: int) -> None:
        torch.cuda._sleep(cycles)

    def plain(cycles: int, i: int) -> None:
        torch.cuda._sleep(cycles)
        wo_a(i, "plain")

    def fetched(mode: str, cycles: int, i: int) -> None:
        m, _, progs = mode.partition(":")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch(ws[i].data, int(m), int(progs or 32))
        torch.cuda._sleep(cycles)
        torch.cuda.current_stream().wait_stream(side)
        wo_a(i, "prefetch " + mode)

    for fill in a.fill_us:
        cycles = int(fill * 1e-6 * hz)
        row = {"fill_us": fill, "sleep_us": graph_us(functools.partial(sleep, cycles), sets)}
        variants = [("plain", functools.partial(plain, cycles))]
        variants += [("prefetch " + m, functools.partial(fetched, m, cycles)) for m in a.modes]
        for _ in range(2):  # interleaved rounds
            for name, body in variants:
                row.setdefault(name + "_us", []).append(graph_us(body, sets))
        for name, _ in variants:
            row[name + "_wo_a_us"] = min(row[name + "_us"]) - row["sleep_us"]
        row["same_output"] = all(torch.equal(outs[name, i].float(), ref[i]) for name, _ in variants
                                 for i in range(sets))
        res["rows"].append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                          if not isinstance(v, list)}), flush=True)
    print(f"wo_a alone {res['alone_us']:.2f} us ({nbytes / res['alone_us'] / 1e6 / copy:.3f} of copy {copy:.2f} TB/s)")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_l2_prefetch.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
