"""Attention at V4-Flash shapes (64 heads x 512, shared K = V) with the model's masks, GPU time per call: decode
(one token; window 128 + a CSA layer's entries with 512 picked, at several contexts) and prefill (every
position; window 128 + entries visible by position, all picked while fewer than 512). `--old DIR` times a
second kernels package (e.g. `mkdir old && git archive HEAD~1 engine/ops/triton/kernels | tar -x -C old`, then
`--old old/engine/ops/triton/kernels`) beside the current one, in the same process; `--variant` the current
one with launch settings changed (bench_slice.py's --set items,
';' between several: "ATTN_GATHER_KEYS=0;ATTN_WIDE.num_warps=4"). Every variant must agree
with the current one (rel. Frobenius <= 1e-2, bench_kernels.check: bf16 outputs; a non-zero exit names a failed
case). The current kernel against float64 is the suite's and bench_kernels.py's.

    python bench/probe_attention.py [--old DIR] [--variant "ATTN_SCAN=256" ...] [--out DIR]   # GPU, ~1 min
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402
from bench_slice import apply_overrides, launch_settings  # noqa: E402

tri = B.tri

H, D, WIN, RATIO, PICKS = 64, 512, 128, 4, 512


def decode_case(ctx: int, g: torch.Generator) -> tuple:
    """One token at position ctx - 1: a full window ring, then ctx / 4 CSA entries of which 512 are picked."""
    t = ctx // RATIO
    mask = torch.zeros(1, 1, WIN + t, dtype=torch.bool)
    mask[..., :WIN] = True
    mask[0, 0, WIN + torch.randperm(t, generator=g)[:min(PICKS, t)]] = True
    return 1, WIN + t, mask


def prefill_case(s: int, g: torch.Generator) -> tuple:
    """Every position of an s-token prompt: keys are the prompt's then its s / 4 entries (model.py's masks)."""
    pos = torch.arange(s)
    win = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - WIN)
    t = s // RATIO
    ent = torch.arange(t)[None] < ((pos + 1) // RATIO)[:, None]
    if t > PICKS:  # each row keeps min(512, visible) of its visible entries, as the indexer's top-k does
        score = torch.rand(s, t, generator=g).masked_fill(~ent, -1.0)
        ent &= torch.zeros_like(ent).scatter_(1, score.topk(PICKS, dim=1).indices, True)
    return s, s + t, torch.cat([win, ent], 1)[None]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a second kernels package (its folder) to time beside the current one")
    ap.add_argument("--variant", action="append", default=[],
                    help="also time the current kernels with these launch settings (bench_slice.py's --set items, "
                         "';' between)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    mods = {"current": (tri._compiled, [])}
    for variant in a.variant:
        mods[variant] = (tri._compiled, [i.strip() for i in variant.split(";") if i.strip()])
    if a.old:
        mods["old"] = (tri.load_kernels(a.old, "old_kernels"), [])
    defaults = launch_settings()

    def restore() -> None:
        tri._compiled = mods["current"][0]
        for k, v in copy.deepcopy(defaults).items():
            setattr(tri, k, v)

    for _, items in mods.values():  # a bad setting stops the probe before any timing
        apply_overrides(items)
        restore()
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    cases = [(f"decode ctx {c}", decode_case(c, g)) for c in (1024, 8192, 16384, 32768, 65536)]
    cases += [(f"prefill {s}", prefill_case(s, g)) for s in (256, 1024, 4096)]
    rows, results = [], {"checks": {}}
    for name, (s, ln, mask) in cases:
        sets = max(2, min(64, (200 << 20) // ((s * H + ln) * D * 2)))
        q = [torch.randn(1, s, H, D, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        kv = [torch.randn(1, ln, D, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        sink = torch.randn(H, device=dev)
        m = mask.to(dev)
        row = {"case": name, "queries": s, "keys": ln, "visible_frac": round(float(mask.float().mean()), 4)}
        outs = {}
        for label, (mod, items) in mods.items():
            tri._compiled = mod
            try:
                apply_overrides(items)
                outs[label] = tri.attention(q[0], kv[0], sink, m, D**-0.5).float()
                call = lambda q, kv, sink=sink, m=m: tri.attention(q, kv, sink, m, D**-0.5)  # noqa: E731
                row[f"{label}_us"] = round(B.time_graph_ms(call, list(zip(q, kv, strict=True)), 20) * 1e3, 2)
            finally:
                restore()
        for label in outs.keys() - {"current"}:
            row[f"rel_{label}"] = float((outs[label] - outs["current"]).norm() / outs["current"].norm())
            B.check(results, f"{name} {label}", row[f"rel_{label}"])
        print(row, flush=True)
        rows.append(row)
    B.probe_done(a.out, "probe_attention", rows, results)


if __name__ == "__main__":
    main()
