"""Flash-attention forward for Hopper (sm_90a), written in CuTe DSL.

One kernel, every feature a compile-time switch of `FwdSpec`: causal with a compress factor,
left/right windows, block sparsity from compact lists, varlen, GQA. Structure:

- CTA = 1 producer + `tile_m / 64` consumer warpgroups. One warp of the producer issues TMA
  loads of the Q tile (`q_stages` buffers) and of K/V tiles into a `num_stages` deep pipeline.
  Each consumer warpgroup owns 64 query rows: S = Q K^T (wgmma, operands in smem), online
  softmax in registers, O += P V (wgmma, P from registers), issued so that the softmax of one
  KV tile runs while the tensor cores do the P V of the previous one.
- Which query tiles a CTA takes comes from `tile_scheduler.TileOrder`: one per CTA, or a
  persistent walk (one or two CTAs per SM) that overlaps a tile's output store and the next
  tile's Q load with compute.
- Every sequence is addressed through cu_seqlens (a padded batch is B equal sequences), so one
  code path serves both layouts; rows and keys past a sequence's end are masked, never stored.
- The visited KV tiles are either a contiguous range (dense: causal, compress factor and window
  cut it before any load) or the compact full/mask lists of the block-sparse tensors. Tiles
  that every row sees completely skip the in-register mask; each mask kind has its own loop
  (see `consume`).

Tensors as the kernel sees them: q, o (T, H, D); k, v (Tk, Hkv, D); lse (H, T) float32.
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

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.block_range import BlockRange
from kernels.sm90.epilogue import OutputStore
from kernels.sm90.layouts import (
    acc_as_a_operand_layout, acc_columns, acc_mn_view, with_row_strides_divisible,
)
from kernels.sm90.mask import apply_mask
from kernels.sm90.mma import gemm, warpgroup_slice
from kernels.sm90.overlap_tiles import OverlapTiles
from kernels.sm90.pipelines import smem_buffer, stage_index, tma_pipeline
from kernels.sm90.score_mod import ScoreMods, score_mods_of
from kernels.sm90.screen import masked_value_screen
from kernels.sm90.softmax import rescale_rows, softmax_finalize, softmax_init, softmax_step
from kernels.sm90.spec import FwdSpec, consumer_registers
from kernels.sm90.tile_scheduler import TileOrder
from kernels.sm90 import trace

_WARPGROUP = 128
# Named barriers: 0 is __syncthreads; 12 + wg is warpgroup wg's turn to issue wgmma under
# `FwdSpec.pingpong` (wg < 3); the output store's (1-3 and 5-10) are in kernels/sm90/epilogue.py.
_TURN_BARRIER = 12
# `FwdSpec.o_in_q`: the consumers meet here before staging the output in the Q buffer.
_Q_DEAD_BARRIER = 11


class FlashAttentionForwardSm90(OverlapTiles):
    producer_regs = 24

    def __init__(self, spec: FwdSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        self.tile_m, self.tile_n, self.head_dim = spec.tile_m, spec.tile_n, spec.head_dim
        # One consumer warpgroup per 64 query rows. With one (tile_m 64) two CTAs share an SM
        # (smem and registers are sized for it), so one CTA's prologue and output store overlap
        # the other's math; with two, one CTA fills the SM.
        assert self.tile_m in (64, 128, 192)
        assert spec.fits_in_smem(), f"{spec} needs {spec.smem_bytes} bytes of shared memory"
        self.num_consumer_warpgroups = self.tile_m // 64
        self.num_threads = _WARPGROUP * (1 + self.num_consumer_warpgroups)
        self.ctas_per_sm = spec.ctas_per_sm
        # The producer warpgroup keeps 24 registers per thread, the consumers take what that
        # frees (`consumer_registers`).
        self.consumer_regs = consumer_registers(
            self.num_threads, _WARPGROUP * self.num_consumer_warpgroups, self.ctas_per_sm,
            self.producer_regs)
        assert not (spec.pingpong and self.num_consumer_warpgroups == 1)
        assert not (spec.defer_store and not spec.persistent)
        assert not (spec.overlap_tiles and (not spec.persistent or spec.defer_store
                                            or spec.block_sparse))
        assert not (spec.o_in_q and (spec.persistent or spec.q_stages != 1))
        assert not (spec.narrow_first_tile and (spec.block_sparse or spec.overlap_tiles
                                                or spec.defer_store or spec.tile_n % 32))
        assert not (spec.screen_masked_v and (spec.overlap_tiles or spec.defer_store))
        # The score mods hook into the KV loops of `consume` at full tile width, and read the
        # user mask in the block-sparse "mask" loop.
        assert not spec.score_mods or (
            spec.block_sparse and not spec.overlap_tiles and not spec.narrow_first_tile)
        assert not (spec.row_dot_output and (spec.store_warp or spec.defer_store
                                             or spec.overlap_tiles or spec.o_in_q))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, H, D)
        mK: cute.Tensor,  # (Tk, Hkv, D)
        mV: cute.Tensor,  # (Tk, Hkv, D)
        mO: cute.Tensor,  # (T, H, D); dO with `row_dot_output` (read)
        mLSE: cute.Tensor,  # (H, T) float32; rowsum(dO * O) with `row_dot_output`
        mCuSeqlensQ: cute.Tensor,  # (S+1,) int32
        mCuSeqlensK: cute.Tensor,  # (S+1,) int32
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        compress_factor: Int32,
        window_left: Int32,
        window_right: Int32,
        num_sms: Int32,  # persistent grid size (ignored otherwise)
        mFullCount: Optional[cute.Tensor],  # (R, Hs) int32
        mFullIndex: Optional[cute.Tensor],  # (R, Hs, Kf) int32
        mMaskCount: Optional[cute.Tensor],
        mMaskIndex: Optional[cute.Tensor],
        mRowBlockOffsets: Optional[cute.Tensor],  # (S+1,) int32
        mTrace: Optional[cute.Tensor],  # int64, kernels/sm90/trace.py (FwdSpec.trace only)
        mScreen: Optional[cute.Tensor],  # int32 (1,), kernels/sm90/screen.py (screen_masked_v)
        mQPositions: Optional[cute.Tensor],  # (S,) int32: first query positions (q_positions)
        mScoreMask: Optional[cute.Tensor],  # (slabs, Nq, Nk) uint8 (score_mask)
        mScoreBias: Optional[cute.Tensor],  # (slabs, Nq, Nk) (score_bias)
        mScoreSlabs: Optional[cute.Tensor],  # (B, H, 2) int32 (either), kernels/sm90/score_mod.py
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        # Views with the sequence first and the head last: (T, D, H) for TMA; V^T as (D, Tk, Hkv).
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))

        qk_tiler = (self.tile_m, self.tile_n, self.head_dim)
        pv_tiler = (self.tile_m, self.head_dim, self.tile_n)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (self.num_consumer_warpgroups, 1, 1), (64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (self.num_consumer_warpgroups, 1, 1), (64, self.head_dim),
            warpgroup.OperandSource.RMEM,
        )
        # The epilogue works per consumer warpgroup: 64 rows, one TMA store each.
        tiled_mma_epilogue = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (64, self.head_dim), warpgroup.OperandSource.RMEM,
        )
        sO_layout = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, (64, self.tile_n, self.head_dim), dtype,
            self.num_consumer_warpgroups)
        sQ_layout = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, qk_tiler, dtype, self.spec.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, qk_tiler, dtype, self.spec.num_stages)
        sV_layout = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.COL_MAJOR, pv_tiler, dtype, self.spec.num_stages)

        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        sV_one = cute.slice_(sV_layout, (None, None, 0))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            load_op, mQ_t, sQ_one, (self.tile_m, self.head_dim))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            load_op, mK_t, sK_one, (self.tile_n, self.head_dim))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            load_op, mVt, sV_one, (self.head_dim, self.tile_n))
        mO = with_row_strides_divisible(mO, 8)  # proves the 32-bit stores of column pairs
        mO_t = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1]))
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO_t, cute.slice_(sO_layout, (None, None, 0)),
            (64, self.head_dim))
        self.q_bytes = cute.size_in_bytes(dtype, sQ_one)
        self.kv_bytes = cute.size_in_bytes(dtype, sK_one)
        # `score_bias_tma`: the bias's (tile_m, tile_n) tile of a step comes with its K, into a
        # K-major swizzled buffer per K stage; the view is (Nq, Nk, slabs), the slab last.
        tma_atom_bias, tma_bias, sBias_layout, bias_dtype = None, None, None, None
        self.bias_bytes = 0
        if const_expr(self.spec.score_bias_tma):
            bias_dtype = mScoreBias.element_type
            bias = with_row_strides_divisible(mScoreBias, 8)
            bias_t = cute.make_tensor(bias.iterator, cute.select(bias.layout, mode=[1, 2, 0]))
            sBias_layout = sm90_utils.make_smem_layout_a(
                utils.LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.tile_n),
                bias_dtype, self.spec.num_stages)
            sBias_one = cute.slice_(sBias_layout, (None, None, 0))
            tma_atom_bias, tma_bias = cpasync.make_tiled_tma_atom(
                load_op, bias_t, sBias_one, (self.tile_m, self.tile_n))
            self.bias_bytes = cute.size_in_bytes(bias_dtype, sBias_one)

        self.shared_storage = self.shared_storage_struct(sQ_layout, sK_layout, sV_layout,
                                                         sO_layout, sBias_layout, bias_dtype)

        tile_order = TileOrder(
            self.spec.heads_fastest, (max_seqlen_q + self.tile_m - 1) // self.tile_m,
            cute.size(mQ.shape[1]), cute.size(mCuSeqlensQ.shape[0]) - 1)
        num_ctas = tile_order.num_tiles()
        if const_expr(self.spec.persistent):
            num_ctas = cutlass.min(num_ctas, num_sms * self.ctas_per_sm)
        scale_log2 = softmax_scale * Float32(1.4426950408889634)
        if const_expr(self.spec.compressed):
            # A multiply-and-shift divisor: the divisions by the compress factor sit on every
            # tile's critical path (KV range, mask limits), and as integer divides they cost
            # about 20 dependent instructions each.
            compress_factor = cute.fast_divmod_create_divisor_v2(compress_factor)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_o, tma_o, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, softmax_scale, scale_log2,
            compress_factor, window_left, window_right, tile_order,
            mFullCount, mFullIndex, mMaskCount, mMaskIndex, mRowBlockOffsets, mTrace, mScreen,
            mQPositions, mScoreMask, mScoreBias, mScoreSlabs, tma_atom_bias, tma_bias,
            sQ_layout, sK_layout, sV_layout, sO_layout, sBias_layout, tiled_mma_qk,
            tiled_mma_pv, tiled_mma_epilogue,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                        min_blocks_per_mp=self.ctas_per_sm,
                        preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None)

    def shared_storage_struct(self, sQ_layout, sK_layout, sV_layout, sO_layout,
                              sBias_layout=None, bias_dtype=None):
        """The CTA's shared memory (`FwdSpec.smem_bytes` computes its size). A plain method, not
        traced: the optional output buffer needs a Python `if`, which the DSL rewrites inside
        jit functions. Without it (`o_in_q`) the output is staged in the Q buffer; with
        `row_dot_output` nothing is staged. `score_bias_tma` adds a bias tile per K stage."""
        dtype, stages, q_stages = self.dtype, self.spec.num_stages, self.spec.q_stages
        lse_rows = 64 * self.num_consumer_warpgroups

        fields = dict(
            mbar_q=cute.struct.MemRange[cutlass.Int64, 2 * q_stages],
            mbar_k=cute.struct.MemRange[cutlass.Int64, 2 * stages],
            mbar_v=cute.struct.MemRange[cutlass.Int64, 2 * stages],
            # Before sQ, in the padding to its 1024-byte alignment: two 64-row CTAs fill the
            # SM's 228 KiB to the byte, and 256 more bytes after sO left room for only one.
            sLSE=smem_buffer(Float32, lse_rows, 16),
            sQ=smem_buffer(dtype, cute.cosize(sQ_layout), 1024),
            sK=smem_buffer(dtype, cute.cosize(sK_layout), 1024),
            sV=smem_buffer(dtype, cute.cosize(sV_layout), 1024),
        )
        if not (self.spec.o_in_q or self.spec.row_dot_output):
            fields["sO"] = smem_buffer(dtype, cute.cosize(sO_layout), 1024)
        if self.spec.score_bias_tma:
            fields["sBias"] = smem_buffer(bias_dtype, cute.cosize(sBias_layout), 1024)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom, mVt: cute.Tensor,
        tma_atom_o: cute.CopyAtom, mO_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
        softmax_scale: Float32, scale_log2: Float32,
        compress_factor, window_left: Int32, window_right: Int32, tile_order: TileOrder,
        mFullCount: Optional[cute.Tensor], mFullIndex: Optional[cute.Tensor],
        mMaskCount: Optional[cute.Tensor], mMaskIndex: Optional[cute.Tensor],
        mRowBlockOffsets: Optional[cute.Tensor], mTrace: Optional[cute.Tensor],
        mScreen: Optional[cute.Tensor], mQPositions: Optional[cute.Tensor],
        mScoreMask: Optional[cute.Tensor], mScoreBias: Optional[cute.Tensor],
        mScoreSlabs: Optional[cute.Tensor], tma_atom_bias: Optional[cute.CopyAtom],
        mBias_tma: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        sBias_layout: Optional[cute.ComposedLayout],
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        tiled_mma_epilogue: cute.TiledMma,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first_tile, _, _ = cute.arch.block_idx()
        tile_stride, _, _ = cute.arch.grid_dim()
        num_tiles = tile_order.num_tiles()

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)
            if const_expr(spec.score_bias_tma):
                cpasync.prefetch_descriptor(tma_atom_bias)

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        consumer_warps = self.num_consumer_warpgroups * 4
        q_producer, q_consumer = tma_pipeline(storage.mbar_q.data_ptr(), spec.q_stages,
                                              self.q_bytes, consumer_warps)
        # A K stage holds the step's bias tile too (`score_bias_tma`): one barrier for both.
        k_producer, k_consumer = tma_pipeline(storage.mbar_k.data_ptr(), spec.num_stages,
                                              self.kv_bytes + self.bias_bytes, consumer_warps)
        v_producer, v_consumer = tma_pipeline(storage.mbar_v.data_ptr(), spec.num_stages,
                                              self.kv_bytes, consumer_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sBias = None
        if const_expr(spec.score_bias_tma):
            sBias = storage.sBias.get_tensor(sBias_layout.outer, swizzle=sBias_layout.inner)
        # `o_in_q`: the tile's Q is dead once every consumer's last Q K^T is done (the
        # consumers meet at a barrier before staging), and no later Q comes (one tile per CTA).
        # `row_dot_output` stages nothing: the view only keeps OutputStore's fields typed.
        sO = (storage.sQ if const_expr(spec.o_in_q or spec.row_dot_output)
              else storage.sO).get_tensor(
            sO_layout.outer, swizzle=sO_layout.inner)
        out_store = OutputStore(
            self.head_dim, self.num_consumer_warpgroups, spec.persistent,
            spec.store_warp, tiled_mma_epilogue, sO,
            storage.sLSE.get_tensor(cute.make_layout((64, self.num_consumer_warpgroups))),
            tma_atom_o, mO_tma, mO, mLSE)
        block_range = BlockRange(
            self.tile_m, self.tile_n, spec.causal, spec.has_window_left, spec.has_window_right,
            spec.compressed, compress_factor, window_left, window_right,
        )
        score_mods = score_mods_of(spec, mScoreMask, mScoreBias, mScoreSlabs, softmax_scale)
        tile_work = partial(
            self.tile_work, tile_order=tile_order, block_range=block_range, mQ=mQ, mK=mK,
            mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mFullCount=mFullCount,
            mMaskCount=mMaskCount, mRowBlockOffsets=mRowBlockOffsets, mQPositions=mQPositions,
            score_mods=score_mods)

        produce_tile = partial(
            self.produce_tile, tile_work=tile_work, tma_atom_q=tma_atom_q, mQ=mQ,
            tma_atom_k=tma_atom_k, mK=mK, tma_atom_v=tma_atom_v, mVt=mVt, sQ=sQ, sK=sK, sV=sV,
            mFullIndex=mFullIndex, mMaskIndex=mMaskIndex, m_trace=mTrace,
            bias_load=(tma_atom_bias, mBias_tma, sBias))
        # What a consumer tile leaves for the next one: its output (`defer_store`) or its
        # unfinished accumulator (`overlap_tiles`).
        carried = None
        if const_expr(spec.defer_store):
            carried = self.make_deferred_output(tiled_mma_pv, tidx - _WARPGROUP)
        if const_expr(spec.overlap_tiles):
            carried = self.make_overlap_state(tiled_mma_qk, tiled_mma_pv, tidx - _WARPGROUP)
        screen = None
        if const_expr(spec.screen_masked_v):
            screen = masked_value_screen(storage.sV.data_ptr(), mScreen, spec.dtype,
                                         self.tile_n, self.head_dim, spec.num_stages)
        consume_tile = partial(
            self.consume_tile, tile_work=tile_work, tidx=tidx - _WARPGROUP, sQ=sQ, sK=sK, sV=sV,
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv,
            out_store=out_store, softmax_scale=softmax_scale,
            scale_log2=scale_log2, mFullIndex=mFullIndex,
            mMaskIndex=mMaskIndex, m_trace=mTrace, carried=carried, screen=screen,
            sBias=sBias)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.walk_tiles(tile_order, first_tile, tile_stride, num_tiles, produce_tile,
                                (q_producer, k_producer, v_producer))
            if const_expr(spec.store_warp):
                if warp_idx == 1:
                    out_store.begin()
                    self.walk_tiles(tile_order, first_tile, tile_stride, num_tiles,
                                    partial(self.drain_tile, tile_work=tile_work,
                                            out_store=out_store), ())
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if const_expr(spec.pingpong):
                # Warpgroup 0 takes the first turn (it arrives on its own turn barrier).
                if tidx // _WARPGROUP == 1:
                    cute.arch.barrier_arrive(barrier_id=_TURN_BARRIER,
                                             number_of_threads=2 * _WARPGROUP)
            q_consumer, k_consumer, v_consumer = self.walk_tiles(
                tile_order, first_tile, tile_stride, num_tiles, consume_tile,
                (q_consumer, k_consumer, v_consumer))
            if const_expr(spec.defer_store):
                self.store_deferred(carried, tidx - _WARPGROUP, out_store)
            if const_expr(spec.overlap_tiles):
                self.drain_overlap(carried, tidx - _WARPGROUP, v_consumer, tiled_mma_pv, sV,
                                   out_store, softmax_scale)
            out_store.finish(tidx - _WARPGROUP)

    @cute.jit
    def walk_tiles(
        self, tile_order: TileOrder, first_tile: Int32, tile_stride: Int32, num_tiles: Int32,
        tile_fn, pipelines,
    ):
        """Run tile_fn(coords, iteration, *pipelines) -> pipelines on this CTA's tiles: only
        `first_tile`, or with `persistent` every tile_stride-th one from it (`iteration` counts
        them), and return the pipelines after the last one. The producer warp, the consumer
        warpgroups and the storer warp all walk through here, so they visit the same tiles in
        order."""
        if const_expr(self.spec.persistent):
            tile = first_tile
            iteration = Int32(0)
            coords = tile_order.coords(first_tile)
            step = tile_order.coords(tile_stride)
            while tile < num_tiles:
                pipelines = tile_fn(coords, iteration, *pipelines)
                tile += tile_stride
                iteration += 1
                coords = tile_order.advance(coords, step)
        else:
            pipelines = tile_fn(tile_order.coords(first_tile), Int32(0), *pipelines)
        return pipelines

    @cute.jit
    def produce_tile(
        self, coords, iteration, q_producer, k_producer, v_producer, tile_work, tma_atom_q, mQ,
        tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sV, mFullIndex, mMaskIndex, m_trace,
        bias_load=None,
    ):
        """`bias_load` (`score_bias_tma`): (TMA atom, (Nq, Nk, slabs) TMA view, smem buffers)
        of the bias tiles, loaded with K."""
        mark = trace.marker(m_trace, 0, iteration, cute.arch.lane_idx() == 0,
                            trace.PRODUCER_EVENTS)
        mark("start")
        (m_block, head, _, offset_q, _, offset_k, _, head_kv, in_sequence, n_max,
         num_iters, num_mask_blocks, sparse_row, sparse_head, _, tile_mods) = tile_work(coords)
        bias_tiles = None
        if const_expr(self.spec.score_bias_tma):
            tma_atom_bias, mBias_tma, sBias = bias_load
            g_bias = cute.local_tile(mBias_tma[None, None, tile_mods.bias_slab],
                                     (self.tile_m, self.tile_n), (m_block, None))
            t_s, t_g = cpasync.tma_partition(
                tma_atom_bias, 0, cute.make_layout(1), cute.group_modes(sBias, 0, 2),
                cute.group_modes(g_bias, 0, 2))
            bias_tiles = (tma_atom_bias, t_g, t_s)
        mark("work")
        overlap = const_expr(self.spec.overlap_tiles)
        if const_expr(overlap):
            # `overlap_tiles`: every tile's Q, so that the consumers wait for it unconditionally
            # (rows past a sequence's end are read, never used; past the tensor, TMA fills 0).
            q_producer = self.load_q(tma_atom_q, mQ, sQ, q_producer, offset_q, head, m_block)
            mark("q_issued")
        if in_sequence:
            q_producer, k_producer, v_producer = self.produce(
                tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sV,
                q_producer, k_producer, v_producer,
                offset_q, offset_k, head, head_kv, m_block, n_max, num_iters,
                num_mask_blocks, mFullIndex, mMaskIndex, sparse_row, sparse_head, mark,
                load_q=not overlap, bias_tiles=bias_tiles,
            )
        return q_producer, k_producer, v_producer

    @cute.jit
    def load_q(self, tma_atom_q, mQ, sQ, q_producer, offset_q: Int32, head: Int32,
               m_block: Int32):
        mQ_seq = cute.domain_offset((offset_q, 0), mQ[None, None, head])
        gQ = cute.local_tile(mQ_seq, (self.tile_m, self.head_dim), (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1),
            cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        q_handle = q_producer.acquire_and_advance()
        cute.copy(tma_atom_q, tQgQ, tQsQ[(None, q_handle.index)], tma_bar_ptr=q_handle.barrier)
        return q_producer

    @cute.jit
    def consume_tile(
        self, coords, iteration, q_consumer, k_consumer, v_consumer, tile_work, tidx: Int32, sQ,
        sK, sV, tiled_mma_qk, tiled_mma_pv, out_store, softmax_scale, scale_log2,
        mFullIndex, mMaskIndex, m_trace, carried=None, screen=None, sBias=None,
    ):
        mark = trace.marker(m_trace, 1 + tidx // _WARPGROUP, iteration,
                            tidx % _WARPGROUP == 0, trace.CONSUMER_EVENTS)
        mark("start")
        (m_block, head, _, offset_q, seqlen_q, _, seqlen_k, _, in_sequence, n_max,
         num_iters, num_mask_blocks, sparse_row, sparse_head, block_range,
         score_mods) = tile_work(coords)
        mark("work")
        mark("kv_tiles", num_iters)
        consume = partial(
            self.consume, tidx, sQ, sK, sV, q_consumer, k_consumer, v_consumer,
            tiled_mma_qk, tiled_mma_pv, out_store, softmax_scale, scale_log2,
            block_range, offset_q, seqlen_q, seqlen_k, head, m_block, n_max,
            num_iters, num_mask_blocks, mFullIndex, mMaskIndex, sparse_row,
            sparse_head, mark, screen=screen, score_mods=score_mods, sBias=sBias)
        if const_expr(self.spec.overlap_tiles):
            q_consumer, k_consumer, v_consumer = self.consume_overlapped(
                tidx, sQ, sK, sV, q_consumer, k_consumer, v_consumer, tiled_mma_qk,
                tiled_mma_pv, out_store, softmax_scale, scale_log2, block_range, offset_q,
                seqlen_q, seqlen_k, head, m_block, n_max, num_iters, in_sequence, carried)
        elif in_sequence:
            q_consumer, k_consumer, v_consumer = consume(carried)
        elif const_expr(carried is not None):
            # A tile past its sequence's end: only the previous tile's output to store.
            self.store_deferred(carried, tidx, out_store)
            carried[2][1] = 0  # nothing left to store
        return q_consumer, k_consumer, v_consumer

    @cute.jit
    def tile_work(
        self, coords, tile_order: TileOrder, block_range: BlockRange, mQ: cute.Tensor,
        mK: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
        mFullCount: Optional[cute.Tensor], mMaskCount: Optional[cute.Tensor],
        mRowBlockOffsets: Optional[cute.Tensor], mQPositions: Optional[cute.Tensor],
        score_mods: Optional[ScoreMods] = None,
    ):
        """Where the work tile at `coords` lies, which KV tiles it visits (a range or
        compact lists), its rows' `BlockRange` (at their sequence's first position with
        `q_positions`) and its `ScoreMods` (None without a user mask or bias)."""
        m_block, head, batch = tile_order.unpack(coords)
        if const_expr(self.spec.q_positions):
            block_range = block_range.at_row_offset(mQPositions[batch])
        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        head_kv = head // (cute.size(mQ.shape[2]) // cute.size(mK.shape[2]))
        n_max = Int32(0)
        sparse_row = Int32(0)
        sparse_head = Int32(0)
        num_mask_blocks = Int32(0)
        num_iters = Int32(0)
        in_sequence = m_block * self.tile_m < seqlen_q
        if const_expr(self.spec.block_sparse):
            # Only tiles inside the sequence have a row in the lists: reading a row for a tile
            # past the end read past the lists' allocation (an illegal address in training).
            if in_sequence:
                sparse_row = mRowBlockOffsets[batch] + m_block
                sparse_head = head // (cute.size(mQ.shape[2]) // cute.size(mFullCount.shape[1]))
                num_mask_blocks = mMaskCount[sparse_row, sparse_head]
                num_iters = num_mask_blocks + mFullCount[sparse_row, sparse_head]
        else:
            n_min, n_max_range = block_range.n_block_min_max(m_block, seqlen_q, seqlen_k)
            n_max = n_max_range
            num_iters = cutlass.max(n_max - n_min, 0)
        tile_mods = None
        if const_expr(score_mods is not None):
            tile_mods = score_mods.for_tile(batch, head)
        return (m_block, head, batch, offset_q, seqlen_q, offset_k, seqlen_k, head_kv,
                in_sequence, n_max, num_iters, num_mask_blocks, sparse_row, sparse_head,
                block_range, tile_mods)

    @cute.jit
    def kv_tile_at(
        self, it: Int32, n_max: Int32, num_mask_blocks: Int32,
        mFullIndex: Optional[cute.Tensor], mMaskIndex: Optional[cute.Tensor],
        sparse_row: Int32, sparse_head: Int32,
    ):
        """The it-th KV tile visited and whether the causal/window mask applies to it.

        Dense: tiles from the last one backwards (the diagonal ones first).
        Block-sparse: the "mask" list, then the "full" list.
        """
        n_block = n_max - 1 - it
        is_mask_tile = cutlass.Boolean(True)
        if const_expr(self.spec.block_sparse):
            if it < num_mask_blocks:
                n_block = mMaskIndex[sparse_row, sparse_head, it]
            else:
                n_block = mFullIndex[sparse_row, sparse_head, it - num_mask_blocks]
                is_mask_tile = False
        return n_block, is_mask_tile

    @cute.jit
    def produce(
        self, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sV,
        q_producer, k_producer, v_producer,
        offset_q: Int32, offset_k: Int32, head: Int32, head_kv: Int32, m_block: Int32,
        n_max: Int32, num_iters: Int32, num_mask_blocks: Int32,
        mFullIndex, mMaskIndex, sparse_row: Int32, sparse_head: Int32, mark,
        load_q: cutlass.Constexpr[bool] = True, bias_tiles=None,
    ):
        """`bias_tiles` (`score_bias_tma`): (TMA atom, the query tile's row of bias tiles as
        TMA partitions, the K stages' bias buffers), each step's tile loaded on its K stage's
        barrier."""
        if const_expr(load_q):
            q_producer = self.load_q(tma_atom_q, mQ, sQ, q_producer, offset_q, head, m_block)
            mark("q_issued")
        mK_seq = cute.domain_offset((offset_k, 0), mK[None, None, head_kv])
        gK = cute.local_tile(mK_seq, (self.tile_n, self.head_dim), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1),
            cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        mV_seq = cute.domain_offset((0, offset_k), mVt[None, None, head_kv])
        gV = cute.local_tile(mV_seq, (self.head_dim, self.tile_n), (0, None))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1),
            cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        for it in cutlass.range(num_iters, unroll=1):
            n_block, _ = self.kv_tile_at(
                it, n_max, num_mask_blocks, mFullIndex, mMaskIndex, sparse_row, sparse_head)
            k_handle = k_producer.acquire_and_advance()
            cute.copy(tma_atom_k, tKgK[(None, n_block)], tKsK[(None, k_handle.index)],
                      tma_bar_ptr=k_handle.barrier)
            if const_expr(bias_tiles is not None):
                tma_atom_bias, t_g_bias, t_s_bias = bias_tiles
                cute.copy(tma_atom_bias, t_g_bias[(None, n_block)],
                          t_s_bias[(None, k_handle.index)], tma_bar_ptr=k_handle.barrier)
            if it == 0:
                mark("k0_issued")
            v_handle = v_producer.acquire_and_advance()
            cute.copy(tma_atom_v, tVgV[(None, n_block)], tVsV[(None, v_handle.index)],
                      tma_bar_ptr=v_handle.barrier)
        mark("done")
        return q_producer, k_producer, v_producer

    @cute.jit
    def consume(
        self, tidx: Int32, sQ, sK, sV, q_consumer, k_consumer, v_consumer,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        out_store: OutputStore, softmax_scale: Float32, scale_log2: Float32,
        block_range: BlockRange, offset_q: Int32, seqlen_q: Int32, seqlen_k: Int32,
        head: Int32, m_block: Int32, n_max: Int32, num_iters: Int32, num_mask_blocks: Int32,
        mFullIndex, mMaskIndex, sparse_row: Int32, sparse_head: Int32, mark, deferred,
        screen=None, score_mods: Optional[ScoreMods] = None, sBias=None,
    ):
        """One query tile: its KV tiles, then its output (stored now, or with `deferred` kept
        in registers and stored by the next tile, which also stores the one before it).
        `screen` (`screen_masked_v`): reads the V stage of each masked KV tile before its P V.
        `sBias` (`score_bias_tma`): the K stages' bias tiles."""
        thr_qk, thr_pv, tSrQ, tSrK, tOrV = self.operand_fragments(
            tidx, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV)
        if const_expr(self.spec.score_bias_tma):
            score_mods = score_mods.with_bias_tiles(thr_qk.partition_C(sBias))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        acc_o.fill(0.0)
        s_shape = thr_qk.partition_shape_C((self.tile_m, self.tile_n))
        t_coord = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(acc_mn_view(acc_o), mode=[0])
        row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        softmax_init(row_max, row_sum)

        correction = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        acc_s = thr_qk.make_fragment_C(s_shape)
        # P of the previous tile, in registers as the A operand of the P @ V wgmma.
        r_p = cute.make_rmem_tensor(acc_as_a_operand_layout(acc_s.layout), self.dtype)
        r_p_as_acc = cute.make_tensor(r_p.iterator, acc_s.layout)
        # Dense: the KV tiles every row sees completely; the others get the in-register mask.
        unmasked_lo, unmasked_hi = Int32(0), Int32(0)
        if const_expr(not self.spec.block_sparse):
            unmasked_lo, unmasked_hi = block_range.unmasked_tiles(m_block, seqlen_q, seqlen_k)

        q_handle = q_consumer.wait_and_advance()
        mark("q_ready")
        sQ_stage = tSrQ[None, None, None, stage_index(q_handle, self.spec.q_stages)]
        first_chunks = Int32(self.tile_n // 32)
        if num_iters > 0:
            n_block, is_mask_tile = self.kv_tile_at(
                0, n_max, num_mask_blocks, mFullIndex, mMaskIndex, sparse_row, sparse_head)
            k_handle = k_consumer.wait_and_advance()
            mark("k0_ready")
            first_scores = partial(
                self.first_scores, tidx=tidx, acc_s=acc_s, r_p_as_acc=r_p_as_acc,
                sQ_stage=sQ_stage, tSrK=tSrK, sQ=sQ, sK=sK, q_handle=q_handle,
                k_handle=k_handle, row_max=row_max, row_sum=row_sum, correction=correction,
                scale_log2=scale_log2, t_coord=t_coord, block_range=block_range,
                m_block=m_block, n_block=n_block, is_mask_tile=is_mask_tile, seqlen_k=seqlen_k,
                unmasked_lo=unmasked_lo, unmasked_hi=unmasked_hi, mark=mark,
                seqlen_q=seqlen_q, score_mods=score_mods)
            if const_expr(self.spec.narrow_first_tile):
                first_chunks = self.visible_chunks(tidx, block_range, m_block, n_block,
                                                   seqlen_q, seqlen_k)
                # One compiled path per width: wgmma shapes and register views are static.
                for chunks in cutlass.range_constexpr(1, self.tile_n // 32 + 1):
                    if first_chunks == chunks:
                        tiled_mma_qk = first_scores(chunks * 32, tiled_mma_qk=tiled_mma_qk)
            else:
                tiled_mma_qk = first_scores(self.tile_n, tiled_mma_qk=tiled_mma_qk,
                                            deferred=deferred, out_store=out_store)
            mark("softmax0_done")
        elif const_expr(deferred is not None):
            self.store_deferred(deferred, tidx, out_store)
        k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = self.later_kv_tiles(
            tidx, sQ_stage, tSrK, tOrV, acc_s, acc_o, r_p, r_p_as_acc, row_max, row_sum,
            correction, scale_log2, t_coord, block_range, m_block, seqlen_k, n_max,
            num_iters, num_mask_blocks, unmasked_lo, unmasked_hi, mFullIndex, mMaskIndex,
            sparse_row, sparse_head, k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv, screen,
            seqlen_q, score_mods)
        mark("loop_done")
        # Every Q K^T product of this tile is done: the producer may load the next tile's Q.
        q_handle.release()
        dout_rows = None
        if const_expr(self.spec.row_dot_output):
            dout_rows = out_store.load_row_dot_operand(offset_q, seqlen_q, head, m_block, tidx)
        if num_iters > 0:
            last_chunks = Int32(self.tile_n // 32)
            if const_expr(self.spec.narrow_first_tile):
                if num_iters == 1:
                    # The last KV tile is the narrowed first one: P is zero past its width.
                    last_chunks = first_chunks
            last_masked = False
            if const_expr(screen is not None):
                last_masked = self.masked_at(num_iters - 1, n_max, num_mask_blocks, unmasked_lo,
                                             unmasked_hi, seqlen_k, mFullIndex, mMaskIndex,
                                             sparse_row, sparse_head)
            tiled_mma_pv, v_consumer = self.last_pv(tidx, v_consumer, tiled_mma_pv, acc_o, r_p,
                                                    tOrV, mark, last_chunks, screen, last_masked)

        lse = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        softmax_finalize(acc_o, row_max, row_sum, softmax_scale, lse)
        if const_expr(self.spec.row_dot_output):
            mark("finalized")
            out_store.write_row_dot(acc_o, dout_rows, offset_q, seqlen_q, head, m_block, tidx)
            mark("stored")
        elif const_expr(deferred is not None):
            out, out_lse, where = deferred
            out.store(acc_o.load().to(self.dtype))
            out_lse.store(lse.load())
            for i, value in enumerate((offset_q, seqlen_q, head, m_block)):
                where[i] = value
            mark("finalized")
        else:
            mark("finalized")
            r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
            r_o.store(acc_o.load().to(self.dtype))
            if const_expr(self.spec.o_in_q):
                # The output goes into the Q buffer: every consumer's products with Q are done.
                cute.arch.barrier(barrier_id=_Q_DEAD_BARRIER,
                                  number_of_threads=_WARPGROUP * self.num_consumer_warpgroups)
            out_store.write(r_o, lse, offset_q, seqlen_q, head, m_block, tidx)
            mark("stored")
        return q_consumer, k_consumer, v_consumer

    def operand_fragments(self, tidx: Int32, tiled_mma_qk: cute.TiledMma,
                          tiled_mma_pv: cute.TiledMma, sQ, sK, sV):
        """This thread's slices of the two products and its views of their smem operands:
        (thr_qk, thr_pv, Q, K, V)."""
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk, wg_pv = warpgroup_slice(tiled_mma_qk, tidx), warpgroup_slice(tiled_mma_pv, tidx)
        return (thr_qk, thr_pv, wg_qk.make_fragment_A(wg_qk.partition_A(sQ)),
                wg_qk.make_fragment_B(wg_qk.partition_B(sK)),
                wg_pv.make_fragment_B(wg_pv.partition_B(sV)))

    @cute.jit
    def last_pv(self, tidx: Int32, v_consumer, tiled_mma_pv: cute.TiledMma, acc_o, r_p, tOrV,
                mark=None, chunks=None, screen=None, screen_tile=False):
        """O += P V for the last KV tile of a query tile, waited for. Returns the rebound
        TiledMma and V consumer (the DSL sees a pipeline advance only through a rebind).
        `chunks` (`narrow_first_tile`): only the first chunks * 32 keys of P are nonzero, so
        only their k-blocks are multiplied. `screen` reads the V stage first if `screen_tile`."""
        v_handle = v_consumer.wait_and_advance()
        if const_expr(mark is not None):
            mark("v_last_ready")
        if const_expr(screen is not None):
            if screen_tile:
                screen(v_handle, tidx)
        self.wait_turn(tidx)
        if const_expr(chunks is None or not self.spec.narrow_first_tile):
            tiled_mma_pv = self.gemm_pv(tiled_mma_pv, acc_o, r_p, tOrV, v_handle)
        else:
            for width_chunks in cutlass.range_constexpr(1, self.tile_n // 32 + 1):
                if chunks == width_chunks:
                    r_p_width = cute.make_tensor(r_p.iterator, acc_as_a_operand_layout(
                        cute.make_layout(((2, 2, width_chunks * 4), 1, 1))))
                    tiled_mma_pv = self.gemm_pv(tiled_mma_pv, acc_o, r_p_width, tOrV, v_handle)
        self.pass_turn(tidx)
        warpgroup.wait_group(0)
        if const_expr(mark is not None):
            mark("pv_last_done")
        v_handle.release()
        return tiled_mma_pv, v_consumer

    @cute.jit
    def later_kv_tiles(
        self, tidx: Int32, sQ_stage, tSrK, tOrV, acc_s, acc_o, r_p, r_p_as_acc, row_max,
        row_sum, correction, scale_log2: Float32, t_coord, block_range: BlockRange,
        m_block: Int32, seqlen_k: Int32, n_max: Int32, num_iters: Int32,
        num_mask_blocks: Int32, unmasked_lo: Int32, unmasked_hi: Int32, mFullIndex,
        mMaskIndex, sparse_row: Int32, sparse_head: Int32, k_consumer, v_consumer,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, screen=None,
        seqlen_q: Int32 = 0, score_mods: Optional[ScoreMods] = None,
    ):
        """KV tiles 1 .. num_iters-1 of a query tile (tile 0's softmax is done, its P in r_p).

        Intra-warpgroup overlap: S = Q K_j^T and O += P_{j-1} V_{j-1} are issued together,
        so the tensor cores work on P V while this warpgroup runs the softmax of S. Each loop
        below has one compile-time mask kind: a runtime branch between the wgmma issue and its
        wait makes ptxas place the wait at the branch's merge point, before the softmax, and
        the overlap is lost (seen in SASS: WARPGROUP.DEPBAR ahead of the MUFU.EX2 block).
        """
        step = partial(
            self.kv_step, tidx=tidx, sQ_stage=sQ_stage, tSrK=tSrK, tOrV=tOrV, acc_s=acc_s,
            acc_o=acc_o, r_p=r_p, r_p_as_acc=r_p_as_acc, row_max=row_max, row_sum=row_sum,
            correction=correction, scale_log2=scale_log2, t_coord=t_coord,
            block_range=block_range, m_block=m_block, seqlen_k=seqlen_k, screen=screen,
            seqlen_q=seqlen_q, score_mods=score_mods)
        # `screen`: whether the it-th KV tile visited gets a mask (its V is read before P V).
        masked_at = lambda it: False  # noqa: E731  (no screen: nothing to decide)
        if const_expr(screen is not None):
            masked_at = partial(
                self.masked_at, n_max=n_max, num_mask_blocks=num_mask_blocks,
                unmasked_lo=unmasked_lo, unmasked_hi=unmasked_hi, seqlen_k=seqlen_k,
                mFullIndex=mFullIndex, mMaskIndex=mMaskIndex, sparse_row=sparse_row,
                sparse_head=sparse_head)
        if const_expr(self.spec.block_sparse):
            for it in cutlass.range(1, num_mask_blocks, unroll=1):
                k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                    n_block=mMaskIndex[sparse_row, sparse_head, it], mask="causal_window",
                    screen_prev=masked_at(it - 1),
                    k_consumer=k_consumer, v_consumer=v_consumer, tiled_mma_qk=tiled_mma_qk,
                    tiled_mma_pv=tiled_mma_pv)
            first_full = cutlass.max(num_mask_blocks, 1)
            if seqlen_k % self.tile_n == 0:
                for it in cutlass.range(first_full, num_iters, unroll=1):
                    k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                        n_block=mFullIndex[sparse_row, sparse_head, it - num_mask_blocks],
                        mask=None, screen_prev=masked_at(it - 1),
                        k_consumer=k_consumer, v_consumer=v_consumer,
                        tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv)
            else:
                # Some "full" block may cross the sequence end: mask keys past it everywhere.
                for it in cutlass.range(first_full, num_iters, unroll=1):
                    k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                        n_block=mFullIndex[sparse_row, sparse_head, it - num_mask_blocks],
                        mask="seqlen", screen_prev=masked_at(it - 1),
                        k_consumer=k_consumer, v_consumer=v_consumer,
                        tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv)
        else:
            # Tiles are visited from n_max - 1 down: masked ones (diagonal, sequence end), then
            # unmasked ones, then masked ones again (the left window edge).
            it_unmasked = cutlass.min(cutlass.max(n_max - unmasked_hi, 1), num_iters)
            it_masked_left = cutlass.min(cutlass.max(n_max - unmasked_lo, it_unmasked),
                                         num_iters)
            for it in cutlass.range(1, it_unmasked, unroll=1):
                k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                    n_block=n_max - 1 - it, mask="causal_window",
                    screen_prev=masked_at(it - 1), k_consumer=k_consumer,
                    v_consumer=v_consumer, tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv)
            for it in cutlass.range(it_unmasked, it_masked_left, unroll=1):
                k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                    n_block=n_max - 1 - it, mask=None, screen_prev=masked_at(it - 1),
                    k_consumer=k_consumer,
                    v_consumer=v_consumer, tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv)
            if const_expr(self.spec.has_window_left):
                for it in cutlass.range(it_masked_left, num_iters, unroll=1):
                    k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv = step(
                        n_block=n_max - 1 - it, mask="causal_window",
                        screen_prev=masked_at(it - 1),
                        k_consumer=k_consumer,
                        v_consumer=v_consumer, tiled_mma_qk=tiled_mma_qk,
                        tiled_mma_pv=tiled_mma_pv)
        return k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv

    @cute.jit
    def masked_at(self, it: Int32, n_max: Int32, num_mask_blocks: Int32, unmasked_lo: Int32,
                  unmasked_hi: Int32, seqlen_k: Int32, mFullIndex, mMaskIndex,
                  sparse_row: Int32, sparse_head: Int32):
        """`screen_masked_v`: whether the it-th KV tile a query tile visits (`kv_tile_at`)
        gets a mask (`gets_mask`)."""
        n_block, is_mask_tile = self.kv_tile_at(it, n_max, num_mask_blocks, mFullIndex,
                                                mMaskIndex, sparse_row, sparse_head)
        return self.gets_mask(n_block, is_mask_tile, seqlen_k, unmasked_lo, unmasked_hi)

    def make_deferred_output(self, tiled_mma_pv: cute.TiledMma, tidx: Int32):
        """`defer_store`: registers that carry a finished tile's output to the next tile:
        O converted to the output type, lse, and (offset_q, seqlen_q, head, m_block). They
        start as a tile of zero rows, which stores nothing."""
        thr_pv = tiled_mma_pv.get_slice(tidx)
        acc_like = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        out = cute.make_rmem_tensor_like(acc_like, self.dtype)
        out_lse = cute.make_rmem_tensor(
            cute.make_layout(cute.size(acc_mn_view(acc_like), mode=[0])), Float32)
        where = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        where.fill(0)
        return out, out_lse, where

    @cute.jit
    def store_deferred(self, deferred, tidx: Int32, out_store: OutputStore):
        out, out_lse, where = deferred
        out_store.write(out, out_lse, where[0], where[1], where[2], where[3], tidx)

    @cute.jit
    def drain_tile(self, coords, iteration, tile_work, out_store: OutputStore):
        """The storer warp's part of a tile (`FwdSpec.store_warp`)."""
        (m_block, head, _, offset_q, seqlen_q, _, _, _, in_sequence, _, _, _, _, _, _,
         _) = tile_work(coords)
        out_store.drain(offset_q, seqlen_q, head, m_block, in_sequence, cute.arch.lane_idx())
        return ()

    @cute.jit
    def kv_step(
        self, n_block: Int32, mask: cutlass.Constexpr, k_consumer, v_consumer,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tidx: Int32, sQ_stage, tSrK,
        tOrV, acc_s, acc_o, r_p, r_p_as_acc, row_max, row_sum, correction, scale_log2: Float32,
        t_coord, block_range: BlockRange, m_block: Int32, seqlen_k: Int32, screen=None,
        screen_prev=False, seqlen_q: Int32 = 0, score_mods: Optional[ScoreMods] = None,
    ):
        """One steady-state iteration: S = Q K_n^T and O += P_prev V_prev in flight together,
        then mask (`mask`: None, "seqlen" or "causal_window") and softmax of S while P V runs.
        `screen` reads V_prev's stage before the products when `screen_prev` (it was masked)."""
        k_handle = k_consumer.wait_and_advance()
        if const_expr(screen is not None):
            # Before any wgmma issue: a branch between an issue and its wait costs the overlap.
            v_handle = v_consumer.wait_and_advance()
            if screen_prev:
                screen(v_handle, tidx)
        self.wait_turn(tidx)
        tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, sQ_stage, tSrK, k_handle)
        if const_expr(screen is None):
            v_handle = v_consumer.wait_and_advance()
        tiled_mma_pv = self.gemm_pv(tiled_mma_pv, acc_o, r_p, tOrV, v_handle)
        self.pass_turn(tidx)
        warpgroup.wait_group(1)
        if const_expr(not self.spec.score_bias_tma):
            k_handle.release()
        if const_expr(score_mods is not None):
            # Block-sparse lists of a user mask: its "mask" tiles come through the
            # "causal_window" loop, and only they read it.
            score_mods.apply(acc_s, t_coord, m_block, n_block, self.tile_m, self.tile_n,
                             seqlen_q, seqlen_k, mask == "causal_window",
                             bias_stage=stage_index(k_handle, self.spec.num_stages))
        if const_expr(self.spec.score_bias_tma):
            k_handle.release()  # the stage's bias tile is read
        if const_expr(mask is not None):
            apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k,
                       mask == "causal_window")
        softmax_step(acc_s, row_max, row_sum, correction, scale_log2)
        warpgroup.wait_group(0)
        v_handle.release()
        rescale_rows(acc_o, correction)
        r_p_as_acc.store(acc_s.load().to(self.dtype))
        return k_consumer, v_consumer, tiled_mma_qk, tiled_mma_pv

    def wait_turn(self, tidx: Int32):
        """`pingpong`: wait until the previous consumer warpgroup in turn order has issued its
        wgmma."""
        if const_expr(self.spec.pingpong):
            cute.arch.barrier(barrier_id=_TURN_BARRIER + tidx // _WARPGROUP,
                              number_of_threads=2 * _WARPGROUP)

    def pass_turn(self, tidx: Int32):
        """`pingpong`: let the next consumer warpgroup (round robin over two or three) issue,
        while this one computes its softmax, so the tensor cores always have work queued.
        Every warpgroup of a tile takes the same number of turns (one per KV tile and one for
        the last P V), so the order never deadlocks."""
        if const_expr(self.spec.pingpong):
            next_wg = (tidx // _WARPGROUP + 1) % self.num_consumer_warpgroups
            cute.arch.barrier_arrive(barrier_id=_TURN_BARRIER + next_wg,
                                     number_of_threads=2 * _WARPGROUP)

    @cute.jit
    def visible_chunks(self, tidx: Int32, block_range: BlockRange, m_block: Int32,
                       n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """`narrow_first_tile`: how many 32-key chunks of KV tile n_block this warpgroup's
        rows may see, 1 .. tile_n / 32 (its last row sees the most)."""
        first_row = m_block * self.tile_m + tidx // _WARPGROUP * 64
        last_row = cutlass.min(first_row + 64, seqlen_q) - 1
        key_end = cutlass.min(block_range.key_limit_right(block_range.position(last_row)),
                              seqlen_k)
        chunks = (key_end - n_block * self.tile_n + 31) // 32
        chunks = cutlass.min(cutlass.max(chunks, 1), self.tile_n // 32)
        return cute.arch.make_warp_uniform(chunks)

    @cute.jit
    def first_scores(
        self, width: cutlass.Constexpr[int], tidx: Int32, tiled_mma_qk: cute.TiledMma, acc_s,
        r_p_as_acc, sQ_stage, tSrK, sQ, sK, q_handle, k_handle, row_max, row_sum, correction,
        scale_log2: Float32, t_coord, block_range: BlockRange, m_block: Int32, n_block: Int32,
        is_mask_tile, seqlen_k: Int32, unmasked_lo: Int32, unmasked_hi: Int32, mark,
        deferred=None, out_store=None, seqlen_q: Int32 = 0,
        score_mods: Optional[ScoreMods] = None,
    ):
        """The first KV tile of a query tile: S = Q K^T over its first `width` keys (all of
        them, or with `narrow_first_tile` as far as this warpgroup's rows see), mask, softmax,
        P into r_p_as_acc (zero past `width`). With `deferred`, the previous tile's output is
        stored while the product runs. Returns the TiledMma (rebound at full width)."""
        s = acc_s
        if const_expr(width != self.tile_n):
            # Its own registers: as a view of acc_s (which the full-width wgmmas of the loop
            # use), ptxas serialised every wgmma of the kernel (C7511, "insufficient register
            # resources for the wgmma pipeline"), no spill.
            s = cute.make_rmem_tensor(cute.make_layout(((2, 2, width // 8), 1, 1)), Float32)
        self.wait_turn(tidx)
        if const_expr(width == self.tile_n):
            tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, sQ_stage, tSrK, k_handle)
        else:
            self.gemm_qk_columns(width, tidx, s, sQ, sK, q_handle, k_handle)
        self.pass_turn(tidx)
        if const_expr(deferred is not None):
            # The previous tile's output goes out while the tensor cores run this Q K^T. Its
            # branches touch no wgmma register, and every path reaches the wait.
            self.store_deferred(deferred, tidx, out_store)
            mark("prev_stored")
        warpgroup.wait_group(0)
        mark("s0_done")
        if const_expr(not self.spec.score_bias_tma):
            k_handle.release()
        if const_expr(score_mods is not None):
            score_mods.apply(s, t_coord, m_block, n_block, self.tile_m, self.tile_n, seqlen_q,
                             seqlen_k, is_mask_tile,
                             bias_stage=stage_index(k_handle, self.spec.num_stages))
        if const_expr(self.spec.score_bias_tma):
            k_handle.release()  # the stage's bias tile is read
        self.mask_scores(s, t_coord, block_range, m_block, n_block, is_mask_tile, seqlen_k,
                         unmasked_lo, unmasked_hi)
        softmax_step(s, row_max, row_sum, correction, scale_log2, is_first=True)
        if const_expr(width == self.tile_n):
            r_p_as_acc.store(acc_s.load().to(self.dtype))
        else:
            acc_columns(r_p_as_acc, 0, width).store(s.load().to(self.dtype))
            for start in cutlass.range_constexpr(width, self.tile_n, 32):
                acc_columns(r_p_as_acc, start, 32).fill(0.0)
        return tiled_mma_qk

    @cute.jit
    def gemm_qk_columns(self, width: cutlass.Constexpr[int], tidx: Int32, acc_s, sQ, sK,
                        q_handle, k_handle):
        """Issue S = Q K[:width]^T into acc_s, a 64 x width fragment: one wgmma per k-block
        (96 keys as 64 + 32, each writing its columns' registers)."""
        pieces = [(64, 0), (32, 64)] if width == 96 else [(width, 0)]
        q_stage = stage_index(q_handle, self.spec.q_stages)
        k_stage = stage_index(k_handle, self.spec.num_stages)
        warpgroup.fence()
        for piece, start in pieces:
            mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.K,
                warpgroup.OperandMajorMode.K, Float32, (self.num_consumer_warpgroups, 1, 1),
                (64, piece))
            thr = warpgroup_slice(mma, tidx)
            t_a = thr.make_fragment_A(thr.partition_A(sQ))[None, None, None, q_stage]
            # The keys [start, start + piece) of the K stage, as a piece-row tile.
            sK_piece = cute.flat_divide(sK, (piece,))[None, start // piece, None, None]
            t_b = thr.make_fragment_B(thr.partition_B(sK_piece))[None, None, None, k_stage]
            acc = acc_columns(acc_s, start, piece)
            for k in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(mma, acc, t_a[None, None, k], t_b[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def mask_scores(
        self, acc_s: cute.Tensor, t_coord: cute.Tensor, block_range: BlockRange, m_block: Int32,
        n_block: Int32, is_mask_tile, seqlen_k: Int32, unmasked_lo: Int32, unmasked_hi: Int32,
    ):
        """Mask only where `gets_mask` says; a block-sparse "full" tile only past the
        sequence end."""
        if const_expr(self.spec.block_sparse):
            if is_mask_tile:
                apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, True)
            elif self.gets_mask(n_block, is_mask_tile, seqlen_k, unmasked_lo, unmasked_hi):
                apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, False)
        else:
            if self.gets_mask(n_block, is_mask_tile, seqlen_k, unmasked_lo, unmasked_hi):
                apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, True)

    @cute.jit
    def gets_mask(self, n_block: Int32, is_mask_tile, seqlen_k: Int32, unmasked_lo: Int32,
                  unmasked_hi: Int32):
        """Whether KV tile n_block gets the in-register mask: block-sparse, a "mask" tile or
        one crossing the sequence end; dense, a tile outside [unmasked_lo, unmasked_hi)."""
        if const_expr(self.spec.block_sparse):
            return is_mask_tile | ((n_block + 1) * self.tile_n > seqlen_k)
        return (n_block < unmasked_lo) | (n_block >= unmasked_hi)

    @cute.jit
    def gemm_qk(self, tiled_mma_qk: cute.TiledMma, acc_s, sQ_stage, tSrK, k_handle):
        """Issue S = Q K^T on the K stage `k_handle` holds."""
        return gemm(
            tiled_mma_qk, acc_s, sQ_stage,
            tSrK[None, None, None, stage_index(k_handle, self.spec.num_stages)],
            zero_init=True)

    @cute.jit
    def gemm_pv(self, tiled_mma_pv: cute.TiledMma, acc_o, r_p, tOrV, v_handle):
        """Issue O += P V on the V stage `v_handle` holds."""
        return gemm(
            tiled_mma_pv, acc_o, r_p,
            tOrV[None, None, None, stage_index(v_handle, self.spec.num_stages)],
            zero_init=False)
