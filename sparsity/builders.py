"""Builders of BlockSparseTensors: from selected blocks, for a compressed branch, from a mask.

All three produce the forward layout (rows = q tiles over all sequences, columns = KV blocks local
to the sequence) with exact full/mask classification under the kernels' visibility rule
(docs/interfaces.md): a listed **full** block must be seen by every existing row of the tile at
every existing key, a **mask** block by at least one row at one key; an invisible block is never
listed. Lists are sorted, duplicate-free and -1 padded to the longest list.

The selected and compressed builders work in O(R * k) memory: causal structure is two per-tile
thresholds (`visible_block_range`), never a (tiles x blocks) table. They run a fixed number of
whole-tensor ops; the device is read only by the argument checks, for the number of tiles and
for the widths of the padded lists (the lengths of the longest lists are data).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from sparsity._checks import (check_block_indices, check_cu_seqlens, check_matching_sequences,
                              check_positive_int, check_same_device, check_tensor)
from sparsity._geometry import (QueryRows, TileGeometry, ceil_div, diagonal_block_range,
                               max_diagonal_blocks, tile_geometry, visible_block_range)
from sparsity._lists import (compact_block_lists, compact_block_lists_below, padded_range,
                             range_lists)
from sparsity.block_sparse import INDEX_DTYPE, BlockSparseTensors, uniform_cu_seqlens
from sparsity.host_cache import cached

NOT_LISTED, MASK_BLOCK, FULL_BLOCK = 0, 1, 2  # tile classes of the dense-mask builder


def build_selected_block_sparse(selected: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                q_tile: int, selected_block_size: int, kv_block: int,
                                causal: bool = True) -> BlockSparseTensors:
    """Block-sparse lists for attention to selected blocks (NSA's selected branch).

    selected: (R, Hs, k) int32/int64, per q tile (R = all tiles of all sequences) and head, the
    selected blocks in units of `selected_block_size` tokens, local to the sequence; -1 pads,
    duplicates and any order are fine. Blocks past the sequence's keys are dropped, and so are
    blocks no row of the tile can see under `causal` (the future): they are never listed.

    Kernel blocks are `kv_block` tokens. When kv_block divides selected_block_size each selected
    block becomes selected_block_size // kv_block kernel blocks. When kv_block is a multiple of
    it, selected blocks merge into kernel blocks, and every kernel block must then be fully
    selected (at least as far as the tile's rows can see into it); otherwise the kernel would
    attend a superset of the selection, so this raises ValueError.
    """
    check_positive_int(q_tile, "q_tile")
    check_positive_int(selected_block_size, "selected_block_size")
    check_positive_int(kv_block, "kv_block")
    if selected_block_size % kv_block and kv_block % selected_block_size:
        raise ValueError(f"kv_block ({kv_block}) must divide selected_block_size "
                         f"({selected_block_size}) or be a multiple of it")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    device = check_tensor(selected, "selected").device
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", device)
    # Self-attention passes one tensor twice: check (and read) it once.
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else check_cu_seqlens(cu_seqlens_k,
                                                                      "cu_seqlens_k", device)
    check_matching_sequences(cu_q, "cu_seqlens_q", cu_k, "cu_seqlens_k")
    geometry = tile_geometry(cu_q, cu_k, q_tile)
    picks = check_block_indices(selected, "selected", geometry.num_tiles)
    return _selected_lists(picks, geometry, q_tile, selected_block_size, kv_block, causal)


def build_selected_block_sparse_trusted(selected: Tensor, *, cu_seqlens: Tensor,
                                        host_cu_seqlens: Sequence[int], q_tile: int,
                                        selected_block_size: int, kv_block: int,
                                        causal: bool = True,
                                        queries: QueryRows | None = None) -> BlockSparseTensors:
    """`build_selected_block_sparse` for self-attention (one cu_seqlens for q and keys) without
    device reads, for callers that produced `selected` themselves and hold the sequence bounds
    on the host (nsa(): its selection, its checked bounds), so a CUDA graph can capture it.

    Trusted, not checked: cu_seqlens holds the values host_cu_seqlens names, and `selected`
    (R, Hs, k) has one row per q tile and entries -1 or block indices of the sequence. The
    lists are padded to host bounds instead of their longest list: k * selected_block_size /
    kv_block full entries (every pick) and, causal, the diagonal blocks of a tile
    (`max_diagonal_blocks`) as mask entries (a block is a mask block only where the tile's
    rows see it partly, which is on the diagonal); non-causal lists have no mask entries.
    queries: the queries are each sequence's rows from a position on (`QueryRows`, positions
    multiples of q_tile), against all of the keys cu_seqlens bounds; None: the same rows.
    """
    if selected_block_size % kv_block:
        raise ValueError(f"kv_block ({kv_block}) must divide selected_block_size "
                         f"({selected_block_size}) for the trusted builder")
    geometry, visible = _selected_geometry(cu_seqlens, host_cu_seqlens, q_tile, kv_block, causal,
                                           queries)
    ratio = selected_block_size // kv_block
    widths = (selected.shape[-1] * ratio, _mask_width(q_tile, kv_block, causal))
    return _selected_lists(selected.to(torch.int64), geometry, q_tile, selected_block_size,
                           kv_block, causal, widths, visible)


def selected_list_classes(cu_seqlens: Tensor, host_cu_seqlens: Sequence[int], *, q_tile: int,
                          kv_block: int, causal: bool = True,
                          queries: QueryRows | None = None) -> tuple[Tensor, Tensor, int]:
    """For a kernel that writes `build_selected_block_sparse_trusted`'s lists itself (nsa()'s
    selection kernel, from blocks of kv_block keys): per tile (n_full, n_visible), (R,) int64,
    the builder's classes (listed blocks below n_full are full, those below n_visible need the
    mask, later ones are dropped), and the mask lists' width (full lists are as wide as the
    selection). Trusted like the builder; no device read."""
    _, (n_full, n_visible) = _selected_geometry(cu_seqlens, host_cu_seqlens, q_tile, kv_block,
                                                causal, queries)
    return n_full, n_visible, _mask_width(q_tile, kv_block, causal)


def selected_block_sparse_from_lists(lists: tuple[Tensor, Tensor, Tensor, Tensor],
                                     cu_seqlens: Tensor, host_cu_seqlens: Sequence[int], *,
                                     q_tile: int, kv_block: int, causal: bool = True,
                                     queries: QueryRows | None = None) -> BlockSparseTensors:
    """BlockSparseTensors of (full_count, full_index, mask_count, mask_index) int32 lists that a
    kernel wrote by `selected_list_classes`' rule: equal to what
    `build_selected_block_sparse_trusted` builds from the same selection."""
    geometry, _ = _selected_geometry(cu_seqlens, host_cu_seqlens, q_tile, kv_block, causal,
                                     queries)
    return _assemble(lists, geometry, q_tile, kv_block)


def _selected_geometry(cu_seqlens: Tensor, host_cu_seqlens: Sequence[int], q_tile: int,
                       kv_block: int, causal: bool, queries: QueryRows | None = None
                       ) -> tuple[TileGeometry, tuple[Tensor, Tensor]]:
    """The tiles of attention over the keys cu_seqlens bounds, for the same rows as queries or
    for `queries`, and their visible block range."""
    def geometry_and_range():
        cu = cu_seqlens.to(torch.int64)
        if queries is None:
            geometry = tile_geometry(cu, cu, q_tile, host_cu_q=host_cu_seqlens)
        else:
            geometry = tile_geometry(queries.cu_seqlens.to(torch.int64), cu, q_tile,
                                     host_cu_q=queries.host_cu_seqlens,
                                     start_positions=queries.start_positions)
        return geometry, visible_block_range(geometry, block_size=kv_block, causal=causal)

    # Functions of the host bounds and the sizes only: kept across calls
    # (sparsity/host_cache.py)
    return cached(("selected tile geometry", tuple(host_cu_seqlens), q_tile, kv_block, causal,
                   None if queries is None else queries.key()),
                  cu_seqlens, geometry_and_range)


def _mask_width(q_tile: int, kv_block: int, causal: bool) -> int:
    """The trusted builders' mask-list width: a tile's diagonal blocks (none non-causal)."""
    return max_diagonal_blocks(q_tile, 1, kv_block) if causal else 0


def _selected_lists(picks: Tensor, geometry: TileGeometry, q_tile: int, selected_block_size: int,
                    kv_block: int, causal: bool, widths: tuple[int, int] | None = None,
                    visible: tuple[Tensor, Tensor] | None = None) -> BlockSparseTensors:
    """`visible`: the geometry's `visible_block_range` when the caller has it."""
    if selected_block_size >= kv_block:
        kernel_blocks = _split_selected_blocks(picks, selected_block_size // kv_block)
    else:
        kernel_blocks = _merge_selected_blocks(picks, geometry, kv_block // selected_block_size,
                                               selected_block_size, kv_block, causal)
    if visible is None:
        visible = visible_block_range(geometry, block_size=kv_block, causal=causal)
    n_full, n_visible = visible
    kernel_blocks = kernel_blocks.masked_fill(kernel_blocks >= n_visible[:, None, None], -1)
    lists = compact_block_lists_below(kernel_blocks, n_full[:, None, None], widths)
    return _assemble(lists, geometry, q_tile, kv_block)


def build_compressed_block_sparse(*, cu_seqlens_q: Tensor, cu_seqlens_k_cmp: Tensor,
                                  compress_factor: int, q_tile: int, kv_block: int,
                                  selected: Tensor | None = None) -> BlockSparseTensors:
    """Block-sparse lists for causal attention to compressed keys (mask with compress_factor).

    Row i sees compressed key j iff (j+1) * compress_factor <= i+1 (and j < the sequence's
    compressed length, from cu_seqlens_k_cmp). Per q tile, blocks every row fully sees are full,
    blocks some row partly sees are mask (the "diagonal"), later blocks are not listed. Computed
    in closed form per tile; Hs = 1.

    selected: optional (R, Hs, n) compressed-KV-block indices (units of kv_block compressed
    tokens), -1 padded, for the sparse compressed branch (docs/interfaces.md): the lists are
    restricted to those blocks plus block 0 and the tile's diagonal blocks (those holding keys
    some row of the tile sees but its first row does not), with the same classification. Future
    or out-of-range selections are dropped. A block the first row sees only part of, with no
    row seeing more of it, is a mask block but not diagonal: it is listed only if selected.
    """
    check_positive_int(compress_factor, "compress_factor")
    check_positive_int(q_tile, "q_tile")
    check_positive_int(kv_block, "kv_block")
    device = check_tensor(cu_seqlens_q, "cu_seqlens_q").device
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", device)
    cu_k = check_cu_seqlens(cu_seqlens_k_cmp, "cu_seqlens_k_cmp", device)
    check_matching_sequences(cu_q, "cu_seqlens_q", cu_k, "cu_seqlens_k_cmp")
    geometry = tile_geometry(cu_q, cu_k, q_tile)
    if selected is None:
        n_full, n_visible = visible_block_range(geometry, block_size=kv_block,
                                                compress_factor=compress_factor, causal=True)
        lists = range_lists(torch.zeros_like(n_full), n_visible, n_full)
        return _assemble(lists, geometry, q_tile, kv_block)
    check_same_device(check_tensor(selected, "selected"), device, "selected", "cu_seqlens_q")
    picks = check_block_indices(selected, "selected", geometry.num_tiles)
    return _compressed_selected_lists(picks, geometry, compress_factor, q_tile, kv_block)


def build_compressed_block_sparse_trusted(selected: Tensor, *, cu_seqlens_q: Tensor,
                                          cu_seqlens_k_cmp: Tensor,
                                          host_cu_seqlens_q: Sequence[int],
                                          compress_factor: int, q_tile: int,
                                          kv_block: int,
                                          start_positions: Sequence[int] | None = None
                                          ) -> BlockSparseTensors:
    """`build_compressed_block_sparse` with `selected` (the sparse compressed branch) without
    device reads, for callers that produced `selected` themselves and hold the sequence bounds
    on the host (nsa()), so a CUDA graph can capture it. Trusted, not checked: the bounds match
    the tensors and `selected` has one row per q tile. The lists are padded to host bounds
    (every candidate: the picks, block 0 and the tile's diagonal blocks) instead of their
    longest list. start_positions: the queries are each sequence's rows from these positions on
    (`QueryRows`); default 0."""
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k_cmp.to(torch.int64)
    geometry = tile_geometry(cu_q, cu_k, q_tile, host_cu_q=host_cu_seqlens_q,
                             start_positions=start_positions)
    candidates = selected.shape[-1] + 1 + max_diagonal_blocks(q_tile, compress_factor, kv_block)
    return _compressed_selected_lists(selected.to(torch.int64), geometry, compress_factor,
                                      q_tile, kv_block, widths=(candidates, candidates))


def _compressed_selected_lists(picks: Tensor, geometry: TileGeometry, compress_factor: int,
                               q_tile: int, kv_block: int,
                               widths: tuple[int, int] | None = None) -> BlockSparseTensors:
    n_full, n_visible = visible_block_range(geometry, block_size=kv_block,
                                            compress_factor=compress_factor, causal=True)
    heads = picks.shape[1]
    diagonal = padded_range(*diagonal_block_range(geometry, block_size=kv_block,
                                                  compress_factor=compress_factor),
                            width=max_diagonal_blocks(q_tile, compress_factor, kv_block))
    first_block = torch.where(n_visible > 0, 0, -1)[:, None, None]
    candidates = torch.cat([picks, first_block.expand(-1, heads, 1),
                            diagonal[:, None, :].expand(-1, heads, -1)], dim=-1)
    candidates = candidates.masked_fill(candidates >= n_visible[:, None, None], -1)
    lists = compact_block_lists_below(candidates, n_full[:, None, None], widths)
    return _assemble(lists, geometry, q_tile, kv_block)


def build_block_sparse_from_mask(mask: Tensor, *, q_tile: int, kv_block: int,
                                 cu_seqlens: Tensor | None = None,
                                 batch_size: int | None = None) -> BlockSparseTensors:
    """Block-sparse lists from a dense mask, for our kernels or any other block-sparse kernel.

    mask: (B or 1, H or 1, Nq, Nk), boolean (True = attend) or additive float (0 = attend,
    -inf = not; other values raise). Per (sequence, head, q tile, kv block), over the cells that
    exist: all attended -> full, some -> mask, none -> not listed. Hs is the mask's head dim.

    Sequences: without cu_seqlens, each batch entry is one sequence (Nq queries, Nk keys); a batch
    dim of 1 with `batch_size` repeats it for batch_size sequences. With cu_seqlens (S+1,), the
    mask is (1, H or 1, T, T) over packed tokens and sequence s uses its diagonal square
    [cu[s]:cu[s+1]]; entries across sequences are ignored (attention never crosses them).

    Exactness: a kernel attends a **mask** block through its own causal/window mask, not through
    this dense mask. The result is therefore exact only when, inside every partial tile, the dense
    mask equals the kernel's mask (causal or sliding-window shaped masks, and block-restrictions
    of them). For other masks (documents inside a tile, arbitrary patterns) the lists are still
    the right iteration metadata for a kernel that applies the dense mask itself in mask blocks.
    The input is dense, so this builder uses (tiles x blocks) memory, unlike the others.
    """
    check_positive_int(q_tile, "q_tile")
    check_positive_int(kv_block, "kv_block")
    attend = _attend_from_mask(mask)
    batch, heads = attend.shape[:2]
    if cu_seqlens is None:
        if batch_size is not None:
            check_positive_int(batch_size, "batch_size")
            if batch not in (1, batch_size):
                raise ValueError(f"mask has batch dim {batch}; with batch_size={batch_size} it "
                                 "must be 1 (shared) or batch_size")
        classes = _classify_tiles(attend, q_tile, kv_block)  # (B, H, Tq, Tk)
        if batch_size is not None and batch == 1 and batch_size > 1:
            classes = classes.expand(batch_size, -1, -1, -1)
        return build_block_sparse_from_tile_classes(
            classes, seqlen_q=attend.shape[2], seqlen_k=attend.shape[3], q_tile=q_tile,
            kv_block=kv_block, bounded_widths=False)
    else:
        if batch_size is not None:
            raise ValueError("pass either cu_seqlens or batch_size, not both")
        cu = check_cu_seqlens(cu_seqlens, "cu_seqlens", attend.device)
        total = int(cu[-1])
        if batch != 1 or tuple(attend.shape[2:]) != (total, total):
            raise ValueError(f"with cu_seqlens, mask must have shape (1, H or 1, T, T) with "
                             f"T = cu_seqlens[-1] = {total}, got {tuple(mask.shape)}")
        per_tile = _classify_packed(attend, cu, q_tile, kv_block)
        return _lists_of_classes(per_tile, cu, cu, q_tile, kv_block)


def build_block_sparse_from_tile_classes(classes: Tensor, *, seqlen_q: int, seqlen_k: int,
                                         q_tile: int, kv_block: int,
                                         bounded_widths: bool = True) -> BlockSparseTensors:
    """Lists from per-tile classes: classes (B, Hs, Tq, Tk) int8 of NOT_LISTED, MASK_BLOCK and
    FULL_BLOCK for B sequences of seqlen_q queries and seqlen_k keys each (Tq, Tk their tiles
    and blocks), e.g. a mask's classes combined with a rule's (`kernels.masked`).
    bounded_widths: every list padded to Tk (no device read), else to the longest list (one
    read). The shapes are checked on the host; the class values are trusted (reading them would
    cost a device read)."""
    check_tensor(classes, "classes")
    check_positive_int(q_tile, "q_tile")
    check_positive_int(kv_block, "kv_block")
    for value, name in ((seqlen_q, "seqlen_q"), (seqlen_k, "seqlen_k")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    tiles_and_blocks = (ceil_div(seqlen_q, q_tile), ceil_div(seqlen_k, kv_block))
    if classes.dtype != torch.int8 or classes.dim() != 4 \
            or tuple(classes.shape[2:]) != tiles_and_blocks:
        raise ValueError(f"classes must be an int8 (B, Hs, Tq, Tk) tensor with (Tq, Tk) = "
                         f"{tiles_and_blocks} (the q tiles of seqlen_q and the kv blocks of "
                         f"seqlen_k), got {classes.dtype} of shape {tuple(classes.shape)}")
    sequences, heads, tiles, blocks_per_row = classes.shape
    per_tile = classes.permute(0, 2, 1, 3).reshape(sequences * tiles, heads, blocks_per_row)
    device = classes.device
    cu = uniform_cu_seqlens(sequences, seqlen_q, device=device).to(torch.int64)
    cu_k = uniform_cu_seqlens(sequences, seqlen_k, device=device).to(torch.int64)
    host_cu_q = [s * seqlen_q for s in range(sequences + 1)]
    return _lists_of_classes(per_tile, cu, cu_k, q_tile, kv_block,
                             (blocks_per_row,) * 2 if bounded_widths else None, host_cu_q)


def _lists_of_classes(per_tile: Tensor, cu: Tensor, cu_k: Tensor, q_tile: int, kv_block: int,
                      widths: tuple[int, int] | None = None,
                      host_cu_q: Sequence[int] | None = None) -> BlockSparseTensors:
    """Lists from (R, Hs, Tk) tile classes of the tiles that cu, cu_k lay out (widths,
    host_cu_q: as `compact_block_lists` and `tile_geometry` take them)."""
    blocks = torch.arange(per_tile.shape[-1], device=per_tile.device).expand(per_tile.shape)
    blocks = blocks.masked_fill(per_tile == NOT_LISTED, -1)
    lists = compact_block_lists(blocks, per_tile == FULL_BLOCK, widths)
    return _assemble(lists, tile_geometry(cu, cu_k, q_tile, host_cu_q), q_tile, kv_block)


def _assemble(lists, geometry: TileGeometry, q_tile: int, kv_block: int) -> BlockSparseTensors:
    full_count, full_index, mask_count, mask_index = lists
    return BlockSparseTensors(
        full_count=full_count, full_index=full_index, mask_count=mask_count,
        mask_index=mask_index, row_block_size=q_tile, col_block_size=kv_block,
        row_block_offsets=geometry.row_block_offsets.to(INDEX_DTYPE))


def _split_selected_blocks(picks: Tensor, ratio: int) -> Tensor:
    """Selected block c -> kernel blocks c*ratio .. c*ratio + ratio-1 (holes stay holes)."""
    if ratio == 1:
        return picks
    parts = picks[..., None] * ratio + torch.arange(ratio, device=picks.device)
    return parts.masked_fill(picks[..., None] < 0, -1).flatten(2)


def _merge_selected_blocks(picks: Tensor, geometry: TileGeometry, ratio: int,
                           selected_block_size: int, kv_block: int, causal: bool) -> Tensor:
    """Selected block c -> kernel block c // ratio, after checking no kernel block is partly
    selected within what the tile can see (a visible unselected part would be attended)."""
    _, n_visible = visible_block_range(geometry, block_size=selected_block_size, causal=causal)
    absent = torch.iinfo(torch.int64).max
    visible = (picks >= 0) & (picks < n_visible[:, None, None])
    ordered = picks.masked_fill(~visible, absent).sort(dim=-1).values
    distinct = ordered != absent
    distinct[..., 1:] &= ordered[..., 1:] != ordered[..., :-1]
    kernel_blocks = torch.where(distinct, ordered // ratio, -1)

    # Count the distinct visible selections per (tile, head, kernel block). Entries are sorted
    # within a row and rows are flattened in order, so equal keys are adjacent.
    rows, heads, _ = picks.shape
    stride = int(ceil_div(n_visible, ratio).max()) + 1 if rows else 1
    row_head = torch.arange(rows * heads, device=picks.device).view(rows, heads, 1)
    keys = (row_head * stride + kernel_blocks)[distinct]
    keys, covered = torch.unique_consecutive(keys, return_counts=True)
    block, row = keys % stride, keys // stride // heads
    needed = torch.minimum((block + 1) * ratio, n_visible[row]) - block * ratio
    partial = (covered < needed).nonzero()
    if partial.numel():
        at = int(partial[0, 0])
        tile, head = int(row[at]), int(keys[at] // stride % heads)
        raise ValueError(
            f"selected: kv_block={kv_block} merges {ratio} selected blocks of "
            f"{selected_block_size}, but kernel block {int(block[at])} of q tile {tile} (head "
            f"{head}) has only {int(covered[at])} of the {int(needed[at])} selected blocks the "
            "tile can see in it selected; the kernel would attend a superset of the selection. "
            "Select whole kernel blocks or use kv_block <= selected_block_size.")
    return kernel_blocks


def _attend_from_mask(mask) -> Tensor:
    check_tensor(mask, "mask")
    if mask.dim() != 4:
        raise ValueError(f"mask must have shape (B or 1, H or 1, Nq, Nk), got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"mask must be bool (True = attend) or an additive float mask, "
                         f"got {mask.dtype}")
    attend = mask == 0
    if bool((~attend & ~torch.isneginf(mask)).any()):
        raise ValueError("an additive float mask may only hold 0 (attend) and -inf (do not "
                         "attend); a bias is not a block-sparsity pattern")
    return attend


def _classify_tiles(attend: Tensor, q_tile: int, kv_block: int) -> Tensor:
    """(B, H, Nq, Nk) bool -> (B, H, Tq, Tk) int8 classes (NOT_LISTED, MASK_BLOCK, FULL_BLOCK)
    over the cells that exist."""
    batch, heads, seqlen_q, seqlen_k = attend.shape
    tiles, blocks = -(-seqlen_q // q_tile), -(-seqlen_k // kv_block)
    padded = torch.nn.functional.pad(attend, (0, blocks * kv_block - seqlen_k,
                                              0, tiles * q_tile - seqlen_q))
    attended = padded.view(batch, heads, tiles, q_tile, blocks, kv_block).sum(dim=(3, 5))
    rows = (seqlen_q - torch.arange(tiles, device=attend.device) * q_tile).clamp(max=q_tile)
    keys = (seqlen_k - torch.arange(blocks, device=attend.device) * kv_block).clamp(max=kv_block)
    cells = rows[:, None] * keys[None, :]
    classes = torch.full(attended.shape, MASK_BLOCK, dtype=torch.int8, device=attend.device)
    classes[attended == cells] = FULL_BLOCK
    classes[attended == 0] = NOT_LISTED
    return classes


def _classify_packed(attend: Tensor, cu: Tensor, q_tile: int, kv_block: int) -> Tensor:
    """Per sequence, classify its diagonal square; rows (tiles) concatenated, columns padded."""
    bounds = cu.tolist()
    per_sequence = [_classify_tiles(attend[:, :, a:b, a:b], q_tile, kv_block)[0].transpose(0, 1)
                    for a, b in zip(bounds[:-1], bounds[1:])]
    width = max((c.shape[-1] for c in per_sequence), default=0)
    padded = [torch.nn.functional.pad(c, (0, width - c.shape[-1]), value=NOT_LISTED)
              for c in per_sequence]
    if not padded:
        return torch.zeros((0, attend.shape[1], 0), dtype=torch.int8, device=attend.device)
    return torch.cat(padded, dim=0)
