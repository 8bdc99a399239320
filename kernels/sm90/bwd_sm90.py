"""Flash-attention backward for Hopper (sm_90a), written in CuTe DSL.

The forward's features as compile-time switches of `BwdSpec`: causal with a compress factor,
left/right windows, block sparsity (the transposed lists, kernels/sm90/backward.py builds them),
varlen, GQA. Structure:

- CTA = one KV tile (`tile_n` keys: 64 per consumer warpgroup; or, `alternate_steps`, 64 keys
  shared by two warpgroups that take alternate query steps) of one KV head of one sequence,
  launched as grid (KV tiles, Hkv, sequences). It walks every query head of the KV head's group
  and, per head, the query steps (64 rows, or 128 at head dim 64) that see its keys (a range
  cut by causal x compress factor and the window, or the transposed block-sparse list), so dK
  and dV are summed over the group in registers and written once, in the input type: no
  atomics and no float32 buffers for them (FA4 turns GQA packing off in its backward and pays
  for float32 dK/dV instead). Split block-sparse lists (`BwdSpec.split_lists`) launch one CTA
  per work unit instead, a chunk of one list walked for the heads that share the list, and add
  float32 dK/dV partials (kernels/sm90/backward.py `work_units`).
- A producer warp TMA-loads K and V once, then per step Q and lse (`q_stages` deep) and dO and
  dO.O. Each consumer warpgroup owns 64 keys and computes, per query tile, with wgmma:
  S^T = K Q^T and dP^T = V dO^T (keys as rows, so P^T and dS^T are already laid out as the
  register A operand of the next products), P^T = exp2(S^T * scale log2 e - lse log2 e),
  dS^T = P^T (dP^T - dO.O), dV += P^T dO, dK += dS^T Q (A from registers). dQ is either the
  query-centric kernel's (kernels/sm90/bwd_dq_sm90.py, `BwdSpec.dq_separate`) or fused here
  (`BwdSpec.fuses_dq`, FA3/FA4's order): dS goes to smem (two buffers, one per Q stage),
  dQ = dS K is issued before dK, and each warpgroup's dQ is staged in smem while dK runs; a
  warp of the producer warpgroup adds it into a float32 accumulator laid out per 64-row query
  tile (kernels/sm90/dq_accumulator.py; kernels/sm90/backward.py converts it).
- Rows past a sequence's end carry lse = +inf in that layout, so their P is exactly 0 without
  a mask (a 128-row step that runs past its sequence's tiles sets those rows' lse to +inf in
  registers); keys past the sequence end are masked and their dK/dV never stored.

Tensors as the kernel sees them: q, dO (T, H, D); k, v, dK, dV (Tk, Hkv, D); lse and dO.O
(H, P) float32 with P = 64 x (query tiles of all sequences); dQacc (H, P, D) float32.
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
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from kernels.sm90.dkv_tiles import unit_owns_tile
from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.block_range import BlockRange
from kernels.sm90.dq_accumulator import DqAccumulator, fragment_layout
from kernels.sm90.ds_tiles import store_ds_tile
from kernels.sm90.layouts import (acc_as_a_operand_layout, acc_mn_view, transposed,
                                  with_row_strides_divisible)
from kernels.sm90.score_mod import ScoreMods, score_mods_of
from kernels.sm90.mask import apply_mask_keys_as_rows
from kernels.sm90.mma import gemm, warpgroup_slice
from kernels.sm90.pipelines import load_seq_tile, smem_buffer, stage_index, tma_pipeline
from kernels.sm90.register_store import reduce_rows_from_registers, store_rows_from_registers
from kernels.sm90.spec import QUERY_SLOT_ROWS, STAGED_BIAS_PAD, BwdSpec, consumer_registers

_WARPGROUP = 128
# Named barrier (0 is __syncthreads) among the consumer warpgroups: the step's dS is in smem
# (6-9 belong to kernels/sm90/dq_accumulator.py).
_DS_FULL_BARRIER = 1
# `alternate_steps`: both warpgroups have walked every step (the Q/dO buffers are free), and
# each has staged the dK or dV it hands over.
_WALKS_DONE_BARRIER = 2
_DKV_STAGED_BARRIER = 3
# `score_stage_bias`: warpgroup w's half of the step's bias tile is in smem (4 + w).
_BIAS_STAGED_BARRIER = 4
_LOG2_E = 1.4426950408889634


class FlashAttentionBackwardSm90:
    producer_regs = 24

    def __init__(self, spec: BwdSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        self.tile_m, self.tile_n, self.head_dim = spec.tile_m, spec.tile_n, spec.head_dim
        # 128-row steps: each consumer warpgroup's dQ rows are one 64-row accumulator tile.
        assert self.tile_n in (64, 128) and self.tile_m in (64, 128)
        assert self.tile_m == 64 or self.tile_m == 64 * spec.num_consumer_warpgroups
        assert spec.fits_in_smem(), f"{spec} needs {spec.smem_bytes} bytes of shared memory"
        # Float32 partial sums of dK/dV land in any order; split lists walk lists, split rows
        # a query-tile range.
        assert not (spec.deterministic and spec.partial_dkv)
        assert not spec.fuses_dq or spec.can_fuse_dq, f"{spec} cannot fuse dQ"
        assert not (spec.add_dkv and spec.partial_dkv)
        assert not (spec.store_dkv_sums and (spec.add_dkv or spec.partial_dkv))
        assert not spec.owned_dkv_stores or spec.split_lists
        # Stored dQ blocks: one CTA per (head, query tile), dense keys, one KV tile a sequence.
        assert not spec.dq_stores or (spec.fuses_dq and not spec.block_sparse
                                      and not spec.row_bands)
        assert not (spec.split_lists and not spec.block_sparse)
        assert not (spec.split_rows and spec.block_sparse)
        assert not spec.alternate_steps or (self.tile_n == 64 and self.tile_m == 64
                                            and spec.dq_separate)
        # dS tiles: one 64 x 64 tile per step of a 64-key list entry (`walk_list`).
        assert not spec.stores_ds or (spec.block_sparse and spec.dq_separate
                                      and self.tile_n == 64 and self.tile_m == 64
                                      and not spec.alternate_steps and not spec.score_mods)
        assert not (spec.heavy_first and spec.block_sparse)
        assert not spec.row_bands or (spec.split_rows and not spec.heavy_first)
        # The score mods hook into the fused-dQ step of block-sparse lists (the dQ kernel
        # would recompute P without them); a bias gradient needs the bias.
        assert not spec.score_mods or (spec.block_sparse and spec.fuses_dq)
        assert not spec.score_bias_grad or spec.score_bias
        assert not spec.score_dbias_stores or spec.score_bias_grad
        assert not spec.score_dbias_tiles or (spec.score_bias_grad
                                              and not spec.score_dbias_stores)
        self.num_wg = spec.num_consumer_warpgroups
        self.key_wg = spec.key_warpgroups
        self.num_consumer_threads = _WARPGROUP * self.num_wg
        self.num_threads = _WARPGROUP * (1 + self.num_wg)
        self.consumer_regs = consumer_registers(self.num_threads, self.num_consumer_threads,
                                                spec.ctas_per_sm, self.producer_regs)
        # The fused dQ = dS K: each warpgroup computes a share of the columns (64-row steps)
        # or every column of its own 64 rows (128-row steps).
        self.dq_cols_per_wg = spec.dq_cols_per_warpgroup

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,        # (T, H, D)
        mK: cute.Tensor,        # (Tk, Hkv, D)
        mV: cute.Tensor,        # (Tk, Hkv, D)
        mdO: cute.Tensor,       # (T, H, D)
        mLSE: cute.Tensor,      # (H, P) float32: lse * log2(e) per 64-row query tile, +inf pad
        mDPsum: cute.Tensor,    # (H, P) float32: rowsum(dO * O), 0 pad
        mdQacc: Optional[cute.Tensor],  # (H, P, D) float32, zeroed (`fuses_dq`)
        mdK: cute.Tensor,       # (Tk, Hkv, D)
        mdV: cute.Tensor,       # (Tk, Hkv, D)
        mCuSeqlensQ: cute.Tensor,   # (S+1,) int32
        mCuSeqlensK: cute.Tensor,   # (S+1,) int32
        mQTileOffsets: cute.Tensor,  # (S+1,) int32: first 64-row tile of each sequence in P
        num_kv_tiles: Int32,    # the grid's first extent: ceil(max_seqlen_k / tile_n), or U
        row_splits: Int32,      # `split_rows`: CTAs per KV tile (1 otherwise)
        softmax_scale: Float32,
        compress_factor: Int32,
        window_left: Int32,
        window_right: Int32,
        mListOffsets: Optional[cute.Tensor],    # (Rk * Hs + 1,) int32: CSR of the transpose
        mListIndex: Optional[cute.Tensor],      # (capacity,) int32: 128-row query tiles
        mListMaskCount: Optional[cute.Tensor],  # (Rk, Hs) int32: mask entries come first
        mKvBlockOffsets: Optional[cute.Tensor],  # (S+1,) int32: first KV block of a sequence
        mUnits: Optional[cute.Tensor],          # (U, 5) int32 (`split_lists`): sequence, KV
                                                # block, list head, first and end list entry
        mQPositions: Optional[cute.Tensor],     # (S,) int32: first query positions
                                                # (`q_positions`)
        mScoreMask: Optional[cute.Tensor],      # as the forward's (kernels/sm90/score_mod.py)
        mScoreBias: Optional[cute.Tensor],
        mScoreSlabs: Optional[cute.Tensor],
        mDBias: Optional[cute.Tensor],          # (slabs, Nq, Nk) float32, zeroed
                                                # (`score_bias_grad`); the bias's dtype,
                                                # its cells written (`score_dbias_stores`);
                                                # (slots, 128, 128) (`score_dbias_tiles`)
        mDBiasSlots: Optional[cute.Tensor],     # (slabs, Tq, Tk) int32: a tile's slot in
                                                # mDBias (`score_dbias_tiles`)
        mdKOut: Optional[cute.Tensor],          # (Tk, Hkv, D) in the input dtype: dK and dV
        mdVOut: Optional[cute.Tensor],          # of the units that own their KV tile
                                                # (`owned_dkv_stores`)
        mListSlot: Optional[cute.Tensor],       # (capacity,) int32: each list entry's forward
                                                # slot (`stores_ds`)
        mDS: Optional[cute.Tensor],             # (tiles, 4096) in the input dtype: dS^T
                                                # tiles (`stores_ds`, kernels/sm90/ds_tiles.py)
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        tm, tn, d = self.tile_m, self.tile_n, self.head_dim
        # Views with the sequence first and the head last, for TMA.
        mQ_t, mdO_t, mK_t, mV_t = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))
            for t in (mQ, mdO, mK, mV))
        mLSE_t, mDPsum_t = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))
                            for t in (mLSE, mDPsum))

        # S^T = K Q^T and dP^T = V dO^T: each warpgroup 64 keys x tm query rows.
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (self.key_wg, 1, 1), (64, tm))
        # dV += P^T dO and dK += dS^T Q: A (P^T, dS^T) from registers, B = dO / Q read
        # head-dim-major from the same smem.
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (self.key_wg, 1, 1), (64, d), warpgroup.OperandSource.RMEM)
        # dQ = dS K: the warpgroups split the step's rows (128-row steps) or its columns.
        dq_atoms = (self.num_wg, 1, 1) if const_expr(self.spec.dq_rows_per_warpgroup) else (
            1, self.num_wg, 1)
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, dq_atoms, (64, self.dq_cols_per_wg))

        row_major = utils.LayoutEnum.ROW_MAJOR
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, (tm, tn, d), dtype,
                                                  self.spec.q_stages)
        sK_layout = sm90_utils.make_smem_layout_a(row_major, (tn, tm, d), dtype, 1)
        sdS_layout = sm90_utils.make_smem_layout_a(row_major, (tm, d, tn), dtype,
                                                   max(1, self.spec.ds_stages))
        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load_op, mQ_t, sQ_one, (tm, d))
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(load_op, mdO_t, sQ_one, (tm, d))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_op, mK_t, sK_one, (tn, d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load_op, mV_t, sK_one, (tn, d))
        row_layout = cute.make_layout(tm)
        tma_atom_lse, tma_lse = cpasync.make_tiled_tma_atom(load_op, mLSE_t, row_layout, (tm,))
        tma_atom_dpsum, tma_dpsum = cpasync.make_tiled_tma_atom(load_op, mDPsum_t, row_layout,
                                                                (tm,))
        # The fused dQ: each warpgroup's 64 x dq_cols float32 block, staged flat in register
        # order (kernels/sm90/dq_accumulator.py).
        sdQ_layout = cute.make_layout((QUERY_SLOT_ROWS * self.dq_cols_per_wg, self.num_wg))
        self.q_bytes = cute.size_in_bytes(dtype, sQ_one) + tm * 4
        self.kv_bytes = 2 * cute.size_in_bytes(dtype, sK_one)
        self.shared_storage = self.shared_storage_struct(
            sQ_layout, sK_layout, sdS_layout, sdQ_layout,
            mScoreBias.element_type if const_expr(self.spec.score_stage_bias) else None)

        # Proves the 32-bit stores of column pairs.
        mdK, mdV = (with_row_strides_divisible(t, 8) for t in (mdK, mdV))
        if const_expr(self.spec.owned_dkv_stores):
            mdKOut, mdVOut = (with_row_strides_divisible(t, 8) for t in (mdKOut, mdVOut))
        if const_expr(self.spec.stores_ds):
            mDS = with_row_strides_divisible(mDS, 8)
        if const_expr(self.spec.compressed):
            compress_factor = cute.fast_divmod_create_divisor_v2(compress_factor)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_lse, tma_lse, tma_atom_dpsum, tma_dpsum, mdQacc, mdK, mdV,
            mCuSeqlensQ, mCuSeqlensK, mQTileOffsets, num_kv_tiles, row_splits, softmax_scale,
            softmax_scale * Float32(_LOG2_E), compress_factor, window_left, window_right,
            mListOffsets, mListIndex, mListMaskCount, mKvBlockOffsets, mUnits, mQPositions,
            mScoreMask, mScoreBias, mScoreSlabs, mDBias, mDBiasSlots, mdKOut, mdVOut,
            mListSlot, mDS, sQ_layout, sK_layout, sdS_layout, sdQ_layout, tiled_mma_sdp,
            tiled_mma_dkv, tiled_mma_dq,
        ).launch(grid=self.grid(num_kv_tiles, row_splits, mK, mCuSeqlensQ),
                 block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.spec.ctas_per_sm,
                 preferred_smem_carveout=100 if self.spec.ctas_per_sm > 1 else None)

    def grid(self, num_kv_tiles, row_splits, mK, mCuSeqlensQ):
        """(KV tiles, Hkv, sequences), `row_splits` times along the KV tiles with
        `split_rows`, or one CTA per work unit with `split_lists`. `heavy_first` folds the KV
        heads into the first extent, innermost: CTAs start in KV tile order, whatever the
        head (the kernel unfolds it); `row_bands` likewise, bands outermost."""
        if self.spec.split_lists:
            return (num_kv_tiles, 1, 1)
        if self.spec.split_rows:
            num_kv_tiles = num_kv_tiles * row_splits
        num_kv_heads = cute.size(mK.shape[1])
        num_seqs = cute.size(mCuSeqlensQ.shape[0]) - 1
        if self.spec.heavy_first or self.spec.row_bands:
            return (num_kv_tiles * num_kv_heads, 1, num_seqs)
        return (num_kv_tiles, num_kv_heads, num_seqs)

    def shared_storage_struct(self, sQ_layout, sK_layout, sdS_layout, sdQ_layout,
                              bias_dtype=None):
        """The CTA's shared memory (`BwdSpec.smem_bytes` computes its size); bias_dtype: the
        staged bias tile's element type (`score_stage_bias`)."""
        dtype, stages = self.dtype, self.spec.q_stages

        fields = dict(
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_q=cute.struct.MemRange[cutlass.Int64, 2 * stages],
            mbar_do=cute.struct.MemRange[cutlass.Int64, 2 * stages],
            sLSE=smem_buffer(Float32, self.tile_m * stages, 128),
            sDPsum=smem_buffer(Float32, self.tile_m * stages, 128),
            sK=smem_buffer(dtype, cute.cosize(sK_layout), 1024),
            sV=smem_buffer(dtype, cute.cosize(sK_layout), 1024),
            sQ=smem_buffer(dtype, cute.cosize(sQ_layout), 1024),
            sdO=smem_buffer(dtype, cute.cosize(sQ_layout), 1024),
        )
        if self.spec.fuses_dq:
            fields["sdS"] = smem_buffer(dtype, cute.cosize(sdS_layout), 1024)
            fields["sdQ"] = smem_buffer(Float32, cute.cosize(sdQ_layout), 1024)
        if self.spec.score_stage_bias:
            fields["sBias"] = smem_buffer(
                bias_dtype, self.tile_m * (self.tile_n + STAGED_BIAS_PAD), 128)
        return cute.struct(type("BackwardSharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_do: cute.CopyAtom, mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor, tma_atom_v: cute.CopyAtom, mV: cute.Tensor,
        tma_atom_lse: cute.CopyAtom, mLSE: cute.Tensor, tma_atom_dpsum: cute.CopyAtom,
        mDPsum: cute.Tensor, mdQacc: Optional[cute.Tensor], mdK: cute.Tensor, mdV: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mQTileOffsets: cute.Tensor,
        num_kv_tiles: Int32, row_splits: Int32, softmax_scale: Float32, scale_log2: Float32,
        compress_factor,
        window_left: Int32, window_right: Int32,
        mListOffsets: Optional[cute.Tensor], mListIndex: Optional[cute.Tensor],
        mListMaskCount: Optional[cute.Tensor], mKvBlockOffsets: Optional[cute.Tensor],
        mUnits: Optional[cute.Tensor], mQPositions: Optional[cute.Tensor],
        mScoreMask: Optional[cute.Tensor], mScoreBias: Optional[cute.Tensor],
        mScoreSlabs: Optional[cute.Tensor], mDBias: Optional[cute.Tensor],
        mDBiasSlots: Optional[cute.Tensor],
        mdKOut: Optional[cute.Tensor], mdVOut: Optional[cute.Tensor],
        mListSlot: Optional[cute.Tensor], mDS: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.Layout, tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head_kv, batch = cute.arch.block_idx()
        num_heads = cute.size(mQ.shape[2])
        group = num_heads // cute.size(mK.shape[2])
        # `split_lists`: a chunk [entry_lo, entry_hi) of one list (one list head's heads).
        list_head, entry_lo, entry_hi = Int32(0), Int32(0), Int32(1)
        split = Int32(0)
        if const_expr(spec.heavy_first or spec.row_bands):  # KV heads innermost (`grid`)
            num_kv_heads = cute.size(mK.shape[2])
            head_kv = n_block % num_kv_heads
            n_block = n_block // num_kv_heads
        if const_expr(spec.row_bands):  # bands outermost, then KV tiles
            split = n_block // num_kv_tiles
            n_block = n_block % num_kv_tiles
        elif const_expr(spec.split_rows):
            split = n_block % row_splits
            n_block = n_block // row_splits
        if const_expr(spec.split_lists):
            unit = n_block
            batch, n_block, list_head = mUnits[unit, 0], mUnits[unit, 1], mUnits[unit, 2]
            entry_lo, entry_hi = mUnits[unit, 3], mUnits[unit, 4]
            head_kv = list_head * (num_heads // cute.size(mListMaskCount.shape[1])) // group
        # `owned_dkv_stores`: a unit alone in adding into its KV tile stores dK/dV itself.
        owns = False
        if const_expr(spec.owned_dkv_stores):
            owns = unit_owns_tile(mListOffsets, mKvBlockOffsets[batch] + n_block, list_head,
                                  cute.size(mListMaskCount.shape[1]), cute.size(mK.shape[2]),
                                  entry_lo, entry_hi)

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_lse,
                         tma_atom_dpsum):
                cpasync.prefetch_descriptor(atom)

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        kv_producer, kv_consumer = tma_pipeline(storage.mbar_kv.data_ptr(), 1, self.kv_bytes,
                                                self.num_wg * 4)
        # A step's Q/dO stage is released by the warps that took the step.
        step_warps = spec.warpgroups_per_step * 4
        q_producer, q_consumer = tma_pipeline(storage.mbar_q.data_ptr(), spec.q_stages,
                                              self.q_bytes, step_warps)
        do_producer, do_consumer = tma_pipeline(storage.mbar_do.data_ptr(), spec.q_stages,
                                                self.q_bytes, step_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS, dq_accumulator = None, None
        if const_expr(spec.fuses_dq):
            sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            dq_accumulator = DqAccumulator(self.dq_cols_per_wg, self.num_wg,
                                           spec.dq_rows_per_warpgroup, mdQacc,
                                           storage.sdQ.get_tensor(sdQ_layout), spec.dq_stores)
        dkv_handover = None
        if const_expr(spec.alternate_steps):
            # float32 dK (in sQ's storage) and dV (in sdO's) in register order, once the walks
            # are done: 64 x D x 4 bytes, the size of two 64-row Q stages.
            handover_layout = fragment_layout(self.tile_n * self.head_dim)
            dkv_handover = tuple(
                cute.make_tensor(cute.recast_ptr(buf.data_ptr(), dtype=Float32), handover_layout)
                for buf in (storage.sQ, storage.sdO))
        rows_by_stage = cute.make_layout((self.tile_m, spec.q_stages))
        sLSE = storage.sLSE.get_tensor(rows_by_stage)
        sDPsum = storage.sDPsum.get_tensor(rows_by_stage)

        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        block_range = BlockRange(
            self.tile_m, self.tile_n, spec.causal, spec.has_window_left, spec.has_window_right,
            spec.compressed, compress_factor, window_left, window_right)
        if const_expr(spec.q_positions):
            block_range = block_range.at_row_offset(mQPositions[batch])
        walk = partial(
            self.walk_steps, block_range=block_range, n_block=n_block, head_kv=head_kv,
            batch=batch, group=group, num_heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            mListOffsets=mListOffsets, mListIndex=mListIndex, mListMaskCount=mListMaskCount,
            mKvBlockOffsets=mKvBlockOffsets, list_head=list_head, entry_lo=entry_lo,
            entry_hi=entry_hi, split=split, row_splits=row_splits, mListSlot=mListSlot)
        q_tile_offset = mQTileOffsets[batch]
        staged_bias = None
        if const_expr(spec.score_stage_bias):
            staged_bias = storage.sBias.get_tensor(cute.make_layout(
                (self.tile_m, self.tile_n), stride=(self.tile_n + STAGED_BIAS_PAD, 1)))
        score_mods = score_mods_of(spec, mScoreMask, mScoreBias, mScoreSlabs, softmax_scale,
                                   mDBias, staged_bias, mDBiasSlots)

        # KV tiles past their sequence's end have nothing to do (the grid covers the longest),
        # nor a band of rows that sees none of the tile's keys (`row_bands`).
        has_work = (n_block * self.tile_n < seqlen_k) & (entry_lo < entry_hi)
        if const_expr(spec.row_bands):
            band_min, band_max = self.row_band(block_range, n_block, split, row_splits,
                                               seqlen_q, seqlen_k)
            has_work = has_work & (band_min < band_max)
        if has_work:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    kv_handle = kv_producer.acquire_and_advance()
                    for tma_atom, m_src, s_dst in ((tma_atom_k, mK, sK), (tma_atom_v, mV, sV)):
                        load_seq_tile(tma_atom, m_src, s_dst, kv_handle, offset_k, head_kv,
                                      n_block, self.tile_n, self.head_dim, 0)
                    produce = partial(
                        self.produce_step, tma_atom_q=tma_atom_q, mQ=mQ, tma_atom_do=tma_atom_do,
                        mdO=mdO, tma_atom_lse=tma_atom_lse, mLSE=mLSE,
                        tma_atom_dpsum=tma_atom_dpsum, mDPsum=mDPsum, sQ=sQ, sdO=sdO, sLSE=sLSE,
                        sDPsum=sDPsum, offset_q=offset_q, q_tile_offset=q_tile_offset)
                    walk(produce, (q_producer, do_producer))
                if const_expr(spec.fuses_dq):
                    if warp_idx == 1:  # the dQ writer
                        write = partial(self.write_dq_step, dq_accumulator=dq_accumulator,
                                        q_tile_offset=q_tile_offset, seqlen_q=seqlen_q)
                        walk(write, (Int32(0),))
                        dq_accumulator.finish()
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(
                    tidx - _WARPGROUP, walk, kv_consumer, q_consumer, do_consumer,
                    tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, sQ, sdO, sK, sV, sdS, sLSE,
                    sDPsum, dq_accumulator, dkv_handover, (mdK, mdV, mdKOut, mdVOut, owns),
                    softmax_scale, scale_log2, block_range, n_block, head_kv, offset_k,
                    seqlen_q, seqlen_k, score_mods, batch, mDS)

    @cute.jit
    def walk_steps(
        self, step_fn, state, block_range: BlockRange, n_block: Int32, head_kv: Int32,
        batch: Int32, group: Int32, num_heads: Int32, seqlen_q: Int32, seqlen_k: Int32,
        mListOffsets, mListIndex, mListMaskCount, mKvBlockOffsets, list_head: Int32,
        entry_lo: Int32, entry_hi: Int32, split: Int32, row_splits: Int32, mListSlot=None,
    ):
        """Run step_fn(head, m_block, mask, needs_mask, *state) -> state over the (query head,
        query step) pairs that see this CTA's KV tile, heads of the group outermost; with
        `stores_ds` also given ds_tile=, the step's dS tile (`walk_list`).
        `mask` is the step's compile-time mask kind: None, "causal_window", or "if_needed"
        (the causal/window mask where the runtime `needs_mask` says so). The
        producer warp and the consumer warpgroups both walk through here, so they agree on
        every step."""
        head_first = head_kv * group
        if const_expr(self.spec.block_sparse):
            kv_row = mKvBlockOffsets[batch] + n_block
            list_heads = cute.size(mListMaskCount.shape[1])
            heads_per_list = num_heads // list_heads
            walk_list = partial(self.walk_list, step_fn=step_fn, mListOffsets=mListOffsets,
                                mListIndex=mListIndex, mListMaskCount=mListMaskCount,
                                kv_row=kv_row, list_heads=list_heads, n_block=n_block,
                                seqlen_q=seqlen_q, seqlen_k=seqlen_k, mListSlot=mListSlot,
                                heads_per_list=heads_per_list)
            if const_expr(self.spec.split_lists):
                for head_in_list in cutlass.range(heads_per_list, unroll=1):
                    state = walk_list(state=state, head=list_head * heads_per_list + head_in_list,
                                      list_head=list_head, entry_lo=entry_lo, entry_hi=entry_hi)
            else:
                for head_in_group in cutlass.range(group, unroll=1):
                    head = head_first + head_in_group
                    head_list = head // heads_per_list
                    list_row = kv_row * list_heads + head_list
                    state = walk_list(state=state, head=head, list_head=head_list,
                                      entry_lo=mListOffsets[list_row],
                                      entry_hi=mListOffsets[list_row + 1])
        else:
            if const_expr(self.spec.row_bands):
                m_min, m_max = self.row_band(block_range, n_block, split, row_splits,
                                             seqlen_q, seqlen_k)
            else:
                m_min, m_max = block_range.m_block_min_max(n_block, seqlen_q, seqlen_k)
                if const_expr(self.spec.split_rows):
                    # This CTA's share of the KV tile's query tiles: one of row_splits equal
                    # runs.
                    share = (m_max - m_min + row_splits - 1) // row_splits
                    m_min = cutlass.min(m_min + split * share, m_max)
                    m_max = cutlass.min(m_min + share, m_max)
            # Query tiles in order: masked ones (the diagonal), unmasked ones, masked ones
            # again (the window's far edge). One loop per compile-time mask kind: a runtime
            # "does this step need the mask" branch between the S/dP products and their wait
            # lets ptxas wait for dP before the exponentials (docs/cute_notes.md).
            unmasked_lo, unmasked_hi = block_range.unmasked_m_blocks(n_block, seqlen_q, seqlen_k)
            first_unmasked = cutlass.min(cutlass.max(unmasked_lo, m_min), m_max)
            end_unmasked = cutlass.min(cutlass.max(unmasked_hi, first_unmasked), m_max)
            for head_in_group in cutlass.range(group, unroll=1):
                head = head_first + head_in_group
                for m_block in cutlass.range(m_min, first_unmasked, unroll=1):
                    state = step_fn(head, m_block, "causal_window", False, *state)
                for m_block in cutlass.range(first_unmasked, end_unmasked, unroll=1):
                    state = step_fn(head, m_block, None, False, *state)
                for m_block in cutlass.range(end_unmasked, m_max, unroll=1):
                    state = step_fn(head, m_block, "causal_window", False, *state)
        return state

    @cute.jit
    def row_band(self, block_range: BlockRange, n_block: Int32, band: Int32, bands: Int32,
                 seqlen_q: Int32, seqlen_k: Int32):
        """`row_bands`: the query steps [m_min, m_max) of KV tile n_block in band `band` of
        `bands`. The sequence's steps are cut into `bands` equal runs, the same for every KV
        tile, so the CTAs of one band add into the same rows of the dQ accumulator; empty
        (m_min == m_max) where the band sees none of the tile's keys."""
        m_min, m_max = block_range.m_block_min_max(n_block, seqlen_q, seqlen_k)
        steps = (seqlen_q + self.tile_m - 1) // self.tile_m
        per_band = (steps + bands - 1) // bands
        band_min = cutlass.min(cutlass.max(m_min, band * per_band), m_max)
        band_max = cutlass.max(cutlass.min(m_max, (band + 1) * per_band), band_min)
        return band_min, band_max

    @cute.jit
    def walk_list(self, step_fn, state, head: Int32, list_head: Int32, entry_lo: Int32,
                  entry_hi: Int32, mListOffsets, mListIndex, mListMaskCount, kv_row: Int32,
                  list_heads: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                  mListSlot=None, heads_per_list: Int32 = 1):
        """The steps of list entries [entry_lo, entry_hi) of (kv_row, list_head) for `head`.
        With `stores_ds` each step also gets its dS tile: 64-row half `half` of (forward slot,
        head of the list) is tile (slot x heads_per_list + head - list_head x heads_per_list)
        x 2 + half, the order kernels/sm90/bwd_dq_from_ds.py reads them in."""
        start = mListOffsets[kv_row * list_heads + list_head]
        num_mask = mListMaskCount[kv_row, list_head]
        # Full KV blocks crossing the sequence end still mask the keys past it.
        full_needs_mask = (n_block + 1) * self.tile_n > seqlen_k
        # One copy of the step with a runtime mask choice: a loop per mask kind (as the dense
        # walk has) tripled the code and measured no faster on 64-key lists (H100, 2026-11-24).
        for entry in cutlass.range(entry_lo, entry_hi, unroll=1):
            q_tile = mListIndex[entry]
            needs_mask = full_needs_mask | (entry - start < num_mask)
            # The lists name 128-row query tiles: one step, or two 64-row steps (the second
            # only if the sequence reaches it).
            steps = 128 // self.tile_m
            for half in cutlass.range_constexpr(steps):
                m_block = q_tile * steps + half
                if m_block * self.tile_m < seqlen_q:
                    if const_expr(self.spec.stores_ds):
                        slot_head = (mListSlot[entry] * heads_per_list + head
                                     - list_head * heads_per_list)
                        state = step_fn(head, m_block, "if_needed", needs_mask, *state,
                                        ds_tile=slot_head * steps + half)
                    else:
                        state = step_fn(head, m_block, "if_needed", needs_mask, *state)
        return state

    @cute.jit
    def write_dq_step(self, head: Int32, m_block: Int32, mask: cutlass.Constexpr, needs_mask,
                      steps: Int32, dq_accumulator: DqAccumulator, q_tile_offset: Int32,
                      seqlen_q: Int32):
        """The dQ writer warp's step (`fuses_dq`): add the consumers' staged dQ blocks
        of (head, m_block) into the float32 accumulator."""
        tiles_per_step = self.tile_m // QUERY_SLOT_ROWS
        dq_accumulator.write_step(head, q_tile_offset + m_block * tiles_per_step,
                                  seqlen_q - m_block * self.tile_m)
        return (steps + 1,)

    @cute.jit
    def load_rows(self, tma_atom, m_src, s_dst, handle, head: Int32, slot_row: Int32, stage):
        """TMA-load one step's float32 row statistics (lse or dO.O), from slot `slot_row`
        of the 64-row tile layout on (a 128-row step may run past its sequence's tiles into
        the next sequence's or past the end, zero-filled there: the consumers set those rows'
        lse to +inf, so their P is 0; their dO.O is the neighbour's, see docs/interfaces.md
        on non-finite inputs)."""
        g_rows = cute.local_tile(cute.domain_offset((slot_row,), m_src[None, head]),
                                 (self.tile_m,), (0,))
        t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), s_dst, g_rows)
        cute.copy(tma_atom, t_g, t_s[(None, stage)], tma_bar_ptr=handle.barrier)

    @cute.jit
    def produce_step(
        self, head: Int32, m_block: Int32, mask: cutlass.Constexpr, needs_mask, q_producer,
        do_producer, tma_atom_q, mQ,
        tma_atom_do, mdO, tma_atom_lse, mLSE, tma_atom_dpsum, mDPsum, sQ, sdO, sLSE, sDPsum,
        offset_q: Int32, q_tile_offset: Int32, ds_tile: Optional[Int32] = None,
    ):
        # ds_tile (`stores_ds`): the consumers' store, not the producer's.
        slot_row = q_tile_offset * QUERY_SLOT_ROWS + m_block * self.tile_m
        q_handle = q_producer.acquire_and_advance()
        load_seq_tile(tma_atom_q, mQ, sQ, q_handle, offset_q, head, m_block, self.tile_m,
                      self.head_dim, q_handle.index)
        self.load_rows(tma_atom_lse, mLSE, sLSE, q_handle, head, slot_row, q_handle.index)
        do_handle = do_producer.acquire_and_advance()
        load_seq_tile(tma_atom_do, mdO, sdO, do_handle, offset_q, head, m_block, self.tile_m,
                      self.head_dim, do_handle.index)
        self.load_rows(tma_atom_dpsum, mDPsum, sDPsum, do_handle, head, slot_row,
                       do_handle.index)
        return q_producer, do_producer

    @cute.jit
    def consume(
        self, tidx: Int32, walk, kv_consumer, q_consumer, do_consumer,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
        sQ, sdO, sK, sV, sdS, sLSE, sDPsum, dq_accumulator: Optional[DqAccumulator],
        dkv_handover, dkv_out, softmax_scale: Float32, scale_log2: Float32,
        block_range: BlockRange, n_block: Int32, head_kv: Int32, offset_k: Int32,
        seqlen_q: Int32, seqlen_k: Int32, score_mods: Optional[ScoreMods] = None,
        batch: Int32 = 0, mDS: Optional[cute.Tensor] = None,
    ):
        """The consumer warpgroups' whole CTA: every step, then dK and dV. dkv_out: (dK, dV,
        the owned tiles' dK and dV, whether this unit owns its tile: `store_keys`)."""
        mdK, mdV, mdKOut, mdVOut, owns = dkv_out
        # With `alternate_steps` both warpgroups hold the whole (64-key) tile: each slices the
        # one-warpgroup MMAs by its own thread index.
        mma_tidx = tidx % _WARPGROUP if const_expr(self.spec.alternate_steps) else tidx
        thr_sdp = tiled_mma_sdp.get_slice(mma_tidx)
        thr_dkv = tiled_mma_dkv.get_slice(mma_tidx)
        thr_dq = tiled_mma_dq.get_slice(mma_tidx)
        wg_sdp, wg_dkv, wg_dq = (warpgroup_slice(mma, mma_tidx)  # smem operands (uniform)
                                 for mma in (tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq))
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tSrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sQ)))
        tdVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sdO)))
        tdQrdS, tdQrK, t_sdS, t_rdS, ds_store_atom = None, None, None, None, None
        if const_expr(self.spec.fuses_dq):
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (..., dS stage)
            tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))  # K head-dim-major
            # dS^T from registers into sdS (rows x keys) with stmatrix.trans: 4 instructions
            # per thread instead of 32 16-bit stores (ncu, H100, 2026-11-24).
            ds_store_atom = cute.make_copy_atom(
                warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
            thr_ds_store = cute.make_tiled_copy_C(ds_store_atom, tiled_mma_sdp).get_slice(tidx)
            t_sdS = thr_ds_store.partition_D(transposed(sdS))  # (..., dS stage)

        acc_s = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dp = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dk = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.head_dim)))
        acc_dv = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.head_dim)))
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.tile_m, self.head_dim)))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        r_p = cute.make_rmem_tensor(acc_as_a_operand_layout(acc_s.layout), self.dtype)
        r_ds = cute.make_rmem_tensor(acc_as_a_operand_layout(acc_s.layout), self.dtype)
        t_coord = thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
        if const_expr(self.spec.fuses_dq):
            t_rdS = thr_ds_store.retile(cute.make_tensor(r_ds.iterator, acc_dp.layout))

        kv_handle = kv_consumer.wait_and_advance()
        step = partial(
            self.consume_step, tidx=tidx, tSrK=tSrK, tSrV=tSrV, tSrQ=tSrQ, tSrdO=tSrdO,
            tdKrQ=tdKrQ, tdVrdO=tdVrdO, tdQrdS=tdQrdS, tdQrK=tdQrK, acc_s=acc_s, acc_dp=acc_dp,
            acc_dk=acc_dk, acc_dv=acc_dv, acc_dq=acc_dq, r_p=r_p, r_ds=r_ds, t_coord=t_coord,
            ds_store_atom=ds_store_atom, t_rdS=t_rdS, t_sdS=t_sdS, sLSE=sLSE, sDPsum=sDPsum,
            dq_accumulator=dq_accumulator, scale_log2=scale_log2, block_range=block_range,
            n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, score_mods=score_mods,
            batch=batch, mDS=mDS)
        mmas = (tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq)
        if const_expr(self.spec.alternate_steps):
            wg = cute.arch.make_warp_uniform(tidx // _WARPGROUP)
            walk(partial(self.consume_turn, step=step, wg=wg),
                 (q_consumer, do_consumer, *mmas, Int32(0)))
            kv_handle.release()
            # Each warpgroup summed dK and dV over its own steps: warpgroup 0 stores dK,
            # warpgroup 1 dV, each adding the other's half handed over through smem.
            self.hand_over_dkv(tidx, wg, acc_dk, acc_dv, dkv_handover)
            if wg == 0:
                acc_dk.store(acc_dk.load() * softmax_scale)
                self.store_keys(thr_dkv, acc_dk, mdK, mdKOut, owns, offset_k, head_kv, n_block,
                                seqlen_k)
            else:
                self.store_keys(thr_dkv, acc_dv, mdV, mdVOut, owns, offset_k, head_kv, n_block,
                                seqlen_k)
        else:
            walk(step, (q_consumer, do_consumer, *mmas))
            kv_handle.release()
            acc_dk.store(acc_dk.load() * softmax_scale)
            for acc, m_out, m_owned in ((acc_dk, mdK, mdKOut), (acc_dv, mdV, mdVOut)):
                self.store_keys(thr_dkv, acc, m_out, m_owned, owns, offset_k, head_kv, n_block,
                                seqlen_k)

    @cute.jit
    def consume_turn(self, head: Int32, m_block: Int32, mask: cutlass.Constexpr, needs_mask,
                     q_consumer, do_consumer, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                     turn: Int32, step, wg: Int32):
        """`alternate_steps`: warpgroup `turn` takes this step; the other only moves its Q
        and dO pipeline states past the step's stage (the producer loads every step)."""
        if turn == wg:
            q_consumer, do_consumer, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = step(
                head, m_block, mask, needs_mask, q_consumer, do_consumer, tiled_mma_sdp,
                tiled_mma_dkv, tiled_mma_dq)
        else:
            q_consumer.advance()
            do_consumer.advance()
        return (q_consumer, do_consumer, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                1 - turn)

    @cute.jit
    def hand_over_dkv(self, tidx: Int32, wg: Int32, acc_dk: cute.Tensor, acc_dv: cute.Tensor,
                      dkv_handover):
        """`alternate_steps`: warpgroup 1 adds its dK into warpgroup 0's, warpgroup 0 its dV
        into warpgroup 1's, through the Q and dO buffers (free once both walks are done; the
        two warpgroups' fragments of the one-warpgroup MMA match value for value), each as
        16-byte stores in register order."""
        consumers = 2 * _WARPGROUP
        cute.arch.barrier(barrier_id=_WALKS_DONE_BARRIER, number_of_threads=consumers)
        lane = tidx % _WARPGROUP
        flat = cute.make_layout(cute.size(acc_dk))
        dk, dv = (cute.make_tensor(acc.iterator, flat) for acc in (acc_dk, acc_dv))
        dk_slot, dv_slot = (t[None, lane] for t in dkv_handover)
        if wg == 0:
            cute.autovec_copy(dv, dv_slot)
        else:
            cute.autovec_copy(dk, dk_slot)
        cute.arch.barrier(barrier_id=_DKV_STAGED_BARRIER, number_of_threads=consumers)
        other = cute.make_rmem_tensor(flat, Float32)
        if wg == 0:
            cute.autovec_copy(dk_slot, other)
            dk.store(dk.load() + other.load())
        else:
            cute.autovec_copy(dv_slot, other)
            dv.store(dv.load() + other.load())

    @cute.jit
    def consume_step(
        self, head: Int32, m_block: Int32, mask: cutlass.Constexpr, needs_mask, q_consumer,
        do_consumer,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
        tidx: Int32, tSrK, tSrV, tSrQ, tSrdO, tdKrQ, tdVrdO, tdQrdS, tdQrK, acc_s, acc_dp,
        acc_dk, acc_dv, acc_dq, r_p, r_ds, t_coord, ds_store_atom, t_rdS, t_sdS, sLSE, sDPsum,
        dq_accumulator: Optional[DqAccumulator], scale_log2: Float32, block_range: BlockRange,
        n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
        score_mods: Optional[ScoreMods] = None, batch: Int32 = 0,
        mDS: Optional[cute.Tensor] = None, ds_tile: Optional[Int32] = None,
    ):
        """One (query head, query step of tile_m rows) against this CTA's keys. `mask`: None,
        "causal_window", or "if_needed" (the causal/window mask where `needs_mask`). With
        `score_mods` the bias is added and the user mask read where the step's mask is (the
        lists' "mask" entries), and dS goes into dbias."""
        stages = self.spec.q_stages
        step_mods = None
        if const_expr(score_mods is not None):
            step_mods = score_mods.for_tile(batch, head).with_dbias_slot(
                t_coord, m_block, n_block, self.tile_m, self.tile_n)
            if const_expr(self.spec.score_stage_bias):
                # The bias tile's copies run under the step's first products.
                step_mods = step_mods.stage_bias(tidx, _BIAS_STAGED_BARRIER, m_block, n_block,
                                                 self.tile_m, self.tile_n, seqlen_q, seqlen_k)
        q_handle = q_consumer.wait_and_advance()
        q_stage = stage_index(q_handle, stages)
        tiled_mma_sdp = gemm(tiled_mma_sdp, acc_s, tSrK[None, None, None, 0],
                                  tSrQ[None, None, None, q_stage], zero_init=True)
        # The row statistics of this thread's columns (query rows) go to registers while the
        # products run: read after the wait, their smem latency led the exponentials' chain
        # (ncu, H100, 2026-11-24: a sixth of the fused kernel's stall samples). 128-row steps
        # read lse after the wait (the variant measured on the H100, 2026-11-25): there S and
        # dP in flight hold 128 registers, dK and dV 64 more.
        s_mn = acc_mn_view(acc_s)
        c_mn = acc_mn_view(t_coord)
        num_cols = cute.size(s_mn, mode=[1])
        r_lse = cute.make_rmem_tensor(cute.make_layout(num_cols), Float32)
        # With score mods lse is read after them: its registers held through the mods' loads
        # made the step spill (SASS, CPU compile: ~150 spill instructions per step).
        early_lse = self.tile_m == 64 and score_mods is None
        if const_expr(early_lse):
            for c in cutlass.range_constexpr(num_cols):
                r_lse[c] = sLSE[c_mn[0, c][1], q_stage]
        do_handle = do_consumer.wait_and_advance()
        do_stage = stage_index(do_handle, stages)
        tiled_mma_sdp = gemm(tiled_mma_sdp, acc_dp, tSrV[None, None, None, 0],
                                  tSrdO[None, None, None, do_stage], zero_init=True)
        warpgroup.wait_group(1)
        if const_expr(score_mods is not None):
            step_mods.apply(acc_s, t_coord, m_block, n_block, self.tile_m, self.tile_n,
                            seqlen_q, seqlen_k, needs_mask, keys_as_rows=True)
        if const_expr(not early_lse):
            for c in cutlass.range_constexpr(num_cols):
                r_lse[c] = sLSE[c_mn[0, c][1], q_stage]
        if const_expr(self.tile_m > 64):
            # A 128-row step may reach past its sequence's 64-row tiles into the next
            # sequence's: those rows' P must be 0 here, as the padding's +inf makes it.
            rows_left = seqlen_q - m_block * self.tile_m
            for c in cutlass.range_constexpr(num_cols):
                r_lse[c] = r_lse[c] if c_mn[0, c][1] < rows_left else Float32.inf
        if const_expr(mask == "causal_window"):
            apply_mask_keys_as_rows(acc_s, t_coord, block_range, n_block, m_block, seqlen_q,
                                    seqlen_k, True)
        elif const_expr(mask == "if_needed"):
            if needs_mask:
                apply_mask_keys_as_rows(acc_s, t_coord, block_range, n_block, m_block,
                                        seqlen_q, seqlen_k, True)
        # P^T = exp2(S^T scale log2(e) - lse log2(e)); lse log2(e) is +inf for rows that see
        # nothing and rows past the sequence, so their P is exactly 0.
        for c in cutlass.range_constexpr(num_cols):
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - r_lse[c], fastmath=True)
        # dO.O of this thread's rows: in registers before the dS loop for 64-row steps; read
        # inside it for 128-row steps, where 32 more live registers spilled (SASS, 240 per
        # thread: S, dP, dK, dV and P already hold 224).
        r_dpsum = cute.make_rmem_tensor(cute.make_layout(num_cols), Float32)
        if const_expr(self.tile_m == 64):
            for c in cutlass.range_constexpr(num_cols):
                r_dpsum[c] = sDPsum[c_mn[0, c][1], do_stage]
        cute.make_tensor(r_p.iterator, acc_s.layout).store(acc_s.load().to(self.dtype))
        if const_expr(self.spec.dv_before_ds):
            # dV += P^T dO goes to the tensor cores before dS is computed: it runs under it.
            tiled_mma_dkv = gemm(tiled_mma_dkv, acc_dv, r_p,
                                 tdVrdO[None, None, None, do_stage], zero_init=False)
            warpgroup.wait_group(1)  # dP (the dV product may still run)
        else:
            warpgroup.wait_group(0)
        # dS^T = P^T (dP^T - dO.O)
        dp_mn = acc_mn_view(acc_dp)
        for c in cutlass.range_constexpr(num_cols):
            if const_expr(self.tile_m > 64):
                r_dpsum[c] = sDPsum[c_mn[0, c][1], do_stage]
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                ds = s_mn[r, c] * (dp_mn[r, c] - r_dpsum[c])
                if const_expr(self.spec.stores_ds):
                    # Exactly 0 where P is, as the dQ kernel makes it: a masked key's dP may
                    # be non-finite (a non-finite V in a later token), and the stored dS
                    # reaches earlier rows' dQ.
                    ds = ds if s_mn[r, c] != Float32(0.0) else Float32(0.0)
                dp_mn[r, c] = ds
        if const_expr(self.spec.score_bias_grad):
            step_mods.add_bias_gradient(acc_dp, t_coord, m_block, n_block, self.tile_m,
                                        self.tile_n, seqlen_q, seqlen_k)
        r_ds_as_acc = cute.make_tensor(r_ds.iterator, acc_dp.layout)
        r_ds_as_acc.store(acc_dp.load().to(self.dtype))
        if const_expr(not self.spec.dv_before_ds):
            tiled_mma_dkv = gemm(tiled_mma_dkv, acc_dv, r_p,
                                 tdVrdO[None, None, None, do_stage], zero_init=False)
        if const_expr(self.spec.fuses_dq):
            # dS to smem (this Q stage's buffer: the other warpgroup's dQ read of the buffer,
            # two steps ago, ended before it reached the last step's barrier), then dQ = dS K
            # before dK += dS^T Q, so dQ's accumulator is staged while dK runs.
            cute.copy(ds_store_atom, t_rdS, t_sdS[None, None, None, q_stage])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_DS_FULL_BARRIER,
                              number_of_threads=self.num_consumer_threads)
            tiled_mma_dq = gemm(tiled_mma_dq, acc_dq, tdQrdS[None, None, None, q_stage],
                                tdQrK[None, None, None, 0], zero_init=True)
            tiled_mma_dkv = gemm(tiled_mma_dkv, acc_dk, r_ds, tdKrQ[None, None, None, q_stage],
                                 zero_init=False)
            warpgroup.wait_group(1)  # dV and dQ (dK may still run)
            do_handle.release()
            dq_accumulator.hand_to_writer(tidx, acc_dq)
            warpgroup.wait_group(0)
            q_handle.release()
        else:  # dQ is the query-centric kernel's (kernels/sm90/bwd_dq_sm90.py)
            tiled_mma_dkv = gemm(tiled_mma_dkv, acc_dk, r_ds, tdKrQ[None, None, None, q_stage],
                                 zero_init=False)
            if const_expr(self.spec.stores_ds):
                # dS^T for the dQ kernel (kernels/sm90/bwd_dq_from_ds.py), stored while dK
                # runs: four 16-byte vectors in register order (kernels/sm90/ds_tiles.py).
                store_ds_tile(r_ds_as_acc, mDS[ds_tile, None].iterator, tidx)
            warpgroup.wait_group(0)
            q_handle.release()
            do_handle.release()
        return q_consumer, do_consumer, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq

    @cute.jit
    def store_keys(self, thr_dkv, acc: cute.Tensor, m_out: cute.Tensor,
                   m_owned: Optional[cute.Tensor], owns, offset_k: Int32, head_kv: Int32,
                   n_block: Int32, seqlen_k: Int32):
        """dK or dV of this thread's keys inside the sequence, straight from registers (one
        32-bit store per pair of adjacent columns); with `add_dkv` added into the caller's
        float32 sums (this CTA alone owns the tile's rows), with `store_dkv_sums` stored into
        them (they hold nothing yet); with `partial_dkv` added into the float32 accumulator
        m_out instead (several CTAs share a KV tile), except, with `owned_dkv_stores`, where
        this unit `owns` the tile: stored into m_owned then."""
        store = partial(store_rows_from_registers, thr_dkv, acc, offset=offset_k, head=head_kv,
                        block=n_block, tile_rows=self.tile_n, head_dim=self.head_dim,
                        seqlen=seqlen_k)
        reduce = partial(reduce_rows_from_registers, thr_dkv, acc, m_out, offset_k, head_kv,
                         n_block, self.tile_n, self.head_dim, seqlen_k)
        if const_expr(self.spec.owned_dkv_stores):
            if owns:
                store(m_out=m_owned, dtype=self.dtype)
            else:
                reduce()
        elif const_expr(self.spec.partial_dkv):
            reduce()
        else:
            add = self.spec.add_dkv
            store(m_out=m_out, dtype=Float32 if self.spec.float32_dkv else self.dtype,
                  accumulate=add)
