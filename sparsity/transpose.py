"""The transpose (inverted index) of block-sparse lists: per column block, the row blocks using it.

The backward kernel owns one KV block per CTA and walks the q tiles that listed it; this builds
those lists from the forward ones. Rows of the result are the column blocks of all sequences
(global, offsets from cu_seqlens_k and col_block_size), columns are row blocks local to the
sequence, and each entry keeps its full/mask class. Built by one sort and one scatter over the
listed entries: O(entries + output), never a dense (tiles x blocks) table.

The output is padded to its longest list like every BlockSparseTensors. A column block listed by
nearly every tile (NSA's forced block 0) therefore makes the transpose O(column blocks x tiles);
`transposed_list_lengths` gives the sizes before anything is allocated. csr.py builds the same
lists in CSR form, O(listed entries), without reading the device.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsity._checks import check_cu_seqlens
from sparsity.block_sparse import (INDEX_DTYPE, BlockSparseTensors, block_offsets,
                                   validate_block_sparse)


def transpose_block_sparse(bs: BlockSparseTensors, col_block_offsets: Tensor | None = None, *,
                           cu_seqlens_k: Tensor | None = None) -> BlockSparseTensors:
    """Rows <-> columns. Give the column blocks per sequence as col_block_offsets (S+1,) or as
    cu_seqlens_k (then ceil(len / bs.col_block_size) blocks per sequence). The result has
    row_block_size = bs.col_block_size, col_block_size = bs.row_block_size and
    row_block_offsets = the column offsets; transposing it back with
    col_block_offsets=bs.row_block_offsets returns bs (when bs is padded to its longest lists,
    as every builder's output is).
    """
    col_offsets = _column_offsets(bs, col_block_offsets, cu_seqlens_k)
    full, mask = (_entries(bs, col_offsets, index_field)
                  for index_field in ("full_index", "mask_index"))
    num_new_rows = int(col_offsets[-1])
    full_count, full_index = _scatter_lists(full, num_new_rows, bs.num_heads)
    mask_count, mask_index = _scatter_lists(mask, num_new_rows, bs.num_heads)
    return BlockSparseTensors(
        full_count=full_count, full_index=full_index, mask_count=mask_count,
        mask_index=mask_index, row_block_size=bs.col_block_size,
        col_block_size=bs.row_block_size, row_block_offsets=col_offsets.to(INDEX_DTYPE))


def transposed_list_lengths(bs: BlockSparseTensors, *, col_block_offsets: Tensor | None = None,
                            cu_seqlens_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(full_count, mask_count), each (column blocks, Hs) int32, of the transpose, without
    building its lists: the transpose's padded size is rows x Hs x (max full + max mask)."""
    col_offsets = _column_offsets(bs, col_block_offsets, cu_seqlens_k)
    num_new_rows = int(col_offsets[-1])
    counts = []
    for index_field in ("full_index", "mask_index"):
        new_row, head, _ = _entries(bs, col_offsets, index_field)
        group = new_row * bs.num_heads + head
        count = torch.bincount(group, minlength=num_new_rows * bs.num_heads)
        counts.append(count.view(num_new_rows, bs.num_heads).to(INDEX_DTYPE))
    return counts[0], counts[1]


def _column_offsets(bs: BlockSparseTensors, col_block_offsets, cu_seqlens_k) -> Tensor:
    validate_block_sparse(bs, name="bs")
    if (col_block_offsets is None) == (cu_seqlens_k is None):
        raise ValueError("pass exactly one of col_block_offsets and cu_seqlens_k")
    if cu_seqlens_k is not None:
        cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", bs.device)
        col_block_offsets = block_offsets(cu_k, bs.col_block_size)
        name = "cu_seqlens_k"
    else:
        name = "col_block_offsets"
    offsets = check_cu_seqlens(col_block_offsets, name, bs.device)
    if offsets.numel() != bs.row_block_offsets.numel():
        raise ValueError(f"{name} describes {offsets.numel() - 1} sequences but "
                         f"bs.row_block_offsets has {bs.num_sequences}")
    return offsets


def _entries(bs: BlockSparseTensors, col_offsets: Tensor, index_field: str):
    """The listed entries of one list as flat (new row, head, new column) int64 tensors."""
    index = getattr(bs, index_field)
    count = bs.full_count if index_field == "full_index" else bs.mask_count
    listed = torch.arange(index.shape[-1], device=index.device) < count[..., None]
    row, head, slot = listed.nonzero(as_tuple=True)
    column = index[row, head, slot].to(torch.int64)

    row_offsets = bs.row_block_offsets.to(torch.int64)
    sequence = torch.repeat_interleave(
        torch.arange(bs.num_sequences, device=index.device), row_offsets.diff())[row]
    columns_in_sequence = (col_offsets[1:] - col_offsets[:-1])[sequence]
    if bool((column >= columns_in_sequence).any()):
        raise ValueError(f"bs.{index_field} names a column block past the end of its sequence "
                         "(according to col_block_offsets / cu_seqlens_k)")
    new_row = col_offsets[sequence] + column  # global column block
    new_column = row - row_offsets[sequence]  # row block local to its sequence
    return new_row, head, new_column


def _scatter_lists(entries, num_new_rows: int, heads: int) -> tuple[Tensor, Tensor]:
    """Groups entries by (new row, head), each group ascending in new column, into padded lists."""
    new_row, head, new_column = entries
    device = new_row.device
    group = new_row * heads + head
    # Columns are local tile indices, each below the number of tiles; one int64 key orders by
    # (group, column). Within a group every column is distinct: a (tile, head) lists a block once.
    span = int(new_column.max()) + 1 if new_column.numel() else 1
    order = torch.argsort(group * span + new_column)
    group, new_column = group[order], new_column[order]

    count = torch.bincount(group, minlength=num_new_rows * heads)
    width = int(count.max()) if count.numel() else 0
    group_start = torch.cumsum(count, 0) - count
    slot = torch.arange(group.numel(), device=device) - group_start[group]
    lists = torch.full((num_new_rows * heads, width), -1, dtype=INDEX_DTYPE, device=device)
    lists[group, slot] = new_column.to(INDEX_DTYPE)
    return (count.view(num_new_rows, heads).to(INDEX_DTYPE),
            lists.view(num_new_rows, heads, width))
