"""Why does bf16 triton incremental decode differ from its prefill? (run 247's question: 1.8 on the H200)
1. graph on/off (batch 1), and the determinism tier's judge at its batch of 2 (near-tie flips told from bugs);
2. with --ops, each op taken from the reference in turn."""
import sys

import torch

from cdna2_engine import load_model
from cdna2_engine.ops import OP_NAMES
from pytest_cdna2.judge import INCREMENTAL_PROMPT, judge_incremental, probe_ids
from pytest_cdna2.tolerance import load_profile

ARGS = [a for a in sys.argv[1:] if a != "--ops"]
MODEL, DEV, STEPS = "goldens/tiny-v4/model", ARGS[0] if ARGS else "cuda:0", 40


def spread(m, ids, graph=None):
    gen = m.generate(ids, STEPS, graph=graph)
    full = m.forward(torch.cat([ids, gen.tokens], 1)[:, :-1])[:, ids.shape[1] - 1:]
    d = (gen.logits.float() - full.float()).abs().amax(-1)
    return d.max().item(), d.argmax().item()


m = load_model(MODEL, device=DEV, backend="triton", dtype="bfloat16")
ids = probe_ids(m, repeat=2)[:, :INCREMENTAL_PROMPT]
print("graph default", spread(m, ids), "graph off", spread(m, ids, graph=False), flush=True)
for tie in (0.0, load_profile(dtype="bfloat16").token.tie_margins):
    print(f"judge_incremental tie_margin {tie}:", judge_incremental(m, 0.5, tie), flush=True)

if "--ops" in sys.argv:  # each op from the reference in turn (~1 min more)
    for op in OP_NAMES:
        r = load_model(MODEL, device=DEV, backend="triton", dtype="bfloat16", reference_ops=[op])
        print(f"reference {op:24s}", spread(r, ids), flush=True)
