"""Row dot products of the elementwise kernels (the backward's row statistics, the gated sum's
backward): a (t, h) row is read by a group of adjacent lanes, 16 bytes each; every lane adds
dO . x over its vectors, then the group sums with butterfly shuffles."""
import operator

import cutlass.cute as cute
from cutlass import Float32


def masked_dot(d, x):
    """sum(d * x) over two float32 register vectors, a product with d == 0 counted as 0.

    Select, do not multiply: 0 * NaN is NaN, and a row whose dO is 0 (the loss does not read
    it) must contribute 0 whatever its other operand holds."""
    products = cute.where(d == Float32(0.0), Float32(0.0), d * x)
    return products.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


def lane_group_reduce(value, lanes: int, op):
    """op(value, ...) over each aligned group of `lanes` adjacent lanes (a power of two dividing
    32), butterfly shuffles from the widest offset; every lane of the warp must call it (the
    shuffles are warp-wide) and gets the group's result."""
    offset = lanes // 2
    while offset > 0:
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset))
        offset //= 2
    return value


def lane_group_sum(value, lanes: int):
    """value summed over each aligned group of `lanes` adjacent lanes (`lane_group_reduce`)."""
    return lane_group_reduce(value, lanes, operator.add)
