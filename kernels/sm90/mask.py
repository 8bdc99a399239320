"""In-register masking of a score tile: keys a row may not see become -inf."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.block_range import BlockRange
from kernels.sm90.layouts import acc_mn_view


@cute.jit
def apply_mask(
    acc_s: cute.Tensor,
    t_coord: cute.Tensor,
    block_range: BlockRange,
    m_block: Int32,
    n_block: Int32,
    seqlen_k: Int32,
    with_causal_window: cutlass.Constexpr[bool],
):
    """Mask acc_s (one thread's fragment) given its (row, col) coordinates in t_coord.

    with_causal_window=False masks only keys past the sequence end (for "full" tiles).
    """
    s_mn = acc_mn_view(acc_s)
    c_mn = acc_mn_view(t_coord)
    key_base = n_block * block_range.tile_n
    check_left = const_expr(with_causal_window and block_range.has_window_left)
    # Columns relative to this thread's first one: compile-time constants once LLVM folds
    # them, so each element costs one compare against an immediate and one select (with the
    # column itself, ptxas materialised all 32 columns with an add each).
    col_base = c_mn[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        row = block_range.position(m_block * block_range.tile_m + c_mn[r, 0][0])
        hi = seqlen_k - key_base
        lo = Int32(0)
        if const_expr(with_causal_window):
            hi = cutlass.min(hi, block_range.key_limit_right(row) - key_base)
        if const_expr(check_left):
            lo = block_range.key_limit_left(row) - key_base
        hi = hi - col_base
        lo = lo - col_base
        # Selects, not branches: one compare (two with a left window) per element.
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            col = c_mn[0, c][1] - col_base
            if const_expr(check_left):
                keep = (col < hi) & (col >= lo)
                s_mn[r, c] = s_mn[r, c] if keep else -Float32.inf
            else:
                s_mn[r, c] = s_mn[r, c] if col < hi else -Float32.inf


@cute.jit
def apply_mask_keys_as_rows(
    acc_st: cute.Tensor,
    t_coord: cute.Tensor,
    block_range: BlockRange,
    n_block: Int32,
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    with_causal_window: cutlass.Constexpr[bool],
):
    """The backward's mask: acc_st holds S^T (rows are keys of KV tile n_block, columns rows of
    query tile m_block). Per key, the rows that see it form one interval
    (`BlockRange.row_limit_low/high`), so each element costs a compare or two, as in
    `apply_mask`. with_causal_window=False masks only keys past the sequence end and rows past
    its end."""
    s_mn = acc_mn_view(acc_st)
    c_mn = acc_mn_view(t_coord)
    row_base = m_block * block_range.tile_m
    col_base = c_mn[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        key = n_block * block_range.tile_n + c_mn[r, 0][0]
        lo = Int32(0)
        hi = seqlen_q
        if const_expr(with_causal_window):
            # Positions to local rows (no clamp needed: only compared with local columns).
            lo = block_range.row_limit_low(key) - block_range.row_offset
            hi = cutlass.min(hi, block_range.row_limit_high(key) - block_range.row_offset)
        if key >= seqlen_k:
            hi = Int32(0)
        lo = lo - row_base - col_base
        hi = hi - row_base - col_base
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            col = c_mn[0, c][1] - col_base
            keep = (col < hi) & (col >= lo)
            s_mn[r, c] = s_mn[r, c] if keep else -Float32.inf
