"""dQ = dS K from the dS tiles the KV-centric backward stored, for Hopper (sm_90a), in CuTe DSL.

Beside 64-key block-sparse lists (NSA's selected branch) the query-centric dQ kernel
(kernels/sm90/bwd_dq_sm90.py) recomputes S = Q K^T and dP = dO V^T for every visited tile:
three products per 64 keys where dQ needs one. With `BwdSpec.stores_ds` the KV-centric kernel
stores each step's dS^T (in the input dtype, 8 KiB per 64 query rows and 64 keys, in the
register layout of kernels/sm90/ds_tiles.py) while its dK product runs, and this kernel only
multiplies (`DqSpec.reads_ds`):

- CTA = the dQ kernel's grid (the list walk, the fused dQ sums and dQ's store are its own),
  with 64-row CTAs two per SM by default (`DqSpec.ctas_per_sm`; a 128-row CTA of two consumer
  warpgroups one per SM measured the same: H200, 8K 0.238 / 0.244 ms, 64K 1.984 / 1.966). A
  producer warp TMA-loads per visited list entry the K tile and the CTA's dS tiles (one box,
  copied as stored) into one stage, `kv_stages` deep: the kernel moves 24 KiB per 64 rows and
  product and runs on memory. Each consumer warpgroup reads its tile from the stage (four
  16-byte loads), transposes its 8 x 8 matrices into the A fragment (`movmatrix`) and issues
  dQ += dS K. Loaded by the consumers straight from global memory one entry ahead instead, the
  kernel took 0.312 ms at 8K against 0.244 (H200, 2026-11-30).
- Tile t = (slot x heads_per_list + head of the list) x 2 + half, slot being the entry's flat
  index in the forward lists (R, Hs, Kf + Km), full slots first: the KV-centric kernel reads
  it from the transpose (`BlockSparseCSR.slot`). A half past the sequence's end was never
  written; its rows are never stored.
- dS is already 0 where P is (masked keys and rows past the sequence: the KV-centric kernel
  selects it so), so no mask, lse or dO.O is read here.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90
from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.ds_tiles import ds_words_as_a_operand, load_ds_words
from kernels.sm90.layouts import acc_as_a_operand_layout, transposed, with_row_strides_divisible
from kernels.sm90.mma import gemm
from kernels.sm90.pipelines import load_seq_tile, smem_buffer, stage_index, tma_pipeline
from kernels.sm90.register_store import store_rows_from_registers
from kernels.sm90.spec import DS_TILE_ELEMENTS, DS_TILE_ROWS, consumer_registers

_WARPGROUP = 128
_LIST_TILE_ROWS = 128  # the forward lists' query tiles
# Elements per row of the dS box (TMA's widest box extent).
_DS_BOX_COLS = 256


class DqFromDsSm90(DqBackwardSm90):
    """`DqSpec.reads_ds`: the dQ kernel's grid and list walk, one product per visited tile."""

    def __init__(self, spec):
        # Not the dQ kernel's __init__: CTAs of one consumer warpgroup (64 rows) here too.
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        self.tile_m, self.tile_n, self.head_dim = spec.tile_m, spec.tile_n, spec.head_dim
        assert spec.reads_ds and spec.block_sparse and spec.tiles_per_list_block == 1
        assert self.tile_m in (DS_TILE_ROWS, 2 * DS_TILE_ROWS) and self.tile_n == 64
        assert spec.fits_in_smem(), f"{spec} needs {spec.smem_bytes} bytes of shared memory"
        # A consumer warpgroup per (query head, 64-row half), heads outer: the order of an
        # entry's dS tiles, so one box holds the CTA's.
        self.halves = self.tile_m // DS_TILE_ROWS
        self.heads_per_cta = spec.heads_per_cta
        assert self.heads_per_cta == 1 or self.halves == 2
        self.num_wg = self.halves * self.heads_per_cta
        self.num_consumer_threads = _WARPGROUP * self.num_wg
        self.num_threads = _WARPGROUP * (1 + self.num_wg)
        # 96 registers a thread at launch with two heads (640 threads): 112 for the consumers.
        self.consumer_regs = consumer_registers(self.num_threads, self.num_consumer_threads,
                                                spec.ctas_per_sm, self.producer_regs)

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
        mDS: cute.Tensor,       # (tiles, 4096): dS^T tiles (kernels/sm90/ds_tiles.py)
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        tn, d = self.tile_n, self.head_dim
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        mDS = with_row_strides_divisible(mDS, 8)  # each tile's 16-byte vectors
        # dQ += dS K per warpgroup: A = dS from registers (its 64 rows x the tile's keys),
        # B = K read head-dim-major.
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (DS_TILE_ROWS, d), warpgroup.OperandSource.RMEM)
        sK_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR,
                                                  (tn, DS_TILE_ROWS, d), dtype,
                                                  self.spec.kv_stages)
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_op, mK_t, sK_one, (tn, d))
        # An entry's two dS tiles lie side by side: one TMA box of rows of _DS_BOX_COLS
        # elements, copied as they are (the consumers read them in register order).
        box_rows = self.num_wg * DS_TILE_ELEMENTS // _DS_BOX_COLS
        mDS_rows = cute.make_tensor(mDS.iterator, cute.make_layout(
            (_DS_BOX_COLS, cute.size(mDS.shape[0]) * (DS_TILE_ELEMENTS // _DS_BOX_COLS)),
            stride=(1, _DS_BOX_COLS)))
        sDS_layout = cute.make_layout((_DS_BOX_COLS, box_rows, self.spec.kv_stages),
                                      stride=(1, _DS_BOX_COLS, _DS_BOX_COLS * box_rows))
        tma_atom_ds, tma_ds = cpasync.make_tiled_tma_atom(
            load_op, mDS_rows, cute.slice_(sDS_layout, (None, None, 0)),
            (_DS_BOX_COLS, box_rows))
        self.kv_bytes = (cute.size_in_bytes(dtype, sK_one)
                         + self.num_wg * DS_TILE_ELEMENTS * dtype.width // 8)
        self.shared_storage = self.ds_shared_storage_struct(sK_layout, sDS_layout)

        mdQ = with_row_strides_divisible(mdQ, 8)  # proves the 32-bit stores of column pairs
        if const_expr(mdQSums is not None):
            mdQSums = with_row_strides_divisible(mdQSums, 4)  # and the sums' 16-byte loads
        self.kernel(
            mQ, tma_atom_k, tma_k, tma_atom_ds, tma_ds, mdQ, mCuSeqlensQ, mCuSeqlensK,
            mQTileOffsets, num_m_blocks, softmax_scale, mFullCount, mFullIndex, mMaskCount,
            mMaskIndex, mRowBlockOffsets, mdQSums, sK_layout, sDS_layout, tiled_mma_dq,
        ).launch(grid=(cute.size(mQ.shape[1]) // self.heads_per_cta, num_m_blocks,
                       cute.size(mCuSeqlensQ.shape[0]) - 1),
                 block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.spec.ctas_per_sm,
                 preferred_smem_carveout=100 if self.spec.ctas_per_sm > 1 else None)

    def ds_shared_storage_struct(self, sK_layout, sDS_layout):
        """The CTA's shared memory (`DqSpec.smem_bytes` computes its size)."""
        fields = dict(
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2 * self.spec.kv_stages],
            sK=smem_buffer(self.dtype, cute.cosize(sK_layout), 1024),
            sDS=smem_buffer(self.dtype, cute.cosize(sDS_layout), 1024),
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
        sK_layout: cute.ComposedLayout, sDS_layout: cute.Layout, tiled_mma_dq: cute.TiledMma,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head_block, m_rev, batch = cute.arch.block_idx()
        head = head_block * self.heads_per_cta  # the CTA's first query head
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
        sDS = storage.sDS.get_tensor(sDS_layout)
        # The same stages as (tile, warpgroup, stage): each consumer warpgroup's tile.
        sDS_tiles = storage.sDS.get_tensor(cute.make_layout(
            (DS_TILE_ELEMENTS, self.num_wg, spec.kv_stages),
            stride=(1, DS_TILE_ELEMENTS, DS_TILE_ELEMENTS * self.num_wg)))

        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        list_heads = cute.size(mFullCount.shape[1])
        heads_per_list = num_heads // list_heads
        # The lists name 128-row query tiles; a 64-row CTA is one of its tile's halves.
        lists_tile = m_block * self.tile_m // _LIST_TILE_ROWS
        first_half = m_block * self.tile_m // DS_TILE_ROWS - lists_tile * 2
        sparse_row = mRowBlockOffsets[batch] + lists_tile
        sparse_head = head // heads_per_list
        num_iters = Int32(0)
        num_mask = Int32(0)
        if m_block * self.tile_m < seqlen_q:
            num_mask = mMaskCount[sparse_row, sparse_head]
            num_iters = num_mask + mFullCount[sparse_row, sparse_head]
        # The first dS tile of each visited entry: the forward slots of this (query tile,
        # list head), full ones first, then mask ones.
        full_width = cute.size(mFullIndex.shape[2])
        row_slots = (sparse_row * list_heads + sparse_head) * (
            full_width + cute.size(mMaskIndex.shape[2]))
        first_tile = partial(self.first_ds_tile, num_mask=num_mask, row_slots=row_slots,
                             full_width=full_width, heads_per_list=heads_per_list,
                             head_in_list=head - sparse_head * heads_per_list,
                             first_half=first_half)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                for it in cutlass.range(num_iters, unroll=1):
                    n_block = self.kv_tile_at(it, Int32(0), num_mask, mFullIndex, mMaskIndex,
                                              sparse_row, sparse_head)
                    kv_handle = kv_producer.acquire_and_advance()
                    load_seq_tile(tma_atom_k, mK, sK, kv_handle, offset_k, head_kv, n_block,
                                  self.tile_n, self.head_dim, kv_handle.index)
                    # Box b holds tiles num_wg b, ...: the CTA's first tile is a multiple.
                    box = first_tile(it) // self.num_wg
                    g_box = cute.local_tile(mDS, (_DS_BOX_COLS, sDS_layout.shape[1]), (0, box))
                    t_s, t_g = cpasync.tma_partition(tma_atom_ds, 0, cute.make_layout(1),
                                                     cute.group_modes(sDS, 0, 2),
                                                     cute.group_modes(g_box, 0, 2))
                    cute.copy(tma_atom_ds, t_g, t_s[(None, kv_handle.index)],
                              tma_bar_ptr=kv_handle.barrier)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if m_block * self.tile_m < seqlen_q:
                self.consume_ds(tidx - _WARPGROUP, num_iters, kv_consumer, tiled_mma_dq, sK,
                                sDS_tiles, mdQ, mQTileOffsets, mdQSums, softmax_scale, m_block,
                                head, batch, offset_q, seqlen_q)

    @cute.jit
    def first_ds_tile(self, it: Int32, num_mask: Int32, row_slots: Int32, full_width: Int32,
                      heads_per_list: Int32, head_in_list: Int32, first_half: Int32) -> Int32:
        """The CTA's first dS tile of visited entry `it` (its 64-row halves are tiles 2 t and
        2 t + 1): mask entries come first in the walk, full ones first in the slots."""
        slot = row_slots + it - num_mask
        if it < num_mask:
            slot = row_slots + full_width + it
        return (slot * heads_per_list + head_in_list) * 2 + first_half

    @cute.jit
    def consume_ds(
        self, tidx: Int32, num_iters: Int32, kv_consumer, tiled_mma_dq: cute.TiledMma, sK,
        sDS_tiles, mdQ: cute.Tensor, mQTileOffsets: cute.Tensor, mdQSums: Optional[cute.Tensor],
        softmax_scale: Float32, m_block: Int32, head: Int32, batch: Int32, offset_q: Int32,
        seqlen_q: Int32,
    ):
        """A consumer warpgroup's 64 rows of one query head (the CTA's head `head` + its
        warpgroup's head index): dQ += dS K over the visited tiles (dS read from the stage into
        registers and transposed there), then dQ (plus the fused branches' sums) scaled and
        stored from registers."""
        wg = cute.arch.make_warp_uniform(tidx // _WARPGROUP)
        half = wg % self.halves
        head = head + wg // self.halves
        thr_dq = tiled_mma_dq.get_slice(tidx % _WARPGROUP)
        wg_dq = tiled_mma_dq.get_slice(0)  # smem operand descriptors: uniform
        tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))  # K head-dim-major
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((DS_TILE_ROWS, self.head_dim)))
        acc_dq.fill(0.0)
        # dS as the A operand: a 64 x 64 accumulator fragment's registers regrouped.
        r_ds = cute.make_rmem_tensor(
            acc_as_a_operand_layout(cute.make_layout(((2, 2, self.tile_n // 8), 1, 1))),
            self.dtype)
        a_words = cute.recast_tensor(cute.make_tensor(r_ds.iterator,
                                                      cute.make_layout(cute.size(r_ds))),
                                     Int32)
        words = cute.make_rmem_tensor(cute.make_layout(cute.size(a_words)), Int32)
        for _ in cutlass.range(num_iters, unroll=1):
            kv_handle = kv_consumer.wait_and_advance()
            stage = stage_index(kv_handle, self.spec.kv_stages)
            load_ds_words(sDS_tiles[None, wg, stage].iterator, tidx, words)
            ds_words_as_a_operand(words, a_words)
            tiled_mma_dq = gemm(tiled_mma_dq, acc_dq, r_ds, tdQrK[None, None, None, stage],
                                zero_init=False)
            warpgroup.wait_group(0)
            kv_handle.release()
        if const_expr(self.spec.sums_block_cols > 0):
            # The sums' rows are the warpgroup's half: named to the helper as its warpgroup.
            self.exchange_fused_sums(acc_dq, mdQSums,
                                     mQTileOffsets[batch] + m_block * self.halves, head,
                                     half * _WARPGROUP + tidx % _WARPGROUP, m_block, seqlen_q,
                                     False)
        acc_dq.store(acc_dq.load() * softmax_scale)
        store_rows_from_registers(thr_dq, acc_dq, mdQ, offset_q, head,
                                  m_block * self.halves + half, DS_TILE_ROWS, self.head_dim,
                                  seqlen_q, self.dtype, self.spec.accumulate)
