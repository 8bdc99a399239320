"""dQ = dS K from the dS tiles the KV-centric backward stored, for Hopper (sm_90a), in CuTe DSL.

Beside 64-key block-sparse lists (NSA's selected branch) the query-centric dQ kernel
(kernels/sm90/bwd_dq_sm90.py) recomputes S = Q K^T and dP = dO V^T for every visited tile:
three products per 64 keys where dQ needs one. With `BwdSpec.stores_ds` the KV-centric kernel
stores each step's dS^T (in the input dtype, 8 KiB per 64 query rows and 64 keys) while its
dK product runs, and this kernel only multiplies (`DqSpec.reads_ds`):

- CTA = one 128-row query tile of one query head of one sequence, as the dQ kernel's grid
  (the list walk, the fused dQ sums and dQ's store are the dQ kernel's own). Two consumer
  warpgroups own 64 rows each; a producer warp TMA-loads per visited list entry the K tile
  and the entry's two 64-row dS^T tiles into one stage (`kv_stages` deep: the kernel moves
  32 KiB per product, so it runs on memory, and the loads must stay ahead).
- dS^T tile t = (slot x heads_per_list + head of the list) x 2 + half, slot being the entry's
  flat index in the forward lists (R, Hs, Kf + Km), full slots first: the KV-centric kernel
  reads it from the transpose (`BlockSparseCSR.slot`). A tile is keys x query rows, rows
  contiguous: the dQ product's A operand dS read M-major from smem, with no transpose in
  either kernel. A half past the sequence's end was never written; its rows are never stored.
- dS is already 0 where P is (masked keys and rows past the sequence: the KV-centric kernel
  selects it so), so no mask, lse or dO.O is read here.
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90
from kernels.sm90.layouts import transposed, with_row_strides_divisible
from kernels.sm90.mma import gemm
from kernels.sm90.pipelines import load_seq_tile, smem_buffer, stage_index, tma_pipeline
from kernels.sm90.register_store import store_rows_from_registers

_WARPGROUP = 128
# Query rows of a dS tile: one consumer warpgroup's rows, one KV-centric step.
_DS_ROWS = 64


class DqFromDsSm90(DqBackwardSm90):
    """`DqSpec.reads_ds`: the dQ kernel's grid and list walk, one product per visited tile."""

    def __init__(self, spec):
        super().__init__(spec)
        assert spec.reads_ds and spec.block_sparse and spec.tiles_per_list_block == 1

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,        # (T, H, D): its shape only (heads)
        mK: cute.Tensor,        # (Tk, Hkv, D)
        mV: cute.Tensor,        # unread (the dQ kernel's argument list)
        mdO: cute.Tensor,       # unread
        mLSE: cute.Tensor,      # unread
        mDPsum: cute.Tensor,    # unread
        mdQ: cute.Tensor,       # (T, H, D) in the input type
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mQTileOffsets: cute.Tensor,
        num_m_blocks: Int32,
        softmax_scale: Float32,
        compress_factor: Int32,  # unread: dS carries every mask
        window_left: Int32,
        window_right: Int32,
        mFullCount: cute.Tensor,  # the forward's block-sparse lists (128-row tiles)
        mFullIndex: cute.Tensor,
        mMaskCount: cute.Tensor,
        mMaskIndex: cute.Tensor,
        mRowBlockOffsets: cute.Tensor,
        mQPositions: Optional[cute.Tensor],
        mdQSums: Optional[cute.Tensor],
        mDS: cute.Tensor,       # (tiles x 64, 64): dS^T tiles, keys as rows
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        tn, d = self.tile_n, self.head_dim
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        # dS^T tiles read as dS, query rows contiguous: (64 rows, tiles x 64 keys).
        mDS = with_row_strides_divisible(mDS, 8)
        mDS_t = cute.make_tensor(mDS.iterator, cute.select(mDS.layout, mode=[1, 0]))
        # dQ += dS K per warpgroup: A = dS (its 64 rows x the tile's keys, M-major in smem),
        # B = K read head-dim-major.
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (_DS_ROWS, d))
        stages = self.spec.kv_stages
        sK_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (tn, _DS_ROWS, d),
                                                  dtype, stages)
        # One buffer per (stage, warpgroup).
        sdS_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.COL_MAJOR,
                                                   (_DS_ROWS, d, tn), dtype,
                                                   stages * self.num_wg)
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        sdS_one = cute.slice_(sdS_layout, (None, None, 0))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_op, mK_t, sK_one, (tn, d))
        tma_atom_ds, tma_ds = cpasync.make_tiled_tma_atom(load_op, mDS_t, sdS_one,
                                                          (_DS_ROWS, tn))
        self.kv_bytes = (cute.size_in_bytes(dtype, sK_one)
                         + self.num_wg * cute.size_in_bytes(dtype, sdS_one))
        self.shared_storage = self.ds_shared_storage_struct(sK_layout, sdS_layout)

        mdQ = with_row_strides_divisible(mdQ, 8)  # proves the 32-bit stores of column pairs
        if const_expr(mdQSums is not None):
            mdQSums = with_row_strides_divisible(mdQSums, 4)  # and the sums' 16-byte loads
        self.kernel(
            mQ, tma_atom_k, tma_k, tma_atom_ds, tma_ds, mdQ, mCuSeqlensQ, mCuSeqlensK,
            mQTileOffsets, num_m_blocks, softmax_scale, mFullCount, mFullIndex, mMaskCount,
            mMaskIndex, mRowBlockOffsets, mdQSums, sK_layout, sdS_layout, tiled_mma_dq,
        ).launch(grid=(cute.size(mQ.shape[1]), num_m_blocks, cute.size(mCuSeqlensQ.shape[0]) - 1),
                 block=[self.num_threads, 1, 1], stream=stream)

    def ds_shared_storage_struct(self, sK_layout, sdS_layout):
        """The CTA's shared memory (`DqSpec.smem_bytes` computes its size)."""
        fields = dict(
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2 * self.spec.kv_stages],
            sK=smem_buffer(self.dtype, cute.cosize(sK_layout), 1024),
            sdS=smem_buffer(self.dtype, cute.cosize(sdS_layout), 1024),
        )
        return cute.struct(type("DqFromDsSharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_ds: cute.CopyAtom, mDS: cute.Tensor, mdQ: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mQTileOffsets: cute.Tensor,
        num_m_blocks: Int32, softmax_scale: Float32, mFullCount: cute.Tensor,
        mFullIndex: cute.Tensor, mMaskCount: cute.Tensor, mMaskIndex: cute.Tensor,
        mRowBlockOffsets: cute.Tensor, mdQSums: Optional[cute.Tensor],
        sK_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        tiled_mma_dq: cute.TiledMma,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head, m_rev, batch = cute.arch.block_idx()
        m_block = num_m_blocks - 1 - m_rev  # the longest lists first, as the dQ kernel
        num_heads = cute.size(mQ.shape[1])
        head_kv = head // (num_heads // cute.size(mK.shape[2]))

        if warp_idx == 0:
            for atom in (tma_atom_k, tma_atom_ds):
                cpasync.prefetch_descriptor(atom)

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        kv_producer, kv_consumer = tma_pipeline(storage.mbar_kv.data_ptr(), spec.kv_stages,
                                                self.kv_bytes, self.num_wg * 4)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)

        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        list_heads = cute.size(mFullCount.shape[1])
        heads_per_list = num_heads // list_heads
        sparse_row = mRowBlockOffsets[batch] + m_block
        sparse_head = head // heads_per_list
        num_iters = Int32(0)
        num_mask = Int32(0)
        if m_block * self.tile_m < seqlen_q:
            num_mask = mMaskCount[sparse_row, sparse_head]
            num_iters = num_mask + mFullCount[sparse_row, sparse_head]
        # The forward slots of this (query tile, list head): full ones first, then mask ones.
        full_width = cute.size(mFullIndex.shape[2])
        row_slots = (sparse_row * list_heads + sparse_head) * (
            full_width + cute.size(mMaskIndex.shape[2]))
        head_in_list = head - sparse_head * heads_per_list

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                for it in cutlass.range(num_iters, unroll=1):
                    n_block = self.kv_tile_at(it, Int32(0), num_mask, mFullIndex, mMaskIndex,
                                              sparse_row, sparse_head)
                    slot = row_slots + it - num_mask
                    if it < num_mask:
                        slot = row_slots + full_width + it
                    first_tile = (slot * heads_per_list + head_in_list) * self.num_wg
                    kv_handle = kv_producer.acquire_and_advance()
                    load_seq_tile(tma_atom_k, mK, sK, kv_handle, offset_k, head_kv, n_block,
                                  self.tile_n, self.head_dim, kv_handle.index)
                    for half in cutlass.range_constexpr(self.num_wg):
                        self.load_ds_tile(tma_atom_ds, mDS, sdS, kv_handle, first_tile + half,
                                          kv_handle.index * self.num_wg + half)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if m_block * self.tile_m < seqlen_q:
                self.consume_ds(tidx - _WARPGROUP, num_iters, kv_consumer, tiled_mma_dq, sK,
                                sdS, mdQ, mQTileOffsets, mdQSums, softmax_scale, m_block,
                                head, batch, offset_q, seqlen_q)

    @cute.jit
    def load_ds_tile(self, tma_atom, m_src, s_dst, handle, tile: Int32, buffer):
        """TMA-load dS^T tile `tile` (64 keys x 64 query rows) into smem buffer `buffer`, read
        as dS, on the barrier of the pipeline `handle`."""
        g_tile = cute.local_tile(m_src, (_DS_ROWS, self.tile_n), (0, tile))
        t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                         cute.group_modes(s_dst, 0, 2),
                                         cute.group_modes(g_tile, 0, 2))
        cute.copy(tma_atom, t_g, t_s[(None, buffer)], tma_bar_ptr=handle.barrier)

    @cute.jit
    def consume_ds(
        self, tidx: Int32, num_iters: Int32, kv_consumer, tiled_mma_dq: cute.TiledMma, sK, sdS,
        mdQ: cute.Tensor, mQTileOffsets: cute.Tensor, mdQSums: Optional[cute.Tensor],
        softmax_scale: Float32, m_block: Int32, head: Int32, batch: Int32, offset_q: Int32,
        seqlen_q: Int32,
    ):
        """A consumer warpgroup's 64 rows: dQ += dS K over the visited tiles, then dQ (plus
        the fused branches' sums) scaled and stored from registers."""
        wg = cute.arch.make_warp_uniform(tidx // _WARPGROUP)
        thr_dq = tiled_mma_dq.get_slice(tidx % _WARPGROUP)
        wg_dq = tiled_mma_dq.get_slice(0)  # smem operand descriptors: uniform
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (..., stage x warpgroup)
        tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))  # K head-dim-major
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((_DS_ROWS, self.head_dim)))
        acc_dq.fill(0.0)
        for _ in cutlass.range(num_iters, unroll=1):
            kv_handle = kv_consumer.wait_and_advance()
            stage = stage_index(kv_handle, self.spec.kv_stages)
            tiled_mma_dq = gemm(tiled_mma_dq, acc_dq,
                                tdQrdS[None, None, None, stage * self.num_wg + wg],
                                tdQrK[None, None, None, stage], zero_init=False)
            warpgroup.wait_group(0)
            kv_handle.release()
        if const_expr(self.spec.sums_block_cols > 0):
            self.add_fused_sums(acc_dq, mdQSums, mQTileOffsets[batch] + m_block * self.num_wg,
                                head, tidx, m_block, seqlen_q)
        acc_dq.store(acc_dq.load() * softmax_scale)
        store_rows_from_registers(thr_dq, acc_dq, mdQ, offset_q, head,
                                  m_block * self.num_wg + wg, _DS_ROWS, self.head_dim,
                                  seqlen_q, self.dtype, self.spec.accumulate)
