"""Train the bundled tiny DeepSeek-V4 (goldens/tiny-v4/model) on the Python standard library's own sources.

Byte-level vocabulary (256), every layer type (sliding, CSA with indexer, HCA), hash and top-k MoE,
hc_mult 2. Trained in float32 through the engine's own reference ops (autograd), then stored in the
official layout (FP8 e4m3 + UE8M0 128x128, MXFP4 experts). The text is on every machine with Python, so
this reproduces anywhere: `python tools/train_tiny.py --out goldens/tiny-v4/model` (CPU: about 10 min;
pass --device cuda on a GPU). The indexer's weights get no gradient through its discrete top-k and stay
at their random start, as the lightning indexer is trained by a separate loss in V4.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

import cdna2_engine
from cdna2_engine import checkpoint as ck
from cdna2_engine.config import Config
from cdna2_engine.ops import QWeight

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
            qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=64,
            n_routed_experts=8, num_experts_per_tok=2, compress_ratios=[0, 4, 128, 4], num_hash_layers=1,
            sliding_window=32, index_n_heads=16, index_head_dim=32, index_topk=4, hc_mult=2,
            max_position_embeddings=4096,
            rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                          "beta_fast": 32, "beta_slow": 1})


def corpus() -> tuple[bytes, bytes]:
    """(train, held-out) bytes: the stdlib's top-level modules, split by file name parity."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 8)
    held = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 8 == 0)
    return train, held


def batch(data: bytes, n: int, T: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(data) - T - 1) for _ in range(n)]
    return torch.tensor([list(data[s:s + T + 1]) for s in starts], dtype=torch.long)


@torch.no_grad()
def evaluate(model, held: bytes, T: int = 256, n: int = 16) -> dict[str, float]:
    ids = batch(held, n, T, random.Random(1234))
    logits = model.step(ids[:, :-1], model.new_cache()).float()
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(-1, ids[:, 1:, None]).mean().item()
    return {"perplexity": math.exp(nll), "mean_top1_prob": logp.exp().amax(-1).mean().item()}


def trainable(model) -> list[torch.Tensor]:
    ts = [v.data if isinstance(v, QWeight) else v for v in model.w.values()]
    ts += [q.data for e in model.experts for q in e.values()]
    ts = [t for t in ts if t.is_floating_point()]
    for t in ts:
        t.requires_grad_(True)
    return ts


def dense_state(model) -> dict[str, torch.Tensor]:
    out = {k: (v.data if isinstance(v, QWeight) else v).detach().cpu() for k, v in model.w.items()}
    for i, e in enumerate(model.experts):
        for name, q in e.items():
            for j in range(q.data.shape[0]):
                out[f"layers.{i}.ffn.experts.{j}.{name}.weight"] = q.data[j].detach().cpu()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.out.exists() and any(a.out.iterdir()):
        raise SystemExit(f"{a.out}: exists and is not empty: choose a new folder or remove it first")
    torch.manual_seed(a.seed)
    cfg = Config(**TINY)
    train, held = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        ck.write_checkpoint(tmp, cfg, ck.random_dense_state(cfg, a.seed))
        model = cdna2_engine.load_model(tmp, device=a.device, dtype=torch.float32)
    before = evaluate(model, held)
    params = trainable(model)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng, t0 = random.Random(a.seed), time.time()
    for step in range(a.steps):
        lr = a.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = batch(train, a.batch, a.seq, rng).to(a.device)
        logits = model.step(ids[:, :-1], model.new_cache())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
    for t in params:
        t.requires_grad_(False)
    after = evaluate(model, held)
    ck.write_checkpoint(a.out, cfg, ck.quantize_state(cfg, dense_state(model)))
    quantized = evaluate(cdna2_engine.load_model(a.out, dtype=torch.float32), held)
    report = {"corpus": "CPython stdlib top-level *.py (train: files i % 8 != 0, held out: i % 8 == 0)",
              "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr, "seed": a.seed,
              "seconds": round(time.time() - t0), "torch": torch.__version__,
              "held_out_before": before, "held_out_after": after, "held_out_after_fp8_mxfp4": quantized}
    (a.out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
