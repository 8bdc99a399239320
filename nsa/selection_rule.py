"""The shape of the causal selection rule: tile sizes, forced-block bounds, list widths.

The rule itself (docs/interfaces.md, "The causal selection rule") is implemented twice, plainly
in `nsa.reference` and batched in `nsa.selection`; both fill a `BlockSelection` whose list widths
come from here, so the two results compare with `torch.equal`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

# Query rows per selection tile: all rows of a tile share one list of selected KV blocks, and the
# selected branch's kernel iterates that list per tile of this many rows.
SELECTION_Q_TILE = 128

# Compressed tokens per KV block of the sparse compressed branch (num_cmp_selected_blocks).
CMP_KV_BLOCK = 128


@dataclass(frozen=True, eq=False)
class BlockSelection:
    """Per query tile and KV head: the KV blocks each sparse branch attends to.

    Lists are local to the tile's sequence, ascending, padded with -1 at the end. Tiles of all
    sequences are stacked: sequence s owns rows row_block_offsets[s] .. row_block_offsets[s+1]-1.
    """

    selected: Tensor  # (R, Hkv, num_selected_blocks) int32: blocks of selected_block_size keys
    cmp_selected: Tensor | None  # (R, Hkv, Kc) int32: blocks of cmp_kv_block compressed tokens
    row_block_offsets: Tensor  # (S+1,) int32: first global q tile of each sequence
    # The selected branch's forward lists (sparsity.BlockSparseTensors, blocks of
    # selected_block_size keys) where the selection kernel wrote them with `selected`; else None
    # (the branch builds them from `selected`).
    selected_lists: object = None


def max_diagonal_blocks(q_tile: int, block_size: int) -> int:
    """The most blocks of `block_size` keys one q tile of `q_tile` rows can overlap.

    Tiles start at multiples of q_tile, blocks at multiples of block_size, so a tile starts at a
    multiple of g = gcd(q_tile, block_size) inside its block; the worst offset is block_size - g.
    Equals q_tile / block_size when block_size divides q_tile, and 1 when q_tile divides it.
    """
    worst_offset = block_size - math.gcd(q_tile, block_size)
    return (worst_offset + q_tile - 1) // block_size + 1


def min_selected_blocks(q_tile: int, selected_block_size: int) -> int:
    """The fewest selected blocks that hold the forced ones: block 0 plus every diagonal block.

    1 + q_tile / selected_block_size when selected_block_size divides q_tile.
    """
    return 1 + max_diagonal_blocks(q_tile, selected_block_size)


def cmp_selection_width(q_tile: int, compress_block_size: int, cmp_kv_block: int,
                        num_cmp_selected_blocks: int) -> int:
    """Longest list of the sparse compressed branch: block 0, the diagonal ones, the top ranked.

    The diagonal runs from the block holding the anchor's first unseen token to the block of the
    last token the tile's last row sees: the rows a .. a + q_tile - 1 see at most
    ceil((q_tile - 1) / l) tokens more than the anchor, which touch at most
    ceil(tokens / cmp_kv_block) + 1 blocks.
    """
    tokens = -(-(q_tile - 1) // compress_block_size)
    diagonal = -(-tokens // cmp_kv_block) + 1
    return 1 + diagonal + num_cmp_selected_blocks
