"""Decode speed of a "flash slice": V4-Flash dimensions, 4 layers of mixed types (hash MoE, CSA, HCA,
sliding), random weights in the official packed format, against transformers' DeepseekV4ForCausalLM in
bf16 eager on the same shapes, and against the byte floor (the bytes one decode step must read: every
attention/compressor/indexer weight, the shared expert, the 6 routed experts a token picks, the head).

    python bench/bench_slice.py            # on a GPU; writes --out (and $OUT/slice.json when OUT is set)
    python bench/bench_slice.py --small    # CPU smoke test at tiny sizes (numbers mean nothing)

Timing: CUDA events around each decode step after a 64-token prefill, median over the steps; the engine's
decode step eager and as a CUDA graph (`DecodeGraph`, checked against the eager step first: the graph
run is teacher-forced with the eager tokens and must reproduce its logits), the MoE block alone
(`moe_decode_frac`), and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cdna2_engine.checkpoint import stored_shapes, tensor_specs
from cdna2_engine.config import FLASH_SLICE, Config
from cdna2_engine.model import DecodeGraph, Model
from cdna2_engine.ops import QWeight, get_ops
from pytest_cdna2.compare import logit_metrics

FLASH = FLASH_SLICE
SMALL = dict(FLASH, vocab_size=300, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
             q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=16,
             index_n_heads=16, index_head_dim=32, index_topk=8, sliding_window=16, hc_mult=2,
             rope_scaling=dict(FLASH["rope_scaling"], original_max_position_embeddings=64))


def random_packed(cfg: Config, device: torch.device, seed: int = 0) -> tuple[dict, int, int]:
    """Official-format random weights made on the device; returns (weights, total bytes, floor bytes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w, total, floor = {}, 0, 0

    def codes(shape):
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)

    for sp in tensor_specs(cfg):
        if sp.kind == "fp8":
            ws, ss = stored_shapes("fp8", sp.shape)
            c = codes(ws)
            c[(c & 0x7F) == 0x7F] = 0x38  # no NaN codes
            s = torch.full(ss, 127 - 9, dtype=torch.uint8, device=device)
            q = QWeight(c.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "fp8")
        elif sp.kind == "mxfp4":
            ws, ss = stored_shapes("mxfp4", sp.shape)
            s = torch.full(ss, 127 - 4, dtype=torch.uint8, device=device)
            q = QWeight(codes(ws).view(torch.int8), s.view(torch.float8_e8m0fnu), "mxfp4")
        elif sp.kind == "int32":
            # tid2eid: each token's k distinct experts, which the byte floor counts
            keys = torch.rand(sp.shape[0], cfg.n_routed_experts, generator=g, device=device)
            q = keys.argsort(-1)[:, :sp.shape[1]].to(torch.int32)
        else:
            dt = torch.bfloat16 if sp.kind == "bf16" else torch.float32
            t = torch.randn(sp.shape, generator=g, device=device, dtype=torch.float32)
            t = (1 + 0.1 * t) if sp.name.endswith("norm.weight") else t / (sp.shape[-1] ** 0.5)
            t = t.to(dt)
            q = QWeight(t, None, "dense") if sp.linear else t
        nb = q.nbytes() if isinstance(q, QWeight) else q.numel() * q.element_size()
        total += nb
        routed = ".experts." in sp.name and ".shared_experts." not in sp.name
        if sp.name == "embed.weight":
            floor += cfg.hidden_size * 2  # one row
        elif routed:
            floor += nb * cfg.num_experts_per_tok // cfg.n_routed_experts  # 6 of 256, on average
        elif "gate.tid2eid" not in sp.name:
            floor += nb
        w[sp.name] = q
    return w, total, floor


def time_steps(step, first, n: int, device: torch.device) -> list[float]:
    """Milliseconds of `n` decode steps (events on a GPU, wall clock on the CPU)."""
    out, tok = [], first
    for _ in range(n):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            tok = step(tok)
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            tok = step(tok)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (> 1: ms per step, no floor or "
                                                         "transformers; the kernels' goals are at batch 1)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of two decode steps")
    ap.add_argument("--out", help="write the results JSON here too")
    ap.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override a triton launch table entry, e.g. MOE_STREAM.PREFETCH=True (repeatable)")
    a = ap.parse_args()
    if not a.small and not torch.cuda.is_available():  # the V4-Flash slice's 16 GB of weights on the CPU
        raise SystemExit("bench_slice.py needs a GPU (CUDA or ROCm) at V4-Flash shapes; --small runs the CPU smoke "
                         "test in Triton's interpreter")
    overrides = apply_overrides(a.set)
    device = torch.device("cpu" if a.small else "cuda")
    cfg = Config(**(SMALL if a.small else FLASH))
    weights, total, floor = random_packed(cfg, device)
    backend = "triton"  # on the CPU (--small): Triton's interpreter
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Model(cfg, weights, device=device, dtype=dtype, ops=get_ops(backend))
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), device=device)
    cache = model.new_cache()
    first = model.step(ids, cache)[:, -1:].argmax(-1)
    cap = a.prompt + a.steps + 2
    eager_sc, graph_sc = model.static_cache(cache, cap), model.static_cache(cache, cap)  # two equal states
    eager_logits, graph_logits = [], []

    def eager(tok):
        eager_logits.append(model.decode(tok, eager_sc))
        return eager_logits[-1].argmax(-1)

    eager_ms = time_steps(eager, first, a.steps, device)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "date": time.strftime("%F"),
           "overrides": overrides,
           "backend": backend, "dtype": str(dtype), "layers": cfg.num_hidden_layers, "batch": a.batch,
           "compress_ratios": cfg.compress_ratios, "weight_bytes": total, "floor_bytes_per_token": floor,
           "slice_eager_decode_ms_per_token": statistics.median(eager_ms), "eager_steps_ms": eager_ms}
    if device.type == "cuda":
        graph = DecodeGraph(model, graph_sc)
        tokens = iter([first] + [lg.argmax(-1) for lg in eager_logits])  # teacher-forced: the eager tokens

        def graphed(_):
            graph_logits.append(graph(next(tokens)))
            return None

        graph_ms = time_steps(graphed, None, a.steps, device)[1:]  # the first call is warm-up + capture
        ref, got = torch.cat(eager_logits, 1).float(), torch.cat(graph_logits, 1).float()
        worst = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        if worst > 1e-6:  # the same kernels on the same inputs: replay must reproduce eager
            raise SystemExit(f"graph decode differs from eager decode: worst rel {worst:.2e}; no timing reported")
        src = torch.empty(1 << 29, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        ms = time_steps(lambda _: dst.copy_(src), None, 10, device)
        copy_tbps = 2 * src.numel() * 4 / (statistics.median(ms) * 1e-3) / 1e12
        del src, dst
        res.update(graph_vs_eager_rel=worst, slice_decode_ms_per_token=statistics.median(graph_ms),
                   graph_steps_ms=graph_ms, copy_TBps=copy_tbps)
        if a.batch == 1:  # the floor counts one token's bytes; the MoE blocks are timed at batch 1
            res.update(slice_floor_ms_per_token=floor / (copy_tbps * 1e12) * 1e3)
            res.update(moe_decode(model, device, copy_tbps))
        if a.profile:  # after every timing: timed after the profiler, the MoE blocks were ~3% slower (run 66)
            res["profile"] = profile_decode(graph, eager_logits[-1].argmax(-1))
    else:
        res["slice_decode_ms_per_token"] = res["slice_eager_decode_ms_per_token"]
    res.update(vs_reference(cfg, weights, ids, model, first, graph_logits or eager_logits, eager_logits))
    if a.batch > 1:  # a step decodes one token of each sequence
        res["slice_decode_ms_per_step"] = res.pop("slice_decode_ms_per_token")
        res["tokens_per_s"] = a.batch / res["slice_decode_ms_per_step"] * 1e3
    elif not a.no_hf:
        res.update(hf_decode_ms(cfg, device, ids, a.steps))
        res["speedup_vs_hf"] = res["hf_slice_decode_ms_per_token"] / res["slice_decode_ms_per_token"]
        if res.get("hf_grouped_mm_slice_decode_ms_per_token"):
            res["speedup_vs_hf_grouped_mm"] = (res["hf_grouped_mm_slice_decode_ms_per_token"]
                                               / res["slice_decode_ms_per_token"])
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "slice.json"), "w") as f:
            json.dump(res, f, indent=1)


def launch_settings() -> dict:
    """A deep copy of cdna2_engine.ops.triton's launch settings (its upper-case dicts, integers and switches):
    what apply_overrides changes, to be set back after a variant."""
    import copy

    from cdna2_engine.ops import triton as tri

    return {k: copy.deepcopy(v) for k, v in vars(tri).items()
            if k.isupper() and not k.startswith("_") and isinstance(v, (dict, int))}


def apply_overrides(items: list[str]) -> dict:
    """TABLE.KEY=VALUE (a Python literal) into cdna2_engine.ops.triton's launch tables (FP8_STREAM, MOE_STREAM,
    ...), or NAME=VALUE into one of its integer or switch settings (ATTN_CHUNK, a True/False switch, ...), for trying a
    variant without editing the defaults; returns what was set."""
    import ast

    from cdna2_engine.ops import triton as tri

    done = {}
    for item in items:
        name, _, value = item.partition("=")
        table, _, key = name.partition(".")
        target = getattr(tri, table, None)
        if not key and isinstance(target, int) and value:  # a scalar setting (bool is an int)
            setattr(tri, table, ast.literal_eval(value))
            done[name] = getattr(tri, table)
            continue
        if not isinstance(target, dict) or key not in target or not value:
            raise SystemExit(f"--set {item!r}: use TABLE.KEY=VALUE with an existing key of a dict in "
                             f"cdna2_engine.ops.triton (e.g. MOE_STREAM.PREFETCH=True), or NAME=VALUE for one of "
                             f"its integer or switch settings (e.g. ATTN_CHUNK=1024)")
        target[key] = done[name] = ast.literal_eval(value)
    return done


def profile_decode(graph: DecodeGraph, tok: torch.Tensor, steps: int = 2) -> dict:
    """Kernels per decode step and the GPU time by kernel name (replayed graph), printed and returned, with one
    step's kernels in launch order (`sequence`: match it with `python bench/launches.py` to name each call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph(tok)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    rows = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in by_name.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile: {len(kernels) / steps:.0f} kernels per step, {total:.0f} us of kernel time per step")
    for us, n, name in rows[:30]:
        print(f"{us:9.1f} us {n:6.0f}x  {name}")
    one = kernels[: len(kernels) // steps]  # the first step's kernels in launch order
    return {"kernels_per_step": len(kernels) / steps, "kernel_us_per_step": total,
            "top": [{"us": us, "calls": n, "name": name} for us, n, name in rows[:30]],
            "sequence": [[e.name[:40], round(e.device_time_total, 2)] for e in one], **_timeline(prof, steps)}


def _timeline(prof, steps: int) -> dict:
    """The first of `steps` replayed steps from the profiler's trace: [name, start us from the step's first
    kernel, duration us, stream] per kernel, copy and memset in start order, and per stream its busy time and the
    gaps between its kernels. The graph spreads its branches over several streams of its own, so a stream's gap is
    time it had nothing ready: waiting on a join, or on nothing."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)["traceEvents"]
    ev = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    ev = ev[: len(ev) // steps]
    while ev and ev[0].get("cat") == "gpu_memcpy":  # the token's copy, issued before the replay (the host's
        ev = ev[1:]  # launch of the graph can come ms later under the profiler): the step starts at the graph
    if not ev:
        return {}
    t0 = ev[0]["ts"]
    rows = [[e["name"][:40], round(e["ts"] - t0, 2), round(e["dur"], 2), e["args"].get("stream")] for e in ev]
    streams: dict[str, dict] = {}
    for _name, start, dur, st in rows:
        d = streams.setdefault(str(st), {"kernels": 0, "busy_us": 0.0, "first": start, "end": start})
        d["kernels"] += 1
        d["busy_us"] += dur
        d["end"] = max(d["end"], start + dur)
    for d in streams.values():
        d["span_us"] = d["end"] - d["first"]
        d["gap_us"] = d["span_us"] - d["busy_us"]
    span = max(r[1] + r[2] for r in rows)
    print(f"timeline: one step spans {span:.0f} us; per stream: " + ", ".join(
        f"{k}: {v['kernels']} kernels, busy {v['busy_us']:.0f} us, gaps {v['gap_us']:.0f} us" for k, v in
        streams.items()))
    return {"timeline": rows, "streams": streams, "step_span_us": span}


def vs_reference(cfg: Config, weights: dict, ids: torch.Tensor, model: Model, first: torch.Tensor,
                 graph_logits: list, eager_logits: list) -> dict:
    """The triton backend against the reference backend at these shapes, same weights (the kernel issue's
    done-when): float32 activations, prefill and teacher-forced decode steps (through a CUDA graph on a
    GPU), 99% of positions within 1e-5 relative (on a GPU: triton's float32 against float64; else against the
    reference's float32); bf16 activations (`model`), prefill with the reference's
    sparse selections forced (random weights leave many router/indexer near-ties, and a flip there is not a
    kernel error: pytest_cdna2/judge.py), within the bf16 profile's token KL (tolerance_bf16.toml, 2e-2).
    The unforced bf16 numbers are reported too. Timings are not reported when a gate fails.
    On a GPU the reference backend also runs in float64, the yardstick for both float32 runs: their
    difference is the two backends' rounding together, and each one's own error against float64 says whose
    it is (`vs_float64_*`)."""
    ref = Model(cfg, weights, device=ids.device, dtype=torch.float32, ops=get_ops("reference"))
    f32 = Model(cfg, weights, device=ids.device, dtype=torch.float32, ops=get_ops("triton"))
    models = [("ref", ref), ("f32", f32)]
    if ids.is_cuda:
        models.append(("f64", Model(cfg, weights, device=ids.device, dtype=torch.float64, ops=get_ops("reference"))))
    toks = [first] + [lg.argmax(-1) for lg in eager_logits][: len(graph_logits) - 1]
    n = len(toks)
    runs = {}
    for name, m in models:
        cache = m.new_cache()
        pre = m.step(ids, cache)
        sc = m.static_cache(cache, ids.shape[1] + n + 1)
        step = DecodeGraph(m, sc) if (name == "f32" and ids.is_cuda) else (lambda t, m=m, sc=sc: m.decode(t, sc))
        runs[name] = torch.cat([pre] + [step(t) for t in toks], 1)
    selections = ref.trace(ids).selections
    forced = model.forward(ids, selections=selections)
    r = ((runs["f32"] - runs["ref"]).norm(dim=-1) / runs["ref"].norm(dim=-1)).flatten()
    want = runs["ref"][:, : ids.shape[1]]
    out = {"vs_reference_f32_rel_max": r.max().item(),
           "vs_reference_f32_frac_within_1e-5": (r <= 1e-5).double().mean().item(),
           "vs_reference_bf16_forced_kl_max": logit_metrics(forced, want).kl_max,
           "vs_reference_bf16_forced_top1": (forced.argmax(-1) == want.argmax(-1)).double().mean().item(),
           "vs_reference_bf16_unforced_prefill_kl_max": logit_metrics(model.forward(ids), want).kl_max,
           "vs_reference_bf16_unforced_decode_kl_max": logit_metrics(torch.cat(graph_logits[:n], 1),
                                                                     runs["ref"][:, ids.shape[1]:]).kl_max}
    if "f64" in runs:
        gold = runs.pop("f64")
        for name, label in (("f32", "triton"), ("ref", "reference")):
            e = ((runs[name].double() - gold).norm(dim=-1) / gold.norm(dim=-1)).flatten()
            out[f"vs_float64_f32_{label}_rel_max"] = e.max().item()
            out[f"vs_float64_f32_{label}_rel_median"] = e.median().item()
            out[f"vs_float64_f32_{label}_frac_within_1e-5"] = (e <= 1e-5).double().mean().item()
    del ref, f32, models
    print(json.dumps(out, indent=1))
    # the yardstick: triton's own float32 error where float64 ran; 1% of positions may miss (a router or indexer
    # near-tie that float32 and float64 break apart flips a position without any kernel being wrong)
    within = out.get("vs_float64_f32_triton_frac_within_1e-5", out["vs_reference_f32_frac_within_1e-5"])
    f32_fails = within < 0.99
    if f32_fails or out["vs_reference_bf16_forced_kl_max"] > 2e-2:
        raise SystemExit(f"triton vs reference at these shapes fails its gate: {out}")
    return out


def moe_decode(model: Model, device: torch.device, copy_tbps: float, inputs: int = 8, reps: int = 20) -> dict:
    """MoE block decode at batch 1 (router, 6 routed MXFP4 experts, shared FP8 expert), every layer on
    `inputs` random activations (distinct routings; the weights read per replay far exceed the 60 MB L2),
    captured in one CUDA graph; fraction of the copy bandwidth over the bytes the calls must read."""
    cfg = model.cfg
    D = cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(1, 1, D, generator=g, device=device).to(model.dtype) for _ in range(inputs)]
    tok = [torch.randint(0, cfg.vocab_size, (1, 1), generator=g, device=device) for _ in range(inputs)]
    layers = range(cfg.num_hidden_layers)
    for i in layers:
        model.moe[i](xs[0], tok[0])  # compile every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, t in zip(xs, tok, strict=True):
            for i in layers:
                model.moe[i](x, t)
    nbytes = 0
    for i in layers:
        p = f"layers.{i}.ffn."
        nbytes += sum(q.nbytes() for k, q in model.w.items() if k.startswith(p + "shared_experts."))
        nbytes += model.w[p + "gate.weight"].nbytes() if not cfg.is_hash_layer(i) else 0
        per_expert = sum(q.nbytes() for q in model.experts[i].values()) // cfg.n_routed_experts
        nbytes += cfg.num_experts_per_tok * per_expert + 2 * D  # 6 distinct experts (distinct ids), x
    ms = time_steps(lambda _: graph.replay(), None, reps, device)
    us = statistics.median(ms) * 1e3 / inputs
    return {"moe_decode_us_per_token": us, "moe_decode_bytes_per_token": nbytes,
            "moe_decode_frac": nbytes / (us * 1e-6) / (copy_tbps * 1e12)}


def hf_decode_ms(cfg: Config, device: torch.device, ids: torch.Tensor, steps: int) -> dict:
    """transformers' DeepseekV4ForCausalLM, bf16 (float32 on the CPU), eager, random init, same shapes: the median
    decode step with its experts looped in Python (`experts_implementation="eager"`, the setting every ratio in
    bench/NOTES.md used, and the one the issue's 16.4 ms for 2 layers matches), then with transformers' own default,
    one grouped matmul for the experts (`grouped_mm`, where torch can dispatch it; else the reason it cannot)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.cache_utils import DynamicCache

    hc = DeepseekV4Config(**(cfg.to_dict() | {"quantization_config": None}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: a float32 build of 4 flash layers is ~100 GB
    try:
        with torch.device(device):
            hf = DeepseekV4ForCausalLM(hc).eval()
    finally:
        torch.set_default_dtype(default)
    res = {}
    for impl, key in (("eager", "hf_slice_decode_ms_per_token"),
                      ("grouped_mm", "hf_grouped_mm_slice_decode_ms_per_token")):
        try:
            hf.set_experts_implementation(impl)
        except (ValueError, ImportError, RuntimeError) as e:  # grouped_mm needs a torch that can dispatch it here
            res[key], res[key.replace("_ms_per_token", "_unavailable")] = None, f"{type(e).__name__}: {e}"[:300]
            continue
        pkv = DynamicCache(config=hc)
        first = hf(input_ids=ids, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)

        def step(tok, pkv=pkv):
            return hf(input_ids=tok, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)

        res[key] = statistics.median(time_steps(step, first, steps, device))
    return res


if __name__ == "__main__":
    main()
