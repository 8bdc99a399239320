"""Where a finished query tile's output goes: O (T, H, D) and lse (H, T).

Each consumer warpgroup owns 64 rows of the tile. Rows inside the sequence go registers ->
smem (stmatrix) -> one TMA store; a 64-row half that crosses the sequence end is stored
straight from registers (32-bit stores of column pairs, each row predicated), so no other
sequence's rows are touched. Registers are not the fast path for whole halves: each store
instruction then writes 16 bytes into each of 8 rows, and a compressed tile's store phase took
3,500 cycles instead of 550-960 (2026-11-23, docs/history.md).

Two ways to finish the smem path (`FwdSpec.store_warp`):
- the consumer warpgroup itself issues the TMA store and writes lse from registers;
- a storer warp of the producer warpgroup does both (`drain`): the consumers stage O and lse in
  smem, fence, arrive on a named barrier and go on to the next tile, so the store's barrier
  waits, the TMA issue and the lse writes leave the consumers' critical path (about 1,100
  cycles of a 6,000-cycle compressed tile, tools/trace_sm90_forward.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from kernels.sm90.layouts import acc_mn_view
from kernels.sm90.row_dot import lane_group_sum, masked_dot

_WARPGROUP = 128
_ROWS = 64  # rows of one consumer warpgroup
# Named barriers (0 is __syncthreads; 11 and 12-14 belong to kernels/sm90/fwd_sm90.py): 1 + wg
# guards warpgroup wg's staging when it stores itself; with a storer warp, 5 + wg says "staged"
# and 8 + wg says "staging buffer free" (wg < 3).
_EPILOGUE_BARRIER = 1
_STAGED_BARRIER = 5
_FREE_BARRIER = 8
_WITH_STORER = _WARPGROUP + 32


@dataclass(frozen=True)
class OutputStore:
    """A CTA's output path; built once in the kernel, used by the consumer warpgroups
    (`write`, `finish`) and the storer warp (`begin`, `drain`)."""
    head_dim: cutlass.Constexpr[int]
    num_warpgroups: cutlass.Constexpr[int]
    persistent: cutlass.Constexpr[bool]
    store_warp: cutlass.Constexpr[bool]
    tiled_mma: cute.TiledMma  # one warpgroup's 64 x head_dim accumulator layout
    sO: cute.Tensor           # (64, head_dim, warpgroup) staging, swizzled
    sLSE: cute.Tensor         # (64, warpgroup) float32 staging (storer warp only)
    tma_atom: cute.CopyAtom
    mO_tma: cute.Tensor       # (T, D, H) view for the TMA store
    mO: cute.Tensor           # (T, H, D)
    mLSE: cute.Tensor         # (H, T)

    @cute.jit
    def begin(self):
        """Storer warp: every warpgroup's staging buffer starts free."""
        if const_expr(self.store_warp):
            for wg in cutlass.range_constexpr(self.num_warpgroups):
                cute.arch.barrier_arrive(barrier_id=_FREE_BARRIER + wg,
                                         number_of_threads=_WITH_STORER)

    @cute.jit
    def write(self, r_o: cute.Tensor, lse: cute.Tensor, offset_q: Int32, seqlen_q: Int32,
              head: Int32, m_block: Int32, tidx: Int32):
        """Consumer warpgroup side: write (or stage) this warpgroup's 64 rows of O and lse.
        `tidx` counts the consumer threads from 0; r_o is O in the output type."""
        wg = tidx // _WARPGROUP
        thr, half, first_row, co_mn = self.warpgroup_rows(m_block, tidx)
        if first_row + _ROWS <= seqlen_q:
            if const_expr(self.store_warp):
                cute.arch.barrier(barrier_id=_FREE_BARRIER + wg, number_of_threads=_WITH_STORER)
            elif const_expr(self.persistent):
                # sO may still be read by this warpgroup's previous tile's TMA store.
                if tidx % _WARPGROUP == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER + wg,
                                  number_of_threads=_WARPGROUP)
            # stmatrix: 8 instructions per thread instead of 32 scalar stores.
            store_atom = sm90_utils.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, self.sO.element_type,
                                                      Float32)
            thr_store = cute.make_tiled_copy_C(store_atom, self.tiled_mma).get_slice(
                tidx % _WARPGROUP)
            cute.copy(store_atom, thr_store.retile(r_o),
                      thr_store.partition_D(self.sO[None, None, wg]))
            cute.arch.fence_proxy("async.shared", space="cta")
            if const_expr(self.store_warp):
                for r in cutlass.range_constexpr(cute.size(co_mn, mode=[0])):
                    if co_mn[r, 0][1] == 0:
                        self.sLSE[co_mn[r, 0][0], wg] = lse[r]
                cute.arch.barrier_arrive(barrier_id=_STAGED_BARRIER + wg,
                                         number_of_threads=_WITH_STORER)
            else:
                cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER + wg,
                                  number_of_threads=_WARPGROUP)
                if tidx % _WARPGROUP == 0:
                    self.issue_tma_store(offset_q, head, half, wg)
                self.write_lse(lse, co_mn, offset_q, seqlen_q, head, first_row)
        else:
            self.store_from_registers(thr, r_o, co_mn, lse, offset_q, seqlen_q, head, half,
                                      first_row)

    @cute.jit
    def store_from_registers(self, thr, r_o: cute.Tensor, co_mn: cute.Tensor, lse: cute.Tensor,
                             offset_q: Int32, seqlen_q: Int32, head: Int32, half: Int32,
                             first_row: Int32):
        """This thread's rows of O that lie inside the sequence, straight from registers: one
        32-bit store per pair of adjacent columns (the accumulator holds columns in pairs),
        then lse."""
        mO_seq = cute.domain_offset((offset_q, 0), self.mO[None, head, None])
        go_mn = acc_mn_view(thr.partition_C(
            cute.local_tile(mO_seq, (_ROWS, self.head_dim), (half, 0))))
        o_mn = acc_mn_view(r_o)
        pair_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), r_o.element_type,
                                         num_bits_per_copy=32)
        num_pairs = cute.size(o_mn, mode=[1]) // 2
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            if first_row + co_mn[r, 0][0] < seqlen_q:
                for c in cutlass.range_constexpr(num_pairs):
                    cute.copy(pair_store, self.column_pair(o_mn, r, c),
                              self.column_pair(go_mn, r, c))
        self.write_lse(lse, co_mn, offset_q, seqlen_q, head, first_row)

    @staticmethod
    def column_pair(t_mn: cute.Tensor, row: int, pair: int) -> cute.Tensor:
        """Columns 2 * pair and 2 * pair + 1 of row `row` of an (rows, (2, V, N)) view: two
        adjacent columns of the tile."""
        return t_mn[row, (None, pair % cute.size(t_mn.shape[1][1]),
                          pair // cute.size(t_mn.shape[1][1]))]

    @cute.jit
    def write_lse(self, lse: cute.Tensor, co_mn: cute.Tensor, offset_q: Int32, seqlen_q: Int32,
                  head: Int32, first_row: Int32):
        """lse of this thread's rows inside the sequence, from registers (one thread of the
        four that share a row writes it)."""
        for r in cutlass.range_constexpr(cute.size(co_mn, mode=[0])):
            row = first_row + co_mn[r, 0][0]
            if row < seqlen_q and co_mn[r, 0][1] == 0:
                self.mLSE[head, offset_q + row] = lse[r]

    def warpgroup_rows(self, m_block: Int32, tidx: Int32):
        """(thread slice of the accumulator layout, 64-row half of the tile, its first row,
        this thread's (row, column) coordinates in it) for consumer thread tidx."""
        thr = self.tiled_mma.get_slice(tidx % _WARPGROUP)
        half = m_block * self.num_warpgroups + tidx // _WARPGROUP
        co_mn = acc_mn_view(thr.partition_C(cute.make_identity_tensor((_ROWS, self.head_dim))))
        return thr, half, half * _ROWS, co_mn

    @cute.jit
    def load_row_dot_operand(self, offset_q: Int32, seqlen_q: Int32, head: Int32,
                             m_block: Int32, tidx: Int32) -> cute.Tensor:
        """`FwdSpec.row_dot_output`: this thread's elements of dO (mO holds dO here), in the
        accumulator's layout, as (2, column pairs, rows) registers. Issued before the tile's
        last P V, so the loads' latency hides under it; rows past the sequence read its last
        row (they are dropped in `write_row_dot`)."""
        _, _, first_row, co_mn = self.warpgroup_rows(m_block, tidx)
        mdO_seq = cute.domain_offset((offset_q, 0), self.mO[None, head, None])
        num_rows = cute.size(co_mn, mode=[0])
        num_pairs = cute.size(co_mn, mode=[1]) // 2
        pair_load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mO.element_type,
                                        num_bits_per_copy=32)
        dout = cute.make_rmem_tensor(cute.make_layout((2, num_pairs, num_rows)),
                                     self.mO.element_type)
        for r in cutlass.range_constexpr(num_rows):
            g_row = mdO_seq[cutlass.min(first_row + co_mn[r, 0][0], seqlen_q - 1), None]
            for c in cutlass.range_constexpr(num_pairs):
                col = self.column_pair(co_mn, r, c)[0][1]
                cute.copy(pair_load, cute.local_tile(g_row, (2,), (col // 2,)),
                          dout[None, c, r])
        return dout

    @cute.jit
    def write_row_dot(self, acc_o: cute.Tensor, dout: cute.Tensor, offset_q: Int32,
                      seqlen_q: Int32, head: Int32, m_block: Int32, tidx: Int32):
        """`FwdSpec.row_dot_output`: instead of O and lse, rowsum(dO * O) of this warpgroup's
        rows into mLSE[head, row], from the float32 accumulator and `load_row_dot_operand`'s
        dO. A zero dO element contributes exactly zero, even against a non-finite O (as the
        gated-sum kernels' gate gradient): selected, not multiplied."""
        _, _, first_row, co_mn = self.warpgroup_rows(m_block, tidx)
        o_mn = acc_mn_view(acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = first_row + co_mn[r, 0][0]
            dot = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                dot += masked_dot(dout[None, c, r].load().to(Float32),
                                  self.column_pair(o_mn, r, c).load())
            # The four lanes of a quad hold the row's columns (the accumulator's layout).
            dot = lane_group_sum(dot, 4)
            if row < seqlen_q and co_mn[r, 0][1] == 0:
                self.mLSE[head, offset_q + row] = dot

    @cute.jit
    def drain(self, offset_q: Int32, seqlen_q: Int32, head: Int32, m_block: Int32,
              in_sequence, lane: Int32):
        """Storer warp side, per tile: for each warpgroup whose 64 rows went through smem, wait
        until they are staged, TMA-store O, write lse, and free the buffer once the store has
        read it."""
        if in_sequence:
            for wg in cutlass.range_constexpr(self.num_warpgroups):
                half = m_block * self.num_warpgroups + wg
                if half * _ROWS + _ROWS <= seqlen_q:
                    cute.arch.barrier(barrier_id=_STAGED_BARRIER + wg,
                                      number_of_threads=_WITH_STORER)
                    if lane == 0:
                        self.issue_tma_store(offset_q, head, half, wg)
                    for i in cutlass.range_constexpr(_ROWS // 32):
                        row = lane + 32 * i
                        self.mLSE[head, offset_q + half * _ROWS + row] = self.sLSE[row, wg]
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.sync_warp()
                    cute.arch.barrier_arrive(barrier_id=_FREE_BARRIER + wg,
                                             number_of_threads=_WITH_STORER)

    @cute.jit
    def issue_tma_store(self, offset_q: Int32, head: Int32, half: Int32, wg):
        mO_seq = cute.domain_offset((offset_q, 0), self.mO_tma[None, None, head])
        gO = cute.local_tile(mO_seq, (_ROWS, self.head_dim), (half, 0))
        tOsO, tOgO = cpasync.tma_partition(
            self.tma_atom, 0, cute.make_layout(1),
            cute.group_modes(self.sO, 0, 2), cute.group_modes(gO, 0, 2))
        cute.copy(self.tma_atom, tOsO[(None, wg)], tOgO)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def finish(self, tidx: Int32):
        """Consumer side, before the CTA exits: the last TMA store has read shared memory.
        With a storer warp, its last "free" arrival (one more than the tiles it drained,
        counting `begin`) is matched here, and comes only after that store's read."""
        if const_expr(self.store_warp):
            cute.arch.barrier(barrier_id=_FREE_BARRIER + tidx // _WARPGROUP,
                              number_of_threads=_WITH_STORER)
        else:
            if tidx % _WARPGROUP == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
