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
    batch: int = 0  # rows, set by the first step

    @classmethod
    def empty(cls, num_layers: int) -> Cache:
        return cls([LayerCache() for _ in range(num_layers)])


@dataclass
class StaticCompressor:
    """A compressor's state in fixed shapes for the graph-captured decode step: a ring of the last one (HCA)
    or two (CSA: the previous window's Ca half is read by the next entry) windows of projected rows, with
    the gate's position bias already added, and every entry slot preallocated (the entry of the window in
    progress is rewritten each step and becomes visible, `valid`, when its window closes)."""

    kv: torch.Tensor  # [B, ring, c], ring = ratio (HCA) or 2 * ratio (CSA); slot = position % ring
    gate: torch.Tensor  # [B, ring, c], -inf where nothing was written yet
    entries: torch.Tensor  # [B, capacity // ratio + 1, d]
    valid: torch.Tensor  # [B, capacity // ratio + 1] bool: the entry's window has closed


@dataclass
class StaticLayer:
    """One layer's attention state: `keys` holds the sliding-window ring (slot = position % window) followed by
    the compressor's entry slots, and `mask` [B, 1, keys] says which of them the next query sees, so the
    attention reads one buffer with no per-step concatenation. A ring slot is visible once written (it then
    holds one of the last `window` positions); an HCA entry once its window closed (the compressor writes
    that flag straight into the mask); a CSA entry once closed and picked by the indexer."""

    keys: torch.Tensor  # [B, window + entry slots, head_dim]
    mask: torch.Tensor  # [B, 1, window + entry slots] bool
    window_size: int
    compressor: StaticCompressor | None = None
    indexer: StaticCompressor | None = None

    @property
    def window(self) -> torch.Tensor:
        return self.keys[:, : self.window_size]

    @property
    def window_ok(self) -> torch.Tensor:
        return self.mask[:, 0, : self.window_size]

    @property
    def entry_mask(self) -> torch.Tensor:
        return self.mask[:, :, self.window_size:]


@dataclass
class StaticCache:
    """Decode state with every shape fixed and the position on the device, so one decode step can be
    captured in a CUDA graph (`cdna2_engine.model.DecodeGraph`) and replayed with no host involvement.
    Built from a `Cache` after the prefill (`Model.static_cache`); `capacity` bounds the total tokens."""

    layers: list[StaticLayer]
    pos: torch.Tensor  # [1] int64 on the device: the next token's position
    capacity: int
    host_pos: int  # the same position counted on the host (read without a sync) to refuse overflow
