"""How a timing depends on what the GPU did just before it: the one-token MXFP4 pair and the FP8 wq_b, each timed
by `time_graph_ms` after 1 s of idle (as after a compile) with 0 to 2 s of graph replays first (WARM_S), rounds
interleaved, the SM clock and power read right after each timing (not during it). Run 219 found the warm-up
raising the FP8 stream's fraction and lowering the MoE pair's. One set of weights throughout: this does not test
the fresh-weights effect of run 216.

    python bench/probe_warm.py [--out DIR]      # on the GPU machine (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

WARMS = (0.0, 0.05, 0.5, 2.0)


def gpu_state() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tri = B.tri
    copy = B.copy_tbps()
    w1, w3, w2 = (B.fp4_weight(B.N_EXP, B.INTER, B.HID), B.fp4_weight(B.N_EXP, B.INTER, B.HID),
                  B.fp4_weight(B.N_EXP, B.HID, B.INTER))
    sets = []
    for _ in range(24):
        x = torch.randn(1, B.HID, device="cuda", dtype=torch.bfloat16)
        idx = torch.randperm(B.N_EXP, device="cuda")[: B.TOPK][None]
        sets.append((x, idx, torch.rand(1, B.TOPK, device="cuda"), tri.moe_prepare(x, idx, B.N_EXP)))
    moe_bytes = B.TOPK * sum(w.nbytes() for w in (w1, w3, w2)) / B.N_EXP
    moe = B.moe_pair(w1, w3, w2)

    ws = [B.fp8_weight(B.HEADS * B.HEAD_DIM, B.Q_LORA) for _ in range(8)]
    xs = [torch.randn(1, B.Q_LORA, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    fp8_bytes = ws[0].nbytes()
    cases = [("mxfp4 M=1", moe, sets, moe_bytes), ("fp8 wq_b M=1", tri.linear, list(zip(xs, ws, strict=True)),
                                                   fp8_bytes)]
    rows = []
    for rnd in range(a.rounds):
        for name, fn, args, nbytes in cases:
            for warm in WARMS:
                B.WARM_S = warm
                time.sleep(1.0)  # idle, as while the host compiles the next tile
                ms = B.time_graph_ms(fn, args)
                state = gpu_state()
                frac = nbytes / (ms * 1e-3) / 1e12 / copy
                rows.append({"round": rnd, "case": name, "warm_s": warm, "us": ms * 1e3, "frac": frac,
                             "after": state})
                print(f"{rnd} {name:13s} warm {warm:4.2f} s  {ms * 1e3:7.2f} us  {frac:.3f}  after: {state}",
                      flush=True)
    with open(os.path.join(a.out, "probe_warm.json"), "w") as f:
        json.dump({"copy_TBps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
