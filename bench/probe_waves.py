"""How many waves does each Triton launch of a flash-slice decode step take on this GPU?

A launch whose programs do not all fit the SMs at once runs a second, mostly empty wave: wq_b's fused q norm
took its kernel from 63 to 67 registers, 8 programs of 4 warps an SM became 7, and its 1024 programs took 13.0
us instead of 11.1 (bench/probe_fp8_norm.py, NOTES runs 234-236). This lists every launch of one eager decode step
with its grid, warps, registers and shared memory, the programs an SM can hold (registers, threads, shared
memory and the 32-block limit), and its waves; `near` marks launches just past a whole wave (up to 1.25) or
that one register-allocation step less (8 a thread) would bring to a whole wave.

    python bench/probe_waves.py [--out DIR]     # on the GPU machine (~1 min)
    python bench/probe_waves.py --moe-tokens 1 4 16 64   # the routed MoE alone (V4-Flash experts) at T tokens
"""

from __future__ import annotations

import argparse
import json
import math
import os

import bench_kernels as B
import torch
from bench_slice import FLASH, random_packed

from cdna2_engine.config import Config
from cdna2_engine.model import Model
from cdna2_engine.ops import get_ops
from cdna2_engine.ops import triton as tri


def per_sm(warps: int, regs: int, smem: int, props) -> int:
    """Programs an SM holds (NVIDIA: registers allocated per warp in 256-register units, i.e. 8 a thread)."""
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_regs = props.regs_per_multiprocessor // (math.ceil(max(regs, 1) / 8) * 8 * 32 * warps)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem_sm // (smem + 1024) if smem else 32
    return max(0, min(32, by_threads, by_regs, by_smem))


class Recorder:
    """Wraps the backend's launcher: every launch runs as before, and its grid, warps, registers and shared memory
    are kept with the waves they take on `props`'s GPU."""

    def __init__(self, props) -> None:
        self.props, self.rows, self.saved = props, [], tri._Launch.__call__

    def __enter__(self) -> Recorder:
        rec = self

        def record(self, name, grid, *args, **kwargs):
            k = getattr(self.mod, name)[grid](*args, **{**tri.COMPILE_OPTIONS, **kwargs})
            rec.add(name, grid, k)

        tri._Launch.__call__ = record
        return self

    def __exit__(self, *exc) -> None:
        tri._Launch.__call__ = self.saved

    def add(self, name: str, grid: tuple, k) -> None:
        props, sms = self.props, self.props.multi_processor_count
        warps, smem, n = k.metadata.num_warps, k.metadata.shared, math.prod(grid)
        fit, fewer = per_sm(warps, k.n_regs, smem, props), per_sm(warps, k.n_regs - 8, smem, props)
        waves = n / (fit * sms) if fit else float("inf")
        waves_fewer = n / (fewer * sms) if fewer else float("inf")
        self.rows.append({"kernel": name, "grid": list(grid), "programs": n, "warps": warps, "regs": k.n_regs,
                          "spills": k.n_spills, "smem": smem, "per_sm": fit, "waves": round(waves, 3),
                          "waves_8_regs_fewer": round(waves_fewer, 3),
                          "near": (1 < waves <= 1.25) or math.ceil(waves_fewer) < math.ceil(waves)})

    def show(self, title: str) -> None:
        print(f"== {title}")
        for r in self.rows:
            print(f"{r['kernel']:28s} {r['programs']:6d} progs {r['warps']:2d}w {r['regs']:3d} regs {r['smem']:6d} B "
                  f"{r['per_sm']:2d}/SM {r['waves']:7.3f} waves ({r['waves_8_regs_fewer']:.3f} at 8 fewer)"
                  f"{'  <- near' if r['near'] else ''}")


def slice_step(device: torch.device, props) -> list:
    """Every launch of one eager decode step of the flash slice (after a compiling step)."""
    cfg = Config(**FLASH)
    weights, _, _ = random_packed(cfg, device)
    model = Model(cfg, weights, device=device, dtype=torch.bfloat16, ops=get_ops("triton"))
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device=device)
    cache = model.new_cache()
    tok = model.step(ids, cache)[:, -1:].argmax(-1)
    sc = model.static_cache(cache, 80)
    model.decode(tok, sc)  # compile everything first
    with Recorder(props) as rec:
        model.decode(tok, sc)
    torch.cuda.synchronize()
    rec.show("flash slice, one decode step")
    return rec.rows


def moe_tokens(tokens: list[int], device: torch.device, props) -> dict:
    """The routed MoE's launches (V4-Flash: 256 experts of 4096 -> 2048, 6 a token) at each token count."""
    w1, w3, w2 = (B.fp4_weight(256, 2048, 4096), B.fp4_weight(256, 2048, 4096), B.fp4_weight(256, 4096, 2048))
    out = {}
    for t in tokens:
        x = torch.randn(t, 4096, device=device).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(256, device=device)[:6] for _ in range(t)])
        wt = torch.rand(t, 6, device=device)
        tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)  # compile first
        with Recorder(props) as rec:
            tri.moe_experts(x, w1, w3, w2, idx, wt, 10.0)
        torch.cuda.synchronize()
        rec.show(f"routed MoE, {t} tokens")
        out[t] = rec.rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--moe-tokens", type=int, nargs="*", help="the routed MoE alone at these token counts")
    a = ap.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    res = {"device": props.name, "sms": props.multi_processor_count}
    if a.moe_tokens:
        res["moe"] = moe_tokens(a.moe_tokens, device, props)
    else:
        res["launches"] = slice_step(device, props)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_waves.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
