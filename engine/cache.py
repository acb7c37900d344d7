"""Decode state per layer: the sliding-window KV and the compressors' running state.

A full prefill and an incremental decode run the same code over this state (a prefill is one chunk from
an empty cache), so "decode reproduces prefill" tests the chunk boundaries: the window, the compressor's
pending tokens, and CSA's overlap carried across calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """Tokens waiting for their window to close, the last closed window's Ca half (CSA's overlapping
    windows read it for the next entry), and every compressed entry emitted so far."""

    pending_kv: torch.Tensor | None = None  # [B, n < ratio, c]
    pending_gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None  # [B, ratio, d] (CSA only)
    prev_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [B, T, d], RoPE applied

    def count(self) -> int:
        return 0 if self.entries is None else self.entries.shape[1]


@dataclass
class LayerCache:
    window: torch.Tensor | None = None  # [B, <= sliding_window - 1, head_dim]: the newest KV rows
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


@dataclass
class Cache:
    layers: list[LayerCache]
    pos: int = 0  # tokens consumed so far (the next token's position)

    @classmethod
    def empty(cls, num_layers: int) -> Cache:
        return cls([LayerCache() for _ in range(num_layers)])
