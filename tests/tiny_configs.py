"""Tiny DeepSeek-V4 configs that together cover every layer and routing type, and a checkpoint maker.

FP8 linear dims are either < 128 or multiples of 128: transformers 5.23's dequantize derives the block
size as rows // scale_rows, which is wrong for a partial edge block (e.g. 160 rows -> blocks of 80), so
only such shapes make it an oracle. The engine itself handles partial blocks (tests/test_formats.py).
"""

from __future__ import annotations

from pathlib import Path

from cdna2_engine import checkpoint as ck
from cdna2_engine.config import Config

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
BASE = dict(vocab_size=97, hidden_size=96, num_attention_heads=3, head_dim=40, qk_rope_head_dim=16, q_lora_rank=48,
            o_groups=2, o_lora_rank=24, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=3,
            sliding_window=16, index_n_heads=16, index_head_dim=24, index_topk=5, hc_mult=2,
            max_position_embeddings=1024)

# name -> (config overrides, sequence length used in the tests)
CONFIGS = {
    "mixed": (dict(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, rope_scaling=YARN), 300),
    "hca-first": (dict(compress_ratios=[128, 4, 0], num_hash_layers=2, hc_mult=3, scoring_func="sigmoid",
                       sliding_window=32, index_topk=9), 330),
    "csa-only": (dict(compress_ratios=[4, 4], num_hash_layers=0, hc_mult=4,
                      sliding_window=8, index_topk=8, rope_scaling=YARN), 140),
    "wide-heads": (dict(compress_ratios=[128, 0, 4], num_hash_layers=1, hidden_size=64, num_attention_heads=2,
                        head_dim=64, qk_rope_head_dim=32, index_head_dim=32, o_groups=4, o_lora_rank=16,
                        moe_intermediate_size=96, n_routed_experts=6, num_experts_per_tok=2, rope_scaling=YARN), 280),
}


def make_config(name: str, **extra) -> Config:
    return Config(num_hidden_layers=len(CONFIGS[name][0]["compress_ratios"]), **{**BASE, **CONFIGS[name][0], **extra})


def make_checkpoint(folder: Path, cfg: Config, seed: int = 0, shard_bytes: int | None = None) -> Path:
    """A random official-layout checkpoint (FP8 + UE8M0 blocks, MXFP4 experts)."""
    ck.write_checkpoint(folder, cfg, ck.quantize_state(cfg, ck.random_dense_state(cfg, seed)), shard_bytes)
    return folder
