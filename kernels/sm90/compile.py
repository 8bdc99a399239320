"""Compile the sm90 forward kernel, cached by its `FwdSpec`.

Two ways in, one kernel:
- `compiled_forward(spec, args)`: the run-time path. Compiles once per spec with the first
  call's tensors, all of whose extents and strides are marked dynamic, so the result serves every
  sequence length, batch and head count. CuTe DSL's disk cache (CUTE_DSL_CACHE_DIR) keeps it
  across processes.
- `compile_forward_on_fake_tensors(spec)`: compiles with fake tensors and no GPU
  (CUTE_DSL_ARCH=sm_90a); CI uses it to prove every variant builds. Its result is not launched:
  in CuTe DSL 4.8.1 a kernel compiled on fake (T, H, D) tensors bound the row stride wrongly at
  run time whenever H > 1 (see docs/cute_notes.md).
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
    """Fake tensors standing for (q, k, v, out, lse, cu_q, cu_k), (block-sparse five, trace)."""
    dtype = _DTYPES[spec.dtype]
    # The launcher's tensors (forward.py `_as_cute`) have every extent and stride dynamic but
    # the unit stride: (?, ?, ?):(?{i64}, ?{i64}, 1), so nothing is known of their
    # divisibility. The fakes say the same, or a build could pass here and fail on the device
    # (it did: a 32-bit store proven aligned only by a static head-dim stride).
    def seq_head_dim():
        return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(3)),
                                stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)
    q, k, v, o = (seq_head_dim() for _ in range(4))
    lse = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                   stride_order=(1, 0), assumed_align=4)
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
    trace = None
    if spec.trace:
        trace = make_fake_compact_tensor(
            cutlass.Int64, tuple(cute.sym_int() for _ in range(4)), stride_order=(3, 2, 1, 0))
    return (q, k, v, o, lse, cu_q, cu_k), (*sparse, trace)


_COMPILED: dict[tuple[type, object, bool], object] = {}


def compiled_once(kernel_class: type, spec, example_args, tvm_ffi: bool = False):
    """`kernel_class(spec)` compiled on first use with `example_args()` (dynamic-layout cute
    tensors, scalars, stream), then cached in memory by (class, spec, tvm_ffi).

    With `tvm_ffi` the result is called with torch tensors and Python scalars on the current
    stream (apache-tvm-ffi), which costs far less host time per launch than converting every
    argument through DLPack; the example arguments then end with a fake env stream.
    """
    key = (kernel_class, spec, tvm_ffi)
    kernel = _COMPILED.get(key)
    if kernel is None:
        options = "--enable-tvm-ffi" if tvm_ffi else None
        kernel = cute.compile(kernel_class(spec), *example_args(), options=options)
        _COMPILED[key] = kernel
    return kernel


def compiled_forward(spec: FwdSpec, example_args, tvm_ffi: bool = False):
    """The forward kernel for `spec` (`compiled_once`)."""
    return compiled_once(FlashAttentionForwardSm90, spec, example_args, tvm_ffi)


@functools.lru_cache(maxsize=None)
def compile_forward_on_fake_tensors(spec: FwdSpec):
    """Compile `spec` for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a); for build checks."""
    return compile_kernel_on_fake_tensors(FlashAttentionForwardSm90(spec))


def compile_kernel_on_fake_tensors(kernel: FlashAttentionForwardSm90):
    """`kernel` compiled on fake tensors (uncached); the kernel object keeps what its host side
    built, such as `shared_storage`."""
    tensors, sparse = fake_arguments(kernel.spec)
    return cute.compile(
        kernel, *tensors, cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(132), *sparse, make_fake_stream(),
    )


# ---------------------------------------------------------------------------- backward

def fake_backward_arguments(spec):
    """Fake tensors standing for the backward kernel's arguments, in order (the scalars and the
    stream excluded): (q, k, v, dO, lse, dO.O, dQacc, dK, dV, cu_q, cu_k, q tile offsets),
    (list offsets, list index, list mask counts, KV block offsets, forward full count, full
    index, mask count, mask index, row offsets, semaphore, work units)."""
    from cutlass.cute.runtime import make_fake_tensor as fake

    dtype = _DTYPES[spec.dtype]

    def seq_head_dim(element=dtype, align=16):
        return fake(element, tuple(cute.sym_int() for _ in range(3)),
                    stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=align)

    def rows(element, align=4):
        return make_fake_compact_tensor(element, (cute.sym_int(),), assumed_align=align)

    q, k, v, dout = (seq_head_dim() for _ in range(4))
    # `partial_dkv`: dK and dV are float32 accumulators (several CTAs per KV tile).
    dk, dv = (seq_head_dim(cutlass.Float32) if spec.partial_dkv else seq_head_dim()
              for _ in range(2))
    # lse, dO.O: (H, P) with P a multiple of 64 (16-byte aligned rows for TMA).
    lse, dpsum = (fake(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                       stride=(cute.sym_int(64), 1), assumed_align=16) for _ in range(2))
    # `dq_separate`: no dQ accumulator (the query-centric kernel writes dQ).
    dq_acc = None if spec.dq_separate else fake(
        cutlass.Float32, tuple(cute.sym_int() for _ in range(3)),
        stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)
    cu_q, cu_k, q_tiles = (rows(cutlass.Int32) for _ in range(3))
    lists = (None,) * 4
    if spec.block_sparse:
        rk, hs = cute.sym_int(), cute.sym_int()
        lists = (rows(cutlass.Int32), rows(cutlass.Int32),
                 make_fake_compact_tensor(cutlass.Int32, (rk, hs), stride_order=(1, 0)),
                 rows(cutlass.Int32))
    forward_lists = (None,) * 5
    semaphore = None
    if spec.deterministic:
        semaphore = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()),
                                             stride_order=(1, 0))
        if spec.block_sparse:
            r, hs, kf, km = (cute.sym_int() for _ in range(4))
            forward_lists = (
                make_fake_compact_tensor(cutlass.Int32, (r, hs), stride_order=(1, 0)),
                make_fake_compact_tensor(cutlass.Int32, (r, hs, kf), stride_order=(2, 1, 0)),
                make_fake_compact_tensor(cutlass.Int32, (r, hs), stride_order=(1, 0)),
                make_fake_compact_tensor(cutlass.Int32, (r, hs, km), stride_order=(2, 1, 0)),
                rows(cutlass.Int32))
    units = None
    if spec.split_lists:
        units = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), 5), stride_order=(1, 0))
    return ((q, k, v, dout, lse, dpsum, dq_acc, dk, dv, cu_q, cu_k, q_tiles),
            (*lists, *forward_lists, semaphore, units))


def compiled_backward(spec, example_args, tvm_ffi: bool = False):
    """The backward kernel for `spec` (`compiled_once`)."""
    from kernels.sm90.bwd_sm90 import FlashAttentionBackwardSm90

    return compiled_once(FlashAttentionBackwardSm90, spec, example_args, tvm_ffi)


@functools.lru_cache(maxsize=None)
def compile_backward_on_fake_tensors(spec):
    """Compile backward `spec` for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.bwd_sm90 import FlashAttentionBackwardSm90

    return compile_backward_kernel_on_fake_tensors(FlashAttentionBackwardSm90(spec))


def compile_backward_kernel_on_fake_tensors(kernel):
    """Backward `kernel` compiled on fake tensors (uncached); the kernel object keeps what its
    host side built, such as `shared_storage`."""
    tensors, optional = fake_backward_arguments(kernel.spec)
    return cute.compile(
        kernel, *tensors, cutlass.Int32(1), cutlass.Int32(1), cutlass.Float32(1.0),
        cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(0), *optional, make_fake_stream())


# ---------------------------------------------------------------------------- backward dQ

def fake_dq_arguments(spec):
    """Fake tensors standing for the dQ kernel's arguments, in order (the scalars and the
    stream excluded): (q, k, v, dO, lse, dO.O, dQ, cu_q, cu_k, q tile offsets), (the forward's
    full count, full index, mask count, mask index, row offsets)."""
    from cutlass.cute.runtime import make_fake_tensor as fake

    dtype = _DTYPES[spec.dtype]

    def seq_head_dim():
        return fake(dtype, tuple(cute.sym_int() for _ in range(3)),
                    stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)

    q, k, v, dout, dq = (seq_head_dim() for _ in range(5))
    lse, dpsum = (fake(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                       stride=(cute.sym_int(64), 1), assumed_align=16) for _ in range(2))
    cu_q, cu_k, q_tiles = (make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),),
                                                    assumed_align=4) for _ in range(3))
    forward_lists = (None,) * 5
    if spec.block_sparse:
        r, hs, kf, km = (cute.sym_int() for _ in range(4))
        forward_lists = (
            make_fake_compact_tensor(cutlass.Int32, (r, hs), stride_order=(1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (r, hs, kf), stride_order=(2, 1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (r, hs), stride_order=(1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (r, hs, km), stride_order=(2, 1, 0)),
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4))
    return (q, k, v, dout, lse, dpsum, dq, cu_q, cu_k, q_tiles), forward_lists


def compiled_dq(spec, example_args, tvm_ffi: bool = False):
    """The query-centric dQ kernel for `spec` (`compiled_once`)."""
    from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90

    return compiled_once(DqBackwardSm90, spec, example_args, tvm_ffi)


@functools.lru_cache(maxsize=None)
def compile_dq_on_fake_tensors(spec):
    """Compile dQ `spec` for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90

    tensors, forward_lists = fake_dq_arguments(spec)
    return cute.compile(
        DqBackwardSm90(spec), *tensors, cutlass.Int32(1), cutlass.Float32(1.0),
        cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(0), *forward_lists,
        make_fake_stream())


def compiled_preprocess(spec, example_args, tvm_ffi: bool = False):
    """The backward's row-statistics kernel for `spec` (`compiled_once`)."""
    from kernels.sm90.bwd_preprocess import BackwardPreprocess

    return compiled_once(BackwardPreprocess, spec, example_args, tvm_ffi)


@functools.lru_cache(maxsize=None)
def compile_preprocess_on_fake_tensors(spec):
    """Compile the row-statistics kernel for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.bwd_preprocess import BackwardPreprocess, fake_preprocess_arguments

    return cute.compile(BackwardPreprocess(spec), *fake_preprocess_arguments(spec.dtype),
                        make_fake_stream())
