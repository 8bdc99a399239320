"""Issuing a warpgroup MMA (wgmma) over the k blocks of its operands: the forward's and both
backward kernels' products."""
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def gemm(tiled_mma, acc, t_a, t_b, zero_init: cutlass.Constexpr[bool]):
    """Issue (not wait for) acc (+)= A @ B over the k blocks; returns the TiledMma.

    Setting ACCUMULATE rebinds the TiledMma value, so callers rebind their variable to the
    result: the DSL only threads plain local rebinds through staged if/for regions.
    """
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, (not zero_init) or k != 0)
        cute.gemm(tiled_mma, acc, t_a[None, None, k], t_b[None, None, k], acc)
    warpgroup.commit_group()
    return tiled_mma
