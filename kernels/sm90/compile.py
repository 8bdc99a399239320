"""Compile the sm90 attention kernels, cached by their specs (`launch.compiled_once`), and the
fake arguments that build them without a GPU.

Two ways in per kernel (shown for the forward; the backward's kernels have the same pair):
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

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.fwd_sm90 import FlashAttentionForwardSm90
from kernels.sm90.launch import compiled_once
from kernels.sm90.spec import FwdSpec


# The launchers' tensors (launch.py `as_cute`) have every extent and stride dynamic but the
# unit stride: (?, ?, ?):(?{i64}, ?{i64}, 1), so nothing is known of their divisibility. The
# fakes say the same, or a build could pass here and fail on the device (it did: a 32-bit store
# proven aligned only by a static head-dim stride).
def fake_seq_head_dim(element):
    """A fake (T, H, D) tensor of `element` as the launchers pass q, k, v, O, dO, dQ, dK, dV."""
    return make_fake_tensor(element, tuple(cute.sym_int() for _ in range(3)),
                            stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)


def fake_int32_vector(length=None):
    """A fake (length,) int32 vector (cu_seqlens, offsets); a new symbolic length if None."""
    length = cute.sym_int() if length is None else length
    return make_fake_compact_tensor(cutlass.Int32, (length,), assumed_align=4)


def fake_forward_lists(num_seqs=None):
    """The forward's block-sparse lists as fakes: full count (R, Hs), full index (R, Hs, Kf),
    mask count, mask index (R, Hs, Km), row block offsets (S + 1,)."""
    rows, heads, kf, km = (cute.sym_int() for _ in range(4))
    return (
        make_fake_compact_tensor(cutlass.Int32, (rows, heads), stride_order=(1, 0)),
        make_fake_compact_tensor(cutlass.Int32, (rows, heads, kf), stride_order=(2, 1, 0)),
        make_fake_compact_tensor(cutlass.Int32, (rows, heads), stride_order=(1, 0)),
        make_fake_compact_tensor(cutlass.Int32, (rows, heads, km), stride_order=(2, 1, 0)),
        fake_int32_vector(num_seqs),
    )


def fake_row_statistics():
    """A fake (H, P) float32 lse log2(e) or dO.O of the backward's 64-row tile layout (P a
    multiple of 64: 16-byte aligned rows for TMA)."""
    return make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                            stride=(cute.sym_int(64), 1), assumed_align=16)


def fake_arguments(spec: FwdSpec):
    """Fake tensors standing for (q, k, v, out, lse, cu_q, cu_k), (block-sparse five, trace,
    screen flag, first query positions)."""
    q, k, v, o = (fake_seq_head_dim(CUTLASS_DTYPES[spec.dtype]) for _ in range(4))
    lse = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                   stride_order=(1, 0), assumed_align=4)
    num_seqs = cute.sym_int()
    cu_q, cu_k = fake_int32_vector(num_seqs), fake_int32_vector(num_seqs)
    sparse = fake_forward_lists(num_seqs) if spec.block_sparse else (None,) * 5
    trace = None
    if spec.trace:
        trace = make_fake_compact_tensor(
            cutlass.Int64, tuple(cute.sym_int() for _ in range(4)), stride_order=(3, 2, 1, 0))
    screen = fake_int32_vector(1) if spec.screen_masked_v else None
    positions = fake_int32_vector(num_seqs) if spec.q_positions else None
    return (q, k, v, o, lse, cu_q, cu_k), (*sparse, trace, screen, positions,
                                           *fake_score_mods(spec))


SCORE_BIAS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
                     "float32": cutlass.Float32}


def fake_score_cells(element):
    """A fake (slabs, Nq, Nk) tensor of mask, bias or dbias cells: 64-bit strides (a per-head
    16K x 16K bias has 2**32 cells), aligned as the launcher passes them (`launch.as_cute`: 16
    bytes for 16-bit elements, 4 otherwise)."""
    return make_fake_tensor(element, tuple(cute.sym_int() for _ in range(3)),
                            stride=(cute.sym_int64(), cute.sym_int64(), 1),
                            assumed_align=16 if element.width == 16 else 4)


def fake_score_mods(spec):
    """Fakes standing for the user mask (slabs, Nq, Nk) uint8, the bias (slabs, Nq, Nk) and the
    (B, H, 2) int32 slab table (kernels/sm90/score_mod.py), None where the spec has none."""
    mask = fake_score_cells(cutlass.Uint8) if spec.score_mask else None
    bias = fake_score_cells(SCORE_BIAS_DTYPES[spec.score_bias]) if spec.score_bias else None
    slabs = (make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), 2),
                                      stride_order=(2, 1, 0))
             if spec.score_mods else None)
    return mask, bias, slabs


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
    (list offsets, list index, list mask counts, KV block offsets, work units, first query
    positions, score mask, bias, slabs, dbias, dbias slots, owned dK, owned dV), None where
    kernels/sm90/backward.py `run` passes None."""
    dtype = CUTLASS_DTYPES[spec.dtype]
    q, k, v, dout = (fake_seq_head_dim(dtype) for _ in range(4))
    # `partial_dkv`, `add_dkv`, `store_dkv_sums`: dK and dV are float32 sums (several CTAs per
    # KV tile, or the caller's).
    dk, dv = (fake_seq_head_dim(cutlass.Float32 if spec.float32_dkv else dtype)
              for _ in range(2))
    lse, dpsum = fake_row_statistics(), fake_row_statistics()
    # `fuses_dq`: the float32 dQ accumulator (H, P, D); else the query-centric kernel writes dQ.
    dq_acc = fake_seq_head_dim(cutlass.Float32) if spec.fuses_dq else None
    cu_q, cu_k, q_tiles = (fake_int32_vector() for _ in range(3))
    lists = (None,) * 4
    if spec.block_sparse:
        lists = (fake_int32_vector(), fake_int32_vector(),
                 make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()),
                                          stride_order=(1, 0)),
                 fake_int32_vector())
    units = None
    if spec.split_lists:
        units = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), 5), stride_order=(1, 0))
    positions = fake_int32_vector() if spec.q_positions else None
    dbias = dbias_slots = None
    if spec.score_bias_grad:
        # float32 sums, or with `score_dbias_stores` the gradient in the bias's dtype; with
        # `score_dbias_tiles` (slots, 128, 128) sums and the (slabs, Tq, Tk) int32 slot map
        dbias = fake_score_cells(SCORE_BIAS_DTYPES[spec.score_bias]
                                 if spec.score_dbias_stores else cutlass.Float32)
        if spec.score_dbias_tiles:
            dbias_slots = fake_score_cells(cutlass.Int32)
    # `owned_dkv_stores`: dK and dV of the units that own their tile, in the input dtype.
    owned = (tuple(fake_seq_head_dim(dtype) for _ in range(2)) if spec.owned_dkv_stores
             else (None, None))
    # `stores_ds`: each list entry's forward slot and the dS^T tiles.
    ds = (fake_int32_vector(), fake_ds_tiles(dtype)) if spec.stores_ds else (None, None)
    return ((q, k, v, dout, lse, dpsum, dq_acc, dk, dv, cu_q, cu_k, q_tiles),
            (*lists, units, positions, *fake_score_mods(spec), dbias, dbias_slots, *owned,
             *ds))


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
    full count, full index, mask count, mask index, row offsets, first query positions, the
    fused dQ sums); dQ None where the kernel stores the sums instead (`stores_sums`)."""
    q, k, v, dout, dq = (fake_seq_head_dim(CUTLASS_DTYPES[spec.dtype]) for _ in range(5))
    if spec.stores_sums:
        dq = None
    lse, dpsum = fake_row_statistics(), fake_row_statistics()
    cu_q, cu_k, q_tiles = (fake_int32_vector() for _ in range(3))
    forward_lists = fake_forward_lists() if spec.block_sparse else (None,) * 5
    positions = fake_int32_vector() if spec.q_positions else None
    sums = None
    if spec.sums_block_cols:
        sums = make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(3)),
                                stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)
    ds = (fake_ds_tiles(CUTLASS_DTYPES[spec.dtype]),) if spec.reads_ds else ()
    return (q, k, v, dout, lse, dpsum, dq, cu_q, cu_k, q_tiles), (*forward_lists, positions,
                                                                   sums, *ds)


def fake_ds_tiles(dtype):
    """The dS tiles of `BwdSpec.stores_ds` / `DqSpec.reads_ds`: (tiles, 4096)."""
    from kernels.sm90.spec import DS_TILE_ELEMENTS

    return make_fake_compact_tensor(dtype, (cute.sym_int(), DS_TILE_ELEMENTS),
                                    stride_order=(1, 0), assumed_align=16)


def dq_kernel_class(spec):
    """The dQ kernel of `spec`: the query-centric recompute, or dQ from stored dS tiles."""
    if spec.reads_ds:
        from kernels.sm90.bwd_dq_from_ds import DqFromDsSm90

        return DqFromDsSm90
    from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90

    return DqBackwardSm90


def compiled_dq(spec, example_args, tvm_ffi: bool = False):
    """The dQ kernel for `spec` (`compiled_once`)."""
    return compiled_once(dq_kernel_class(spec), spec, example_args, tvm_ffi)


@functools.lru_cache(maxsize=None)
def compile_dq_on_fake_tensors(spec):
    """Compile dQ `spec` for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    tensors, optional = fake_dq_arguments(spec)
    return cute.compile(
        dq_kernel_class(spec)(spec), *tensors, cutlass.Int32(1), cutlass.Float32(1.0),
        cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(0), *optional,
        make_fake_stream())


def compiled_preprocess(spec, example_args, tvm_ffi: bool = False):
    """The backward's row-statistics kernel for `spec` (`compiled_once`)."""
    from kernels.sm90.bwd_preprocess import BackwardPreprocess

    return compiled_once(BackwardPreprocess, spec, example_args, tvm_ffi)


def fake_preprocess_arguments(spec):
    """Fake tensors standing for the row-statistics kernel's arguments (the stream excluded):
    O, dO (T, H, D), lse (H, T) float32, the rows' slots (T,) int32, lse log2(e) and dO.O."""
    o, dout = (fake_seq_head_dim(CUTLASS_DTYPES[spec.dtype]) for _ in range(2))
    lse = make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                           stride=(cute.sym_int(), 1), assumed_align=4)
    return (o, dout, lse, fake_int32_vector(), fake_row_statistics(), fake_row_statistics())


def fake_gate_fold_arguments(spec):
    """Fake tensors and scalar standing for `GateFoldedStatistics`' arguments (the stream
    excluded): row dots (H, T) float32 of any strides, lse (H, T) float32, the gates (T, H, B)
    float32, the gate column, the rows' slots (T,) int32, lse log2(e) and dO.O (H, P)."""
    def heads_by_rows(unit_columns: bool):
        return make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                stride=(cute.sym_int(), 1 if unit_columns else cute.sym_int()),
                                assumed_align=4)

    gates = make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(3)),
                             stride=(cute.sym_int(), cute.sym_int(), 1), assumed_align=4)
    return (heads_by_rows(False), heads_by_rows(True), gates, cutlass.Int32(0),
            fake_int32_vector(), fake_row_statistics(), fake_row_statistics())


def compiled_dq_convert(spec, example_args, tvm_ffi: bool = False):
    """The fused backward's dQ conversion kernel for `spec` (`compiled_once`)."""
    from kernels.sm90.dq_convert import BackwardDqConvert

    return compiled_once(BackwardDqConvert, spec, example_args, tvm_ffi)


def fake_dq_convert_arguments(spec):
    """Fake tensors and scalar standing for the dQ conversion's arguments (the stream
    excluded): the float32 accumulator (H, P, D), the sequences' first query tiles and
    cu_seqlens (S+1,) int32, dQ (T, H, D), the softmax scale."""
    acc = make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(3)),
                           stride=(cute.sym_int(64), cute.sym_int(64), 1), assumed_align=16)
    num_seqs = cute.sym_int()
    return (acc, fake_int32_vector(num_seqs), fake_int32_vector(num_seqs),
            fake_seq_head_dim(CUTLASS_DTYPES[spec.dtype]), cutlass.Float32(1.0))


@functools.lru_cache(maxsize=None)
def compile_dq_convert_on_fake_tensors(spec):
    """Compile the dQ conversion kernel for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.dq_convert import BackwardDqConvert

    return cute.compile(BackwardDqConvert(spec), *fake_dq_convert_arguments(spec),
                        make_fake_stream())


@functools.lru_cache(maxsize=None)
def compile_preprocess_on_fake_tensors(spec):
    """Compile the row-statistics kernel for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.bwd_preprocess import BackwardPreprocess

    return cute.compile(BackwardPreprocess(spec), *fake_preprocess_arguments(spec),
                        make_fake_stream())


@functools.lru_cache(maxsize=None)
def compile_gate_fold_on_fake_tensors(spec):
    """Compile the gate-folding row statistics for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    from kernels.sm90.bwd_preprocess import GateFoldedStatistics

    return cute.compile(GateFoldedStatistics(spec), *fake_gate_fold_arguments(spec),
                        make_fake_stream())
