"""H200 kernel benchmark: correctness at V4-Flash shapes first, then timings against the measured copy ceiling.

One command (repo root, on the GPU machine):  python bench/bench_kernels.py [--out DIR] [--sweep | --stream-sweep]
CPU smoke test of the whole script (Triton interpreter, tiny shapes, fp16, no timing that means anything):
    python bench/bench_kernels.py --small --sweep --out /tmp/bench_small
Writes DIR/h200.json (default bench/results/) and prints a table. Method (the device README's METHOD.md):
CUDA events around each call, median of many runs after warm-up, inputs rotated over a set larger than the
60 MB L2, copy bandwidth measured in the same run (bytes read + written of a 4 GiB device copy).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_engine():
    """cdna2_engine from this checkout even where the package is not installed (the device machine)."""
    try:
        import cdna2_engine  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "cdna2_engine", ROOT / "engine" / "__init__.py", submodule_search_locations=[str(ROOT / "engine")]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["cdna2_engine"] = mod
        spec.loader.exec_module(mod)
    from cdna2_engine.ops import QWeight
    from cdna2_engine.ops import reference as ref
    from cdna2_engine.ops import triton as tri

    return QWeight, ref, tri


QWeight, ref, tri = _import_engine()
SMALL = "--small" in sys.argv  # CPU smoke mode: the interpreter, tiny shapes, fp16 (it cannot run bf16)
DEV = "cpu" if SMALL else "cuda"
if not SMALL and not torch.cuda.is_available():  # this module and the probes built on it time GPU kernels
    raise SystemExit(f"{os.path.basename(sys.argv[0])} needs a GPU (CUDA or ROCm); --small, where the script "
                     "takes it, runs a CPU smoke test in Triton's interpreter")
GEN = torch.Generator(device=DEV)
ACT = torch.float16 if SMALL else torch.bfloat16  # activation dtype

# V4-Flash shapes (issue 3): hidden 4096, expert width 2048, 256 experts, 6 per token, 64 heads x 512,
# q_lora 1024, o_groups 8, o_lora 1024.
HID, INTER, N_EXP, TOPK = 4096, 2048, 256, 6
HEADS, HEAD_DIM, Q_LORA, O_GROUPS, O_LORA = 64, 512, 1024, 8, 1024
if SMALL:
    HID, INTER, N_EXP, TOPK = 256, 128, 8, 2
    HEADS, HEAD_DIM, Q_LORA, O_GROUPS, O_LORA = 4, 64, 128, 2, 128
L2_BYTES = 60e6
# Seconds of graph replays before each timing: the first timing of a fresh set of weights came out 4-6% slower than
# the same launch timed again right after (bench/probe_fp8_blocked.py, NOTES run 216), and not with these replays
# (run 218). Not the clocks: after 1 s of idle, 0-2 s of replays moved a timing less than run-to-run noise (run 220).
WARM_S = 0.05
MOE_TOKENS = (1, 4) if SMALL else (1, 4, 8, 16, 64)  # the MoE's token counts (issue 3: M = 1, 4, 16, 64; 8:
# MOE_MMA's TWO_MIN_T)
HEAD_ROWS = (5,) if SMALL else (2, 4, 8, 16)  # the head at a batched step's rows: tensor cores, stream, reference
FP8_ROWS = (2,) if SMALL else (2, 4, 8, 16)  # wq_b at a batched decode step's rows, stream and tensor-core forms


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def fp8_weight(n: int, k: int) -> QWeight:
    """Random E4M3 codes (NaN codes avoided) and UE8M0 scales near 2^-8: fresh data, not zeros."""
    b = torch.randint(0, 256, (n, k), device=DEV, dtype=torch.int32, generator=GEN)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    s = torch.randint(116, 124, (-(-n // 128), -(-k // 128)), device=DEV, dtype=torch.int32, generator=GEN)
    return QWeight(b.view(torch.float8_e4m3fn), s.to(torch.uint8).view(torch.float8_e8m0fnu), "fp8")


def fp4_weight(e: int, n: int, k: int) -> QWeight:
    b = torch.randint(-128, 128, (e, n, k // 2), device=DEV, dtype=torch.int32, generator=GEN).to(torch.int8)
    s = torch.randint(118, 124, (e, n, k // 32), device=DEV, dtype=torch.int32, generator=GEN)
    return QWeight(b, s.to(torch.uint8).view(torch.float8_e8m0fnu), "mxfp4")


def _time_cpu(fn, args_list) -> float:
    t0 = time.perf_counter()
    for a in args_list[:2]:
        fn(*a)
    return (time.perf_counter() - t0) * 1e3 / min(2, len(args_list))


def time_ms(fn, args_list, reps: int = 200, warmup: int = 10) -> float:
    """Median ms of fn(*args) over reps, cycling through args_list (rotates inputs beyond the L2)."""
    if SMALL:
        return _time_cpu(fn, args_list)
    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        a = args_list[i % len(args_list)]
        starts[i].record()
        fn(*a)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def time_graph_ms(fn, args_list, replays: int = 30) -> float:
    """Median ms per call with the host out of the way: one CUDA graph holds one call per input set (the
    sets rotate beyond the L2), replayed `replays` times, each replay timed by events. Triton's Python
    launch costs tens of microseconds, more than these kernels take, so eager per-call events time the
    host; the graph times the GPU (the launch gaps left between kernels in a graph are counted)."""
    if SMALL:
        return _time_cpu(fn, args_list)
    for a in args_list[:2]:
        fn(*a)  # compile and warm
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in args_list[:2]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args_list:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARM_S:  # the first timing of fresh weights is slow (runs 216, 218)
        graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / len(args_list))
    del graph
    return statistics.median(times)


def copy_tbps() -> float:
    n = 1 << (20 if SMALL else 31)  # 2 GiB each way
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV, generator=GEN)
    dst = torch.empty_like(src)
    ms = time_ms(lambda a, b: b.copy_(a), [(src, dst)], reps=30, warmup=3)
    return 2 * n / (ms * 1e-3) / 1e12


def check(results: dict, name: str, err: float, tol: float = 1e-2) -> None:
    ok = err <= tol
    results["checks"][name] = {"rel_frobenius": err, "tol": tol, "ok": ok}
    print(f"check {name:40s} rel={err:.2e} tol={tol:g} {'ok' if ok else 'FAIL'}", flush=True)


def probe_done(out_dir: str, name: str, rows: list, results: dict, **extra: object) -> None:
    """A probe's end: its rows and checks in out_dir/name.json, then, since its timings count only when its
    outputs were right, a non-zero exit naming any failed check."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **extra, "rows": rows, "checks": results["checks"]}, f,
                  indent=1)
    failed = [k for k, c in results["checks"].items() if not c["ok"]]
    if failed:
        sys.exit(f"{len(failed)} check(s) failed: {', '.join(failed)}")


def correctness(results: dict, streams_only: bool = False) -> None:
    """Every kernel against the float64 reference (streams_only: the FP8 linears and the MoE only)."""
    # fp8 linear (wq_b) decode and prefill, grouped wo_a
    w = fp8_weight(HEADS * HEAD_DIM, Q_LORA)
    for m in (1, 3, 8, 64):  # M = 3, 8: the few-token tensor-core kernel (FP8_MMA), and the tile FP8_DOT without it
        x = torch.randn(m, Q_LORA, device=DEV, dtype=ACT, generator=GEN)
        check(results, f"fp8_linear wq_b M={m}", rel(tri.linear(x, w), ref.linear(x.double(), w)))
        if 1 < m <= 8:
            mma0, tri.FP8_MMA["on"] = tri.FP8_MMA["on"], False
            check(results, f"fp8_linear wq_b M={m} dot", rel(tri.linear(x, w), ref.linear(x.double(), w)))
            tri.FP8_MMA["on"] = mma0
    x = torch.randn(1, Q_LORA, device=DEV, dtype=ACT, generator=GEN)
    saved = dict(tri.FP8_STREAM)
    for hw in (False, True):  # the stream kernel's bit decode and hardware E4M3 conversion (forced)
        for un in (1, 2):
            for pf in (False, True):  # and its register double buffering (W as words; HW then inline PTX)
                tri.FP8_STREAM.update(HW=hw, UNROLL=un, PREFETCH=pf)
                check(results, f"fp8_linear wq_b M=1 stream hw={hw} unroll={un} prefetch={pf}",
                      rel(tri.linear(x, w), ref.linear(x.double(), w)))
    tri.FP8_STREAM.update(saved)
    tri.FP8_STREAM_MAX_M, saved_m = 0, tri.FP8_STREAM_MAX_M
    check(results, "fp8_linear wq_b M=1 via dot (old path)", rel(tri.linear(x, w), ref.linear(x.double(), w)))
    tri.FP8_STREAM_MAX_M = saved_m
    kg = HEADS * HEAD_DIM // O_GROUPS
    wo = fp8_weight(O_GROUPS * O_LORA, kg)
    for m in (1, 4, 33):
        x = torch.randn(m, O_GROUPS, kg, device=DEV, dtype=ACT, generator=GEN)
        got = tri.grouped_linear(x, wo, O_GROUPS)
        check(results, f"fp8_grouped wo_a M={m}", rel(got, ref.grouped_linear(x.double(), wo, O_GROUPS)))
        if m == 1:  # the prefetching stream split along K (its next-tile loads stop at each split's end)
            tri.FP8_STREAM.update(PREFETCH=True)
            got = tri.grouped_linear(x, wo, O_GROUPS)
            tri.FP8_STREAM.update(saved)
            check(results, "fp8_grouped wo_a M=1 prefetch", rel(got, ref.grouped_linear(x.double(), wo, O_GROUPS)))
    # MoE on 16 experts (the reference decodes each selected expert in float64)
    e = 16
    w1, w3, w2 = fp4_weight(e, INTER, HID), fp4_weight(e, INTER, HID), fp4_weight(e, HID, INTER)
    for t in (1, 5, 64) + (() if SMALL else (400,)):  # 400 tokens: 150 pairs an expert, 128-row blocks
        x = torch.randn(t, HID, device=DEV, dtype=ACT, generator=GEN)
        idx = torch.stack([torch.randperm(e, device=DEV, generator=GEN)[:TOPK] for _ in range(t)])
        wt = torch.rand(t, TOPK, device=DEV, generator=GEN)
        want = ref.moe_experts(x.double(), w1, w3, w2, idx, wt.double(), 10.0)
        saved_st, saved_mma, saved_dot = dict(tri.MOE_STREAM), dict(tri.MOE_MMA), dict(tri.MOE_DOT)
        # the per-pair forms (up to MOE_PAIRS_MAX_T tokens): the stream, with register double buffering and/or the
        # inline-PTX E2M1 decode (CUDA only), and the tensor-core kernels (CUDA sm_80+, bf16: the stream in --small)
        # at their token-count splits and two fixed ones
        off = dict(on=False)
        one = [("stream", dict(PREFETCH=False, PRMT=False), off),
               ("stream prefetch", dict(PREFETCH=True, PRMT=False), off),
               ("stream prmt", dict(PREFETCH=False, PRMT=True), off),
               ("stream prefetch prmt", dict(PREFETCH=True, PRMT=True), off),
               ("mma", {}, dict(on=True)),
               ("mma splits 4,2", {}, dict(on=True, SPLITS=((1, 4, 2),))),
               ("mma splits 2,4", {}, dict(on=True, SPLITS=((1, 2, 4),))),
               ("mma one pair a row", {}, dict(on=True, TWO_MIN_T=1 << 30))]
        dots = [("dot", {}, off), ("dot noswap", {}, off)]  # the grouped tl.dot blocks, MOE_DOT's SWAP on and off
        for variant, stream, mma in (one if t <= min(tri.MOE_PAIRS_MAX_T.values()) else []) + dots:
            tri.MOE_STREAM.update(saved_st, on=not variant.startswith("dot"), **stream)
            tri.MOE_MMA.update(saved_mma, **mma)
            tri.MOE_DOT.update(saved_dot, SWAP=saved_dot.get("SWAP", False) and variant != "dot noswap")
            check(results, f"moe_experts T={t} {variant}", rel(tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), want))
        tri.MOE_STREAM.update(saved_st)
        tri.MOE_MMA.update(saved_mma)
        tri.MOE_DOT.update(saved_dot)
    if streams_only:
        return
    x = torch.randn(7, HID, device=DEV, dtype=ACT, generator=GEN)
    g = torch.randn(HID, device=DEV, dtype=ACT, generator=GEN)
    check(results, "rms_norm D=4096", rel(tri.rms_norm(x, g, 1e-6), ref.rms_norm(x.double(), g.double(), 1e-6)))
    x = torch.randn(2, 5, HEADS, HEAD_DIM, device=DEV, dtype=ACT, generator=GEN)
    ang = torch.rand(2, 5, 32, device=DEV, generator=GEN) * 6
    for inv in (False, True):
        check(results, f"rope inverse={inv}",
              rel(tri.rope(x, ang.cos(), ang.sin(), inv), ref.rope(x.double(), ang.cos().double(),
                                                                    ang.sin().double(), inv)))
    for s, ln in ((1, 1000), (17, 300)):
        q = torch.randn(2, s, HEADS, HEAD_DIM, device=DEV, dtype=ACT, generator=GEN)
        kv = torch.randn(2, ln, HEAD_DIM, device=DEV, dtype=ACT, generator=GEN)
        sink = torch.randn(HEADS, device=DEV, generator=GEN)
        mask = torch.rand(2, s, ln, device=DEV, generator=GEN) > 0.2
        sc = HEAD_DIM**-0.5
        want = ref.attention(q.double(), kv.double(), sink.double(), mask, sc)
        check(results, f"attention S={s} L={ln}", rel(tri.attention(q, kv, sink, mask, sc), want))
        ang = torch.rand(2, s, 32, device=DEV, dtype=torch.float64, generator=GEN) * 100  # the model's form
        rot = (ang.cos(), ang.sin())
        want = ref.attention(q.double(), kv.double(), sink.double(), mask, sc, rot)
        check(results, f"attention S={s} L={ln} rotary", rel(tri.attention(q, kv, sink, mask, sc, rot), want))
    q = torch.randn(1, 9, 64, 128, device=DEV, dtype=ACT, generator=GEN)
    k = torch.randn(1, 777, 128, device=DEV, dtype=ACT, generator=GEN)
    wi = torch.randn(1, 9, 64, device=DEV, dtype=ACT, generator=GEN)
    want = ref.index_scores(q.double(), k.double(), wi.double(), 0.1)
    check(results, "index_scores T=777", rel(tri.index_scores(q, k, wi, 0.1), want))


def moe_pair(w1: QWeight, w3: QWeight, w2: QWeight):
    """The routed experts' gate/up and down launches for one routing (x, idx, weights, moe_prepare's plan, ...), as
    the benchmarks time them: the pair-rows table is the routing's, so it is rebuilt with the launches."""
    def run(x, idx, wt, plan, *_):
        if tri._mma_device(x) and tri._mma_one_on(x, w1.data.shape[1]):  # one token split by channels (MOE_MMA_ONE)
            tri._mma_one(x, w1, w3, w2, idx, wt, 10.0, None)
            return
        if plan[-2] is not None:
            plan = (*plan[:-2], tri._pair_rows(idx), plan[-1])
        tri.moe_down(tri.moe_gate_up(x, w1, w3, plan, 10.0), w2, wt, plan)

    return run


def moe_bench(results: dict, copy: float, sweep: bool) -> None:
    """Grouped gate_up + down launches over the experts a routing selects; bytes = packed weights + scales of
    the distinct selected experts + activations (x, h written and read, contributions written). The per-pair
    forms (stream, tensor cores) are timed at every T, as if MOE_PAIRS_MAX_T reached it, to place that bound."""
    w1, w3, w2 = fp4_weight(N_EXP, INTER, HID), fp4_weight(N_EXP, INTER, HID), fp4_weight(N_EXP, HID, INTER)
    per_expert = sum(w.nbytes() for w in (w1, w3, w2)) / N_EXP
    def cfg_of() -> dict:
        if tri.MOE_MMA["on"]:
            return {"MMA": True, **{k: v for k, v in tri.MOE_MMA.items() if k != "on"}}
        if tri.MOE_STREAM["on"]:
            return {"STREAM": True, **{k: v for k, v in tri.MOE_STREAM.items() if k != "on"}}
        return {"DOT": True, **tri.MOE_DOT_M1}

    def apply(cfg: dict) -> None:
        tri.MOE_MMA["on"] = bool(cfg.get("MMA"))
        if cfg.get("MMA"):  # the per-pair tensor-core kernels (their plan is the stream's: one block a pair)
            tri.MOE_STREAM["on"] = True
            tri.MOE_MMA.update(saved["MOE_MMA"], **{k: v for k, v in cfg.items() if k != "MMA"})
            return
        tri.MOE_STREAM["on"] = bool(cfg.get("STREAM"))
        if cfg.get("STREAM"):  # the per-pair dot-free stream
            tri.MOE_STREAM.update({k: v for k, v in cfg.items() if k != "STREAM"})
            return
        c = {k: v for k, v in cfg.items() if k != "DOT"}
        tri.MOE_DOT.update(c)
        tri.MOE_DOT_M1.update(c)
        tri.MOE_DOT_DOWN.clear()  # the swept tile for down too

    configs = [cfg_of()]
    if configs[0].get("MMA"):  # the tensor-core kernels with one pair a program row, beside two (TWO_MIN_T)
        configs.append({**configs[0], "TWO_MIN_T": 1 << 30})
    if sweep:
        # the tensor-core form (tokens gathered into 16-row blocks): the tiles of runs 4-6
        configs += [{"DOT": True, "BLOCK_N": bn, "GROUPS": g, "num_warps": nw, "num_stages": st}
                    for bn, g, nw, st in ((32, 4, 4, 3), (64, 2, 4, 4), (32, 8, 4, 3), (64, 4, 4, 3))]
        # the dot-free per-pair stream (uint32-word decode, per-thread scale groups) next to the dot forms
        configs += [{"STREAM": True, "BLOCK_N": bn, "GROUPS": g, "num_warps": nw, "num_stages": st}
                    for bn, g, nw, st in ((64, 4, 4, 2), (32, 8, 4, 2), (16, 8, 2, 2), (16, 16, 4, 2),
                                          (32, 16, 8, 2), (8, 16, 2, 2), (16, 8, 4, 2), (8, 8, 1, 2))]
        # the per-pair tensor-core kernels' K splits (gate/up, down) at every token count (two pairs a row from the
        # default TWO_MIN_T)
        configs += [{"MMA": True, "SPLITS": ((1, u, dn),)} for u, dn in ((4, 2), (4, 1), (2, 1), (1, 1), (2, 2))]
        configs = [c for i, c in enumerate(configs) if c not in configs[:i]]
    if all(c.get("STREAM") or c.get("MMA") for c in configs):  # the grouped form beside them at every T
        configs.append({"DOT": True, **tri.MOE_DOT_M1})
    saved = {name: dict(getattr(tri, name)) for name in ("MOE_PAIRS_MAX_T", "MOE_STREAM", "MOE_MMA", "MOE_DOT",
                                                          "MOE_DOT_M1", "MOE_DOT_DOWN")}
    tri.MOE_PAIRS_MAX_T.update(mma=64, stream=64)
    for t in MOE_TOKENS:
        sets = []
        for _ in range(24):  # 24 routings x 6 experts: far beyond the L2
            x = torch.randn(t, HID, device=DEV, dtype=ACT, generator=GEN)
            idx = torch.stack([torch.randperm(N_EXP, device=DEV, generator=GEN)[:TOPK] for _ in range(t)])
            wt = torch.rand(t, TOPK, device=DEV, generator=GEN)
            sets.append((x, idx, wt, None, torch.unique(idx).numel()))
        n_unique = statistics.mean(s[4] for s in sets)
        act = t * HID * 2 + t * TOPK * INTER * 4 * 2 + t * TOPK * HID * 4
        nbytes = n_unique * per_expert + act
        best = None
        timed = []
        for cfg in configs:
            if cfg.get("TWO_MIN_T", 0) > 64 and t < saved["MOE_MMA"]["TWO_MIN_T"]:
                continue  # below TWO_MIN_T the default is one pair a row too: timed once
            apply(cfg)
            planned = [(x, idx, wt, tri.moe_prepare(x, idx, N_EXP), n) for x, idx, wt, _, n in sets]  # bm per cfg
            try:
                ms = time_graph_ms(moe_pair(w1, w3, w2), planned)
            except Exception as exc:  # a tile that does not compile is reported, not fatal
                print(f"moe cfg {cfg} failed: {exc!r}"[:300])
                continue
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            print(f"moe T={t:3d} cfg={cfg} {ms*1e3:8.1f} us  {nbytes/1e6:7.1f} MB  frac={frac:.3f}", flush=True)
            timed.append((ms, cfg))
            if best is None or ms < best[0]:
                best = (ms, cfg, frac)
        apply(best[1])
        full = time_ms(lambda x, idx, wt, plan, _n: tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0), sets, reps=50)
        results["mxfp4_moe"][f"M{t}"] = {
            "gemv_us": best[0] * 1e3, "bytes_MB": nbytes / 1e6, "frac": best[2], "cfg": best[1],
            "moe_experts_op_us": full * 1e3, "unique_experts": n_unique,
            "by_form_us": {_short(c): round(ms * 1e3, 1) for ms, c in timed},
        }
        print(f"moe T={t} whole op, eager (host-bound: torch routing tables + 3 launches): {full*1e3:.1f} us",
              flush=True)
        # the 3 fastest forms of each kind go on to larger T
        ranked = [c for _, c in sorted(timed, key=lambda p: p[0])]
        one_pair = [c for c in configs if c.get("TWO_MIN_T", 0) > 64]  # goes on at every T, beside the default
        configs = ([c for c in ranked if c.get("MMA")][:3] + [c for c in ranked if c.get("DOT")][:3]
                   + [c for c in ranked if c.get("STREAM")][:3])
        configs += [c for c in one_pair if c not in configs]
    for name, table in saved.items():  # the defaults again for the benchmarks after this one
        getattr(tri, name).update(table)
    results["mxfp4_gemv_m1_frac"] = results["mxfp4_moe"]["M1"]["frac"]


def fp8_bench(results: dict, copy: float, sweep: bool) -> None:
    ws = [fp8_weight(HEADS * HEAD_DIM, Q_LORA) for _ in range(8)]  # 8 x 32 MB
    nbytes = ws[0].nbytes() + Q_LORA * 2 + HEADS * HEAD_DIM * 2
    dot0 = {"dot": True, **tri.FP8_DOT}  # the committed tensor-core tile, before the sweep updates FP8_DOT

    def cur() -> dict:
        if tri.FP8_STREAM_MAX_M >= 1:
            return {"stream": True, **tri.FP8_STREAM}
        return {"dot": True, **tri.FP8_DOT}

    configs = [cur()]
    if sweep:
        # the dot-free stream: E4M3 by the hardware conversion (HW) or the bit decode, tile and unroll
        # (LOCAL: the products each thread sums before its accumulator; 1 is the form before run 122)
        configs += [{"stream": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "UNROLL": un, "HW": hw,
                     "PREFETCH": False, "LOCAL": lc}
                    for bn, bk, nw, un, hw, lc in ((32, 256, 4, 1, None, 16), (64, 256, 8, 1, None, 16),
                                                   (16, 512, 4, 1, None, 16), (16, 256, 2, 1, None, 16),
                                                   (8, 1024, 4, 1, None, 16), (32, 256, 4, 2, None, 16),
                                                   (32, 256, 4, 1, False, 16), (64, 256, 8, 1, None, 1),
                                                   (16, 512, 4, 1, None, 1), (32, 512, 8, 1, None, 1),
                                                   (8, 1024, 4, 1, None, 1))]
        configs += [dot0]  # the old default: tensor cores, rows padded to 16
        configs = [c for i, c in enumerate(configs) if c not in configs[:i]]
        # M=1 through the tensor-core kernel (rows padded to 16)
        configs += [{"dot": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st}
                    for bn, bk, nw, st in ((128, 64, 4, 3), (128, 128, 4, 3), (256, 128, 8, 3))]
    xs = [torch.randn(1, Q_LORA, device=DEV, dtype=ACT, generator=GEN) for _ in range(8)]
    best = None
    def apply(cfg: dict) -> None:
        tri.FP8_STREAM_MAX_M = 1 if cfg.get("stream") else 0
        if cfg.get("stream"):
            tri.FP8_STREAM.update({k: v for k, v in cfg.items() if k != "stream"})
        else:
            tri.FP8_DOT.update({k: v for k, v in cfg.items() if k != "dot"})

    # two rounds, each config's best kept: the first configs timed in a run were up to 15% slow (runs 105, 127)
    for _ in range(2 if sweep else 1):
        for cfg in configs:
            apply(cfg)
            try:
                ms = time_graph_ms(tri.linear, list(zip(xs, ws, strict=True)))
            except Exception as exc:
                print(f"fp8 cfg {cfg} failed: {exc!r}"[:300])
                continue
            frac = nbytes / (ms * 1e-3) / 1e12 / copy
            print(f"fp8 wq_b M=1 cfg={cfg} {ms*1e3:8.1f} us frac={frac:.3f}", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg, frac)
    apply(best[1])
    results["fp8_linear_m1_frac"] = best[2]
    results["fp8_linear"] = {"wq_b_M1": {"us": best[0] * 1e3, "bytes_MB": nbytes / 1e6, "frac": best[2],
                                         "cfg": best[1]}}
    # grouped output projection wo_a at M=1 and prefill wq_b at M=64 (MFMA/tensor-core path)
    kg = HEADS * HEAD_DIM // O_GROUPS
    wos = [fp8_weight(O_GROUPS * O_LORA, kg) for _ in range(4)]
    xo = [torch.randn(1, O_GROUPS, kg, device=DEV, dtype=ACT, generator=GEN) for _ in range(4)]
    ms = time_graph_ms(lambda x, w: tri.grouped_linear(x, w, O_GROUPS), list(zip(xo, wos, strict=True)))
    if sweep:  # wo_a under each stream tile (rows = 8 x 1024, K = 4096) and the old dot path
        best_cfg = {"FP8_STREAM_LONG": dict(tri.FP8_STREAM_LONG)}  # what the launch above used (K >= min_k)
        long_k, tri.FP8_STREAM_LONG["min_k"] = tri.FP8_STREAM_LONG["min_k"], 1 << 62  # FP8_STREAM's tiles as given
        for cfg in [c for c in configs if c.get("stream")] + [dot0]:
            apply(cfg)
            try:
                t2 = time_graph_ms(lambda x, w: tri.grouped_linear(x, w, O_GROUPS), list(zip(xo, wos, strict=True)))
            except Exception as exc:
                print(f"fp8 wo_a cfg {cfg} failed: {exc!r}"[:300])
                continue
            print(f"fp8 wo_a grouped M=1 cfg={cfg} {t2*1e3:8.1f} us", flush=True)
            if t2 < ms:
                ms, best_cfg = t2, cfg
        results["fp8_wo_a_best_cfg"] = best_cfg  # as configured: the launch narrows row tiles to 16 (MIN_PROGRAMS)
        tri.FP8_STREAM_LONG["min_k"] = long_k
        apply(dot0)
        for mp in (0, 528):
            saved, tri.MIN_PROGRAMS = tri.MIN_PROGRAMS, mp
            t2 = time_graph_ms(lambda x, w: tri.grouped_linear(x, w, O_GROUPS), list(zip(xo, wos, strict=True)))
            print(f"fp8 wo_a grouped M=1 min_programs={mp} {t2*1e3:.1f} us")
            tri.MIN_PROGRAMS = saved
        apply(best[1])
    nb = wos[0].nbytes() + O_GROUPS * kg * 2 + O_GROUPS * O_LORA * 2
    results["fp8_linear"]["wo_a_grouped_M1"] = {"us": ms * 1e3, "bytes_MB": nb / 1e6,
                                                "frac": nb / (ms * 1e-3) / 1e12 / copy}
    print(f"fp8 wo_a grouped M=1 {ms*1e3:.1f} us frac={results['fp8_linear']['wo_a_grouped_M1']['frac']:.3f}")
    x64 = [torch.randn(64, Q_LORA, device=DEV, dtype=ACT, generator=GEN) for _ in range(8)]
    ms = time_graph_ms(tri.linear, list(zip(x64, ws, strict=True)))
    flops = 2 * 64 * Q_LORA * HEADS * HEAD_DIM
    results["fp8_linear"]["wq_b_M64"] = {"us": ms * 1e3, "TFLOPs": flops / (ms * 1e-3) / 1e12,
                                         "frac_of_copy": (ws[0].nbytes() + 64 * (Q_LORA + HEADS * HEAD_DIM) * 2)
                                         / (ms * 1e-3) / 1e12 / copy}
    print(f"fp8 wq_b M=64 {ms*1e3:.1f} us")
    # a few rows (a batched decode step): the few-token tensor-core kernel (FP8_MMA, the default up to its max_m),
    # the stream (one program row per x row) and the tensor-core tile FP8_DOT
    saved_m, saved_mma, by_m = tri.FP8_STREAM_MAX_M, tri.FP8_MMA["on"], {}
    for m in FP8_ROWS:
        xm = [torch.randn(m, Q_LORA, device=DEV, dtype=ACT, generator=GEN) for _ in range(8)]
        nb = ws[0].nbytes() + m * (Q_LORA + HEADS * HEAD_DIM) * 2
        for form in ("mma", "stream", "dot"):
            tri.FP8_MMA["on"] = form == "mma"
            tri.FP8_STREAM_MAX_M = m if form == "stream" else 0
            if form == "mma" and not tri._fp8_mma_on(xm[0][:, None], ws[0].data.view(torch.uint8), ws[0].data.shape[0],
                                                     Q_LORA):
                continue
            ms = time_graph_ms(tri.linear, list(zip(xm, ws, strict=True)))
            by_m[f"M{m} {form}"] = {"us": ms * 1e3, "frac": nb / (ms * 1e-3) / 1e12 / copy}
            print(f"fp8 wq_b M={m} {form} {ms*1e3:.1f} us frac={by_m[f'M{m} {form}']['frac']:.3f}", flush=True)
    tri.FP8_STREAM_MAX_M, tri.FP8_MMA["on"] = saved_m, saved_mma
    results["fp8_linear"]["wq_b_by_M"] = by_m


def _short(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items() if k not in ("on", "num_stages", "HW"))


def stream_sweep(results: dict, copy: float) -> None:
    """--stream-sweep: the one-token weight streams only, as fractions of the copy bandwidth. MXFP4 gate_up + down
    (one launch each, 24 routings x 6 of 256 experts) and FP8 wq_b (1024 -> 32768, 8 weights) under the committed
    defaults, PREFETCH (register double buffering), PRMT (the inline-PTX E2M1 decode) and tiles.
    The globals are restored afterwards (nothing is adopted)."""
    moe0, fp80 = dict(tri.MOE_STREAM), dict(tri.FP8_STREAM)
    moe_cfgs = [dict(moe0)] + [dict(moe0, PREFETCH=pf, PRMT=pr) for pf, pr in ((False, False), (True, False),
                                                                                 (False, True))]
    for bn, g, nw in ((16, 8, 2), (32, 8, 4), (16, 16, 4), (8, 16, 2), (32, 8, 8)):
        moe_cfgs += [dict(moe0, BLOCK_N=bn, GROUPS=g, num_warps=nw, PREFETCH=True, PRMT=True)]
    fp8_cfgs = [dict(fp80), dict(fp80, PREFETCH=True), dict(fp80, PREFETCH=True, UNROLL=2)]
    for bn, bk, nw in ((32, 256, 4), (64, 128, 8), (128, 128, 8), (32, 128, 4), (16, 256, 4)):  # run 15's best
        fp8_cfgs += [dict(fp80, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, PREFETCH=True, UNROLL=u) for u in (1, 2)]
    fp8_cfgs = [c for i, c in enumerate(fp8_cfgs) if c not in fp8_cfgs[:i]]
    table = []

    def timed(kind: str, cfg: dict, fn, args_list, nbytes: float) -> None:
        try:
            ms = time_graph_ms(fn, args_list)
        except Exception as exc:  # a tile that does not compile is reported, not fatal
            print(f"stream {kind} cfg {cfg} failed: {exc!r}"[:300], flush=True)
            return
        frac = nbytes / (ms * 1e-3) / 1e12 / copy
        table.append({"kernel": kind, "cfg": cfg, "us": ms * 1e3, "frac": frac})
        print(f"stream {kind:24s} {ms * 1e3:8.1f} us  frac={frac:.3f}  cfg={_short(cfg)}", flush=True)

    w1, w3, w2 = fp4_weight(N_EXP, INTER, HID), fp4_weight(N_EXP, INTER, HID), fp4_weight(N_EXP, HID, INTER)
    up_bytes = TOPK * (w1.nbytes() + w3.nbytes()) / N_EXP + HID * 2 + TOPK * INTER * 4  # weights, x, h written
    down_bytes = TOPK * w2.nbytes() / N_EXP + TOPK * INTER * 4 + TOPK * HID * 4  # weights, h, contributions
    sets = []
    for _ in range(2 if SMALL else 24):  # 24 routings x 6 experts: far beyond the L2 (--small times 2 calls)
        idx = torch.randperm(N_EXP, device=DEV, generator=GEN)[:TOPK][None]
        sets.append((torch.randn(1, HID, device=DEV, dtype=ACT, generator=GEN), idx,
                     torch.rand(1, TOPK, device=DEV, generator=GEN)))
    mma0 = tri.MOE_MMA["on"]
    tri.MOE_STREAM.update(on=True)
    tri.MOE_MMA["on"] = False  # the streams themselves, not the tensor-core kernels that take one token by default
    for cfg in moe_cfgs:  # both launches (moe_experts: the down sums in-launch), then each alone
        tri.MOE_STREAM.update(cfg)
        planned = [(x, wt, tri.moe_prepare(x, idx, N_EXP)) for x, idx, wt in sets]
        timed("mxfp4 gate_up+down M=1", cfg, lambda x, idx, wt: tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0),
              sets, up_bytes + down_bytes)
        timed("  mxfp4 gate_up M=1", cfg, lambda x, wt, plan: tri.moe_gate_up(x, w1, w3, plan, 10.0), planned,
              up_bytes)
        hs = [(tri.moe_gate_up(x, w1, w3, plan, 10.0), wt, plan, torch.empty_like(x)) for x, wt, plan in planned]
        timed("  mxfp4 down M=1", cfg, lambda h, wt, plan, out: tri.moe_down(h, w2, wt, plan, out=out), hs,
              down_bytes)
    tri.MOE_STREAM.update(moe0)
    tri.MOE_MMA["on"] = mma0

    ws = [fp8_weight(HEADS * HEAD_DIM, Q_LORA) for _ in range(8)]  # 8 x 32 MB
    xs = [torch.randn(1, Q_LORA, device=DEV, dtype=ACT, generator=GEN) for _ in range(8)]
    nbytes = ws[0].nbytes() + Q_LORA * 2 + HEADS * HEAD_DIM * 2
    saved_m, tri.FP8_STREAM_MAX_M = tri.FP8_STREAM_MAX_M, 1
    for cfg in fp8_cfgs:
        tri.FP8_STREAM.update(cfg)
        timed("fp8 wq_b M=1", cfg, tri.linear, list(zip(xs, ws, strict=True)), nbytes)
    tri.FP8_STREAM.update(fp80)
    tri.FP8_STREAM_MAX_M = saved_m
    results["stream_sweep"] = table
    print("\nbest first (fraction of the copy bandwidth):")
    for kind in ("mxfp4 gate_up+down M=1", "  mxfp4 gate_up M=1", "  mxfp4 down M=1", "fp8 wq_b M=1"):
        for row in sorted((r for r in table if r["kernel"] == kind), key=lambda r: -r["frac"]):
            print(f"  {kind:24s} {row['frac']:.3f} {row['us']:8.1f} us  {_short(row['cfg'])}")


def other_bench(results: dict, copy: float, sweep: bool) -> None:
    out = {}
    xs = [torch.randn(64, HID, device=DEV, dtype=ACT, generator=GEN) for _ in range(4)]
    g = torch.randn(HID, device=DEV, dtype=ACT, generator=GEN)
    ms = time_graph_ms(lambda x: tri.rms_norm(x, g, 1e-6), [(x,) for x in xs])
    out["rms_norm_T64"] = {"us": ms * 1e3, "frac": 2 * xs[0].nbytes / (ms * 1e-3) / 1e12 / copy}
    q = torch.randn(1, 1, HEADS, HEAD_DIM, device=DEV, dtype=ACT, generator=GEN)
    kvs = [torch.randn(1, 8192, HEAD_DIM, device=DEV, dtype=ACT, generator=GEN) for _ in range(8)]
    sink = torch.randn(HEADS, device=DEV, generator=GEN)
    mask = torch.ones(1, 1, 8192, dtype=torch.bool, device=DEV)
    ms = time_graph_ms(lambda kv: tri.attention(q, kv, sink, mask, 0.04), [(kv,) for kv in kvs])
    out["attention_decode_L8192"] = {"us": ms * 1e3, "frac": kvs[0].nbytes / (ms * 1e-3) / 1e12 / copy}
    # the unquantized head (vocab 129280 x 4096 bf16, fp32 activations), M = 1: dense_gemv_kernel tiles
    vocab, wdt = (1000, torch.float16) if SMALL else (129280, torch.bfloat16)
    heads = [QWeight(torch.randn(vocab, HID, device=DEV, generator=GEN).to(wdt), None, "dense") for _ in range(2)]
    x1 = torch.randn(1, HID, device=DEV, generator=GEN)
    saved, best = dict(tri.DENSE_GEMV), None
    configs = [dict(saved)] + [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw} for bn, bk, nw in
                               ((16, 512, 4), (8, 1024, 4), (32, 256, 8), (16, 1024, 8), (4, 1024, 2), (8, 512, 2),
                                (32, 512, 8), (64, 256, 8)) if sweep]
    for cfg in configs:
        tri.DENSE_GEMV.update(cfg)
        ms = time_graph_ms(lambda w: tri.linear(x1, w), [(w,) for w in heads])
        frac = heads[0].nbytes() / (ms * 1e-3) / 1e12 / copy
        print(f"dense head M=1 cfg={cfg} {ms * 1e3:8.1f} us frac={frac:.3f}", flush=True)
        if best is None or frac > best["frac"]:
            best = {"us": ms * 1e3, "frac": frac, "cfg": dict(cfg)}
    tri.DENSE_GEMV.update(saved)
    out["dense_head_M1"] = best
    # a batched step's rows: the tensor-core form (x in bf16 parts, DENSE_MMA's tiles swept), the stream in
    # DENSE_GEMV_BLOCK_M row blocks, the reference (a float32 copy of W, then cuBLAS); fp32 x, and bf16 x at 64 rows
    saved_m, saved_mma, by_m = tri.DENSE_GEMV_MAX_M, dict(tri.DENSE_MMA), {}
    mma_cfgs = [dict(saved_mma)] + [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st} for bn, bk, nw, st
                                    in ((64, 64, 4, 4), (128, 128, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3),
                                        (128, 64, 4, 6), (64, 128, 4, 4)) if sweep]
    cases = [(m, torch.float32) for m in HEAD_ROWS] + ([] if SMALL else [(64, torch.bfloat16)])
    for m, dt in cases:
        xm = torch.randn(m, HID, device=DEV, generator=GEN).to(dt)
        forms = [("mma", cfg, 0) for cfg in (mma_cfgs if not SMALL else [])]
        forms += [("stream", None, m)] if m <= 16 and dt == torch.float32 else []
        forms += [("reference", None, 0)]
        for form, cfg, max_m in forms:
            tri.DENSE_MMA.update(cfg or {"on": False})
            tri.DENSE_GEMV_MAX_M = max_m
            ms = time_graph_ms(lambda w, xm=xm: tri.linear(xm, w, torch.float32), [(w,) for w in heads])
            row = {"us": ms * 1e3, "frac": heads[0].nbytes() / (ms * 1e-3) / 1e12 / copy}
            key = f"M{m} {str(dt)[6:]} {form}"
            print(f"dense head {key} {cfg or ''} {ms * 1e3:8.1f} us frac={row['frac']:.3f}", flush=True)
            if cfg:
                row["cfg"] = dict(cfg)
            if key not in by_m or row["us"] < by_m[key]["us"]:
                by_m[key] = row
            tri.DENSE_MMA.clear()
            tri.DENSE_MMA.update(saved_mma)
    tri.DENSE_GEMV_MAX_M = saved_m
    out["dense_head_by_M"] = by_m
    results["other"] = out
    print(f"other {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="results folder (default: bench/results on a GPU; with --small a temporary "
                                  "folder, so a smoke run never replaces the committed H200 numbers)")
    ap.add_argument("--sweep", action="store_true", help="time several tile configs and keep the best")
    ap.add_argument("--stream-sweep", action="store_true",
                    help="only the one-token MXFP4/FP8 streams: defaults, PREFETCH, PRMT and nearby tiles (after the "
                         "stream kernels' correctness checks); writes DIR/stream_sweep.json")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--small", action="store_true", help="CPU smoke run: interpreter, tiny shapes (read at import)")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "cdna2-bench-small" if SMALL else ROOT / "bench" / "results")
    import triton

    GEN.manual_seed(20261129)
    props = None if SMALL else torch.cuda.get_device_properties(0)
    results = {
        "card": props.name if props else "cpu (--small)", "sms": props.multi_processor_count if props else 0,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__,
        "command": "python bench/bench_kernels.py" + (" --sweep" if args.sweep else ""),
        "checks": {}, "mxfp4_moe": {},
    }
    t0 = time.time()
    if not args.skip_check:
        correctness(results, streams_only=args.stream_sweep)
    results["all_checks_ok"] = all(c["ok"] for c in results["checks"].values())
    copy = copy_tbps()
    results["copy_TBps"] = copy
    print(f"copy {copy:.3f} TB/s", flush=True)
    if args.stream_sweep:
        results["command"] = "python bench/bench_kernels.py --stream-sweep"
        stream_sweep(results, copy)
        results["wall_s"] = time.time() - t0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for d in [out] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
            (d / "stream_sweep.json").write_text(json.dumps(results, indent=1))
        print(f"all checks ok: {results['all_checks_ok']}  wall {results['wall_s']:.0f} s")
        return
    moe_bench(results, copy, args.sweep)
    fp8_bench(results, copy, args.sweep)
    other_bench(results, copy, args.sweep)
    results["copy_TBps_end"] = copy_tbps()
    results["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200.json").write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "h200.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k not in ("checks",)}, indent=1))


if __name__ == "__main__":
    main()
