"""The transpose of block-sparse lists in CSR form: per KV block and head, the q tiles listing it.

The sm90 backward owns one KV block per work unit and walks the q tiles that listed it. The
padded transpose (transpose.py) pads every list to the longest one, and NSA lists block 0 in every
q tile, so that layout is O(KV blocks x q tiles): 4 GiB at 1M tokens. Here the lists of all
(KV block, head) groups are concatenated behind one offsets array: O(listed entries).

Built on the lists' device without reading it back: the entries become sort keys (int32 where
every key fits, `sort_key_dtype`, else int64), one sort orders them by (group, kind, tile), and
one searchsorted finds the group boundaries. Every output
size comes from tensor shapes and host ints, so with check=False the host never waits for a GPU.
The layout is documented in docs/interfaces.md ("Compact block-sparse tensors").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparsity._checks import check_cu_seqlens, check_cu_seqlens_layout
from sparsity.host_cache import cached
from sparsity.block_sparse import (INDEX_DTYPE, BlockSparseTensors, IndexTensors, block_offsets,
                                   validate_block_sparse)

# Within a group, mask entries come first: the kind is the key's middle digit.
_MASK_RANK, _FULL_RANK = 0, 1
_INT32_MAX = 2**31 - 1


def sort_key_dtype(unlisted: int) -> torch.dtype:
    """The sort keys' dtype: int32 when every key, `unlisted` (the largest) included, fits, so
    the radix sort makes half the passes of int64's (4 launches instead of 8 a call: the 8K
    backward's lists), else int64."""
    return torch.int32 if unlisted <= _INT32_MAX else torch.int64


@dataclass(frozen=True, eq=False)
class BlockSparseCSR(IndexTensors):
    """Per KV block (row) and head, the q tiles that list it: mask tiles, then full tiles.

    Group g = r * Hs + hs holds index[offsets[g] : offsets[g + 1]]; its first mask_count[r, hs]
    entries are mask tiles, the rest full tiles, each kind ascending. eq=False: compare with
    `equals`.
    """

    offsets: Tensor  # (Rk * Hs + 1,) int32: starts of the groups in index, offsets[0] = 0
    index: Tensor  # (capacity,) int32: q tiles local to the sequence; -1 past offsets[-1]
    mask_count: Tensor  # (Rk, Hs) int32: leading mask entries of each group
    row_block_size: int  # tokens per row block: the KV block (the forward's col_block_size)
    col_block_size: int  # tokens per column block: the q tile (the forward's row_block_size)
    row_block_offsets: Tensor  # (S+1,) int32: first global KV block of each sequence
    # (capacity,) int32: where each entry sits in the forward lists, the flat index of its slot
    # in (R, Hs, Kf + Km) with the full slots first (the sm90 backward's dS tiles are kept per
    # forward slot: kernels/sm90/backward.py); entries past offsets[-1] hold the unlisted
    # slots in no set order. None where a builder does not give it (`csr_rows`: its lists are
    # not a forward call's).
    slot: Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Rk: KV blocks over all sequences."""
        return self.mask_count.shape[0]

    @property
    def num_heads(self) -> int:
        """Hs: the forward lists' heads (H or Hkv)."""
        return self.mask_count.shape[1]

    @property
    def capacity(self) -> int:
        """Slots in index: a host bound on the entries (the forward lists' padded size)."""
        return self.index.numel()

    def __repr__(self) -> str:
        # The default repr would print every index; a summary is what one wants in a log.
        return (f"BlockSparseCSR(rows={self.num_rows}, heads={self.num_heads}, "
                f"sequences={self.num_sequences}, capacity={self.capacity}, "
                f"row_block_size={self.row_block_size}, col_block_size={self.col_block_size}, "
                f"device={self.device}, nbytes={self.nbytes})")


def transpose_block_sparse_csr(bs: BlockSparseTensors, col_block_offsets: Tensor | None = None,
                               *, cu_seqlens_k: Tensor | None = None,
                               num_col_blocks: int | None = None,
                               check: bool = True, layout_key: tuple | None = None,
                               sort_keys=None) -> BlockSparseCSR:
    """The transpose of forward lists `bs` as a BlockSparseCSR.

    Give the column (KV) blocks per sequence as col_block_offsets (S+1,) or as cu_seqlens_k
    (then ceil(len / bs.col_block_size) blocks per sequence), exactly one. num_col_blocks is their
    total (col_block_offsets[-1]) as a host int: it sizes the output, so check=False needs it.

    check=True validates bs (contents included), the offsets and every column block against its
    sequence, reading the device. check=False (for callers that validated already) runs only the
    checks that need no device read and never synchronises; entries the full check would reject
    (columns outside their sequence) are left out rather than written out of range.

    layout_key (with check=False): a hashable key holding every host value that the column
    offsets and bs.row_block_offsets derive from (the sequence bounds, as the caller holds
    them). The per-tile geometry, a function of those only, is then kept across calls
    (sparsity/host_cache.py) instead of being rebuilt (about 20 small launches).

    sort_keys (with check=False): a faster builder of the slots' sort keys, called as
    sort_keys(bs, geometry, span, unlisted) and returning what `_sort_keys` returns (kernels
    pass the sm90 kernel, kernels/sm90/list_layout.py; sparsity itself stays torch only).
    """
    return _transpose(bs, col_block_offsets, cu_seqlens_k, num_col_blocks, check, "bs",
                      layout_key, sort_keys)


def _transpose(bs: BlockSparseTensors, col_block_offsets, cu_seqlens_k, num_col_blocks,
               check: bool, bs_name: str, layout_key: tuple | None = None,
               sort_keys=None) -> BlockSparseCSR:
    """transpose_block_sparse_csr, naming the forward lists `bs_name` in its errors."""
    heads, num_tiles = bs.num_heads, bs.num_rows
    # A key is ((group * 2 + kind) * span + local tile); local tiles are below num_tiles.
    span = max(num_tiles, 1)

    def layout():
        offsets, total = _column_offsets(bs, col_block_offsets, cu_seqlens_k, num_col_blocks,
                                         check, bs_name)
        # Where each (group, kind) segment's first possible key would sort, in the keys' dtype
        # (the largest, 2 * total * heads * span, is the call's `unlisted`).
        segment_keys = torch.arange(2 * total * heads + 1, device=bs.device,
                                    dtype=sort_key_dtype(2 * total * heads * span)) * span
        return offsets.to(INDEX_DTYPE), total, _tile_geometry(bs, offsets), segment_keys

    if layout_key is None or check:
        col_offsets32, num_col_blocks, geometry, segment_keys = layout()
    else:
        validate_block_sparse(bs, name=bs_name, check_contents=False)
        col_offsets32, num_col_blocks, geometry, segment_keys = cached(
            ("csr transpose layout", layout_key, bs.row_block_size, bs.col_block_size,
             num_tiles, heads, num_col_blocks), bs.full_count, layout)
    groups = num_col_blocks * heads
    unlisted = 2 * groups * span  # sorts after every listed entry and marks the empty slots
    capacity = num_tiles * heads * (bs.full_index.shape[-1] + bs.mask_index.shape[-1])
    if unlisted >= 2**63 or capacity > _INT32_MAX:
        raise ValueError(f"{bs_name} is too large for the CSR transpose: {capacity} slots and "
                         f"{groups} (KV block, head) groups of {num_tiles} tiles")

    if sort_keys is not None and not check:
        keys = sort_keys(bs, geometry, span, unlisted)
    else:
        keys = _sort_keys(bs, geometry, span, unlisted, check, bs_name)
    keys, order = keys.sort()
    # Entry p of the sorted keys belongs to the segment (group, kind) = key // span; the
    # capacity check above keeps every position an int32.
    starts = torch.searchsorted(keys, segment_keys.to(keys.dtype), out_int32=True)
    offsets = starts[0::2]
    mask_count = (starts[1::2] - offsets[:-1]).view(num_col_blocks, heads)
    index = torch.where(keys < unlisted, keys % span, -1)
    return BlockSparseCSR(
        offsets=offsets.contiguous(), index=index.to(INDEX_DTYPE),
        mask_count=mask_count.contiguous(), row_block_size=bs.col_block_size,
        col_block_size=bs.row_block_size, row_block_offsets=col_offsets32,
        slot=order.to(INDEX_DTYPE))


def csr_rows(csr: BlockSparseCSR, rows_per_sequence: int, start: int, end: int) -> BlockSparseCSR:
    """The lists of rows (KV blocks) [start, end) of each sequence of `csr`, every sequence
    `rows_per_sequence` rows long (a padded call's transpose), as the transpose of a call of
    those KV blocks alone: row b * (end - start) + r - start holds row b * rows_per_sequence + r's
    groups, the entries moved to the front of an index of the same capacity (-1 after).
    Built on the device from shapes and host ints, without a read (kernels.masked's column
    chunks: each launch of the backward walks some KV tiles of every sequence)."""
    if not 0 <= start < end <= rows_per_sequence or csr.num_rows % rows_per_sequence:
        raise ValueError(f"rows [{start}, {end}) of {csr.num_rows} rows in sequences of "
                         f"{rows_per_sequence}")
    device, heads = csr.offsets.device, csr.num_heads
    sequences = csr.num_rows // rows_per_sequence
    rows = (torch.arange(sequences, device=device)[:, None] * rows_per_sequence
            + torch.arange(start, end, device=device)).flatten()
    groups = (rows[:, None] * heads + torch.arange(heads, device=device)).flatten()
    offsets = csr.offsets.to(torch.int64)
    starts = offsets[groups]
    kept = torch.zeros(groups.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(offsets[groups + 1] - starts, 0, out=kept[1:])
    slot = torch.arange(csr.capacity, device=device)
    group = torch.searchsorted(kept[1:], slot, right=True).clamp(max=groups.numel() - 1)
    source = (starts[group] + slot - kept[group]).clamp(max=max(csr.capacity - 1, 0))
    index = torch.where(slot < kept[-1], csr.index[source], -1).to(INDEX_DTYPE)
    width = end - start
    return BlockSparseCSR(
        offsets=kept.to(INDEX_DTYPE), index=index, mask_count=csr.mask_count[rows],
        row_block_size=csr.row_block_size, col_block_size=csr.col_block_size,
        row_block_offsets=torch.arange(0, sequences * width + 1, width, dtype=INDEX_DTYPE,
                                       device=device))


def validate_block_sparse_csr(csr, *, name: str = "block_sparse_transposed",
                              num_heads: int | None = None, device=None,
                              check_contents: bool = True) -> None:
    """Raises ValueError/TypeError naming the offending field of `csr` (prefixed by `name`).

    Always (no device read): types, dtypes int32, contiguity, one device, shapes (Rk * Hs + 1,),
    (capacity,), (Rk, Hs), (S+1,), Hs == num_heads when given. With check_contents (reads the
    device): row_block_offsets from 0 to Rk; offsets from 0, non-decreasing, ending at most at the
    capacity; mask_count within each group's length; entries >= 0 and -1 after offsets[-1];
    entries strictly ascending within each kind, and no tile both mask and full in one group.
    """
    if not isinstance(csr, BlockSparseCSR):
        raise TypeError(f"{name} must be a BlockSparseCSR, got {type(csr).__name__}")
    for field in ("row_block_size", "col_block_size"):
        value = getattr(csr, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
    fields = ("offsets", "index", "mask_count", "row_block_offsets")
    if csr.slot is not None:
        fields += ("slot",)
    for field in fields:
        tensor = getattr(csr, field)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != INDEX_DTYPE:
            raise ValueError(f"{name}.{field} must be int32, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}.{field} must be contiguous")
    expected_device = csr.offsets.device if device is None else torch.device(device)
    for field in fields:
        tensor_device = getattr(csr, field).device
        # torch.device("cuda") and torch.device("cuda:0") name the same device here.
        if tensor_device.type != expected_device.type or (
                expected_device.index is not None and tensor_device.index != expected_device.index):
            raise ValueError(f"{name}.{field} is on {tensor_device}, expected {expected_device}")

    if csr.mask_count.dim() != 2:
        raise ValueError(f"{name}.mask_count must have shape (Rk, Hs), "
                         f"got {tuple(csr.mask_count.shape)}")
    rows, heads = csr.mask_count.shape
    if tuple(csr.offsets.shape) != (rows * heads + 1,):
        raise ValueError(f"{name}.offsets must have shape (Rk * Hs + 1,) = ({rows * heads + 1},) "
                         f"for mask_count's (Rk, Hs) = {(rows, heads)}, "
                         f"got {tuple(csr.offsets.shape)}")
    if csr.index.dim() != 1:
        raise ValueError(f"{name}.index must be 1-D (capacity,), got {tuple(csr.index.shape)}")
    if csr.slot is not None and csr.slot.shape != csr.index.shape:
        raise ValueError(f"{name}.slot must have index's shape {tuple(csr.index.shape)}, "
                         f"got {tuple(csr.slot.shape)}")
    if csr.row_block_offsets.dim() != 1 or csr.row_block_offsets.numel() < 1:
        raise ValueError(f"{name}.row_block_offsets must have shape (S+1,), "
                         f"got {tuple(csr.row_block_offsets.shape)}")
    if num_heads is not None and heads != num_heads:
        raise ValueError(f"{name}.mask_count has {heads} heads, expected {num_heads} "
                         "(the forward lists' heads)")
    if check_contents:
        _validate_contents(csr, name)


def check_csr_matches(csr, bs: BlockSparseTensors, *, num_col_blocks: int | None = None,
                      name: str = "block_sparse_transposed", bs_name: str = "block_sparse",
                      check_contents: bool = False) -> None:
    """Raises ValueError when `csr` is not the transpose of the forward lists `bs`.

    Without check_contents nothing is read from the device: csr's layout (as
    validate_block_sparse_csr without contents), its heads, sequences and swapped block sizes
    against bs, and its KV blocks against num_col_blocks when given. With check_contents, also
    both lists' contents and csr's entries against the transpose of bs (device reads).

    The capacity is not compared: it is only a bound, and a CSR cut to its entries is as good.
    """
    validate_block_sparse(bs, name=bs_name, check_contents=False)
    validate_block_sparse_csr(csr, name=name, device=bs.device, check_contents=False)
    if (csr.row_block_size, csr.col_block_size) != (bs.col_block_size, bs.row_block_size):
        raise ValueError(f"{name} must swap the block sizes of {bs_name}: expected "
                         f"row_block_size={bs.col_block_size}, col_block_size={bs.row_block_size}"
                         f", got {csr.row_block_size}, {csr.col_block_size}")
    if csr.num_heads != bs.num_heads:
        raise ValueError(f"{name} has {csr.num_heads} heads but {bs_name} has {bs.num_heads}")
    if csr.num_sequences != bs.num_sequences:
        raise ValueError(f"{name} has {csr.num_sequences} sequences but {bs_name} has "
                         f"{bs.num_sequences}")
    if num_col_blocks is not None and csr.num_rows != num_col_blocks:
        raise ValueError(f"{name} has {csr.num_rows} KV blocks (rows), expected {num_col_blocks}")
    if not check_contents:
        return
    validate_block_sparse_csr(csr, name=name)
    try:
        expected = _transpose(bs, csr.row_block_offsets, None, csr.num_rows, True, bs_name)
    except ValueError as error:
        raise ValueError(f"{name} does not match {bs_name}: {error}") from error
    _check_same_entries(csr, expected, name, bs_name)


def _column_offsets(bs: BlockSparseTensors, col_block_offsets, cu_seqlens_k, num_col_blocks,
                    check: bool, bs_name: str) -> tuple[Tensor, int]:
    """(S+1,) int64 column-block offsets on bs's device, and their total as a host int."""
    validate_block_sparse(bs, name=bs_name, check_contents=check)
    if (col_block_offsets is None) == (cu_seqlens_k is None):
        raise ValueError("pass exactly one of col_block_offsets and cu_seqlens_k")
    if num_col_blocks is not None and (isinstance(num_col_blocks, bool)
                                       or not isinstance(num_col_blocks, int)
                                       or num_col_blocks < 0):
        raise ValueError(f"num_col_blocks must be an int >= 0, got {num_col_blocks!r}")
    # check_cu_seqlens reads the values to the host; its layout half does not.
    check_offsets = check_cu_seqlens if check else check_cu_seqlens_layout
    if cu_seqlens_k is not None:
        name = "cu_seqlens_k"
        check_offsets(cu_seqlens_k, name, bs.device)
        offsets = block_offsets(cu_seqlens_k.to(torch.int64), bs.col_block_size)
    else:
        name = "col_block_offsets"
        check_offsets(col_block_offsets, name, bs.device)
        offsets = col_block_offsets
    offsets = offsets.to(torch.int64)
    if offsets.numel() != bs.row_block_offsets.numel():
        raise ValueError(f"{name} describes {offsets.numel() - 1} sequences but "
                         f"{bs_name}.row_block_offsets has {bs.num_sequences}")
    if bs.num_sequences == 0 and bs.num_rows > 0:
        raise ValueError(f"{bs_name} has {bs.num_rows} row blocks but no sequences")
    if check:
        total = int(offsets[-1])
        if num_col_blocks is not None and num_col_blocks != total:
            raise ValueError(f"num_col_blocks={num_col_blocks} but {name} gives {total} column "
                             "blocks")
        num_col_blocks = total
    elif num_col_blocks is None:
        raise ValueError("check=False needs num_col_blocks (the total column blocks, "
                         "col_block_offsets[-1]): it sizes the output, and reading it from the "
                         "device would synchronise")
    return offsets, num_col_blocks


def _tile_geometry(bs: BlockSparseTensors, col_offsets: Tensor) -> tuple[Tensor, ...]:
    """Per forward row block (q tile), each (R, 1, 1) int64: its tile index local to the
    sequence, the sequence's first global column block and its number of column blocks."""
    row_offsets = bs.row_block_offsets.to(torch.int64)
    tile = torch.arange(bs.num_rows, device=bs.device)
    # The clamp keeps inconsistent trusted offsets from indexing past the end.
    sequence = torch.searchsorted(row_offsets[1:], tile, right=True).clamp_(
        max=max(bs.num_sequences - 1, 0))
    first_col = col_offsets[sequence]
    columns = col_offsets[sequence + 1] - first_col
    local_tile = tile - row_offsets[sequence]
    return tuple(x.view(-1, 1, 1) for x in (local_tile, first_col, columns))


def _sort_keys(bs: BlockSparseTensors, geometry, span: int, unlisted: int, check: bool,
               bs_name: str) -> Tensor:
    """The flat sort keys (`sort_key_dtype(unlisted)`) of every slot of both lists; slots past
    their count get `unlisted`. Both lists go through as one (R, Hs, Kf + Km) tensor: half the
    launches."""
    local_tile, first_col, columns = geometry
    full_width = bs.full_index.shape[-1]
    index = torch.cat([bs.full_index, bs.mask_index], dim=-1).to(torch.int64)
    slot = torch.arange(index.shape[-1], device=index.device)
    is_mask = slot >= full_width
    count = torch.where(is_mask, bs.mask_count[..., None], bs.full_count[..., None])
    listed = slot - full_width * is_mask < count
    inside = (index >= 0) & (index < columns)
    if check:
        outside = listed & ~inside
        if bool(outside.any()):
            kind = "full" if bool(outside[..., :full_width].any()) else "mask"
            raise ValueError(f"{bs_name}.{kind}_index names a column block past the end of its "
                             "sequence (according to col_block_offsets / cu_seqlens_k)")
    head = torch.arange(bs.num_heads, device=index.device).view(1, -1, 1)
    group = (first_col + index) * bs.num_heads + head  # (global KV block, head)
    rank = torch.where(is_mask, _MASK_RANK, _FULL_RANK)
    keys = (group * 2 + rank) * span + local_tile
    return torch.where(listed & inside, keys, unlisted).flatten().to(sort_key_dtype(unlisted))


def _validate_contents(csr: BlockSparseCSR, name: str) -> None:
    row_offsets = csr.row_block_offsets.to(torch.int64)
    if (int(row_offsets[0]) != 0 or bool((row_offsets.diff() < 0).any())
            or int(row_offsets[-1]) != csr.num_rows):
        raise ValueError(f"{name}.row_block_offsets must start at 0, be non-decreasing and end at "
                         f"the number of KV blocks Rk = {csr.num_rows}, "
                         f"got {row_offsets.tolist()[:8]}...")
    offsets = csr.offsets.to(torch.int64)
    if int(offsets[0]) != 0 or bool((offsets.diff() < 0).any()) or int(offsets[-1]) > csr.capacity:
        raise ValueError(f"{name}.offsets must start at 0, be non-decreasing and end at most at "
                         f"the capacity len({name}.index) = {csr.capacity}")
    lengths = offsets.diff()
    mask_count = csr.mask_count.to(torch.int64).flatten()
    if bool(((mask_count < 0) | (mask_count > lengths)).any()):
        raise ValueError(f"{name}.mask_count entries must lie in [0, the group's length "
                         f"offsets[g + 1] - offsets[g]]")
    total = int(offsets[-1])
    entries = csr.index[:total].to(torch.int64)
    if bool((entries < 0).any()):
        raise ValueError(f"{name}.index entries before offsets[-1] must be q tiles >= 0")
    if bool((csr.index[total:] != -1).any()):
        raise ValueError(f"{name}.index must hold -1 after offsets[-1]")
    position = torch.arange(total, device=entries.device)
    group = torch.searchsorted(offsets[1:], position, right=True)
    segment = group * 2 + (position >= offsets[group] + mask_count[group])
    same_segment = segment[1:] == segment[:-1]
    if bool((same_segment & (entries[1:] <= entries[:-1])).any()):
        raise ValueError(f"{name}.index must be strictly ascending within each group's mask "
                         "entries and within its full entries")
    span = int(entries.max()) + 1 if total else 1
    by_tile = (group * span + entries).sort().values
    if bool((by_tile[1:] == by_tile[:-1]).any()):
        raise ValueError(f"{name}.index lists a q tile as both mask and full in one "
                         "(KV block, head) group")


def _check_same_entries(csr: BlockSparseCSR, expected: BlockSparseCSR, name: str,
                        bs_name: str) -> None:
    """Names the first (KV block, head) group whose lengths, kinds or tiles differ."""
    heads = csr.num_heads
    lengths, expected_lengths = csr.offsets.diff(), expected.offsets.diff()
    differs = (lengths != expected_lengths) | (csr.mask_count.flatten()
                                               != expected.mask_count.flatten())
    if not bool(differs.any()):
        total = int(csr.offsets[-1])
        wrong = (csr.index[:total] != expected.index[:total]).nonzero()
        if wrong.numel() == 0:
            return
        position = wrong[0]
        differs = (csr.offsets[:-1] <= position) & (position < csr.offsets[1:])
    group = int(differs.to(torch.int8).argmax())
    raise ValueError(f"{name} is not the transpose of {bs_name}: the q tiles of KV block "
                     f"{group // heads}, head {group % heads} differ")
