"""Turn per-row candidate blocks (any order, duplicates, -1 holes) into the compact sorted lists.

Every function here reads the device once (the widths of the padded lists are data: the longest
list) and otherwise runs a fixed number of whole-tensor ops, so a GPU never waits on the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsity.block_sparse import INDEX_DTYPE

# Block indices stay far below 2**40; one int64 sort key then carries (class rank, block).
_SPAN = 1 << 40
_ABSENT = _SPAN - 1

Lists = tuple[Tensor, Tensor, Tensor, Tensor]  # full_count, full_index, mask_count, mask_index


def compact_block_lists_below(blocks: Tensor, full_end: Tensor,
                              widths: tuple[int, int] | None = None) -> Lists:
    """Like compact_block_lists, for the causal builders where a block is full exactly when its
    index is below its row's threshold: blocks (R, Hs, n) int64, negative = absent; full_end
    broadcastable to (R, Hs, 1).

    Full blocks then lead every ascending list, so sorting out holes and duplicates (two sorts
    of the block indices alone) already puts full before mask blocks. `widths`: host bounds on
    the longest full and mask lists (the lists are padded to them; no device read); None pads to
    the longest lists, read from the device.
    """
    keys = blocks.masked_fill(blocks < 0, _ABSENT).sort(dim=-1).values
    keys[..., 1:].masked_fill_(keys[..., 1:] == keys[..., :-1], _ABSENT)  # later duplicates
    ordered = keys.sort(dim=-1).values
    present = ordered != _ABSENT
    full_count = (present & (ordered < full_end)).sum(-1)
    mask_count = present.sum(-1) - full_count
    return _lists(ordered, full_count, mask_count, widths)


def compact_block_lists(blocks: Tensor, is_full: Tensor,
                        widths: tuple[int, int] | None = None) -> Lists:
    """blocks (R, Hs, n) int64, negative = absent; is_full broadcastable to it (a block's class
    must not depend on which duplicate carries it). Returns (full_count, full_index, mask_count,
    mask_index) in the BlockSparseTensors layout, padded to the longest list (one device read),
    or to `widths` (host bounds, e.g. (n, n): no read).

    Two sorts along the last axis: one to drop duplicates, one to put full blocks before mask
    blocks before holes. Memory stays O(R * Hs * n).
    """
    by_block, order = blocks.masked_fill(blocks < 0, _ABSENT).sort(dim=-1)
    full = is_full.expand(blocks.shape).gather(-1, order)
    present = by_block != _ABSENT
    present[..., 1:] &= by_block[..., 1:] != by_block[..., :-1]

    rank = torch.where(present, (~full).to(torch.int64), 2)
    ordered = (rank * _SPAN + by_block.masked_fill(~present, 0)).sort(dim=-1).values % _SPAN
    full_count = (present & full).sum(-1)
    return _lists(ordered, full_count, present.sum(-1) - full_count, widths)


def range_lists(start: Tensor, stop: Tensor, full_stop: Tensor) -> Lists:
    """Per row the full blocks [start, full_stop) and the mask blocks [full_stop, stop), each
    (R,) int64 with start <= full_stop <= stop, as (R, 1) lists."""
    full_count, mask_count = full_stop - start, stop - full_stop
    full_width, mask_width = _widths(full_count, mask_count)
    return (full_count[:, None].to(INDEX_DTYPE),
            _range_index(start, full_count, full_width)[:, None].contiguous(),
            mask_count[:, None].to(INDEX_DTYPE),
            _range_index(full_stop, mask_count, mask_width)[:, None].contiguous())


def padded_range(start: Tensor, stop: Tensor, width: int) -> Tensor:
    """(R, width) int64: the blocks [start, stop) of each row, -1 padded; width (a host bound on
    stop - start) needs no device read."""
    slots = torch.arange(width, device=start.device)
    return torch.where(slots < (stop - start)[:, None], start[:, None] + slots, -1)


def _lists(ordered: Tensor, full_count: Tensor, mask_count: Tensor,
           widths: tuple[int, int] | None = None) -> Lists:
    """Full lists are the first full_count entries of each ordered row, mask lists the next
    mask_count; both -1 padded to their longest list, or to `widths` (host bounds the caller
    guarantees: an entry past them would be lost)."""
    full_width, mask_width = widths if widths is not None else _widths(full_count, mask_count)
    full_index = _take(ordered[..., :full_width], full_count, full_width)
    if mask_width:
        slots = torch.arange(mask_width, device=ordered.device)
        positions = (full_count[..., None] + slots).clamp_(max=ordered.shape[-1] - 1)
        mask_index = _take(ordered.gather(-1, positions), mask_count, mask_width)
    else:
        mask_index = _take(ordered[..., :0], mask_count, 0)
    return (full_count.to(INDEX_DTYPE).contiguous(), full_index,
            mask_count.to(INDEX_DTYPE).contiguous(), mask_index)


def _widths(full_count: Tensor, mask_count: Tensor) -> tuple[int, int]:
    """The longest full and mask lists: the one device -> host read of a build."""
    if full_count.numel() == 0:
        return 0, 0
    full_width, mask_width = torch.stack([full_count.max(), mask_count.max()]).tolist()
    return full_width, mask_width


def _take(values: Tensor, count: Tensor, width: int) -> Tensor:
    """values (..., width): the first count[...] entries of each row, the rest -1."""
    listed = torch.arange(width, device=values.device) < count[..., None]
    return torch.where(listed, values, -1).to(INDEX_DTYPE).contiguous()


def _range_index(start: Tensor, count: Tensor, width: int) -> Tensor:
    slots = torch.arange(width, device=start.device)
    return torch.where(slots < count[:, None], start[:, None] + slots, -1).to(INDEX_DTYPE)
