"""Prefill of the V4-Flash slice (bench_slice.py's 4 layers, random official-format weights) on the GPU: the
time per prompt with every position's logits and with the last one's (generate's prefill, `last_only`), and the
GPU time by kernel of the latter, to find kernels tuned only for decode (NOTES run 137: a prefill's
q RoPE took 124 us in one program per position).

    python bench/probe_prefill.py [--prompts 256 1024] [--out DIR]     # on the GPU machine (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from bench_slice import FLASH, random_packed
from torch.profiler import ProfilerActivity, profile

from cdna2_engine.config import Config
from cdna2_engine.model import Model
from cdna2_engine.ops import get_ops


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_prefill.py needs a GPU (CUDA or ROCm): run it on the GPU machine")
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    cfg = Config(**FLASH)
    weights, _, _ = random_packed(cfg, torch.device("cuda"))
    model = Model(cfg, weights, device=torch.device("cuda"), dtype=torch.bfloat16, ops=get_ops("triton"))
    res = {"device": torch.cuda.get_device_name(), "prompts": {}}
    for n in a.prompts:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        ms = {}
        for last in (False, True):  # every position's logits (forward, trace), the last one's (generate)
            model.step(ids, model.new_cache(), last_only=last)  # compile
            ms[last] = []
            for _ in range(3):
                cache = model.new_cache()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                model.step(ids, cache, last_only=last)
                e.record()
                e.synchronize()
                ms[last].append(s.elapsed_time(e))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.step(ids, model.new_cache(), last_only=True)
            torch.cuda.synchronize()
        by_name: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                by_name.setdefault(ev.name[:80], []).append(ev.device_time_total)
        rows = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)
        total = sum(r[0] for r in rows)
        print(f"prefill {n} tokens: {statistics.median(ms[False]):.2f} ms with every position's logits, "
              f"{statistics.median(ms[True]):.2f} ms with the last one's (events); {total / 1e3:.2f} ms of kernels "
              "in the last-only one, by kernel:")
        for us, calls, name in rows[:25]:
            print(f"  {us:9.1f} us {calls:4d}x  {name}")
        res["prompts"][n] = {"ms_all_logits": statistics.median(ms[False]),
                             "ms_last_logits": statistics.median(ms[True]), "kernel_us_last": total,
                             "top": [{"us": us, "calls": c, "name": k} for us, c, k in rows[:40]]}
    with open(os.path.join(a.out, "probe_prefill.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
