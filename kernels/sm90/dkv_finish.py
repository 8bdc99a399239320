"""dK and dV of nsa()'s backward from their float32 sums and the compressed keys' row gradients.

The attention branches that read the original keys leave dK and dV as float32 sums; the
compressed branch's gradient reaches the keys through the mean pooling, each row of a block
carrying 1/l of its compressed token's gradient. Expanding that to a float32 tensor of the keys'
shape and adding the branches into it wrote and read the keys' float32 size twice more than
needed; here the expansion is read where it is used, in the conversion every backward makes
anyway: out[t] = sums[t] + row_gradients[row_tokens[t]], rounded once to the input dtype
(`kernels.dkv_sums.finish_dkv`'s torch path computes the same values, bit for bit).

Layout: sums (T, Hkv, D) float32, for dK and dV; row gradients (Tc + 1, Hkv, D) float32, the
last row zeros (the token of rows that feed none: a sequence's incomplete tail block); row
tokens (T,) int64; out (T, Hkv, D) in the input dtype. Every row 16-byte aligned. The grid is
(ceil(T / rows per CTA), Hkv); a CTA's 256 threads take a 4-element vector each, `PASSES`
groups of rows in turn, dK's and dV's cells both.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.layouts import with_row_strides_divisible

THREADS = 256
VECTOR = 4  # elements per thread and row: 16 bytes of float32
PASSES = 4  # row groups per CTA


@dataclass(frozen=True)
class DkvFinishSpec:
    """The compile key: dK/dV's element type and the head dim."""
    dtype: str
    head_dim: int

    def __post_init__(self):
        if self.dtype not in CUTLASS_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {tuple(CUTLASS_DTYPES)})")
        if self.head_dim % VECTOR or THREADS % (self.head_dim // VECTOR):
            raise ValueError(f"head_dim {self.head_dim}: a multiple of {VECTOR} dividing "
                             f"{THREADS * VECTOR}")

    @property
    def rows_per_pass(self) -> int:
        return THREADS * VECTOR // self.head_dim

    @property
    def rows_per_cta(self) -> int:
        return self.rows_per_pass * PASSES


class DkvFinishSm90:
    """The kernel for one `DkvFinishSpec`; called with (dK sums, dV sums, dK row gradients,
    dV row gradients, row tokens, dK, dV)."""

    def __init__(self, spec: DkvFinishSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, dk_sums: cute.Tensor, dv_sums: cute.Tensor, dk_rows: cute.Tensor,
                 dv_rows: cute.Tensor, row_tokens: cute.Tensor, dk: cute.Tensor,
                 dv: cute.Tensor, stream):
        tensors = tuple(with_row_strides_divisible(t, VECTOR)
                        for t in (dk_sums, dv_sums, dk_rows, dv_rows, dk, dv))
        grid = [cute.ceil_div(cute.size(dk.shape[0]), self.spec.rows_per_cta),
                cute.size(dk.shape[1]), 1]
        self.kernel(*tensors, row_tokens).launch(grid=grid, block=[THREADS, 1, 1],
                                                 stream=stream)

    @cute.kernel
    def kernel(self, dk_sums: cute.Tensor, dv_sums: cute.Tensor, dk_rows: cute.Tensor,
               dv_rows: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor,
               row_tokens: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, head, _ = cute.arch.block_idx()
        vectors_per_row = self.spec.head_dim // VECTOR
        vector = tidx % vectors_per_row
        num_rows = cute.size(dk.shape[0])
        dtype = CUTLASS_DTYPES[self.spec.dtype]
        for p in cutlass.range_constexpr(PASSES):
            row = (cta * self.spec.rows_per_cta + p * self.spec.rows_per_pass
                   + tidx // vectors_per_row)
            if row < num_rows:
                token = Int64(row_tokens[row])
                for sums, rows, out in ((dk_sums, dk_rows, dk), (dv_sums, dv_rows, dv)):
                    total = cute.make_rmem_tensor((VECTOR,), Float32)
                    total.store(
                        cute.local_tile(sums[row, head, None], (VECTOR,), (vector,)).load()
                        + cute.local_tile(rows[token, head, None], (VECTOR,), (vector,)).load())
                    cells = cute.make_rmem_tensor((VECTOR,), dtype)
                    cells.store(total.load().to(dtype))
                    cute.local_tile(out[row, head, None], (VECTOR,), (vector,)).store(
                        cells.load())


def fake_arguments(spec: DkvFinishSpec):
    """Fake arguments for a CPU build (CUTE_DSL_ARCH=sm_90a), as the launcher passes them."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    heads = cute.sym_int()

    def rows(dtype, count):
        return make_fake_tensor(dtype, (count, heads, spec.head_dim),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)

    keys, tokens = cute.sym_int(), cute.sym_int()
    dtype = CUTLASS_DTYPES[spec.dtype]
    row_tokens = make_fake_compact_tensor(cutlass.Int64, (keys,), assumed_align=8)
    return (rows(Float32, keys), rows(Float32, keys), rows(Float32, tokens),
            rows(Float32, tokens), row_tokens, rows(dtype, keys), rows(dtype, keys))


def compile_on_fake_tensors(spec: DkvFinishSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(DkvFinishSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side (kernels/dkv_sums.py asks `can_run`, then `run`).
# ------------------------------------------------------------------------------------------------


def can_run(sums, row_gradients, row_tokens, dtype) -> tuple[bool, str]:
    """(ok, reason): whether the kernel finishes these tensors (the device already checked)."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in CUTLASS_DTYPES:
        return False, f"dtype {dtype} (the kernel writes {'/'.join(CUTLASS_DTYPES)})"
    for t in (*sums, *row_gradients):
        if t.dtype != sums[0].dtype or t.dtype.itemsize != 4 or t.dim() != 3:
            return False, "sums and row gradients: float32 (T, Hkv, D) tensors"
        if t.stride(-1) != 1 or any(s % VECTOR for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return False, "rows 16 bytes apart, 16-byte aligned"
    head_dim = sums[0].shape[-1]
    if head_dim % VECTOR or THREADS % (head_dim // VECTOR):
        return False, f"head dim {head_dim}"
    if row_tokens.dtype != torch.int64 or row_tokens.dim() != 1 or row_tokens.stride(0) != 1:
        return False, "row tokens: a contiguous int64 vector"
    if sums[0].numel() == 0:
        return False, "no rows (a kernel grid cannot be empty)"
    return True, "sm90 CuTe DSL kernel"


def run(sums, row_gradients, row_tokens, out) -> None:
    """out (dK, dV) = sums + row_gradients[row_tokens], rounded to out's dtype."""
    from kernels.sm90.launch import launch_on_current_stream

    spec = DkvFinishSpec(str(out[0].dtype).removeprefix("torch."), out[0].shape[-1])
    launch_on_current_stream(DkvFinishSm90, spec, fake_arguments,
                             (*sums, *row_gradients, row_tokens, *out), out[0].device)
