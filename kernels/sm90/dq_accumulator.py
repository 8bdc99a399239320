"""Where the fused backward's dQ goes (`BwdSpec.fuses_dq`): a float32 accumulator (H, P, D)
over the 64-row query tiles of kernels/sm90/backward.py, which every KV tile that sees a query
tile adds into.

Each consumer warpgroup stages its 64 x cols block of dQ (its wgmma accumulator) in smem, and a
warp of the producer warpgroup, the dQ writer, adds the block into global memory with one bulk
reduce-add (`cp.reduce.async.bulk.global.shared::cta.add.f32`). The two sides hand the buffer
over through a pair of named barriers per warpgroup (empty: the writer's previous reduce has
read it; full: the block is staged), so the consumers never wait on the bulk copy themselves
(FA3/FA4's scheme).

The block keeps the accumulator's register order, in smem and in global memory: value v of
thread t sits at float ((v // 4) * 128 + t) * 4 + v % 4 of the block, so each thread stores
eight 16-byte vectors and a warp's store covers 512 contiguous bytes (no bank conflicts); the
block is one contiguous 64 x cols run of the (H, P, D) tensor, which the conversion pass
(kernels/sm90/dq_convert.py, `fragment_offset`) reads back in row order. A row-major,
swizzled staging block with a tiled TMA reduce-add (sessions 11-17) cost 2-way conflicted
8-byte stores and run-time swizzle arithmetic on the consumers' critical path (ncu, H100,
session 17).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental import primitives

_WARPGROUP = 128
_VECTOR = 4  # float32 per 16-byte store
# 6 + wg: the writer has read warpgroup wg's buffer (empty); 8 + wg: the warpgroup has staged
# its block (full); each between the warpgroup and the writer warp (1-3 belong to
# bwd_sm90.py).
_DQ_EMPTY_BARRIER = 6
_DQ_FULL_BARRIER = 8
_HANDOFF_THREADS = _WARPGROUP + 32


def fragment_layout(block_values: int) -> cute.Layout:
    """(value, thread) -> float offset in a staged block of `block_values` floats."""
    groups = block_values // _WARPGROUP // _VECTOR
    return cute.make_layout(((_VECTOR, groups), _WARPGROUP),
                            stride=((1, _VECTOR * _WARPGROUP), _VECTOR))


@dataclass(frozen=True)
class DqAccumulator:
    tile_m: cutlass.Constexpr[int]
    cols_per_wg: cutlass.Constexpr[int]   # columns of one warpgroup's block
    num_wg: cutlass.Constexpr[int]
    mdQacc: cute.Tensor                   # (H, P, D) float32
    sdQ: cute.Tensor                      # (tile_m * cols_per_wg, num_wg) float32 staging

    @cute.jit
    def hand_to_writer(self, tidx: Int32, acc_dq: cute.Tensor):
        """Consumer side: once the writer has read this warpgroup's previous block, stage this
        one (16-byte stores in register order) and tell the writer."""
        wg = tidx // _WARPGROUP
        cute.arch.barrier(barrier_id=_DQ_EMPTY_BARRIER + wg, number_of_threads=_HANDOFF_THREADS)
        block = cute.make_tensor(self.sdQ[None, wg].iterator,
                                 fragment_layout(self.tile_m * self.cols_per_wg))
        mine = block[None, tidx % _WARPGROUP]
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout(cute.size(mine))),
                          mine)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=_DQ_FULL_BARRIER + wg,
                                 number_of_threads=_HANDOFF_THREADS)

    @cute.jit
    def write_step(self, head: Int32, slot_tile: Int32):
        """The writer warp: one step's blocks, every warpgroup's, added into query tile
        `slot_tile` of head `head`. The buffers are handed back as soon as the previous
        step's reduces have read them."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=_DQ_EMPTY_BARRIER + wg,
                                     number_of_threads=_HANDOFF_THREADS)
        block_values = self.tile_m * self.cols_per_wg
        tile = self.mdQacc[head, slot_tile * self.tile_m, None].iterator
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier(barrier_id=_DQ_FULL_BARRIER + wg, number_of_threads=_HANDOFF_THREADS)
            with cute.arch.elect_one():
                primitives.cp_reduce_async_bulk_global_shared_cta(
                    tile + wg * block_values, self.sdQ[None, wg].iterator, block_values * 4,
                    op=primitives.CpReduceOp.ADD, type=primitives.CpReduceType.F32)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def finish(self):
        """The writer, before the CTA exits: the staging buffers have been read."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
