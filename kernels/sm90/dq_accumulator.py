"""Where the backward's dQ goes: a float32 accumulator (H, P, D) in the 64-row query tile
layout of kernels/sm90/backward.py, which every KV tile that sees a query tile adds into.

Three ways, compile-time switches (`BwdSpec.dq_tma_reduce`, `BwdSpec.dq_writer_warp`):
- the warpgroup stages its 64 x cols float32 block in smem and a warp of the producer
  warpgroup (the dQ writer) adds it with one TMA reduce-add (`cp.reduce.async.bulk.tensor`);
  the two sides hand the buffer over through a pair of named barriers per warpgroup (empty:
  the writer's previous reduce has read it; full: the block is staged), so the consumers
  never wait on the bulk copy themselves (`dq_writer_warp`, FA3/FA4's scheme);
- the same staging, with the warpgroup's first warp issuing the reduce-add, which runs while
  the warpgroup goes on; the buffer is reused once the previous reduce has read it (H100,
  session 11: dense causal 16K backward 20.1 -> 12.3 ms against the next way). The issuing
  warp must be whole: the TMA copy elects one lane with `elect.sync` over the full warp, and a
  first version that issued it from a single thread hung on the H100 (the other 31 lanes had
  moved on to a named barrier);
- one `red.global.add.f32` per element, straight from the wgmma accumulator registers (the
  first design; 12 of 21 ms of that backward were these reductions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

_WARPGROUP = 128
# 4 + wg: warpgroup wg's staging buffer is free / written (1-3 belong to bwd_sm90.py); with
# the writer warp, 6 + wg: the writer has read the buffer (empty), 8 + wg: the warpgroup has
# staged its block (full), each between the warpgroup and the writer warp.
_DQ_STAGE_BARRIER = 4
_DQ_EMPTY_BARRIER = 6
_DQ_FULL_BARRIER = 8
_WRITER_HANDOFF_THREADS = _WARPGROUP + 32


@dataclass(frozen=True)
class DqAccumulator:
    tma_reduce: cutlass.Constexpr[bool]
    tile_m: cutlass.Constexpr[int]
    cols_per_wg: cutlass.Constexpr[int]   # columns of one warpgroup's block per pass
    num_wg: cutlass.Constexpr[int]
    dtype: cutlass.Constexpr              # the MMA operand type (for the staging partition)
    mdQacc: cute.Tensor                   # (H, P, D) float32
    tma_atom: cute.CopyAtom
    mdQacc_tma: cute.Tensor               # (P, D, H) TMA coordinates of the same tensor
    sdQ: Optional[cute.Tensor]            # (tile_m, cols_per_wg, num_wg) float32 staging

    @cute.jit
    def add(self, tidx: Int32, thr_dq, acc_dq: cute.Tensor, head: Int32, slot_tile: Int32,
            p: cutlass.Constexpr[int]):
        """Add this warpgroup's block of dQ (the columns of pass p) into query tile
        `slot_tile` of head `head`."""
        pass_cols = self.cols_per_wg * self.num_wg
        if const_expr(self.tma_reduce):
            wg = tidx // _WARPGROUP
            issuer = tidx % _WARPGROUP < 32  # a whole warp (see the module docstring)
            if issuer:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=_DQ_STAGE_BARRIER + wg, number_of_threads=_WARPGROUP)
            self.stage_block(tidx, acc_dq)
            cute.arch.barrier(barrier_id=_DQ_STAGE_BARRIER + wg, number_of_threads=_WARPGROUP)
            if issuer:
                self.reduce_block(wg, head, slot_tile, p * self.num_wg + wg)
                cute.arch.cp_async_bulk_commit_group()
        else:
            g_dq = cute.local_tile(self.mdQacc[head, None, None], (self.tile_m, pass_cols),
                                   (slot_tile, p))
            coord = thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, pass_cols)))
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                offset = cute.crd2idx(coord[i], g_dq.layout)
                cute.arch.red(g_dq.iterator + offset, acc_dq[i], op="add", dtype="f32",
                              sem="relaxed", scope="gpu")

    @cute.jit
    def stage_block(self, tidx: Int32, acc_dq: cute.Tensor):
        """This warpgroup's block of dQ into its staging buffer, visible to the TMA unit."""
        wg = tidx // _WARPGROUP
        # The warpgroup's share of the (1, num_wg) MMA, partitioned as a one-warpgroup MMA of
        # the block's shape: the same per-thread fragment order.
        thr_block = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1),
            (64, self.cols_per_wg)).get_slice(tidx % _WARPGROUP)
        cute.autovec_copy(acc_dq, thr_block.partition_C(self.sdQ[None, None, wg]))
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def reduce_block(self, wg, head: Int32, slot_tile: Int32, col_block):
        """One TMA reduce-add of warpgroup wg's staged block into columns block `col_block`
        of query tile `slot_tile` (issued by a whole warp)."""
        g_block = cute.local_tile(self.mdQacc_tma[None, None, head],
                                  (self.tile_m, self.cols_per_wg), (slot_tile, col_block))
        t_s, t_g = cpasync.tma_partition(
            self.tma_atom, 0, cute.make_layout(1), cute.group_modes(self.sdQ, 0, 2),
            cute.group_modes(g_block, 0, 2))
        cute.copy(self.tma_atom, t_s[(None, wg)], t_g)

    @cute.jit
    def hand_to_writer(self, tidx: Int32, acc_dq: cute.Tensor):
        """`dq_writer_warp`, consumer side: once the writer has read this warpgroup's previous
        block, stage this one and tell the writer."""
        wg = tidx // _WARPGROUP
        cute.arch.barrier(barrier_id=_DQ_EMPTY_BARRIER + wg,
                          number_of_threads=_WRITER_HANDOFF_THREADS)
        self.stage_block(tidx, acc_dq)
        cute.arch.barrier_arrive(barrier_id=_DQ_FULL_BARRIER + wg,
                                 number_of_threads=_WRITER_HANDOFF_THREADS)

    @cute.jit
    def write_step(self, head: Int32, slot_tile: Int32):
        """`dq_writer_warp`, the writer warp: one step's blocks, every warpgroup's. The
        buffers are handed back as soon as the previous step's reduces have read them."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=_DQ_EMPTY_BARRIER + wg,
                                     number_of_threads=_WRITER_HANDOFF_THREADS)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier(barrier_id=_DQ_FULL_BARRIER + wg,
                              number_of_threads=_WRITER_HANDOFF_THREADS)
            self.reduce_block(wg, head, slot_tile, wg)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def settle(self, tidx: Int32):
        """The adds issued so far have landed in global memory (`deterministic`: before the
        next KV tile's turn)."""
        if const_expr(self.tma_reduce):
            if tidx % _WARPGROUP < 32:
                cute.arch.cp_async_bulk_wait_group(0)
                cute.arch.fence_proxy("async.global")

    @cute.jit
    def finish(self, tidx: Int32):
        """Before the CTA exits: the staging buffer has been read."""
        if const_expr(self.tma_reduce):
            if tidx % _WARPGROUP < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
