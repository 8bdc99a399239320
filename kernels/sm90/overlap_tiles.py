"""`FwdSpec.overlap_tiles`: a persistent CTA's tiles software-pipelined across tile boundaries.

A tile's last `P V` is issued with the next tile's first `Q K^T` and runs under that tile's
first softmax; the previous output is finalised and stored after it. Measured -3% at 16K
compressed keys and +5% at 64K (docs/history.md, 2026-11-23), so the dispatcher does not pick it;
tools/tune_sm90_forward.py times it. A mixin of `FlashAttentionForwardSm90`: it uses the
kernel's products (`gemm_qk`, `gemm_pv`, `last_pv`), turns and KV loop.
"""
from __future__ import annotations

from functools import partial

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from kernels.sm90.block_range import BlockRange
from kernels.sm90.epilogue import OutputStore
from kernels.sm90.layouts import acc_as_a_operand_layout, acc_mn_view
from kernels.sm90.mask import apply_mask
from kernels.sm90.pipelines import stage_index
from kernels.sm90.softmax import softmax_finalize, softmax_init, softmax_step


class OverlapTiles:
    def make_overlap_state(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                           tidx: Int32):
        """`overlap_tiles`: what a tile leaves for the next one to finish: the output
        accumulator and P awaiting the last P V, the row max and sum, and (offset_q, seqlen_q,
        head, m_block, pending) of that tile (pending 0: nothing left)."""
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        r_p = cute.make_rmem_tensor(acc_as_a_operand_layout(acc_s.layout), self.dtype)
        num_rows = cute.size(acc_mn_view(acc_o), mode=[0])
        row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        where = cute.make_rmem_tensor(cute.make_layout(5), Int32)
        where.fill(0)
        return acc_o, r_p, row_max, row_sum, where

    @cute.jit
    def consume_overlapped(
        self, tidx: Int32, sQ, sK, sV, q_consumer, k_consumer, v_consumer,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, out_store: OutputStore,
        softmax_scale: Float32, scale_log2: Float32, block_range: BlockRange, offset_q: Int32,
        seqlen_q: Int32, seqlen_k: Int32, head: Int32, m_block: Int32, n_max: Int32,
        num_iters: Int32, in_sequence, state,
    ):
        """`overlap_tiles`: one query tile, software-pipelined with its neighbours.

        The previous tile's last `P V` is issued together with this tile's first `Q K^T` and runs
        under this tile's first softmax; the previous output is finalised and stored after it.
        This tile's own last `P V` waits for the next tile. Each branch below issues and waits
        for its own wgmma (ptxas serialises every wgmma when a runtime branch separates a
        product from its wait or wraps the KV loops), and every tile waits for its Q (the
        producer loads one per tile), so the loops and the Q release stay at the top level.
        """
        acc_o, r_p, row_max, row_sum, where = state
        thr_qk, _, tSrQ, tSrK, tOrV = self.operand_fragments(
            tidx, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV)
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        r_p_as_acc = cute.make_tensor(r_p.iterator, acc_s.layout)
        t_coord = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(row_max)
        correction = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        prev_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        prev_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        unmasked_lo, unmasked_hi = block_range.unmasked_tiles(m_block, seqlen_q, seqlen_k)
        iters = num_iters
        if not in_sequence:
            iters = Int32(0)
        active = iters > 0
        pending = where[4] != 0
        finish = partial(self.finish_pending, tidx=tidx, out_store=out_store,
                         softmax_scale=softmax_scale)

        q_handle = q_consumer.wait_and_advance()
        sQ_stage = tSrQ[None, None, None, stage_index(q_handle, self.spec.q_stages)]
        n_block = n_max - 1
        # The first KV tile's mask and softmax: always masked, with selects only (a runtime
        # "needs a mask?" branch would pull the wait for the previous tile's P V above them).
        first_softmax = partial(self.first_softmax_masked, row_max=row_max, row_sum=row_sum,
                                correction=correction, scale_log2=scale_log2, t_coord=t_coord,
                                block_range=block_range, m_block=m_block, n_block=n_block,
                                seqlen_k=seqlen_k)
        if active & pending:
            k_handle = k_consumer.wait_and_advance()
            v_handle = v_consumer.wait_and_advance()
            self.wait_turn(tidx)
            tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, sQ_stage, tSrK, k_handle)
            tiled_mma_pv = self.gemm_pv(tiled_mma_pv, acc_o, r_p, tOrV, v_handle)
            self.pass_turn(tidx)
            warpgroup.wait_group(1)
            k_handle.release()
            prev_max.store(row_max.load())
            prev_sum.store(row_sum.load())
            first_softmax(acc_s)
            warpgroup.wait_group(0)
            v_handle.release()
            finish(acc_o, prev_max, prev_sum, where)
            acc_o.fill(0.0)
            r_p_as_acc.store(acc_s.load().to(self.dtype))
        elif active:
            k_handle = k_consumer.wait_and_advance()
            self.wait_turn(tidx)
            tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, sQ_stage, tSrK, k_handle)
            self.pass_turn(tidx)
            warpgroup.wait_group(0)
            k_handle.release()
            first_softmax(acc_s)
            acc_o.fill(0.0)
            r_p_as_acc.store(acc_s.load().to(self.dtype))
        elif pending:
            tiled_mma_pv, v_consumer = self.last_pv(tidx, v_consumer, tiled_mma_pv, acc_o, r_p,
                                                    tOrV)
            finish(acc_o, row_max, row_sum, where)
        if (not active) & in_sequence:
            # No key to attend: out 0, lse -inf, stored now (after the previous tile's).
            acc_o.fill(0.0)
            softmax_init(row_max, row_sum)
            where[0], where[1], where[2], where[3] = offset_q, seqlen_q, head, m_block
            finish(acc_o, row_max, row_sum, where)
        k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = self.later_kv_tiles(
            tidx, sQ_stage, tSrK, tOrV, acc_s, acc_o, r_p, r_p_as_acc, row_max, row_sum,
            correction, scale_log2, t_coord, block_range, m_block, seqlen_k, n_max,
            iters, Int32(0), unmasked_lo, unmasked_hi, None, None, Int32(0), Int32(0),
            k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv)
        q_handle.release()
        where[0], where[1], where[2], where[3] = offset_q, seqlen_q, head, m_block
        where[4] = Int32(0)
        if active:
            where[4] = Int32(1)
        return q_consumer, k_consumer, v_consumer

    @cute.jit
    def first_softmax_masked(self, acc_s, row_max, row_sum, correction, scale_log2: Float32,
                             t_coord, block_range: BlockRange, m_block: Int32, n_block: Int32,
                             seqlen_k: Int32):
        """`overlap_tiles`: a tile's first KV tile, masked and turned into probabilities."""
        softmax_init(row_max, row_sum)
        apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, True)
        softmax_step(acc_s, row_max, row_sum, correction, scale_log2, is_first=True)

    @cute.jit
    def finish_pending(self, acc_o, row_max, row_sum, where, tidx: Int32,
                       out_store: OutputStore, softmax_scale: Float32):
        """Normalise a finished tile's output and store it with its lse."""
        lse = cute.make_rmem_tensor(cute.make_layout(cute.size(row_max)), Float32)
        softmax_finalize(acc_o, row_max, row_sum, softmax_scale, lse)
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        out_store.write(r_o, lse, where[0], where[1], where[2], where[3], tidx)

    @cute.jit
    def drain_overlap(self, state, tidx: Int32, v_consumer, tiled_mma_pv: cute.TiledMma, sV,
                      out_store: OutputStore, softmax_scale: Float32):
        """`overlap_tiles`, after the last tile: its last P V and output."""
        acc_o, r_p, row_max, row_sum, where = state
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        if where[4] != 0:
            tiled_mma_pv, v_consumer = self.last_pv(tidx, v_consumer, tiled_mma_pv, acc_o, r_p,
                                                    tOrV)
            self.finish_pending(acc_o, row_max, row_sum, where, tidx, out_store, softmax_scale)
