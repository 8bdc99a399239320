"""Which (query tile, head, sequence) each CTA works on.

Work tiles are numbered 0 .. M*H*S-1 (M query tiles of the longest sequence, H query heads, S
sequences) and decoded here, so the launch grid is one-dimensional:

- one CTA per tile (`FwdSpec.persistent` False): CTA b takes tile b and exits;
- persistent (`FwdSpec.persistent` True): one CTA per SM walks tiles b, b + grid, b + 2*grid...;
  its producer warp loads the next tile's Q and first K/V while the consumers still finish the
  current tile and store its output, which pays when each tile visits only a few KV tiles
  (sliding windows, compressed keys).

Query tiles are numbered from the last one backwards (longest causal work first). With
`heads_fastest` the query heads of one tile index are neighbours in the order, so CTAs running
at the same time share the K/V tiles of a GQA group in L2 instead of re-reading them from HBM
once per query head; otherwise one head's query tiles are neighbours (dense causal prefers it:
all of them walk the same K/V prefix).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class TileOrder:
    heads_fastest: cutlass.Constexpr[bool]
    num_m_blocks: Int32
    num_heads: Int32
    num_seqs: Int32

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_seqs

    @cute.jit
    def decode(self, tile: Int32):
        """(m_block, head, batch) of linear tile index `tile`."""
        if const_expr(self.heads_fastest):
            head = tile % self.num_heads
            rest = tile // self.num_heads
            m_from_end = rest % self.num_m_blocks
            batch = rest // self.num_m_blocks
        else:
            m_from_end = tile % self.num_m_blocks
            rest = tile // self.num_m_blocks
            head = rest % self.num_heads
            batch = rest // self.num_heads
        return self.num_m_blocks - 1 - m_from_end, head, batch
