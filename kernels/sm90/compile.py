"""Compile the sm90 forward kernel on fake tensors and cache it by its `FwdSpec`.

Fake tensors with symbolic extents make one compiled kernel serve every sequence length, batch
and head count; CuTe DSL's own disk cache (CUTE_DSL_CACHE_DIR) keeps the result across
processes. Compiling needs no GPU: with CUTE_DSL_ARCH=sm_90a it runs on any machine.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from kernels.sm90.fwd_sm90 import FlashAttentionForwardSm90
from kernels.sm90.spec import FwdSpec

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def fake_arguments(spec: FwdSpec):
    """Fake tensors standing for (q, k, v, out, lse, cu_q, cu_k, [block-sparse five])."""
    dtype = _DTYPES[spec.dtype]
    d = spec.head_dim
    total_q, total_k, heads, heads_kv = (cute.sym_int() for _ in range(4))
    # Row strides are symbolic so q/k/v may be views (e.g. slices of a packed qkv tensor).
    def seq_head_dim(total, nheads):
        return make_fake_tensor(
            dtype, (total, nheads, d),
            stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
            assumed_align=16)
    q = seq_head_dim(total_q, heads)
    k = seq_head_dim(total_k, heads_kv)
    v = seq_head_dim(total_k, heads_kv)
    o = make_fake_compact_tensor(dtype, (total_q, heads, d), stride_order=(2, 1, 0),
                                 assumed_align=16)
    lse = make_fake_compact_tensor(cutlass.Float32, (heads, total_q), stride_order=(1, 0),
                                   assumed_align=4)
    num_seqs = cute.sym_int()
    cu_q = make_fake_compact_tensor(cutlass.Int32, (num_seqs,), assumed_align=4)
    cu_k = make_fake_compact_tensor(cutlass.Int32, (num_seqs,), assumed_align=4)
    sparse = (None,) * 5
    if spec.block_sparse:
        rows, sheads, kf, km = (cute.sym_int() for _ in range(4))
        sparse = (
            make_fake_compact_tensor(cutlass.Int32, (rows, sheads), stride_order=(1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (rows, sheads, kf), stride_order=(2, 1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (rows, sheads), stride_order=(1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (rows, sheads, km), stride_order=(2, 1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (num_seqs,), assumed_align=4),
        )
    return (q, k, v, o, lse, cu_q, cu_k), sparse


@functools.lru_cache(maxsize=None)
def compile_forward(spec: FwdSpec):
    """The compiled kernel for `spec` (in-memory cache on top of CuTe DSL's disk cache)."""
    tensors, sparse = fake_arguments(spec)
    kernel = FlashAttentionForwardSm90(spec)
    return cute.compile(
        kernel, *tensors, cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1),
        cutlass.Int32(0), cutlass.Int32(0), *sparse, make_fake_stream(),
    )
