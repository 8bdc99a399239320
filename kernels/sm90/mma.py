"""Issuing a warpgroup MMA (wgmma) over the k blocks of its operands: the forward's and both
backward kernels' products; the slice that partitions their smem operands."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warpgroup

_WARPGROUP = 128


def warpgroup_slice(tiled_mma, tidx: Int32):
    """The TiledMma's slice for the smem (A/B) operand fragments of thread tidx's warpgroup.

    A wgmma's smem operand descriptors are the same for the warpgroup's 128 threads; sliced by
    the warpgroup's first thread, an index the compiler knows is warp-uniform, they stay in
    uniform registers. Sliced by tidx, ptxas built the backward's K/V descriptors in regular
    registers and moved them with R2UR before every HGMMA (SASS: 162 R2UR in the fused KV-centric
    kernel, 19 sliced this way)."""
    return tiled_mma.get_slice(cute.arch.make_warp_uniform(tidx // _WARPGROUP) * _WARPGROUP)


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
