"""The bias's gradient in its own layout and dtype: dbias[s, q, k] = acc[s, k, q], one pass.

The sm90 backward sums dS into a float32 accumulator kept transposed, (slabs, Nk, Nq'), so
that each of a thread's reductions covers two adjacent query rows of one key
(kernels/sm90/score_mod.py). This kernel turns it into the (slabs, Nq, Nk) gradient in the
bias's dtype: a CTA takes 64 keys x 64 query rows, reads them along the query rows (8 bytes a
lane, 256 contiguous bytes a warp), stages them in shared memory (rows padded by one float
against bank conflicts) and writes them along the keys (two keys a lane), converted.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, const_expr

BLOCK = 64  # keys and query rows per CTA
WARPS = 8
PAD = 1  # floats of padding per staged row
OUT_DTYPES = ("bfloat16", "float16", "float32")


def _cutlass_dtype(name: str):
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
            "float32": cutlass.Float32}[name]


@dataclass(frozen=True)
class DbiasTransposeSpec:
    """The compile key: the gradient's dtype (the bias's)."""
    dtype: str

    def __post_init__(self):
        if self.dtype not in OUT_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {OUT_DTYPES})")


class DbiasTransposeSm90:
    """The kernel for one `DbiasTransposeSpec`; called with (acc (S, Nk, Nq') float32, out
    (S, Nq, Nk))."""

    def __init__(self, spec: DbiasTransposeSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, acc: cute.Tensor, out: cute.Tensor, stream):
        # Rows start at even elements (the launcher admits only such strides): pair accesses.
        acc = cute.make_tensor(acc.iterator, cute.make_layout(acc.shape, stride=(
            cute.assume(acc.stride[0], divby=2), cute.assume(acc.stride[1], divby=2), 1)))
        out = cute.make_tensor(out.iterator, cute.make_layout(out.shape, stride=(
            cute.assume(out.stride[0], divby=2), cute.assume(out.stride[1], divby=2), 1)))
        grid = [cute.ceil_div(cute.size(out.shape[2]), BLOCK),
                cute.ceil_div(cute.size(out.shape[1]), BLOCK), cute.size(out.shape[0])]
        self.kernel(acc, out).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                     smem=4 * BLOCK * (BLOCK + PAD) + 16, stream=stream)

    @cute.kernel
    def kernel(self, acc: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        key_block, row_block, slab = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        seqlen_q, seqlen_k = out.shape[1], out.shape[2]
        first_key, first_row = key_block * BLOCK, row_block * BLOCK
        smem = cutlass.memory.SmemAllocator()
        staged = smem.allocate_tensor(Float32, cute.make_layout(
            (BLOCK, BLOCK), stride=(BLOCK + PAD, 1)), byte_alignment=16)

        # Read: warp w takes keys w, w + WARPS, ...; lane l the query rows 2l, 2l + 1.
        row = first_row + 2 * lane
        for step in cutlass.range_constexpr(BLOCK // WARPS):
            key_in_block = step * WARPS + warp
            key = first_key + key_in_block
            if (key < seqlen_k) & (row < seqlen_q):
                pair = cute.make_rmem_tensor((2,), Float32)
                pair.store(cute.local_tile(acc[slab, key, None], (2,), (row // 2,)).load())
                staged[key_in_block, 2 * lane] = pair[0]
                staged[key_in_block, 2 * lane + 1] = pair[1]
        cute.arch.barrier()

        # Write: warp w takes query rows w, w + WARPS, ...; lane l the keys 2l, 2l + 1.
        key = first_key + 2 * lane
        for step in cutlass.range_constexpr(BLOCK // WARPS):
            row_in_block = step * WARPS + warp
            row = first_row + row_in_block
            if (key < seqlen_k) & (row < seqlen_q):
                pair = cute.make_rmem_tensor((2,), out.element_type)
                pair[0] = staged[2 * lane, row_in_block].to(out.element_type)
                pair[1] = staged[2 * lane + 1, row_in_block].to(out.element_type)
                cute.local_tile(out[slab, row, None], (2,), (key // 2,)).store(pair.load())


def fake_arguments(spec: DbiasTransposeSpec):
    """Fake (acc, out) for a CPU build (CUTE_DSL_ARCH=sm_90a), as the launcher passes them:
    every extent and the leading strides dynamic (64-bit), unit last strides."""
    from cutlass.cute.runtime import make_fake_tensor

    slabs, rows, keys = cute.sym_int(), cute.sym_int(), cute.sym_int()
    acc = make_fake_tensor(Float32, (slabs, keys, cute.sym_int()),
                           stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=8)
    element = _cutlass_dtype(spec.dtype)
    out = make_fake_tensor(element, (slabs, rows, keys),
                           stride=(cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=2 * element.width // 8)  # a pair of keys
    return acc, out


def compile_on_fake_tensors(spec: DbiasTransposeSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(DbiasTransposeSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `run` launches (kernels/masked.py).
# ------------------------------------------------------------------------------------------------


def can_run(acc, dtype) -> bool:
    """Whether the kernel writes the (S, Nq, Nk) gradient in `dtype` of acc (S, Nk, Nq'), the
    device checked: float32 acc with even row strides and Nq' even, Nk even (pairs of keys),
    the blocks within the launch grid."""
    import torch

    return (acc.dtype == torch.float32 and acc.dim() == 3 and acc.stride(2) == 1
            and acc.shape[2] % 2 == 0 and acc.shape[1] % 2 == 0 and acc.stride(0) % 2 == 0
            and acc.stride(1) % 2 == 0 and acc.data_ptr() % 8 == 0
            and str(dtype).removeprefix("torch.") in OUT_DTYPES and acc.shape[0] <= 65535
            and -(-acc.shape[2] // BLOCK) <= 65535)


def run(acc, seqlen_q: int, dtype):
    """The (S, seqlen_q, Nk) gradient in `dtype` of acc (S, Nk, Nq' >= seqlen_q) float32, which
    `can_run` accepts."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    out = torch.empty(acc.shape[0], seqlen_q, acc.shape[1], dtype=dtype, device=acc.device)
    if out.numel():
        spec = DbiasTransposeSpec(str(dtype).removeprefix("torch."))
        launch_on_current_stream(DbiasTransposeSm90, spec, fake_arguments, (acc, out),
                                 acc.device)
    return out
