"""Per-tile geometry of packed sequences and the causal visibility of key blocks, in closed form.

Everything here is per row block (q tile), O(R) memory: the builders never materialise a
(tiles x blocks) table for causal structure; they compare block indices against two per-tile
thresholds instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def ceil_div(a: Tensor, b: int) -> Tensor:
    return (a + b - 1) // b


def offsets_from_counts(counts: Tensor) -> Tensor:
    """(S,) counts -> (S+1,) exclusive prefix sums, int64."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


@dataclass(frozen=True, eq=False)
class QueryRows:
    """Queries that are each sequence's last rows, from a start position on, against all of its
    keys (a later shard of a document's queries; `kernels`' q_start_positions): their packed
    bounds, on the device and the host, and each sequence's first position. Tiles of q rows
    start at that position, so it must be a multiple of the tile size where tiles are used."""

    cu_seqlens: Tensor  # (S+1,) int32, the queries' packed bounds
    host_cu_seqlens: tuple[int, ...]
    start_positions: tuple[int, ...]  # (S,) the position of each sequence's first query row

    def key(self) -> tuple:
        """The host values, for caches keyed by bounds."""
        return (self.host_cu_seqlens, self.start_positions)


@dataclass(frozen=True)
class TileGeometry:
    """Where each global q tile sits. All tensors are (R,) int64 except row_block_offsets (S+1,)."""

    row_block_offsets: Tensor  # first global tile of each sequence
    sequence: Tensor  # sequence of the tile
    local_tile: Tensor  # tile index inside its sequence
    first_row: Tensor  # position of the tile's first row in its sequence
    last_row: Tensor  # position of its last existing row (partial last tile included)
    seqlen_k: Tensor  # keys (or compressed keys) of the tile's sequence

    @property
    def num_tiles(self) -> int:
        return self.sequence.numel()


def tile_geometry(cu_q: Tensor, cu_k: Tensor, q_tile: int,
                  host_cu_q: Sequence[int] | None = None,
                  start_positions: Sequence[int] | None = None) -> TileGeometry:
    """cu_q, cu_k: checked (S+1,) int64 cumulative lengths on one device.

    Reads the device once (the number of tiles sizes every per-tile tensor), unless the caller
    has cu_q's values on the host (`host_cu_q`); the per-sequence quantities reach the tiles in
    one gather. start_positions (host ints, one per sequence; default 0): the position of each
    sequence's first query row (`QueryRows`); rows' positions are offset by it.
    """
    seqlen_q, seqlen_k = cu_q.diff(), cu_k.diff()
    offsets = offsets_from_counts(ceil_div(seqlen_q, q_tile))
    if host_cu_q is None:
        num_tiles = int(offsets[-1])
    else:
        num_tiles = sum(ceil_div(b - a, q_tile) for a, b in zip(host_cu_q, host_cu_q[1:]))
    tile = torch.arange(num_tiles, device=cu_q.device)
    sequence = torch.searchsorted(offsets[1:], tile, right=True)
    # The start positions join the one gather only where given: nsa()'s own calls (every row
    # from position 0) pay no op for them.
    starts = [] if start_positions is None else [
        torch.tensor(start_positions, dtype=torch.int64).to(cu_q.device)]
    per_sequence = torch.stack([offsets[:-1], seqlen_q, seqlen_k, *starts], dim=1)[sequence]
    first_tile, tile_seqlen_q, tile_seqlen_k, *tile_start = per_sequence.unbind(1)
    local_tile = tile - first_tile
    first_row = local_tile * q_tile
    last_row = torch.minimum(first_row + q_tile, tile_seqlen_q) - 1
    if tile_start:
        first_row, last_row = tile_start[0] + first_row, tile_start[0] + last_row
    return TileGeometry(offsets, sequence, local_tile, first_row, last_row, tile_seqlen_k)


def max_diagonal_blocks(q_tile: int, compress_factor: int, block_size: int) -> int:
    """A host bound on the diagonal blocks of one tile (`diagonal_block_range`), for any tile.

    The last row sees at most m = ceil((q_tile - 1) / compress_factor) keys more than the first,
    and the blocks from the first row's partly seen one to the last row's span at most
    ceil(m / block_size) + 1 blocks.
    """
    extra_keys = -(-(q_tile - 1) // compress_factor)
    return -(-extra_keys // block_size) + 1


def visible_block_range(geometry: TileGeometry, *, block_size: int, compress_factor: int = 1,
                        causal: bool = True) -> tuple[Tensor, Tensor]:
    """(n_full, n_visible), each (R,): per tile, blocks [0, n_full) are full, [n_full, n_visible)
    need the mask, and blocks >= n_visible are invisible to every row of the tile.

    Key j (standing for tokens [j*cf, (j+1)*cf)) is seen by row i iff (j+1)*cf <= i+1 and j < Nk.
    Visibility is monotone in j, so "every row sees every key of block b" is "the first row sees
    the block's last existing key", and "some row sees some key" is "the last row sees its first
    key". A sequence's partial last block counts as full once its existing keys are all seen.
    """
    if not causal:
        num_blocks = ceil_div(geometry.seqlen_k, block_size)
        return num_blocks, num_blocks
    return _causal_block_range(geometry.seqlen_k, *_keys_seen(geometry, compress_factor),
                               block_size)


def _causal_block_range(seqlen_k: Tensor, seen_by_first: Tensor, seen_by_last: Tensor,
                        block_size: int) -> tuple[Tensor, Tensor]:
    n_full = torch.where(seen_by_first >= seqlen_k, ceil_div(seqlen_k, block_size),
                         seen_by_first // block_size)
    return n_full, ceil_div(seen_by_last, block_size)


def diagonal_block_range(geometry: TileGeometry, *, block_size: int,
                         compress_factor: int = 1) -> tuple[Tensor, Tensor]:
    """(start, stop), each (R,): the causal "diagonal" blocks of each tile, those holding keys
    that some row of the tile sees but its first row (the anchor) does not.

    They are the mask blocks [n_full, n_visible) except when no row sees more than the anchor:
    then a block the anchor sees only part of is still a mask block but not a diagonal one.
    """
    seen_by_first, seen_by_last = _keys_seen(geometry, compress_factor)
    n_full, n_visible = _causal_block_range(geometry.seqlen_k, seen_by_first, seen_by_last,
                                            block_size)
    return n_full, torch.where(seen_by_last > seen_by_first, n_visible, n_full)


def _keys_seen(geometry: TileGeometry, compress_factor: int) -> tuple[Tensor, Tensor]:
    """Keys [0, n) seen by the tile's first row and by its last row (causal visibility)."""
    seen_by_first = torch.minimum((geometry.first_row + 1) // compress_factor, geometry.seqlen_k)
    seen_by_last = torch.minimum((geometry.last_row + 1) // compress_factor, geometry.seqlen_k)
    return seen_by_first, seen_by_last
