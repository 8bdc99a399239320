"""Where the fused backward's dQ goes (`BwdSpec.fuses_dq`): a float32 accumulator (H, P, D)
over the 64-row query tiles of kernels/sm90/backward.py, which every KV tile that sees a query
tile adds into.

Each consumer warpgroup stages its 64 x cols block of dQ (its wgmma accumulator: a share of a
64-row step's columns, or every column of its own 64 rows of a 128-row step) in smem, and a
warp of the producer warpgroup, the dQ writer, adds the block into global memory with one bulk
reduce-add (`cp.reduce.async.bulk.global.shared::cta.add.f32`), or, where each block is the
only one of its rows (`BwdSpec.dq_stores`), one bulk store (`cp.async.bulk.global.shared::cta`).
The two sides hand the buffer over through a pair of named barriers per warpgroup (empty: the
writer's previous reduce has read it; full: the block is staged), so the consumers never wait
on the bulk copy themselves (FA3/FA4's scheme).

The block keeps the accumulator's register order, in smem and in global memory: value v of
thread t sits at float ((v // 4) * 128 + t) * 4 + v % 4 of the block, so each thread stores
eight 16-byte vectors and a warp's store covers 512 contiguous bytes (no bank conflicts); the
block is one contiguous 64 x cols run of the (H, P, D) tensor, which the conversion pass
(kernels/sm90/dq_convert.py, from CuTe's fragment) reads back in row order. A row-major,
swizzled staging block with a tiled TMA reduce-add (2026-11-24) cost 2-way conflicted
8-byte stores and run-time swizzle arithmetic on the consumers' critical path (ncu, H100,
2026-11-24).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.experimental import primitives

from kernels.sm90.spec import QUERY_SLOT_ROWS as _BLOCK_ROWS  # a block: one accumulator tile

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
    cols_per_wg: cutlass.Constexpr[int]   # columns of one warpgroup's 64-row block
    num_wg: cutlass.Constexpr[int]
    rows_per_wg: cutlass.Constexpr[bool]  # each warpgroup's block is its own 64-row tile
                                          # (128-row steps), else a share of the columns
    mdQacc: cute.Tensor                   # (H, P, D) float32
    sdQ: cute.Tensor                      # (64 * cols_per_wg, num_wg) float32 staging
    stores: cutlass.Constexpr[bool] = False  # each block is the only one of its rows and
                                             # columns: a bulk store instead of a reduce-add
                                             # (`BwdSpec.dq_stores`)

    @cute.jit
    def hand_to_writer(self, tidx: Int32, acc_dq: cute.Tensor):
        """Consumer side: once the writer has read this warpgroup's previous block, stage this
        one (16-byte stores in register order) and tell the writer."""
        wg = tidx // _WARPGROUP
        cute.arch.barrier(barrier_id=_DQ_EMPTY_BARRIER + wg, number_of_threads=_HANDOFF_THREADS)
        block = cute.make_tensor(self.sdQ[None, wg].iterator,
                                 fragment_layout(_BLOCK_ROWS * self.cols_per_wg))
        mine = block[None, tidx % _WARPGROUP]
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout(cute.size(mine))),
                          mine)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=_DQ_FULL_BARRIER + wg,
                                 number_of_threads=_HANDOFF_THREADS)

    @cute.jit
    def write_step(self, head: Int32, slot_tile: Int32, rows_in_step: Int32):
        """The writer warp: one step's blocks, every warpgroup's, added into the accumulator
        from 64-row tile `slot_tile` of head `head` on (one tile, or one per warpgroup with
        `rows_per_wg`: then a warpgroup's tile past the sequence's `rows_in_step` rows is not
        written, its values are zeros and the tile may be another sequence's or past the end).
        The buffers are handed back as soon as the previous step's reduces have read them."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=_DQ_EMPTY_BARRIER + wg,
                                     number_of_threads=_HANDOFF_THREADS)
        # Blocks follow each other: a column share within one tile, or whole tiles.
        block_values = _BLOCK_ROWS * self.cols_per_wg
        tile = self.mdQacc[head, slot_tile * _BLOCK_ROWS, None].iterator
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier(barrier_id=_DQ_FULL_BARRIER + wg, number_of_threads=_HANDOFF_THREADS)
            inside = True
            if const_expr(self.rows_per_wg):
                inside = wg * _BLOCK_ROWS < rows_in_step
            if inside:
                with cute.arch.elect_one():
                    if const_expr(self.stores):
                        primitives.cp_async_bulk_global_shared_cta(
                            tile + wg * block_values, self.sdQ[None, wg].iterator,
                            block_values * 4)
                    else:
                        primitives.cp_reduce_async_bulk_global_shared_cta(
                            tile + wg * block_values, self.sdQ[None, wg].iterator,
                            block_values * 4, op=primitives.CpReduceOp.ADD,
                            type=primitives.CpReduceType.F32)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def finish(self):
        """The writer, before the CTA exits: the staging buffers have been read."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
