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


@cute.jit
def last_offset_at_most(offsets: cute.Tensor, value: Int32, hi: Int32) -> Int32:
    """The last s in [0, hi] with offsets[s] <= value (offsets ascending, offsets[0] <= value):
    which sequence a packed index belongs to, by bisection. Empty sequences share their offset
    with the next one, which owns the index; `hi` = S - 1 keeps indices past the end in the last
    sequence, S names them."""
    lo = Int32(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= value:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class TileOrder:
    heads_fastest: cutlass.Constexpr[bool]
    num_m_blocks: Int32
    num_heads: Int32
    num_seqs: Int32

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_seqs

    def _radices(self):
        """Extents of the (fastest, middle, slowest) coordinates of the tile order."""
        if const_expr(self.heads_fastest):
            return self.num_heads, self.num_m_blocks
        return self.num_m_blocks, self.num_heads

    @cute.jit
    def coords(self, tile: Int32):
        """Mixed-radix digits (fastest, middle, slowest) of linear tile index `tile` (two
        integer divisions: call it once per CTA, then `advance`)."""
        fast_extent, mid_extent = self._radices()
        fast = tile % fast_extent
        rest = tile // fast_extent
        return fast, rest % mid_extent, rest // mid_extent

    @cute.jit
    def advance(self, coords, step):
        """coords of tile + s, given `step` = coords(s) with s the persistent grid stride: a
        carry chain of adds and compares instead of the two integer divisions of `coords`
        (about 60 dependent instructions that sat at the start of every tile)."""
        fast_extent, mid_extent = self._radices()
        fast = coords[0] + step[0]
        carry = Int32(0)
        if fast >= fast_extent:
            fast = fast - fast_extent
            carry = Int32(1)
        mid = coords[1] + step[1] + carry
        carry = Int32(0)
        if mid >= mid_extent:
            mid = mid - mid_extent
            carry = Int32(1)
        return fast, mid, coords[2] + step[2] + carry

    def unpack(self, coords):
        """(m_block, head, batch) of tile coordinates; query tiles count from the last one."""
        if const_expr(self.heads_fastest):
            head, m_from_end, batch = coords
        else:
            m_from_end, head, batch = coords
        return self.num_m_blocks - 1 - m_from_end, head, batch
