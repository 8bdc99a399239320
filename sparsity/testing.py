"""Test helpers: expand compact lists to dense tables. For tests at small sizes only.

Production code never needs these: a dense (row blocks x column blocks) table is exactly the
memory the compact layout exists to avoid.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsity.block_sparse import BlockSparseTensors
from sparsity.builders import FULL_BLOCK, MASK_BLOCK, NOT_LISTED

__all__ = ["FULL_BLOCK", "MASK_BLOCK", "NOT_LISTED", "dense_block_mask"]


def dense_block_mask(bs: BlockSparseTensors, num_col_blocks: int) -> Tensor:
    """(R, Hs, num_col_blocks) int8: FULL_BLOCK, MASK_BLOCK or NOT_LISTED per column block.

    Column indices are local to each row's sequence, so num_col_blocks must cover the longest
    sequence's blocks. A block listed in both lists (invalid input) reads as
    FULL_BLOCK | MASK_BLOCK.
    """
    rows, heads = bs.full_count.shape
    table = torch.zeros((rows, heads, num_col_blocks + 1), dtype=torch.int8, device=bs.device)
    for index, count, value in ((bs.full_index, bs.full_count, FULL_BLOCK),
                                (bs.mask_index, bs.mask_count, MASK_BLOCK)):
        listed = torch.arange(index.shape[-1], device=bs.device) < count[..., None]
        # Unlisted slots land in the spare last column, which is cut off below.
        target = torch.where(listed, index.to(torch.int64), num_col_blocks)
        if bool((target > num_col_blocks).any()):
            raise ValueError(f"num_col_blocks={num_col_blocks} is smaller than a listed block")
        contribution = torch.zeros_like(table).scatter_(-1, target, value)
        table |= contribution
    return table[..., :num_col_blocks]
