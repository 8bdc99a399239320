"""out = sum_i g[:, :, c_i] * o_i in one pass: the gated combination of NSA's branch outputs.

Each o_i is a (T, H, D) bf16/fp16 branch output, g a (T, H, G) float32 gate tensor and c_i the
gate column of term i. The sum runs in float32 and is rounded once, as the torch path
(`kernels.gated_sum`, an fp32 accumulator updated term by term) does; the difference is the
memory traffic. The torch path reads and writes a (T, H, D) float32 accumulator once per term
through mixed-dtype, broadcasting elementwise kernels: H100, 64K tokens x 32 heads x 128,
3 terms, 4.65 ms in the forward profile (FINDINGS section 2, session 9). This kernel reads each
term once and writes the result once in its dtype (about 2 GiB there: 0.87 ms, 2.5 TB/s), into
the first term's storage, so no new (T, H, D) buffer is allocated either.

Layout: every tensor is viewed flat; one thread takes 8 consecutive elements (one 16-byte
load per term, one store), which all lie in one (t, h) row since D is a multiple of 8. The row
is chunk // (D / 8), a division by a compile-time constant; the row's gates are scalar loads
shared by the row's D / 8 threads through L1.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

VECTOR = 8  # elements per thread: 16 bytes of bf16/fp16
THREADS = 256
MAX_TERMS = 3

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


@dataclass(frozen=True)
class GatedSumSpec:
    """What a compiled build fixes: dtype, head dim (the row length), the gate columns of the
    terms (their number, too) and the gate tensor's row length."""
    dtype: str
    head_dim: int
    columns: tuple[int, ...]
    gate_width: int

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {sorted(_DTYPES)})")
        if self.head_dim % VECTOR:
            raise ValueError(f"head_dim {self.head_dim} (expected a multiple of {VECTOR})")
        if not 1 <= len(self.columns) <= MAX_TERMS:
            raise ValueError(f"columns {self.columns} (1 to {MAX_TERMS} terms)")
        if any(not 0 <= c < self.gate_width for c in self.columns):
            raise ValueError(f"columns {self.columns} outside a gate row of {self.gate_width}")


class GatedSumSm90:
    """The kernel for one `GatedSumSpec`; called with flat tensors (gates, out, o_0, o_1, o_2)
    where missing terms are None and `out` may be o_0 itself."""

    def __init__(self, spec: GatedSumSpec):
        self.spec = spec
        self.dtype = _DTYPES[spec.dtype]

    @cute.jit
    def __call__(self, gates: cute.Tensor, out: cute.Tensor, o0: cute.Tensor,
                 o1: cute.Tensor | None, o2: cute.Tensor | None, stream):
        chunks = cute.size(out) // VECTOR
        o1_chunks, o2_chunks = None, None
        if const_expr(o1 is not None):
            o1_chunks = cute.zipped_divide(o1, (VECTOR,))
        if const_expr(o2 is not None):
            o2_chunks = cute.zipped_divide(o2, (VECTOR,))
        self.kernel(gates, cute.zipped_divide(out, (VECTOR,)), cute.zipped_divide(o0, (VECTOR,)),
                    o1_chunks, o2_chunks, chunks).launch(
            grid=[cute.ceil_div(chunks, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gates: cute.Tensor, out: cute.Tensor, o0: cute.Tensor,
               o1: cute.Tensor | None, o2: cute.Tensor | None, chunks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunk = bidx * THREADS + tidx
        if chunk < chunks:
            gate_row = chunk // (self.spec.head_dim // VECTOR) * self.spec.gate_width
            columns = self.spec.columns
            total = o0[(None, chunk)].load().to(Float32) * gates[gate_row + columns[0]]
            if const_expr(o1 is not None):
                total = total + o1[(None, chunk)].load().to(Float32) * gates[gate_row + columns[1]]
            if const_expr(o2 is not None):
                total = total + o2[(None, chunk)].load().to(Float32) * gates[gate_row + columns[2]]
            out[(None, chunk)].store(total.to(self.dtype))


def fake_arguments(spec: GatedSumSpec):
    """Fake flat tensors (gates, out, o_0..o_2) for a CPU build (CUTE_DSL_ARCH=sm_90a)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    elements = cute.sym_int()  # as at run time: nothing known of its divisibility
    gates = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    tensors = [make_fake_compact_tensor(_DTYPES[spec.dtype], (elements,), assumed_align=16)
               for _ in range(1 + len(spec.columns))]
    terms = tensors[1:] + [None] * (MAX_TERMS - len(spec.columns))
    return gates, tensors[0], *terms


def compile_gated_sum_on_fake_tensors(spec: GatedSumSpec):
    """`spec` built for sm_90a without a GPU; for build checks (CI)."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(GatedSumSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches on (T, H, D) tensors, compiling each spec once
# per process.
# ------------------------------------------------------------------------------------------------


def can_run(like) -> tuple[bool, str]:
    """(ok, reason): whether the kernel sums terms shaped like `like` (device already checked)."""
    dtype = str(like.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        return False, f"dtype {like.dtype} (the kernel takes {'/'.join(_DTYPES)})"
    if like.dim() != 3 or like.shape[-1] % VECTOR:
        return False, (f"shape {tuple(like.shape)} (the kernel takes (T, H, D), "
                       f"D % {VECTOR} == 0)")
    if like.numel() == 0:
        return False, "no elements (a kernel grid cannot be empty)"
    if like.numel() >= 2 ** 31:
        return False, f"{like.numel()} elements (the kernel indexes 32-bit)"
    return True, "sm90 CuTe DSL kernel"


def run(terms, columns, gates):
    """sum_i gates[..., columns[i]] * terms[i], written into terms[0] and returned.

    terms: 1-3 contiguous, 16-byte aligned (T, H, D) bf16/fp16 tensors of one shape and dtype;
    gates: a contiguous (T, H, G) float32 tensor; the caller (`kernels.GatedSum`) has made sure.
    """
    import torch
    from cutlass.cute.runtime import make_fake_stream

    from kernels.sm90.compile import compiled_once
    from kernels.sm90.forward import _as_cute, _tvm_ffi_available

    first = terms[0]
    spec = GatedSumSpec(str(first.dtype).removeprefix("torch."), first.shape[-1],
                        tuple(columns), gates.shape[-1])
    flat = [t.view(-1) for t in terms] + [None] * (MAX_TERMS - len(terms))
    args = (gates.view(-1), flat[0], *flat)
    if _tvm_ffi_available():
        compiled_once(GatedSumSm90, spec, lambda: (
            *fake_arguments(spec), make_fake_stream(use_tvm_ffi_env_stream=True)),
            tvm_ffi=True)(*args)
        return first
    import cuda.bindings.driver as cuda

    stream = cuda.CUstream(torch.cuda.current_stream(first.device).cuda_stream)
    cute_args = (*(_as_cute(t) for t in args), stream)
    compiled_once(GatedSumSm90, spec, lambda: cute_args)(*cute_args)
    return first
