"""Brute-force oracles for the sparsity tests, token by token at small sizes.

Independent of the builders' closed forms: visibility is a dense (rows x keys) table per
sequence, and tiles are classified by counting attended and existing cells.
"""
from __future__ import annotations

import torch

from sparsity import BlockSparseTensors, validate_block_sparse
from sparsity.testing import FULL_BLOCK, MASK_BLOCK, NOT_LISTED, dense_block_mask


def cu_from_lengths(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def key_visibility(nq: int, nk: int, *, compress_factor: int = 1, causal: bool = True):
    """(nq, nk) bool: row i sees key j (key j stands for tokens [j*cf, (j+1)*cf))."""
    rows = torch.arange(nq)[:, None]
    keys = torch.arange(nk)[None, :]
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool)
    return (keys + 1) * compress_factor - 1 <= rows


def classify_cells(intended: torch.Tensor, q_tile: int, kv_block: int, num_blocks: int):
    """intended (H, nq, nk) bool -> (tiles, H, num_blocks) int8 classes over existing cells.

    Counts attended and existing cells of every (tile, block) on zero-padded grids."""
    heads, nq, nk = intended.shape
    tiles, blocks = ceil_div(nq, q_tile), ceil_div(nk, kv_block)
    grid = torch.zeros(heads, tiles * q_tile, num_blocks * kv_block, dtype=torch.int64)
    exists = torch.zeros(tiles * q_tile, num_blocks * kv_block, dtype=torch.int64)
    grid[:, :nq, :nk] = intended.long()
    exists[:nq, :nk] = 1
    attended = grid.view(heads, tiles, q_tile, num_blocks, kv_block).sum((2, 4))
    cells = exists.view(tiles, q_tile, num_blocks, kv_block).sum((1, 3))
    classes = torch.where(attended == 0, NOT_LISTED,
                          torch.where(attended == cells, FULL_BLOCK, MASK_BLOCK))
    assert blocks <= num_blocks
    return classes.permute(1, 0, 2).to(torch.int8)


def kernel_attended(classes: torch.Tensor, nq: int, nk: int, q_tile: int, kv_block: int, *,
                    compress_factor: int = 1, causal: bool = True) -> torch.Tensor:
    """What a block-sparse kernel attends given per-tile classes: (H, nq, nk) bool.

    Full blocks without a mask, mask blocks through the causal (compress_factor) mask."""
    tile_of_row = torch.arange(nq) // q_tile
    block_of_key = torch.arange(nk) // kv_block
    per_cell = classes[tile_of_row][:, :, block_of_key]  # (nq, H, nk)
    visible = key_visibility(nq, nk, compress_factor=compress_factor, causal=causal)
    attended = (per_cell == FULL_BLOCK) | ((per_cell == MASK_BLOCK) & visible[:, None, :])
    return attended.permute(1, 0, 2)


def sequence_rows(bs: BlockSparseTensors, num_blocks: int):
    """Per sequence, the dense (tiles, Hs, num_blocks) classes of its rows."""
    table = dense_block_mask(bs, num_blocks)
    offsets = bs.row_block_offsets.tolist()
    return [table[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def as_lists(bs):
    """Per row and head, (full list, mask list) as python lists."""
    out = []
    for r in range(bs.num_rows):
        out.append([(bs.full_index[r, h, :bs.full_count[r, h]].tolist(),
                     bs.mask_index[r, h, :bs.mask_count[r, h]].tolist())
                    for h in range(bs.num_heads)])
    return out


def assert_well_formed(bs: BlockSparseTensors, *, cu_seqlens_q=None, cu_seqlens_k=None):
    """Contract invariants: validation passes (sorted, unique, disjoint, -1 padded, counts in
    range, offsets consistent), lists are padded to exactly the longest list, and counts equal
    the number of valid entries."""
    validate_block_sparse(bs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for count, index in ((bs.full_count, bs.full_index), (bs.mask_count, bs.mask_index)):
        assert torch.equal(count, (index >= 0).sum(-1).to(count.dtype))
        longest = int(count.max()) if count.numel() else 0
        assert index.shape[-1] == longest


def selected_token_mask(picks: torch.Tensor, nk: int, selected_block_size: int) -> torch.Tensor:
    """picks (H, k) selected blocks of one tile -> (H, nk) bool: keys inside a selected block."""
    block_of_key = torch.arange(nk) // selected_block_size
    return (block_of_key[None, :, None] == picks[:, None, :]).any(-1)


def from_dense_classes(classes: torch.Tensor, row_block_offsets, row_block_size: int,
                       col_block_size: int) -> BlockSparseTensors:
    """(R, Hs, n) classes -> BlockSparseTensors, by python lists (independent of the library)."""
    rows, heads, _ = classes.shape
    full = [[[c for c, v in enumerate(classes[r, h].tolist()) if v == FULL_BLOCK]
             for h in range(heads)] for r in range(rows)]
    mask = [[[c for c, v in enumerate(classes[r, h].tolist()) if v == MASK_BLOCK]
             for h in range(heads)] for r in range(rows)]

    def pad(lists_):
        width = max((len(x) for row in lists_ for x in row), default=0)
        index = torch.full((rows, heads, width), -1, dtype=torch.int32)
        count = torch.zeros(rows, heads, dtype=torch.int32)
        for r, row in enumerate(lists_):
            for h, x in enumerate(row):
                index[r, h, :len(x)] = torch.tensor(x, dtype=torch.int32)
                count[r, h] = len(x)
        return count, index

    full_count, full_index = pad(full)
    mask_count, mask_index = pad(mask)
    return BlockSparseTensors(full_count=full_count, full_index=full_index, mask_count=mask_count,
                              mask_index=mask_index, row_block_size=row_block_size,
                              col_block_size=col_block_size,
                              row_block_offsets=torch.tensor(row_block_offsets, dtype=torch.int32))


__all__ = ["FULL_BLOCK", "MASK_BLOCK", "NOT_LISTED", "as_lists", "assert_well_formed", "ceil_div",
           "classify_cells", "cu_from_lengths", "from_dense_classes", "kernel_attended",
           "key_visibility", "selected_token_mask", "sequence_rows"]
