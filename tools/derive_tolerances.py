"""Derive the token and determinism limits of a tolerance profile from measured spreads.

Independent correct paths on the bundled model: the float64 goldens against the float32 reference
engine and the float32 Triton backend (float32 profile), or against the bf16 reference (bf16 profile).
Logit and tap metrics are measured with the golden's sparse selections forced in, as the token tier
judges a prompt whose selections flipped at near-ties; the tie margins (one per kind) cover every flip seen.
Each limit is the worst value seen over every golden prompt, times MARGIN (10x: room for other
hardware's different but correct summation orders, still orders of magnitude below a real bug: the
fault catalog moves KL by > 1e-2). The profile is written with the measurements beside each number.

    python tools/derive_tolerances.py --dtype float32 --out pytest_cdna2/tolerance_default.toml
    python tools/derive_tolerances.py --dtype bfloat16 --out pytest_cdna2/tolerance_bf16.toml
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
from pathlib import Path

import torch

import cdna2_engine
from pytest_cdna2.bisect import rel_fro, tap_order
from pytest_cdna2.compare import flip_width, logit_metrics
from pytest_cdna2.goldens import GoldenStore
from pytest_cdna2.judge import batch_spread, judge_incremental

KINDS = ("router", "indexer")
MARGIN = 10.0
ROOT = Path(__file__).resolve().parent.parent


def measure(model, store: GoldenStore, prompts: int | None = None, tokens: int | None = None) -> dict[str, float]:
    """Worst metrics of `model` over the golden prompts (teacher-forced, taps, selection flips); `prompts`
    and `tokens` cut the work for slow paths (Triton's interpreter on the CPU)."""
    worst = {"kl_max": 0.0, "one_minus_cos": 0.0, "max_abs": 0.0, "top1_min": 1.0, "tap_rtol_fro": 0.0,
             **{f"{w}_{kind}": 0 for w in ("flip_width", "flips") for kind in KINDS}}
    for p in store.prompts[:prompts]:
        ids = store.input_ids(p.name).unsqueeze(0)[:, :tokens]
        gt = {k: v[:tokens] for k, v in store.taps(p.name).items()}
        golden_sel = store.selections(p.name)
        # golden selections forced, as the token tier judges a near-tie flip; the trace then records the
        # engine's own pick at each layer given the golden upstream: a flip there is that layer's rounding
        forced = {k: s.indices[:tokens].unsqueeze(0) for k, s in golden_sel.items()}
        tr = model.trace(ids, taps=tap_order(gt), selections=forced)
        m = logit_metrics(tr.logits[0], store.teacher_logits(p.name)[:tokens])
        worst["kl_max"] = max(worst["kl_max"], m.kl_max)
        worst["one_minus_cos"] = max(worst["one_minus_cos"], 1 - m.cosine_min)
        worst["max_abs"] = max(worst["max_abs"], m.max_abs)
        worst["top1_min"] = min(worst["top1_min"], m.top1_agreement)
        for name, t in gt.items():
            worst["tap_rtol_fro"] = max(worst["tap_rtol_fro"], rel_fro(tr.taps[name][0], t))
        for key, gs in golden_sel.items():
            finite = gs.margin[:tokens][torch.isfinite(gs.margin[:tokens])]
            worst.setdefault("margins", {}).setdefault(key[1], []).append(finite)
            mine, gold = tr.selections[key].indices[0], gs.indices[:tokens]
            differ = (mine.sort(-1).values != gold.sort(-1).values).any(-1)
            for t in differ.nonzero().flatten().tolist():  # the band each flip needs (old stores: its margin)
                width = gs.margin[t].item() if gs.ranked is None else \
                    flip_width(mine[t].tolist(), gold[t].tolist(), gs.ranked[t].tolist(), gs.scores[t].tolist())
                if not math.isfinite(width):
                    raise SystemExit(f"prompt {p.name}: layer {key[0]} {key[1]} at step {t}: a flip no rounding "
                                     "explains (outside the golden's ranked entries, or at no competitor): fix the "
                                     "engine (or raise RANKED_EXTRA in engine/model.py) before deriving")
                worst[f"flips_{key[1]}"] += 1
                worst[f"flip_width_{key[1]}"] = max(worst[f"flip_width_{key[1]}"], width)
    return worst


def determinism(model, tie_margin: float) -> dict[str, float]:
    """The determinism tier's own probes (pytest_cdna2.judge), on this model; the incremental one as the tier
    judges it when over its limit (limit 0: against a prefill given the decode's picks whenever one flipped)."""
    inc = judge_incremental(model, 0.0, tie_margin)
    if inc.cause not in ("", "limit"):  # a failure beside the diff: no limit can be derived from it
        raise SystemExit(f"derive_tolerances: the determinism probe fails on this engine: {inc.message}")
    return {"batch": max(batch_spread(model)), "incremental": inc.diff}


def up2(x: float) -> float:
    """x rounded up to two significant digits (as the profile prints it: never below what was measured)."""
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / step - 1e-9) * step


def limit(x: float, floor: float) -> float:
    """x * MARGIN rounded up to one significant digit, never below `floor`."""
    v = max(x * MARGIN, floor)
    e = math.floor(math.log10(v))
    return math.ceil(v / 10**e) * 10**e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "goldens/tiny-v4/model")
    ap.add_argument("--goldens", type=Path, default=ROOT / "goldens/tiny-v4/goldens")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    store = GoldenStore.open(a.goldens)
    dtype = getattr(torch, a.dtype)
    paths = {"reference": cdna2_engine.load_model(a.model, dtype=dtype)}
    if a.dtype == "float32":  # the interpreter cannot run bf16
        paths["triton"] = cdna2_engine.load_model(a.model, dtype=dtype, backend="triton")
    # the interpreter runs every kernel program in Python: the first 4 prompts (with taps), 96 tokens
    seen = {name: measure(m, store, *((4, 96) if name == "triton" else (None, None))) for name, m in paths.items()}
    margins = {kind: torch.cat(m).double() for kind, m in seen["reference"].pop("margins").items()}
    for s in seen.values():
        s.pop("margins", None)
    w = {k: (min if k == "top1_min" else max)(s[k] for s in seen.values()) for k in seen["reference"]}
    for k, v in w.items():
        print(f"{k:16s} {v:.3e}   " + "  ".join(f"{n}={s[k]:.3e}" for n, s in seen.items()))
    cos_gap = limit(w["one_minus_cos"], 1e-9)
    # tie margins, per kind (router scores round far less than indexer scores): 2x the widest golden near-tie
    # band that a rounding flip needed (the best score left out minus the worst picked: a simple swap's margin,
    # more at a three-way tie; a flip beyond it is a bug); with no flip seen, a chosen 1e-4 (far above float32
    # score rounding), which is also the floor (flips only at exact ties). The share of golden selections with
    # a margin under it says how many could be forgiven.
    tie = {kind: up2(max(2 * w[f"flip_width_{kind}"], 1e-4)) if w[f"flips_{kind}"] else 1e-4 for kind in KINDS}
    det = determinism(paths["reference"], tie)
    print(f"batch {det['batch']:.3e}  incremental {det['incremental']:.3e}")
    ties = "\n".join(
        f"tie_margin_{kind} = {tie[kind]:.1e}   # " + (f"2 x {w[f'flip_width_{kind}']:.2e}, the widest golden band "
                                                     f"of {w[f'flips_{kind}']} rounding flips" if w[f"flips_{kind}"]
                                                     else "chosen: no rounding flip seen") +
        f"\n# ({(margins[kind] < tie[kind]).double().mean().item():.1%} of golden {kind} selections have a margin "
        f"under it; median margin {margins[kind].median().item():.2e})" for kind in KINDS)
    batch_lim = limit(det["batch"], 1e-12) if det["batch"] else 0.0
    incr_lim = limit(det["incremental"], 1e-12)
    stamp = f"{datetime.date.today()} on {platform.machine()} torch {torch.__version__}"
    src = " and ".join(f"{a.dtype} {n}" for n in seen)
    text = f'''# pytest-cdna2 tolerance profile for {a.dtype} engines, derived by tools/derive_tolerances.py
# ({stamp}): the float64 goldens of the bundled tiny-v4 against {src},
# worst value over every golden prompt, times a margin of {MARGIN:g} rounded up to one digit.
# A user profile (--cdna2-tolerance=FILE) needs only the keys it changes.

name = "{a.dtype}-derived"

[token]
kl_max = {limit(w["kl_max"], 1e-12):.0e}        # measured {w["kl_max"]:.2e} nats
cosine_min = {1 - cos_gap:.12g}   # measured 1 - cos = {w["one_minus_cos"]:.2e}
max_abs = {limit(w["max_abs"], 1e-9):.0e}       # measured {w["max_abs"]:.2e}
top1_min = {1 - limit(1 - w["top1_min"], 1e-3):.4g}   # measured {w["top1_min"]:.4f} (floor: 1e-3 disagreement)
topk = 5                   # chosen, not measured: vLLM's containment check at the first greedy divergence
{ties}
tap_rtol_fro = {limit(w["tap_rtol_fro"], 1e-12):.0e}    # measured {w["tap_rtol_fro"]:.2e}

[kernel]
# DESIGN.md section 5 gates: rel. Frobenius error against float64 by operand dtype.
rtol_fro_float64 = 1e-12
rtol_fro_float32 = 1e-5
rtol_fro_float16 = 1e-2
rtol_fro_bfloat16 = 1e-2

[determinism]
repeat_max_abs = 0.0        # fixed reduction order: bit-identical
batch_max_abs = {batch_lim:.0e}  # measured {det["batch"]:.2e} (0: bit-identical; kernels may tile by M: re-derive)
incremental_max_abs = {incr_lim:.0e}  # measured {det["incremental"]:.2e}
device_max_abs = 0.0        # the same kernels on two identical GCDs
'''
    a.out.write_text(text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
