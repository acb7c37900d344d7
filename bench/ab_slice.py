"""A/B of flash-slice decode variants in one process: one set of random weights and one prefill, a CUDA graph
per variant, rounds interleaved so that clock and placement drift reach every variant alike (separate
`bench_slice.py` runs differ by up to +-25 us a step from run to run, more than most changes being judged).

    python bench/ab_slice.py --variant "" --variant "ATTN_CHUNK=1024" --variant "model._decode_ropes=set()"
    python bench/ab_slice.py --moe --variant "" --variant "MOE_MMA.PDL=False"  # + the MoE blocks alone

A variant is a ';'-separated list of bench_slice's --set items (TABLE.KEY=VALUE, NAME=VALUE) and
model.ATTR=VALUE (a Python literal set on the Model); "" is the defaults. Every variant is teacher-forced
with the first one's tokens, and its graph must reproduce its own eager step (1e-6, as in bench_slice.py)
before its time counts: the kernels' numerics are the tests' business. Prints and writes (--out,
$OUT/ab_slice.json) the median step time per variant and round.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import statistics

import torch
from bench_slice import FLASH, apply_overrides, launch_settings, moe_decode, random_packed, time_steps

from cdna2_engine.config import Config
from cdna2_engine.model import DecodeGraph, Model
from cdna2_engine.ops import get_ops
from cdna2_engine.ops import triton as tri


def _apply(model: Model, variant: str, saved: dict) -> None:
    """Put the launch settings and model attributes back to `saved`, then set the variant's items."""
    for name, value in saved["tri"].items():
        setattr(tri, name, copy.deepcopy(value))
    for name, value in saved["model"].items():
        setattr(model, name, value)
    items = [i.strip() for i in variant.split(";") if i.strip()]
    for item in items:
        if item.startswith("model."):
            name, _, value = item[len("model."):].partition("=")
            if not hasattr(model, name):
                raise SystemExit(f"--variant {item!r}: the Model has no attribute {name!r}")
            saved["model"].setdefault(name, getattr(model, name))
            setattr(model, name, ast.literal_eval(value))
    apply_overrides([i for i in items if not i.startswith("model.")])


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="';'-separated settings ('' = defaults)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--moe", action="store_true", help="also time the MoE blocks alone per variant and round "
                                                       "(bench_slice.py's moe_decode)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ab_slice.py times CUDA graphs: it needs a GPU (bench_slice.py --small is the CPU smoke test)")
    device = torch.device("cuda")
    cfg = Config(**FLASH)
    weights, _, floor = random_packed(cfg, device)
    model = Model(cfg, weights, device=device, dtype=torch.bfloat16, ops=get_ops("triton"))
    ids = torch.randint(0, cfg.vocab_size, (1, a.prompt), device=device)
    cache = model.new_cache()
    first = model.step(ids, cache)[:, -1:].argmax(-1)
    saved = {"tri": launch_settings(), "model": {}}
    times: dict[str, list[float]] = {v: [] for v in a.variant}
    moe: dict[str, list[float]] = {v: [] for v in a.variant}
    cap = a.prompt + a.steps + 2
    tokens = None  # every variant is teacher-forced with the first one's eager tokens
    for r in range(a.rounds):
        for v in a.variant:
            _apply(model, v, saved)
            if r == 0:  # the variant's graph must reproduce its own eager step (as in bench_slice.py)
                sc, eager = model.static_cache(cache, cap), []
                for t in range(a.steps):
                    tok = first if t == 0 else (eager[-1].argmax(-1) if tokens is None else tokens[t - 1])
                    eager.append(model.decode(tok, sc))
                if tokens is None:
                    tokens = [lg.argmax(-1) for lg in eager]
                eager_logits = torch.cat(eager, 1).float()
            graph = DecodeGraph(model, model.static_cache(cache, cap))
            feed = iter([first] + tokens)
            logits = []

            def step(_, graph=graph, logits=logits, feed=feed):
                logits.append(graph(next(feed)))

            ms = time_steps(step, None, a.steps, device)[1:]  # the first call is the eager step + capture
            if r == 0:
                got = torch.cat(logits, 1).float()
                rel = ((got - eager_logits).norm(dim=-1) / eager_logits.norm(dim=-1)).max().item()
                if rel > 1e-6:
                    raise SystemExit(f"variant {v!r}: graph differs from its eager step by {rel:.2e}; no timing")
            times[v].append(statistics.median(ms))
            if a.moe:
                moe[v].append(moe_decode(model, device, 1.0)["moe_decode_us_per_token"])
            print(f"{v or '(defaults)':60s} {times[v][-1] * 1e3:7.1f} us/token"
                  + (f"  MoE blocks {moe[v][-1]:6.1f} us/token" if a.moe else ""), flush=True)
            del graph, logits
            torch.cuda.empty_cache()
    _apply(model, "", saved)
    res = {"device": torch.cuda.get_device_name(), "floor_bytes_per_token": floor,
           "variants": {v or "(defaults)": {"median_ms": statistics.median(t), "rounds_ms": t}
                        | ({"moe_median_us": statistics.median(moe[v]), "moe_rounds_us": moe[v]} if a.moe else {})
                        for v, t in times.items()}}
    print(json.dumps(res, indent=1))
    base = times[a.variant[0]]  # rounds are interleaved: compare each round with the first variant's same round
    for v, t in times.items():
        faster = sum(x < y for x, y in zip(t, base, strict=True))
        res["variants"][v or "(defaults)"]["faster_than_first_rounds"] = faster
        print(f"{v or '(defaults)':60s} median {statistics.median(t) * 1e3:7.1f} us, rounds {min(t) * 1e3:.1f}-"
              f"{max(t) * 1e3:.1f}, {(statistics.median(t) - statistics.median(base)) * 1e3:+6.1f} us against the "
              f"first variant, faster than it in {faster} of {len(t)} rounds")
    for path in (a.out, os.path.join(os.environ["OUT"], "ab_slice.json") if os.environ.get("OUT") else None):
        if path:
            with open(path, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
