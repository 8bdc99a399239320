"""Register-fragment views for sm90 wgmma accumulators.

A wgmma accumulator fragment of a 64 x N tile holds, per thread, values shaped
((2, 2, N/8), MMA_M, MMA_N): two adjacent columns, two rows 8 apart, N/8 column groups.
Softmax works per row, so we view it as (rows, cols); the P @ V product takes P from
registers, and for 16-bit types the accumulator order is already the A-operand order.
"""
import cutlass.cute as cute


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): rows first, then columns."""
    col_major = cute.make_layout(acc_layout.shape)
    s, d = col_major.shape, col_major.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.composition(acc_layout, mn)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


def acc_as_a_operand_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): k-blocks of 16 columns for wgmma A.

    Only a regrouping of the compact register order, valid for 16-bit operands.
    """
    col_major = cute.make_layout(acc_layout.shape)
    s, d = col_major.shape, col_major.stride
    return cute.make_layout(
        ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2])),
        stride=((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2])),
    )


def acc_columns(acc: cute.Tensor, start: int, width: int) -> cute.Tensor:
    """Columns [start, start + width) of a 64 x N accumulator fragment, as the fragment of a
    64 x width wgmma (same per-thread order).

    The N/8 column groups are the outermost value mode, so a block of columns is a contiguous
    run of registers: a prefix when start is 0 (any width that is a multiple of 8), else the
    block start/width of equal blocks (start a multiple of width).
    """
    groups = width // 8
    if start == 0:
        return cute.make_tensor(acc.iterator, cute.make_layout(((2, 2, groups), 1, 1)))
    assert start % width == 0, "a column block starts at a multiple of its width"
    total_groups = cute.size(acc, mode=[0]) // 4
    blocks = cute.make_tensor(acc.iterator, cute.make_layout(
        ((2, 2, groups), 1, 1, total_groups // groups), stride=((1, 2, 4), 0, 0, 4 * groups)))
    return blocks[None, None, None, start // width]


def with_row_strides_divisible(t: cute.Tensor, divby: int) -> cute.Tensor:
    """t with every stride but the last (1) asserted to be a multiple of `divby` elements.

    The launcher passes fully dynamic strides, so the compiler knows nothing of their
    alignment and refuses a 32-bit store of two 16-bit elements; kernels/sm90/forward.py
    `can_run` only admits tensors whose strides are multiples of 8 elements (16 bytes)."""
    strides = tuple(cute.assume(s, divby=divby) for s in t.stride[:-1]) + (t.stride[-1],)
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=strides))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The first two modes of a (swizzled) smem tensor swapped: the same bytes read as the
    other operand major-ness (Q is the K-major B of S^T = K Q^T and the MN-major B of
    dK = dS^T Q)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))
