"""Which KV tiles a query tile visits, and which of them need the in-register mask.

Key j stands for tokens [j*cf, (j+1)*cf) and sits at position pos(j) = (j+1)*cf - 1.
Row i sees key j iff j < seqlen_k, pos(j) <= i (causal) and i - left <= pos(j) <= i + right
(window). Everything here is scalar integer work done once per tile or per iteration; tiles
that no row of the query tile can see are never visited, so they are never loaded.

Rows are positions: query row r of a sequence (its r-th row in the packed tensor) sits at
position r + row_offset. row_offset is 0 (a Python int: no instruction) unless the kernel takes
q_start_positions, where each tile's copy of the range carries its sequence's first position
(`at_row_offset`), so every limit below is the one of the rows' true positions.
"""
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class BlockRange:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    has_window_left: cutlass.Constexpr[bool]
    has_window_right: cutlass.Constexpr[bool]
    compressed: cutlass.Constexpr[bool]  # False: compress_factor is 1 and no division is emitted
    compress_factor: object  # compressed: a cute.FastDivmodDivisorV2, else an unused Int32
    window_left: Int32
    window_right: Int32
    row_offset: object = 0  # Int32 with q_start_positions (`at_row_offset`), else the int 0

    def at_row_offset(self, row_offset: Int32) -> "BlockRange":
        """This range for a tile whose sequence's first query row sits at `row_offset`."""
        return replace(self, row_offset=row_offset)

    @property
    def shifted(self) -> bool:
        """Whether rows sit past their local index (a compile-time fact)."""
        return not isinstance(self.row_offset, int)

    @cute.jit
    def position(self, row: Int32) -> Int32:
        """The position of local query row `row`."""
        position = row
        if const_expr(self.shifted):
            position = row + self.row_offset
        return position

    @cute.jit
    def local_row(self, position: Int32) -> Int32:
        """The local index of position `position`, clamped at row 0 (positions before the
        sequence's first row are no rows of it)."""
        row = position
        if const_expr(self.shifted):
            row = cutlass.max(position - self.row_offset, 0)
        return row

    @cute.jit
    def key_limit_right(self, row: Int32) -> Int32:
        """Exclusive upper bound on the key index row `row` may see (ignoring seqlen_k)."""
        limit = Int32(2**30)
        if const_expr(self.causal):
            limit = self.keys_up_to(row + 1)
        if const_expr(self.has_window_right):
            limit = cutlass.min(limit, self.keys_up_to(row + self.window_right + 1))
        return limit

    @cute.jit
    def keys_up_to(self, tokens: Int32) -> Int32:
        """How many keys lie entirely within the first `tokens` tokens (tokens >= 0)."""
        count = tokens
        if const_expr(self.compressed):
            count = tokens // self.compress_factor
        return count

    @cute.jit
    def key_limit_left(self, row: Int32) -> Int32:
        """Inclusive lower bound on the key index row `row` may see (0 without a left window)."""
        limit = Int32(0)
        if const_expr(self.has_window_left):
            # First key j with pos(j) = (j+1)*cf - 1 >= row - left.
            first_pos = cutlass.max(row - self.window_left, 0)
            limit = first_pos
            if const_expr(self.compressed):
                limit = (first_pos + self.compress_factor.divisor) // self.compress_factor - 1
        return limit

    @cute.jit
    def n_block_min_max(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[n_min, n_max) of KV tiles seen by any row of query tile m_block."""
        row_first = self.position(m_block * self.tile_m)
        row_last = self.position(cutlass.min(m_block * self.tile_m + self.tile_m, seqlen_q) - 1)
        key_end = cutlass.min(self.key_limit_right(row_last), seqlen_k)
        n_max = (key_end + self.tile_n - 1) // self.tile_n
        n_min = self.key_limit_left(row_first) // self.tile_n
        return n_min, n_max

    @cute.jit
    def unmasked_tiles(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[lo, hi): the KV tiles every row of query tile m_block sees completely (may be empty,
        lo >= hi). The others that the tile visits need the in-register mask."""
        row_first = self.position(m_block * self.tile_m)
        row_last = self.position(cutlass.min(m_block * self.tile_m + self.tile_m, seqlen_q) - 1)
        key_end = seqlen_k
        if const_expr(self.causal or self.has_window_right):
            key_end = cutlass.min(key_end, self.key_limit_right(row_first))
        hi = key_end // self.tile_n
        lo = Int32(0)
        if const_expr(self.has_window_left):
            lo = (self.key_limit_left(row_last) + self.tile_n - 1) // self.tile_n
        return lo, hi

    # -------------------------------------------------------------- backward (keys as rows)
    # The backward walks, for one KV tile, the query tiles that see it: the same rule read the
    # other way round. Key j at pos(j) is seen by rows pos(j) (causal) or pos(j) - right
    # (window right) up to pos(j) + left (window left); no division by the compress factor.
    # row_limit_low/high are positions; the query-tile ranges are local.

    @cute.jit
    def key_position(self, key: Int32) -> Int32:
        """pos(j) = (j + 1) * cf - 1: the last token key j stands for."""
        pos = key
        if const_expr(self.compressed):
            pos = (key + 1) * self.compress_factor.divisor - 1
        return pos

    @cute.jit
    def row_limit_low(self, key: Int32) -> Int32:
        """First row that may see key `key` (ignoring seqlen_q)."""
        limit = Int32(0)
        if const_expr(self.causal):
            limit = self.key_position(key)
        if const_expr(self.has_window_right):
            limit = cutlass.max(self.key_position(key) - self.window_right, 0)
        return limit

    @cute.jit
    def row_limit_high(self, key: Int32) -> Int32:
        """One past the last row that may see key `key` (ignoring seqlen_q)."""
        limit = Int32(2**30)
        if const_expr(self.has_window_left):
            limit = self.key_position(key) + self.window_left + 1
        return limit

    @cute.jit
    def m_block_min_max(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[m_min, m_max) of query tiles with a row that sees some key of KV tile n_block."""
        key_first = n_block * self.tile_n
        key_last = cutlass.min(key_first + self.tile_n, seqlen_k) - 1
        m_min = self.local_row(self.row_limit_low(key_first)) // self.tile_m
        row_end = cutlass.min(self.local_row(self.row_limit_high(key_last)), seqlen_q)
        m_max = (row_end + self.tile_m - 1) // self.tile_m
        return m_min, m_max

    @cute.jit
    def unmasked_m_blocks(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[lo, hi): query tiles every row of which sees every key of KV tile n_block (may be
        empty). A KV tile crossing the sequence end is never unmasked."""
        key_first = n_block * self.tile_n
        key_last = key_first + self.tile_n - 1
        lo = (self.local_row(self.row_limit_low(key_last)) + self.tile_m - 1
              ) // self.tile_m
        hi = Int32(2**30)
        if const_expr(self.has_window_left):
            hi = self.local_row(self.row_limit_high(key_first)) // self.tile_m
        if key_last >= seqlen_k:
            hi = Int32(0)
        return lo, hi
