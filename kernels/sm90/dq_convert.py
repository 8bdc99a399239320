"""The fused backward's dQ out of its float32 accumulator, in CuTe DSL: dQ = scale x the
accumulator's rows, gathered from the 64-row query tile layout (H, P, D) that the backward
kernel reduces into (kernels/sm90/backward.py `QueryTiles`) to the rows of q (T, H, D) in q's
type, or added into the values a given dq holds (nsa()'s running dq).

One pass: each row's D float32 are read as 16-byte vectors by D/4 adjacent lanes and written
as D/4 8-byte vectors. The torch version it replaces (an index gather, a scale and a cast in
row chunks) made three passes over float32 copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.layouts import with_row_strides_divisible

_THREADS = 128
_VECTOR = 4  # float32 elements per 16-byte load


@dataclass(frozen=True)
class DqConvertSpec:
    """The compile key of `DqConvert`."""
    dtype: str        # "bfloat16" | "float16": dq's type
    head_dim: int     # 64 | 128
    accumulate: bool  # add into dq's values instead of overwriting them


class DqConvert:
    rows_per_cta = 64

    def __init__(self, spec: DqConvertSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        self.lanes_per_row = spec.head_dim // _VECTOR
        assert 32 % self.lanes_per_row == 0 or self.lanes_per_row % 32 == 0
        self.rows_per_pass = _THREADS // self.lanes_per_row

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,  # (H, P, D) float32
        mSlot: cute.Tensor,   # (T,) int32: the row's slot in the tile layout
        mdQ: cute.Tensor,     # (T, H, D) out (and in, with `accumulate`)
        scale: Float32,
        stream: cuda.CUstream,
    ):
        mdQacc = with_row_strides_divisible(mdQacc, _VECTOR)  # proves the 16-byte loads
        mdQ = with_row_strides_divisible(mdQ, _VECTOR)       # and the 8-byte stores aligned
        total = cute.size(mdQ.shape[0])
        self.kernel(mdQacc, mSlot, mdQ, scale).launch(
            grid=((total + self.rows_per_cta - 1) // self.rows_per_cta,
                  cute.size(mdQ.shape[1]), 1),
            block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mSlot: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, _ = cute.arch.block_idx()
        total = cute.size(mdQ.shape[0])
        chunk = tidx % self.lanes_per_row
        for p in cutlass.range_constexpr(self.rows_per_cta // self.rows_per_pass):
            row = (row_block * self.rows_per_cta + p * self.rows_per_pass
                   + tidx // self.lanes_per_row)
            if row < total:
                slot = mSlot[row]
                r_acc = cute.make_rmem_tensor(cute.make_layout(_VECTOR), Float32)
                cute.autovec_copy(
                    cute.local_tile(mdQacc[head, slot, None], (_VECTOR,), (chunk,)), r_acc)
                g_out = cute.local_tile(mdQ[row, head, None], (_VECTOR,), (chunk,))
                values = r_acc.load() * scale
                r_out = cute.make_rmem_tensor(cute.make_layout(_VECTOR), self.dtype)
                if cutlass.const_expr(self.spec.accumulate):
                    cute.autovec_copy(g_out, r_out)
                    values = values + r_out.load().to(Float32)
                r_out.store(values.to(self.dtype))
                cute.autovec_copy(r_out, g_out)
