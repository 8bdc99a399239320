"""Compact block-sparse index tensors, their validation, and per-sequence row-block offsets.

The layout is the contract in docs/interfaces.md ("Compact block-sparse tensors"): per row block
(a q tile in the forward layout, a KV block in the transposed one) and head, two short ascending
lists of column blocks, local to the row's sequence. "Full" blocks are attended without the
causal/window mask (every existing row of the tile sees every existing key of the block); "mask"
blocks need it. The lists are padded with -1 to the longest list, so memory is
O(row blocks x heads x longest list), never O(row blocks x column blocks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from sparsity._checks import check_cu_seqlens, check_positive_int

INDEX_DTYPE = torch.int32


class IndexTensors:
    """What a dataclass of block-index tensors shares (BlockSparseTensors and
    sparsity.csr.BlockSparseCSR): its tensors are the fields holding one, in field order;
    `row_block_size`, `col_block_size` and `row_block_offsets` are fields of both."""

    @property
    def num_sequences(self) -> int:
        return self.row_block_offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self._tensors()[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by the index tensors (the metadata's whole memory footprint)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def to(self, device):
        return dataclasses.replace(self, **{
            field.name: getattr(self, field.name).to(device)
            for field in dataclasses.fields(self) if isinstance(getattr(self, field.name), Tensor)})

    def equals(self, other) -> bool:
        """Same type, block sizes and identical tensors (shapes included, so padding widths
        and capacities too)."""
        if type(other) is not type(self):
            return False
        if (self.row_block_size, self.col_block_size) != (other.row_block_size,
                                                          other.col_block_size):
            return False
        mine, theirs = self._tensors(), other._tensors()
        return len(mine) == len(theirs) and all(
            a.shape == b.shape and a.device == b.device and torch.equal(a, b)
            for a, b in zip(mine, theirs))

    def _tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self)
                     if isinstance(getattr(self, field.name), Tensor))


@dataclass(frozen=True, eq=False)
class BlockSparseTensors(IndexTensors):
    """Per row block and head: which column blocks to visit, split into full and mask blocks.

    eq=False: tensors have no single truth value; compare two instances with `equals`.
    """

    full_count: Tensor  # (R, Hs) int32: number of full blocks per row block and head
    full_index: Tensor  # (R, Hs, Kf) int32: ascending column-block indices; -1 after full_count
    mask_count: Tensor  # (R, Hs) int32
    mask_index: Tensor  # (R, Hs, Km) int32
    row_block_size: int  # tokens per row block (q tile in the forward layout)
    col_block_size: int  # tokens per column block (kv block in the forward layout)
    row_block_offsets: Tensor  # (S+1,) int32: first global row block of each sequence

    @property
    def num_rows(self) -> int:
        """R: row blocks over all sequences."""
        return self.full_count.shape[0]

    @property
    def num_heads(self) -> int:
        """Hs: H (one list per query head) or Hkv (one list shared by a KV group)."""
        return self.full_count.shape[1]

    def __repr__(self) -> str:
        # The default repr would print every index; a summary is what one wants in a log.
        return (f"BlockSparseTensors(rows={self.num_rows}, heads={self.num_heads}, "
                f"sequences={self.num_sequences}, Kf={self.full_index.shape[-1]}, "
                f"Km={self.mask_index.shape[-1]}, row_block_size={self.row_block_size}, "
                f"col_block_size={self.col_block_size}, device={self.device}, "
                f"nbytes={self.nbytes})")


def uniform_cu_seqlens(batch_size: int, seqlen: int, device=None) -> Tensor:
    """cu_seqlens (B+1,) int32 of a padded batch: B sequences of `seqlen` tokens each."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 0:
        raise ValueError(f"seqlen must be an int >= 0, got {seqlen!r}")
    return (torch.arange(batch_size + 1, device=device, dtype=torch.int64) * seqlen).to(INDEX_DTYPE)


def row_block_offsets_from_cu_seqlens(cu_seqlens: Tensor, block_size: int) -> Tensor:
    """(S+1,) int32: first global block of each sequence;
    sequence s has ceil(len_s / block_size)."""
    check_positive_int(block_size, "block_size")
    return block_offsets(check_cu_seqlens(cu_seqlens, "cu_seqlens"), block_size)


def block_offsets(cu: Tensor, block_size: int) -> Tensor:
    """row_block_offsets_from_cu_seqlens for an already checked int64 cu_seqlens."""
    blocks = (cu.diff() + block_size - 1) // block_size
    return torch.cat([cu.new_zeros(1), blocks.cumsum(0)]).to(INDEX_DTYPE)


def validate_block_sparse(bs, *, name: str = "block_sparse", num_heads: int | None = None,
                          num_kv_heads: int | None = None, device=None,
                          cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                          check_contents: bool = True) -> None:
    """Raises ValueError/TypeError naming the offending field of `bs` (prefixed by `name`).

    Always (no device sync): types, dtypes int32, shapes (R, Hs) / (R, Hs, K) / (S+1,), one
    device, contiguity, Hs in {num_heads, num_kv_heads} when given, S matching cu_seqlens_q/k.
    With check_contents (reads the tensors, so it synchronises a GPU): offsets start at 0, are
    non-decreasing and end at R (and equal the ones cu_seqlens_q implies); counts in [0, K];
    list entries ascending, >= 0, -1 after the count; full and mask disjoint; and with
    cu_seqlens_k, every column block exists in its sequence.
    """
    if not isinstance(bs, BlockSparseTensors):
        raise TypeError(f"{name} must be a BlockSparseTensors, got {type(bs).__name__}")
    for field in ("row_block_size", "col_block_size"):
        value = getattr(bs, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
    for field in ("full_count", "full_index", "mask_count", "mask_index", "row_block_offsets"):
        tensor = getattr(bs, field)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != INDEX_DTYPE:
            raise ValueError(f"{name}.{field} must be int32, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}.{field} must be contiguous")
    expected_device = bs.full_count.device if device is None else torch.device(device)
    for field in ("full_count", "full_index", "mask_count", "mask_index", "row_block_offsets"):
        tensor_device = getattr(bs, field).device
        # torch.device("cuda") and torch.device("cuda:0") name the same device here.
        if tensor_device.type != expected_device.type or (
                expected_device.index is not None and tensor_device.index != expected_device.index):
            raise ValueError(f"{name}.{field} is on {tensor_device}, expected {expected_device}")

    if bs.full_count.dim() != 2:
        raise ValueError(f"{name}.full_count must have shape (R, Hs), "
                         f"got {tuple(bs.full_count.shape)}")
    rows, heads = bs.full_count.shape
    for count_field, index_field in (("full_count", "full_index"), ("mask_count", "mask_index")):
        count, index = getattr(bs, count_field), getattr(bs, index_field)
        if tuple(count.shape) != (rows, heads):
            raise ValueError(f"{name}.{count_field} must have shape (R, Hs) = {(rows, heads)}, "
                             f"got {tuple(count.shape)}")
        if index.dim() != 3 or tuple(index.shape[:2]) != (rows, heads):
            raise ValueError(f"{name}.{index_field} must have shape (R, Hs, K) with (R, Hs) = "
                             f"{(rows, heads)}, got {tuple(index.shape)}")
    allowed_heads = [h for h in (num_heads, num_kv_heads) if h is not None]
    if allowed_heads and heads not in allowed_heads:
        raise ValueError(f"{name}.full_count has {heads} heads; expected one list per query head "
                         f"or per KV head, i.e. one of {sorted(set(allowed_heads))}")
    offsets = bs.row_block_offsets
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name}.row_block_offsets must have shape (S+1,), "
                         f"got {tuple(offsets.shape)}")
    for cu_name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is not None and (not isinstance(cu, Tensor) or cu.dim() != 1
                               or cu.numel() != offsets.numel()):
            raise ValueError(f"{name}.row_block_offsets has {offsets.numel() - 1} sequences but "
                             f"{cu_name} does not describe the same number of sequences")
    if not check_contents:
        return
    _validate_contents(bs, name, cu_seqlens_q, cu_seqlens_k)


def _validate_contents(bs: BlockSparseTensors, name: str, cu_seqlens_q, cu_seqlens_k) -> None:
    rows = bs.num_rows
    offsets = bs.row_block_offsets.to(torch.int64)
    if int(offsets[0]) != 0 or bool((offsets.diff() < 0).any()) or int(offsets[-1]) != rows:
        raise ValueError(f"{name}.row_block_offsets must start at 0, be non-decreasing and end at "
                         f"the number of row blocks R = {rows}, got {offsets.tolist()[:8]}...")
    if cu_seqlens_q is not None:
        cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
        expected = block_offsets(cu_q, bs.row_block_size).to(offsets)
        if not torch.equal(expected, offsets):
            raise ValueError(f"{name}.row_block_offsets does not match cu_seqlens_q with "
                             f"row_block_size={bs.row_block_size} "
                             "(sequence s must own ceil(len_s / row_block_size) row blocks)")
    col_blocks_per_row = None
    if cu_seqlens_k is not None:
        cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k").to(offsets.device)
        col_blocks = (cu_k.diff() + bs.col_block_size - 1) // bs.col_block_size
        sequence_of_row = torch.repeat_interleave(
            torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff())
        col_blocks_per_row = col_blocks[sequence_of_row]

    for count_field, index_field in (("full_count", "full_index"), ("mask_count", "mask_index")):
        count = getattr(bs, count_field).to(torch.int64)
        index = getattr(bs, index_field).to(torch.int64)
        width = index.shape[-1]
        if count.numel() and (int(count.min()) < 0 or int(count.max()) > width):
            raise ValueError(f"{name}.{count_field} entries must lie in [0, {width}] "
                             f"(the width of {name}.{index_field})")
        listed = torch.arange(width, device=index.device) < count[..., None]
        if bool((index[~listed] != -1).any()):
            raise ValueError(f"{name}.{index_field} must hold -1 after {count_field} entries")
        if bool((index[listed] < 0).any()):
            raise ValueError(f"{name}.{index_field} entries before {count_field} must be >= 0")
        if width > 1:
            both_listed = listed[..., 1:]
            if bool((index[..., 1:] <= index[..., :-1])[both_listed].any()):
                raise ValueError(f"{name}.{index_field} lists must be strictly ascending "
                                 "(sorted, no duplicates)")
        if col_blocks_per_row is not None:
            too_far = listed & (index >= col_blocks_per_row[:, None, None])
            if bool(too_far.any()):
                raise ValueError(f"{name}.{index_field} names column blocks past the end of their "
                                 f"sequence (cu_seqlens_k with col_block_size={bs.col_block_size})")

    # Disjointness: merge both lists per row, sort, and look for equal neighbours.
    merged = torch.cat([bs.full_index, bs.mask_index], dim=-1).to(torch.int64)
    if merged.shape[-1] > 1:
        merged = merged.masked_fill(merged < 0, -1).sort(dim=-1).values
        repeated = (merged[..., 1:] == merged[..., :-1]) & (merged[..., 1:] >= 0)
        if bool(repeated.any()):
            raise ValueError(f"{name}.full_index and {name}.mask_index must be disjoint per row "
                             "and head")
