"""dQ of the attention backward for Hopper (sm_90a), query-centric, written in CuTe DSL.

The KV-centric backward (kernels/sm90/bwd_sm90.py) adds a 64 x D float32 block of dQ into
global memory per 64 keys and 64 query rows it visits. Where a query tile sees few keys of each
KV tile that sees it (NSA's 64-key selected blocks, the compressed branch, where every KV tile
of 128 compressed keys adds into all of dQ), those reductions and the Q/dO reloads dominate:
NSA's selected branch ran its backward at 13x its forward (H100, 2026-11-24). This kernel
computes dQ the forward's way round instead, and the KV-centric kernel then skips its dQ
(`BwdSpec.dq_separate`):

- CTA = one 128-row query tile of one query head of one sequence (grid (H, query tiles, S),
  heads fastest so the heads of a KV group read the same K/V tiles from L2 at about the same
  time). Two consumer warpgroups own 64 rows each; a producer warp TMA-loads Q and dO once,
  then K and V per visited KV tile (`kv_stages` deep).
- It visits the KV tiles the forward visits (a causal x compress factor x window range, or the
  forward's block-sparse lists: mask entries, then full ones), and per tile recomputes
  S = Q K^T and dP = dO V^T, P = exp2(S scale log2 e - lse log2 e), dS = P (dP - dO.O) and
  adds dQ += dS K in registers. dQ is scaled and written once, in the input type, straight
  from registers to (T, H, D) with rows past the sequence end predicated off: no float32
  accumulator, no atomics (so it is deterministic) and no postprocess. With `accumulate`
  each row adds the values dQ held before (nsa() sums its branches' dQ so, without a pass of
  its own per branch: 0.55 ms per branch at 64K tokens, H=32, on an H100). With
  `sums_block_cols` it adds the fused branches' float32 sums into dQ first, or with
  `stores_sums` stores its unscaled dQ as those sums' first values and writes no dq (nsa()'s
  `DqSums`, kernels/sm90/backward.py).
- lse log2(e) and dO.O come from the KV-centric kernel's 64-row tile layout
  (kernels/sm90/backward.py `QueryTiles`), read per row from global memory.
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

from kernels.sm90.dq_accumulator import fragment_layout
from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.block_range import BlockRange
from kernels.sm90.layouts import (acc_as_a_operand_layout, acc_mn_view, transposed,
                                  with_row_strides_divisible)
from kernels.sm90.mask import apply_mask
from kernels.sm90.mma import gemm, warpgroup_slice
from kernels.sm90.pipelines import load_seq_tile, smem_buffer, stage_index, tma_pipeline
from kernels.sm90.register_store import store_rows_from_registers
from kernels.sm90.spec import DqSpec, consumer_registers

_WARPGROUP = 128
_LOG2_E = 1.4426950408889634


class DqBackwardSm90:
    producer_regs = 24

    def __init__(self, spec: DqSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        self.tile_m, self.tile_n, self.head_dim = spec.tile_m, spec.tile_n, spec.head_dim
        assert self.tile_m == 128 and self.tile_n == 64
        assert spec.fits_in_smem(), f"{spec} needs {spec.smem_bytes} bytes of shared memory"
        self.num_wg = self.tile_m // 64
        self.num_consumer_threads = _WARPGROUP * self.num_wg
        self.num_threads = _WARPGROUP * (1 + self.num_wg)
        self.consumer_regs = consumer_registers(self.num_threads, self.num_consumer_threads,
                                                spec.ctas_per_sm, self.producer_regs)

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
        mdQ: Optional[cute.Tensor],  # (T, H, D) in the input type; None with `stores_sums`
        mCuSeqlensQ: cute.Tensor,   # (S+1,) int32
        mCuSeqlensK: cute.Tensor,   # (S+1,) int32
        mQTileOffsets: cute.Tensor,  # (S+1,) int32: first 64-row tile of each sequence in P
        num_m_blocks: Int32,    # ceil(max_seqlen_q / 128)
        softmax_scale: Float32,
        compress_factor: Int32,
        window_left: Int32,
        window_right: Int32,
        mFullCount: Optional[cute.Tensor],   # the forward's block-sparse lists (128-row tiles)
        mFullIndex: Optional[cute.Tensor],
        mMaskCount: Optional[cute.Tensor],
        mMaskIndex: Optional[cute.Tensor],
        mRowBlockOffsets: Optional[cute.Tensor],
        mQPositions: Optional[cute.Tensor],  # (S,) int32: first query positions (`q_positions`)
        mdQSums: Optional[cute.Tensor],  # (H, P, D) float32: fused dQ sums (`sums_block_cols`)
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        tm, tn, d = self.tile_m, self.tile_n, self.head_dim
        # Views with the sequence first and the head last, for TMA.
        mQ_t, mdO_t, mK_t, mV_t = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))
            for t in (mQ, mdO, mK, mV))
        # S = Q K^T and dP = dO V^T: each warpgroup 64 rows x tn keys.
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (self.num_wg, 1, 1), (64, tn))
        # dQ += dS K: dS from registers, K read head-dim-major from the same smem.
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (self.num_wg, 1, 1), (64, d), warpgroup.OperandSource.RMEM)

        row_major = utils.LayoutEnum.ROW_MAJOR
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, (tm, tn, d), dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_a(row_major, (tn, tm, d), dtype,
                                                  self.spec.kv_stages)
        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load_op, mQ_t, sQ_one, (tm, d))
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(load_op, mdO_t, sQ_one, (tm, d))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_op, mK_t, sK_one, (tn, d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load_op, mV_t, sK_one, (tn, d))
        self.q_bytes = 2 * cute.size_in_bytes(dtype, sQ_one)
        self.kv_bytes = 2 * cute.size_in_bytes(dtype, sK_one)
        self.shared_storage = self.shared_storage_struct(sQ_layout, sK_layout)

        if const_expr(mdQ is not None):
            mdQ = with_row_strides_divisible(mdQ, 8)  # proves the 32-bit stores of column pairs
        if const_expr(mdQSums is not None):
            mdQSums = with_row_strides_divisible(mdQSums, 4)  # and the sums' 16-byte loads
        if const_expr(self.spec.compressed):
            compress_factor = cute.fast_divmod_create_divisor_v2(compress_factor)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            mLSE, mDPsum, mdQ, mCuSeqlensQ, mCuSeqlensK, mQTileOffsets, num_m_blocks,
            softmax_scale, softmax_scale * Float32(_LOG2_E), compress_factor, window_left,
            window_right, mFullCount, mFullIndex, mMaskCount, mMaskIndex, mRowBlockOffsets,
            mQPositions, mdQSums, sQ_layout, sK_layout, tiled_mma_sdp, tiled_mma_dq,
        ).launch(grid=(cute.size(mQ.shape[1]), num_m_blocks, cute.size(mCuSeqlensQ.shape[0]) - 1),
                 block=[self.num_threads, 1, 1], stream=stream)

    def shared_storage_struct(self, sQ_layout, sK_layout):
        """The CTA's shared memory (`DqSpec.smem_bytes` computes its size)."""
        dtype = self.dtype

        fields = dict(
            mbar_q=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2 * self.spec.kv_stages],
            sQ=smem_buffer(dtype, cute.cosize(sQ_layout), 1024),
            sdO=smem_buffer(dtype, cute.cosize(sQ_layout), 1024),
            sK=smem_buffer(dtype, cute.cosize(sK_layout), 1024),
            sV=smem_buffer(dtype, cute.cosize(sK_layout), 1024),
        )
        return cute.struct(type("DqSharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_do: cute.CopyAtom, mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor, tma_atom_v: cute.CopyAtom, mV: cute.Tensor,
        mLSE: cute.Tensor, mDPsum: cute.Tensor, mdQ: Optional[cute.Tensor],
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mQTileOffsets: cute.Tensor,
        num_m_blocks: Int32,
        softmax_scale: Float32, scale_log2: Float32, compress_factor, window_left: Int32,
        window_right: Int32, mFullCount: Optional[cute.Tensor],
        mFullIndex: Optional[cute.Tensor], mMaskCount: Optional[cute.Tensor],
        mMaskIndex: Optional[cute.Tensor], mRowBlockOffsets: Optional[cute.Tensor],
        mQPositions: Optional[cute.Tensor], mdQSums: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head, m_rev, batch = cute.arch.block_idx()
        # The last query tiles first: under a causal mask they visit the most KV tiles.
        m_block = num_m_blocks - 1 - m_rev
        num_heads = cute.size(mQ.shape[2])
        head_kv = head // (num_heads // cute.size(mK.shape[2]))

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        consumer_warps = self.num_wg * 4
        q_producer, q_consumer = tma_pipeline(storage.mbar_q.data_ptr(), 1, self.q_bytes,
                                              consumer_warps)
        kv_producer, kv_consumer = tma_pipeline(storage.mbar_kv.data_ptr(), spec.kv_stages,
                                                self.kv_bytes, consumer_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)

        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        block_range = BlockRange(
            self.tile_m, self.tile_n, spec.causal, spec.has_window_left, spec.has_window_right,
            spec.compressed, compress_factor, window_left, window_right)
        if const_expr(spec.q_positions):
            block_range = block_range.at_row_offset(mQPositions[batch])

        # Which KV tiles this query tile visits: the forward's range or its lists.
        n_max = Int32(0)
        num_iters = Int32(0)
        num_mask = Int32(0)
        sparse_row = Int32(0)
        sparse_head = Int32(0)
        in_sequence = m_block * self.tile_m < seqlen_q
        if in_sequence:
            if const_expr(spec.block_sparse):
                sparse_row = mRowBlockOffsets[batch] + m_block
                sparse_head = head // (num_heads // cute.size(mFullCount.shape[1]))
                # Lists of 128-key blocks: each entry is visited as two 64-key tiles.
                num_mask = mMaskCount[sparse_row, sparse_head] * spec.tiles_per_list_block
                num_iters = num_mask + mFullCount[sparse_row, sparse_head] * (
                    spec.tiles_per_list_block)
            else:
                n_min, n_max = block_range.n_block_min_max(m_block, seqlen_q, seqlen_k)
                num_iters = cutlass.max(n_max - n_min, 0)
        tile_at = lambda it: self.kv_tile_at(  # noqa: E731
            it, n_max, num_mask, mFullIndex, mMaskIndex, sparse_row, sparse_head)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                if num_iters > 0:
                    q_handle = q_producer.acquire_and_advance()
                    for atom, m_src, s_dst in ((tma_atom_q, mQ, sQ), (tma_atom_do, mdO, sdO)):
                        load_seq_tile(atom, m_src, s_dst, q_handle, offset_q, head, m_block,
                                      self.tile_m, self.head_dim, 0)
                for it in cutlass.range(num_iters, unroll=1):
                    n_block = tile_at(it)
                    kv_handle = kv_producer.acquire_and_advance()
                    for atom, m_src, s_dst in ((tma_atom_k, mK, sK), (tma_atom_v, mV, sV)):
                        load_seq_tile(atom, m_src, s_dst, kv_handle, offset_k, head_kv,
                                      n_block, self.tile_n, self.head_dim, kv_handle.index)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if in_sequence:
                self.consume(
                    tidx - _WARPGROUP, tile_at, num_iters, n_max, num_mask, q_consumer,
                    kv_consumer,
                    tiled_mma_sdp, tiled_mma_dq, sQ, sdO, sK, sV, mLSE, mDPsum, mdQ,
                    mQTileOffsets, softmax_scale, scale_log2, block_range, m_block, head,
                    batch, offset_q, seqlen_q, seqlen_k, mdQSums)

    @cute.jit
    def kv_tile_at(self, it: Int32, n_max: Int32, num_mask: Int32, mFullIndex, mMaskIndex,
                   sparse_row: Int32, sparse_head: Int32):
        """The it-th KV tile visited. Dense: from the last tile backwards (the diagonal
        first). Block-sparse: the mask entries, then the full ones."""
        n_block = n_max - 1 - it
        if const_expr(self.spec.block_sparse):
            per_block = self.spec.tiles_per_list_block
            if it < num_mask:
                n_block = mMaskIndex[sparse_row, sparse_head, it // per_block]
            else:
                n_block = mFullIndex[sparse_row, sparse_head, (it - num_mask) // per_block]
            n_block = n_block * per_block + it % per_block
        return n_block

    @cute.jit
    def consume(
        self, tidx: Int32, tile_at, num_iters: Int32, n_max: Int32, num_mask: Int32,
        q_consumer, kv_consumer,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dq: cute.TiledMma, sQ, sdO, sK, sV,
        mLSE: cute.Tensor, mDPsum: cute.Tensor, mdQ: Optional[cute.Tensor],
        mQTileOffsets: cute.Tensor, softmax_scale: Float32, scale_log2: Float32,
        block_range: BlockRange, m_block: Int32,
        head: Int32, batch: Int32, offset_q: Int32, seqlen_q: Int32, seqlen_k: Int32,
        mdQSums: Optional[cute.Tensor] = None,
    ):
        """The consumer warpgroups' whole CTA: every visited KV tile, then dQ."""
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        wg_sdp, wg_dq = (warpgroup_slice(mma, tidx)  # smem operands (uniform descriptors)
                         for mma in (tiled_mma_sdp, tiled_mma_dq))
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tSrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))

        acc_s = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)))
        acc_dp = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)))
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.tile_m, self.head_dim)))
        acc_dq.fill(0.0)
        r_ds = cute.make_rmem_tensor(acc_as_a_operand_layout(acc_s.layout), self.dtype)
        t_coord = thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        s_mn = acc_mn_view(acc_s)
        c_mn = acc_mn_view(t_coord)

        # This thread's rows' lse log2(e) and dO.O. Rows past the sequence end see nothing
        # (lse +inf: P = 0); their dQ is never stored.
        num_rows = cute.size(s_mn, mode=[0])
        lse = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        dpsum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        slot_base = mQTileOffsets[batch] * 64 + m_block * self.tile_m
        for r in cutlass.range_constexpr(num_rows):
            row = c_mn[r, 0][0]
            lse[r] = Float32.inf
            dpsum[r] = Float32(0.0)
            if m_block * self.tile_m + row < seqlen_q:
                lse[r] = mLSE[head, slot_base + row]
                dpsum[r] = mDPsum[head, slot_base + row]

        if num_iters > 0:  # the producer loads Q and dO only for a tile that visits keys
            q_handle = q_consumer.wait_and_advance()
            q_handle.release()  # read only by this CTA's own products: nothing refills it
        step = partial(
            self.consume_tile, tile_at=tile_at, num_mask=num_mask, tSrQ=tSrQ, tSrdO=tSrdO,
            tSrK=tSrK, tSrV=tSrV, tdQrK=tdQrK, acc_s=acc_s, acc_dp=acc_dp, acc_dq=acc_dq,
            r_ds=r_ds, t_coord=t_coord, lse=lse, dpsum=dpsum, scale_log2=scale_log2,
            block_range=block_range, m_block=m_block, seqlen_k=seqlen_k)
        state = (kv_consumer, tiled_mma_sdp, tiled_mma_dq)
        if const_expr(self.spec.block_sparse):
            # One copy of the step with a runtime mask choice: a loop per mask kind tripled
            # the code and measured no faster on the H100's 64-key lists (2026-11-24).
            for it in cutlass.range(num_iters, unroll=1):
                state = step(it, "if_needed", *state)
        else:
            # Tiles are visited from n_max - 1 down: masked ones (diagonal, sequence end), then
            # unmasked ones, then masked ones again (the left window edge). One loop per
            # compile-time mask kind: a runtime "does this tile need the mask" branch between
            # the S/dP products and their wait made ptxas wait for dP before the first
            # exponential (SASS: 0 of 32 MUFU.EX2 under the dP product; 7-9 now).
            unmasked_lo, unmasked_hi = block_range.unmasked_tiles(m_block, seqlen_q, seqlen_k)
            it_unmasked = cutlass.min(cutlass.max(n_max - unmasked_hi, 0), num_iters)
            it_masked_left = cutlass.min(cutlass.max(n_max - unmasked_lo, it_unmasked),
                                         num_iters)
            for it in cutlass.range(it_unmasked, unroll=1):
                state = step(it, "causal_window", *state)
            for it in cutlass.range(it_unmasked, it_masked_left, unroll=1):
                state = step(it, None, *state)
            if const_expr(self.spec.has_window_left):
                for it in cutlass.range(it_masked_left, num_iters, unroll=1):
                    state = step(it, "causal_window", *state)

        first_slot_tile = mQTileOffsets[batch] + m_block * self.num_wg
        if const_expr(self.spec.stores_sums):  # unscaled, as the fused calls add theirs
            self.exchange_fused_sums(acc_dq, mdQSums, first_slot_tile, head, tidx, m_block,
                                     seqlen_q, True)
        else:
            if const_expr(self.spec.sums_block_cols > 0):
                self.exchange_fused_sums(acc_dq, mdQSums, first_slot_tile, head, tidx,
                                         m_block, seqlen_q, False)
            acc_dq.store(acc_dq.load() * softmax_scale)
            store_rows_from_registers(thr_dq, acc_dq, mdQ, offset_q, head, m_block,
                                      self.tile_m, self.head_dim, seqlen_q, self.dtype,
                                      self.spec.accumulate)

    @cute.jit
    def exchange_fused_sums(self, acc_dq: cute.Tensor, mdQSums: cute.Tensor,
                            first_slot_tile: Int32, head: Int32, tidx: Int32, m_block: Int32,
                            seqlen_q: Int32, store: cutlass.Constexpr[bool]):
        """acc_dq += this thread's values of the fused branches' float32 dQ sums (unscaled, as
        acc_dq), or with `store` acc_dq stored as the sums' first values (`stores_sums`).
        Each warpgroup's 64 rows are one 64-row slot tile of the sums; its blocks of
        `sums_block_cols` columns hold the values in the dQ product's register order
        (kernels/sm90/dq_accumulator.py), the same wgmma fragment as acc_dq's, so value v of
        thread t is value v % (cols / 2) of thread t in block v // (cols / 2): 16-byte
        accesses in register order, a warp's one contiguous 512-byte run. A warpgroup whose
        rows start past the sequence touches nothing (its slot tile is another sequence's or
        past the end; its rows are never stored); each slot tile of a sequence is one
        warpgroup's, so a store writes every value that a later call adds into or reads."""
        wg, thread = tidx // _WARPGROUP, tidx % _WARPGROUP
        if m_block * self.tile_m + wg * 64 < seqlen_q:
            cols = self.spec.sums_block_cols
            block_values = 64 * cols
            per_block = cols // 2  # one thread's values of a block
            tile_start = mdQSums[head, (first_slot_tile + wg) * 64, None].iterator
            values = cute.make_tensor(acc_dq.iterator, cute.make_layout(cute.size(acc_dq)))
            for b in cutlass.range_constexpr(self.head_dim // cols):
                block = cute.make_tensor(tile_start + b * block_values,
                                         fragment_layout(block_values))
                sums = cute.make_rmem_tensor(cute.make_layout(per_block), Float32)
                if const_expr(store):
                    for i in cutlass.range_constexpr(per_block):
                        sums[i] = values[b * per_block + i]
                    cute.autovec_copy(sums, block[None, thread])
                else:
                    cute.autovec_copy(block[None, thread], sums)
                    for i in cutlass.range_constexpr(per_block):
                        values[b * per_block + i] = values[b * per_block + i] + sums[i]

    @cute.jit
    def consume_tile(
        self, it: Int32, mask: cutlass.Constexpr, kv_consumer,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dq: cute.TiledMma, tile_at, num_mask: Int32,
        tSrQ, tSrdO, tSrK, tSrV, tdQrK, acc_s, acc_dp, acc_dq, r_ds, t_coord, lse, dpsum,
        scale_log2: Float32, block_range: BlockRange, m_block: Int32, seqlen_k: Int32,
    ):
        """Visited KV tile `it`: S and dP, P, dS, dQ += dS K. `mask`: None, "causal_window",
        or "if_needed" (block-sparse: the causal/window mask on mask entries and on blocks
        crossing the sequence end)."""
        n_block = tile_at(it)
        kv_handle = kv_consumer.wait_and_advance()
        stage = stage_index(kv_handle, self.spec.kv_stages)
        tiled_mma_sdp = gemm(tiled_mma_sdp, acc_s, tSrQ[None, None, None, 0],
                             tSrK[None, None, None, stage], zero_init=True)
        tiled_mma_sdp = gemm(tiled_mma_sdp, acc_dp, tSrdO[None, None, None, 0],
                             tSrV[None, None, None, stage], zero_init=True)
        warpgroup.wait_group(1)
        if const_expr(mask == "causal_window"):
            apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, True)
        elif const_expr(mask == "if_needed"):
            # Mask entries, and full ones crossing the sequence end (keys past it).
            if (it < num_mask) | ((n_block + 1) * self.tile_n > seqlen_k):
                apply_mask(acc_s, t_coord, block_range, m_block, n_block, seqlen_k, True)
        s_mn = acc_mn_view(acc_s)
        dp_mn = acc_mn_view(acc_dp)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse[r], fastmath=True)
        warpgroup.wait_group(0)
        # dS = P (dP - dO.O), and exactly 0 where P is: a masked key's dP may be NaN or
        # Inf (a non-finite V in a later token), which must not reach earlier rows.
        for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                p = s_mn[r, c]
                ds = p * (dp_mn[r, c] - dpsum[r])
                dp_mn[r, c] = ds if p != Float32(0.0) else Float32(0.0)
        cute.make_tensor(r_ds.iterator, acc_dp.layout).store(acc_dp.load().to(self.dtype))
        tiled_mma_dq = gemm(tiled_mma_dq, acc_dq, r_ds, tdQrK[None, None, None, stage],
                            zero_init=False)
        warpgroup.wait_group(0)
        kv_handle.release()
        return kv_consumer, tiled_mma_sdp, tiled_mma_dq
