"""Turn per-row candidate blocks (any order, duplicates, -1 holes) into the compact sorted lists."""
from __future__ import annotations

import torch
from torch import Tensor

from sparsity.block_sparse import INDEX_DTYPE

# Block indices stay far below 2**40; one int64 sort key then carries (class rank, block).
_SPAN = 1 << 40
_ABSENT = _SPAN - 1


def compact_block_lists(blocks: Tensor, is_full: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """blocks (R, Hs, n) int64, negative = absent; is_full broadcastable to it (a block's class
    must not depend on which duplicate carries it). Returns (full_count, full_index, mask_count,
    mask_index) in the BlockSparseTensors layout, padded to the longest list.

    Two sorts along the last axis: one to drop duplicates, one to put full blocks before mask
    blocks before holes. Memory stays O(R * Hs * n).
    """
    rows, heads, _ = blocks.shape
    by_block, order = blocks.masked_fill(blocks < 0, _ABSENT).sort(dim=-1)
    full = is_full.expand(blocks.shape).gather(-1, order)
    present = by_block != _ABSENT
    present[..., 1:] &= by_block[..., 1:] != by_block[..., :-1]

    rank = torch.where(present, (~full).to(torch.int64), 2)
    ordered = (rank * _SPAN + by_block.masked_fill(~present, 0)).sort(dim=-1).values % _SPAN

    full_count = (present & full).sum(-1)
    mask_count = (present & ~full).sum(-1)
    full_index = _take_lists(ordered, start=None, count=full_count)
    mask_index = _take_lists(ordered, start=full_count, count=mask_count)
    return (full_count.to(INDEX_DTYPE).contiguous(), full_index,
            mask_count.to(INDEX_DTYPE).contiguous(), mask_index)


def _take_lists(ordered: Tensor, *, start: Tensor | None, count: Tensor) -> Tensor:
    """Slices count[r, h] entries from position start[r, h] of each row, -1 padded to the max."""
    width = int(count.max()) if count.numel() else 0
    slots = torch.arange(width, device=ordered.device)
    if width == 0:
        return torch.full((*count.shape, 0), -1, dtype=INDEX_DTYPE, device=ordered.device)
    if start is None:
        values = ordered[..., :width]
    else:
        positions = (start[..., None] + slots).clamp(max=ordered.shape[-1] - 1)
        values = ordered.gather(-1, positions)
    listed = slots < count[..., None]
    return torch.where(listed, values, -1).to(INDEX_DTYPE).contiguous()
