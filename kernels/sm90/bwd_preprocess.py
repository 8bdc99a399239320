"""The backward's row statistics, in CuTe DSL: dO.O = rowsum(dO * O) in float32 (a product
with dO == 0 counts as 0, whatever O holds) and lse * log2(e) (+inf where a row sees nothing),
scattered into the 64-row query tile layout that both backward kernels read
(kernels/sm90/backward.py `QueryTiles`).

One pass over O and dO in their input type. The torch version it replaces converted both to
float32 tensors first, multiplied and summed: at 64K tokens, H=32, that moved about 6 GB and
took ~3 ms of a 13 ms selected-branch backward (H100, 2026-11-24, torch.profiler).

Each row's D elements are read as 16-byte vectors by D/8 adjacent lanes, which add their dot
products with butterfly shuffles; a CTA of 128 threads covers `rows_per_cta` rows of one head.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.layouts import with_row_strides_divisible
from kernels.sm90.row_dot import lane_group_sum, masked_dot

_THREADS = 128
_VECTOR = 8  # 16-bit elements per 16-byte load
_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class PreprocessSpec:
    """The compile key of `BackwardPreprocess`."""
    dtype: str      # "bfloat16" | "float16"
    head_dim: int   # 64 | 128


class BackwardPreprocess:
    rows_per_cta = 64

    def __init__(self, spec: PreprocessSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        head_dim = self.head_dim = spec.head_dim
        self.lanes_per_row = head_dim // _VECTOR
        assert 32 % self.lanes_per_row == 0, f"head_dim {head_dim}: D/8 must divide a warp"
        self.rows_per_pass = _THREADS // self.lanes_per_row

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,         # (T, H, D)
        mdO: cute.Tensor,        # (T, H, D)
        mLSE: cute.Tensor,       # (H, T) float32, natural log; -inf where a row sees nothing
        mSlot: cute.Tensor,      # (T,) int32: the row's slot in the tile layout
        mLSElog2: cute.Tensor,   # (H, P) float32 out
        mDPsum: cute.Tensor,     # (H, P) float32 out
        stream: cuda.CUstream,
    ):
        mO = with_row_strides_divisible(mO, _VECTOR)  # proves the 16-byte loads aligned
        mdO = with_row_strides_divisible(mdO, _VECTOR)
        total = cute.size(mO.shape[0])
        self.kernel(mO, mdO, mLSE, mSlot, mLSElog2, mDPsum).launch(
            grid=((total + self.rows_per_cta - 1) // self.rows_per_cta,
                  cute.size(mO.shape[1]), 1),
            block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mSlot: cute.Tensor,
               mLSElog2: cute.Tensor, mDPsum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, _ = cute.arch.block_idx()
        total = cute.size(mO.shape[0])
        chunk = tidx % self.lanes_per_row
        for p in cutlass.range_constexpr(self.rows_per_cta // self.rows_per_pass):
            row = (row_block * self.rows_per_cta + p * self.rows_per_pass
                   + tidx // self.lanes_per_row)
            dot = Float32(0.0)
            if row < total:
                r_o = cute.make_rmem_tensor(cute.make_layout(_VECTOR), self.dtype)
                r_do = cute.make_rmem_tensor(cute.make_layout(_VECTOR), self.dtype)
                cute.autovec_copy(cute.local_tile(mO[row, head, None], (_VECTOR,), (chunk,)), r_o)
                cute.autovec_copy(cute.local_tile(mdO[row, head, None], (_VECTOR,), (chunk,)),
                                  r_do)
                # A row whose dO is 0 (the loss does not read it) gets dO.O = 0 even where its O
                # is NaN (a NaN the forward kept inside a tile), else dS = P (dP - NaN) would
                # carry it into dK of every key the row sees.
                dot = masked_dot(r_do.load().to(Float32), r_o.load().to(Float32))
            dot = lane_group_sum(dot, self.lanes_per_row)  # every lane: the row test is per lane
            if (row < total) & (chunk == 0):
                slot = mSlot[row]
                mDPsum[head, slot] = dot
                lse = mLSE[head, row] * Float32(_LOG2_E)
                if lse == -Float32.inf:
                    lse = Float32.inf  # P = exp2(s - inf) = 0 exactly for such a row
                mLSElog2[head, slot] = lse



@dataclass(frozen=True)
class GateFoldSpec:
    """The compile key of `GateFoldedStatistics`: every operand is float32, so one build."""
    rows_per_cta: int = _THREADS


class GateFoldedStatistics:
    """The row statistics of one nsa() branch whose gate is folded into its lse, from the row
    dots the recomputing forward wrote (`nsa.function.fused_gate_pass`): one launch instead of
    the ~15 small torch ops (log, subtract, masks, two scatters) of folding and scattering.

    lse log2(e) = (lse - ln g) * log2(e), +inf where g is not > 0 (a gate that underflowed, or
    NaN: the branch adds nothing to that row) or where that is -inf (the row sees nothing);
    dO.O = the given row dot, both at the row's slot. The rule and its reasons:
    `kernels.sm90.backward.gate_folded_lse`. One thread per (row, head): the row dots and lse
    are read, and the slots written, along rows; the gate column is a strided gather.

    It writes every slot, so the outputs need no fill first: the last row of a sequence also
    marks the slots up to the next row's (its last tile's padding: +inf, 0), and the slots
    after the last row's are shared out over all threads. The row dots may have any strides
    (nsa() passes a column of its (T, H, 3) gate gradients, transposed: no copy). The two
    fills and the copy this replaces were three launches per branch on the backward's
    critical path, about 0.028 ms a branch; the strided reads cost the kernel 0.017 ms of it
    (8 x 8K tokens, H=32, H200, 2026-12-01).
    """

    def __init__(self, spec: GateFoldSpec):
        self.spec = spec

    @cute.jit
    def __call__(
        self,
        mDots: cute.Tensor,      # (H, T) float32: <dO, o_b> per head and row
        mLSE: cute.Tensor,       # (H, T) float32, natural log; -inf where a row sees nothing
        mGates: cute.Tensor,     # (T, H, B) float32 gate weights
        gate_index: cutlass.Int32,  # b: this branch's gate column
        mSlot: cute.Tensor,      # (T,) int32: the row's slot in the tile layout
        mLSElog2: cute.Tensor,   # (H, P) float32 out
        mDPsum: cute.Tensor,     # (H, P) float32 out
        stream: cuda.CUstream,
    ):
        total = cute.size(mSlot.shape[0])
        rows = self.spec.rows_per_cta
        self.kernel(mDots, mLSE, mGates, gate_index, mSlot, mLSElog2, mDPsum).launch(
            grid=((total + rows - 1) // rows, cute.size(mDots.shape[0]), 1),
            block=[rows, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mDots: cute.Tensor, mLSE: cute.Tensor, mGates: cute.Tensor,
               gate_index: cutlass.Int32, mSlot: cute.Tensor, mLSElog2: cute.Tensor,
               mDPsum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, _ = cute.arch.block_idx()
        row = row_block * self.spec.rows_per_cta + tidx
        total = cute.size(mSlot.shape[0])
        slots = cute.size(mLSElog2.shape[1])
        if row < total:
            slot = mSlot[row]
            mDPsum[head, slot] = mDots[head, row]
            gate = mGates[row, head, gate_index]
            lse = Float32.inf
            if gate > Float32(0.0):  # False for NaN too
                folded = (mLSE[head, row] - cute.math.log(gate, fastmath=False)) * Float32(_LOG2_E)
                if folded != -Float32.inf:
                    lse = folded
            mLSElog2[head, slot] = lse
            if row + 1 < total:  # a sequence's last row: its tile's padding up to the next
                for pad in cutlass.range(slot + 1, mSlot[row + 1], unroll=1):
                    mLSElog2[head, pad] = Float32.inf
                    mDPsum[head, pad] = Float32(0.0)
        # The slots after the last row's (the last tile's padding and the spare tiles), over
        # every thread of the grid's rows.
        threads = cute.arch.grid_dim()[0] * self.spec.rows_per_cta
        for pad in cutlass.range(mSlot[total - 1] + 1 + row, slots, threads, unroll=1):
            mLSElog2[head, pad] = Float32.inf
            mDPsum[head, pad] = Float32(0.0)
