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
