"""Per-tile geometry of packed sequences and the causal visibility of key blocks, in closed form.

Everything here is per row block (q tile), O(R) memory: the builders never materialise a
(tiles x blocks) table for causal structure; they compare block indices against two per-tile
thresholds instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def ceil_div(a: Tensor, b: int) -> Tensor:
    return (a + b - 1) // b


def offsets_from_counts(counts: Tensor) -> Tensor:
    """(S,) counts -> (S+1,) exclusive prefix sums, int64."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


@dataclass(frozen=True)
class TileGeometry:
    """Where each global q tile sits. All tensors are (R,) int64 except row_block_offsets (S+1,)."""

    row_block_offsets: Tensor  # first global tile of each sequence
    sequence: Tensor  # sequence of the tile
    local_tile: Tensor  # tile index inside its sequence
    first_row: Tensor  # local position of the tile's first row
    last_row: Tensor  # local position of its last existing row (partial last tile included)
    seqlen_k: Tensor  # keys (or compressed keys) of the tile's sequence

    @property
    def num_tiles(self) -> int:
        return self.sequence.numel()


def tile_geometry(cu_q: Tensor, cu_k: Tensor, q_tile: int) -> TileGeometry:
    """cu_q, cu_k: checked (S+1,) int64 cumulative lengths on one device."""
    seqlen_q, seqlen_k = cu_q.diff(), cu_k.diff()
    tiles = ceil_div(seqlen_q, q_tile)
    offsets = offsets_from_counts(tiles)
    sequence = torch.repeat_interleave(torch.arange(tiles.numel(), device=cu_q.device), tiles)
    local_tile = torch.arange(sequence.numel(), device=cu_q.device) - offsets[sequence]
    first_row = local_tile * q_tile
    last_row = torch.minimum(first_row + q_tile, seqlen_q[sequence]) - 1
    return TileGeometry(offsets, sequence, local_tile, first_row, last_row, seqlen_k[sequence])


def visible_block_range(geometry: TileGeometry, *, block_size: int, compress_factor: int = 1,
                        causal: bool = True) -> tuple[Tensor, Tensor]:
    """(n_full, n_visible), each (R,): per tile, blocks [0, n_full) are full, [n_full, n_visible)
    need the mask, and blocks >= n_visible are invisible to every row of the tile.

    Key j (standing for tokens [j*cf, (j+1)*cf)) is seen by row i iff (j+1)*cf <= i+1 and j < Nk.
    Visibility is monotone in j, so "every row sees every key of block b" is "the first row sees
    the block's last existing key", and "some row sees some key" is "the last row sees its first
    key". A sequence's partial last block counts as full once its existing keys are all seen.
    """
    seqlen_k = geometry.seqlen_k
    num_blocks = ceil_div(seqlen_k, block_size)
    if not causal:
        return num_blocks, num_blocks
    seen_by_first, seen_by_last = _keys_seen(geometry, compress_factor)
    n_full = torch.where(seen_by_first >= seqlen_k, num_blocks, seen_by_first // block_size)
    n_visible = ceil_div(seen_by_last, block_size)
    return n_full, n_visible


def diagonal_block_range(geometry: TileGeometry, *, block_size: int,
                         compress_factor: int = 1) -> tuple[Tensor, Tensor]:
    """(start, stop), each (R,): the causal "diagonal" blocks of each tile, those holding keys
    that some row of the tile sees but its first row (the anchor) does not.

    They are the mask blocks [n_full, n_visible) except when no row sees more than the anchor:
    then a block the anchor sees only part of is still a mask block but not a diagonal one.
    """
    n_full, n_visible = visible_block_range(geometry, block_size=block_size,
                                            compress_factor=compress_factor)
    seen_by_first, seen_by_last = _keys_seen(geometry, compress_factor)
    return n_full, torch.where(seen_by_last > seen_by_first, n_visible, n_full)


def _keys_seen(geometry: TileGeometry, compress_factor: int) -> tuple[Tensor, Tensor]:
    """Keys [0, n) seen by the tile's first row and by its last row (causal visibility)."""
    seen_by_first = torch.minimum((geometry.first_row + 1) // compress_factor, geometry.seqlen_k)
    seen_by_last = torch.minimum((geometry.last_row + 1) // compress_factor, geometry.seqlen_k)
    return seen_by_first, seen_by_last
