"""The MXFP4 weight layout of the few-token tensor-core kernels (kernels/mma.py, `moe_mma_*`), made once per weight.

mma.sync m16n8k16 hands each lane (g = lane // 4, t = lane % 4) of a warp the A elements (row g or g + 8,
column 2t, 2t + 1, 2t + 8 or 2t + 9) of a 16 x 16 tile as four bf16 pairs. `mma_repack` stores the 8 codes a
lane needs for one mma step in one int32 word, and the 8 words of a [16 rows x 128 K] tile as two halves of
[32 lanes x 4 words] (steps 0-3, then 4-7), so each 16-byte load of a warp reads 512 consecutive bytes (a lane's 8
words in one 32-byte run made each load touch every sector of the 1 KB tile: 0.60 -> 0.62 of copy, run 68).
Inside a word, pair j's two codes (h = 0, 1: columns +0 and +1) sit with their 3 magnitude bits at MAGPOS[j] + 16 h
and their sign bit at SIGNPOS[j] + 16 h; a mask (pair 0) or two shifts, two masks and an or (`_a_regs`) move each
pair to bits 6-8 and 15 of its bf16 halves: the bf16 E2M1 x 2^-126.
Pairs: j = 0 (row g, column 2t), 1 (row g + 8, 2t), 2 (row g, 2t + 8), 3 (row g + 8, 2t + 8).
The scales follow the accumulator fragment instead: the lane holding output rows g and g + 8 and column pair
(2t, 2t + 1), which is scale group t of the tile (x is block-diagonal over the tile's 4 groups), gets bytes
(row g, group t) and (row g + 8, group t).
"""

from __future__ import annotations

import torch

MAGPOS = (6, 9, 3, 0)
SIGNPOS = (15, 14, 13, 12)
ROWS_PER_CHUNK = 4096  # rows repacked at once (the int64 intermediates: ~8 bytes x 32 per packed byte)


def _fragment_index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column) in a 16 x 16 step of each lane's pair j, half h: [32, 4, 2]; and each lane's g, t."""
    lane = torch.arange(32, device=device)
    g, t = lane // 4, lane % 4
    j = torch.arange(4, device=device)[None, :, None]
    h = torch.arange(2, device=device)[None, None, :]
    rows = (g[:, None, None] + 8 * (j & 1)).expand(32, 4, 2)
    cols = (2 * t[:, None, None] + 8 * (j >> 1) + h).expand(32, 4, 2)
    return rows, cols, g, t


def mma_repack(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes [..., R, K/2] (int8/uint8, element 2i in the low nibble) and UE8M0 scales [..., R, K/32] ->
    words [..., R/16, K/128, 2, 32, 4] int32 (half, lane, step % 4) and scales [..., R/16, K/128, 32, 2] uint8
    (module docstring)."""
    *lead, r, k2 = data.shape
    k = 2 * k2
    if r % 16 or k % 128 or tuple(scale.shape) != (*lead, r, k // 32):
        raise ValueError(f"mma_repack: needs rows % 16 == 0, K % 128 == 0 and scales [..., R, K/32]; got codes "
                         f"{tuple(data.shape)} and scales {tuple(scale.shape)}")
    u8 = data.reshape(-1, k2).contiguous().view(torch.uint8)
    s8 = scale.reshape(-1, k // 32).contiguous().view(torch.uint8)
    rows, cols, g, t = _fragment_index(data.device)
    h = torch.arange(2, device=data.device)
    mag = torch.tensor(MAGPOS, device=data.device)[:, None] + 16 * h
    sgn = torch.tensor(SIGNPOS, device=data.device)[:, None] + 16 * h
    words, scales = [], []
    for lo in range(0, u8.shape[0], ROWS_PER_CHUNK):
        c = u8[lo:lo + ROWS_PER_CHUNK]
        n = c.shape[0]
        codes = torch.stack((c & 0x0F, c >> 4), dim=-1).reshape(n // 16, 16, k // 128, 8, 16).to(torch.int64)
        sel = codes.permute(0, 2, 3, 1, 4)[:, :, :, rows, cols]  # [RT, KT, step, lane, j, h]
        w = ((sel & 7) << mag).sum((-2, -1)) + ((sel >> 3) << sgn).sum((-2, -1))  # disjoint bits: sum = or
        words.append(torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).transpose(2, 3))
        s4 = s8[lo:lo + n].reshape(n // 16, 16, k // 128, 4).permute(0, 2, 1, 3)  # [RT, KT, row, group]
        scales.append(torch.stack((s4[:, :, g, t], s4[:, :, g + 8, t]), dim=-1))
    return (torch.cat(words).reshape(*lead, r // 16, k // 128, 32, 2, 4).transpose(-3, -2).contiguous(),
            torch.cat(scales).reshape(*lead, r // 16, k // 128, 32, 2).contiguous())


def interleave_rows(a: torch.Tensor, b: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """[..., R, C] twice -> [..., 2R, C] in alternating blocks of `rows` (a's block i, then b's block i)."""
    *lead, r, c = a.shape
    return torch.stack((a.reshape(*lead, r // rows, rows, c), b.reshape(*lead, r // rows, rows, c)),
                       dim=-3).reshape(*lead, 2 * r, c)
