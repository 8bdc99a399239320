"""Online softmax over KV tiles, in base 2, for one thread's rows of a wgmma fragment.

State is two register tensors per thread (row max, row sum). Rows are spread over the 4
threads of a quad, so row reductions finish with two shuffles. A row that has seen only
masked keys keeps max = -inf; it is treated as max 0 so that exp2(-inf) = 0 and nothing
becomes NaN; at the end it gets out = 0 and lse = -inf.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from kernels.sm90.layouts import acc_mn_view


def _quad_allreduce(value, op):
    for offset in (1, 2):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


def _add(a, b):
    return a + b


@cute.jit
def softmax_init(row_max: cute.Tensor, row_sum: cute.Tensor):
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)


def _reduce_row(s_mn: cute.Tensor, r: int, op, init=None, lanes: int = 4):
    """op-reduce row r of s_mn with `lanes` independent partials.

    A single running value makes a dependency chain as long as the row (32 columns per thread
    at tile_n 128); with two consumer warps per SM quadrant nothing hides that latency. Four
    partials cut the chain to a quarter.
    """
    num_cols = cute.size(s_mn, mode=[1])
    lanes = min(lanes, num_cols)
    partial = [s_mn[r, c] for c in range(lanes)]
    for c in range(lanes, num_cols):
        partial[c % lanes] = op(partial[c % lanes], s_mn[r, c])
    while len(partial) > 1:
        partial = [op(partial[i], partial[i + 1]) if i + 1 < len(partial) else partial[i]
                   for i in range(0, len(partial), 2)]
    return partial[0] if init is None else op(partial[0], init)


@cute.jit
def softmax_step(
    acc_s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, correction: cute.Tensor,
    scale_log2: Float32, is_first: cutlass.Constexpr[bool] = False,
):
    """Turn scores acc_s into unnormalised probabilities, update max and sum.

    Writes each row's rescale factor for the output accumulator into `correction`; the caller
    applies it (`rescale_rows`) once the P @ V product still reading the old output is done.
    `is_first` (the first KV tile of a query tile): no previous max or sum to fold in.
    """
    s_mn = acc_mn_view(acc_s)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        tile_max = _reduce_row(s_mn, r, cute.arch.fmax)
        tile_max = _quad_allreduce(tile_max, cute.arch.fmax)
        new_max = tile_max
        if const_expr(not is_first):
            new_max = cute.arch.fmax(row_max[r], tile_max)
        safe_max = new_max
        if new_max == -Float32.inf:
            safe_max = Float32(0.0)
        max_scaled = safe_max * scale_log2
        if const_expr(not is_first):
            correction[r] = cute.math.exp2(row_max[r] * scale_log2 - max_scaled, fastmath=True)
        row_max[r] = new_max
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - max_scaled, fastmath=True)
        if const_expr(is_first):
            row_sum[r] = _reduce_row(s_mn, r, _add)
        else:
            row_sum[r] = _reduce_row(s_mn, r, _add, init=row_sum[r] * correction[r])


@cute.jit
def rescale_rows(acc_o: cute.Tensor, correction: cute.Tensor):
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            o_mn[r, c] = o_mn[r, c] * correction[r]


@cute.jit
def softmax_finalize(
    acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale: Float32,
    lse: cute.Tensor,
):
    """Normalise acc_o and write each row's natural-log lse (-inf for empty rows)."""
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        total = _quad_allreduce(row_sum[r], _add)
        inv = Float32(0.0)
        row_lse = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            row_lse = row_max[r] * scale + cute.math.log(total, fastmath=True)
        lse[r] = row_lse
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            o_mn[r, c] = o_mn[r, c] * inv
