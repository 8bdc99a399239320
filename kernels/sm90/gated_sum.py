"""out = sum_i g[:, :, c_i] * o_i in one pass: the gated combination of NSA's branch outputs.

Each o_i is a (T, H, D) bf16/fp16 branch output, g a (T, H, G) float32 gate tensor and c_i the
gate column of term i. The sum runs in float32 and is rounded once, as the torch path
(`kernels.gated_sum`, an fp32 accumulator updated term by term) does; the difference is the
memory traffic. The torch path reads and writes a (T, H, D) float32 accumulator once per term
through mixed-dtype, broadcasting elementwise kernels: H100, 64K tokens x 32 heads x 128,
3 terms, 4.65 ms in the forward profile (docs/history.md, section 2). This kernel reads each
term once and writes the result once in its dtype (about 2 GiB there: 0.87 ms, 2.5 TB/s), into
the first term's storage, so no new (T, H, D) buffer is allocated either.

Layout: every tensor is viewed flat; one thread takes 8 consecutive elements (one 16-byte
load per term, one store), which all lie in one (t, h) row since D is a multiple of 8. The row
is chunk // (D / 8), a division by a compile-time constant; the row's gates are scalar loads
shared by the row's D / 8 threads through L1.

The backward of one term (`GatedSumBackwardSm90`), for NSA's backward where a branch's
gradient arrives as dO: dL/dg[:, :, c] = rowsum(dO * o) into a float32 (T, H, G) tensor, and
dL/do = g[:, :, c] * dO in the input type, in one pass that reads dO and o once. A product with
dO == 0 counts as exactly 0, so a NaN or Inf in a row the loss does not depend on stays out of
dL/dg. The torch code it replaces (nsa/function.py) moved about 6.7 GB per branch at 64K
tokens, H=32, D=128, through float32 temporaries; this pass moves 1.5 GB. Without
`term_gradient` it writes dL/dg alone (1 GB there): nsa()'s backward on the sm90 kernels folds
g into the attention backward's lse and never needs g * dO. Then one pass takes up to three
terms (the branch outputs nsa() kept) and reads dO once for all: a pass per branch read dO
three times, 2 GiB each at 256K tokens, H=32 (3.18 ms of the step's gate passes, H200).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.row_dot import lane_group_sum, masked_dot

VECTOR = 8  # elements per thread: 16 bytes of bf16/fp16
THREADS = 256
MAX_TERMS = 3
BACKWARD_MIN_LANES = 8  # the backward's lanes per row: a power of two dividing D / 8
BACKWARD_ROWS_PER_CTA = 64
LAUNCH_ELEMENTS = 2 ** 31 - 1  # the most elements of a tensor one launch indexes (32-bit)


@dataclass(frozen=True)
class GatedSumSpec:
    """What a compiled build fixes: dtype, head dim (the row length), the gate columns of the
    terms (their number, too) and the gate tensor's row length."""
    dtype: str
    head_dim: int
    columns: tuple[int, ...]
    gate_width: int

    def __post_init__(self):
        if self.dtype not in CUTLASS_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {sorted(CUTLASS_DTYPES)})")
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
        self.dtype = CUTLASS_DTYPES[spec.dtype]

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


@dataclass(frozen=True)
class GatedSumBackwardSpec:
    """What a compiled backward build fixes: dtype, head dim, the terms' gate columns (their
    number, too), the gate tensor's row length and whether it writes the term's gradient g * dO
    (`term_gradient`, one term only; without it only the gate gradients: nsa()'s backward on
    the sm90 kernels folds the gate into the attention backward's lse instead, see
    nsa/function.py). Several terms share one read of dO: their gate gradients in one pass."""
    dtype: str
    head_dim: int
    columns: tuple[int, ...]
    gate_width: int
    term_gradient: bool = True

    def __post_init__(self):
        if self.dtype not in CUTLASS_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {sorted(CUTLASS_DTYPES)})")
        if self.head_dim % (VECTOR * BACKWARD_MIN_LANES):
            raise ValueError(f"head_dim {self.head_dim} (expected a multiple of "
                             f"{VECTOR * BACKWARD_MIN_LANES})")
        if not 1 <= len(self.columns) <= (1 if self.term_gradient else MAX_TERMS):
            raise ValueError(f"columns {self.columns} (1 term with term_gradient, else 1 to "
                             f"{MAX_TERMS})")
        if any(not 0 <= c < self.gate_width for c in self.columns):
            raise ValueError(f"columns {self.columns} outside a gate row of {self.gate_width}")


class GatedSumBackwardSm90:
    """The backward of 1-3 terms for one `GatedSumBackwardSpec`; called with flat tensors
    (gates, d_gates, dout, term_0, term_1, term_2, d_term), d_gates written at the spec's
    columns only; missing terms are None, and gates and d_term are None without
    `term_gradient`.

    Each (t, h) row of D elements is read by `lanes` adjacent threads, 16 bytes at a time
    (D / 8 / lanes vectors each, interleaved so a warp's loads stay contiguous), dO once for
    every term; the lanes add their partial dot products with butterfly shuffles. A CTA of 128
    threads covers BACKWARD_ROWS_PER_CTA rows."""

    threads = 128

    def __init__(self, spec: GatedSumBackwardSpec):
        self.spec = spec
        self.dtype = CUTLASS_DTYPES[spec.dtype]
        vectors = spec.head_dim // VECTOR
        self.lanes = 16 if vectors % 16 == 0 else BACKWARD_MIN_LANES
        self.vectors_per_lane = vectors // self.lanes
        self.rows_per_pass = self.threads // self.lanes

    @cute.jit
    def __call__(self, gates: cute.Tensor | None, d_gates: cute.Tensor, dout: cute.Tensor,
                 term0: cute.Tensor, term1: cute.Tensor | None, term2: cute.Tensor | None,
                 d_term: cute.Tensor | None, stream):
        rows = cute.size(dout) // self.spec.head_dim
        term1_vectors, term2_vectors, d_term_vectors = None, None, None
        if const_expr(term1 is not None):
            term1_vectors = cute.zipped_divide(term1, (VECTOR,))
        if const_expr(term2 is not None):
            term2_vectors = cute.zipped_divide(term2, (VECTOR,))
        if const_expr(d_term is not None):
            d_term_vectors = cute.zipped_divide(d_term, (VECTOR,))
        self.kernel(gates, d_gates, cute.zipped_divide(dout, (VECTOR,)),
                    cute.zipped_divide(term0, (VECTOR,)), term1_vectors, term2_vectors,
                    d_term_vectors, rows).launch(
            grid=[cute.ceil_div(rows, BACKWARD_ROWS_PER_CTA), 1, 1], block=[self.threads, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, gates: cute.Tensor | None, d_gates: cute.Tensor, dout: cute.Tensor,
               term0: cute.Tensor, term1: cute.Tensor | None, term2: cute.Tensor | None,
               d_term: cute.Tensor | None, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % self.lanes
        vectors_per_row = self.spec.head_dim // VECTOR
        columns = self.spec.columns
        for p in cutlass.range_constexpr(BACKWARD_ROWS_PER_CTA // self.rows_per_pass):
            row = bidx * BACKWARD_ROWS_PER_CTA + p * self.rows_per_pass + tidx // self.lanes
            dot0, dot1, dot2 = Float32(0.0), Float32(0.0), Float32(0.0)
            if row < rows:
                gate = Float32(0.0)
                if const_expr(d_term is not None):
                    gate = gates[row * self.spec.gate_width + columns[0]]
                for j in cutlass.range_constexpr(self.vectors_per_lane):
                    vector = row * vectors_per_row + j * self.lanes + lane
                    d = dout[(None, vector)].load().to(Float32)
                    dot0 = dot0 + masked_dot(d, term0[(None, vector)].load().to(Float32))
                    if const_expr(term1 is not None):
                        dot1 = dot1 + masked_dot(d, term1[(None, vector)].load().to(Float32))
                    if const_expr(term2 is not None):
                        dot2 = dot2 + masked_dot(d, term2[(None, vector)].load().to(Float32))
                    if const_expr(d_term is not None):
                        d_term[(None, vector)].store((d * gate).to(self.dtype))
            # Every lane: the row test is per lane.
            dot0 = lane_group_sum(dot0, self.lanes)
            if const_expr(term1 is not None):
                dot1 = lane_group_sum(dot1, self.lanes)
            if const_expr(term2 is not None):
                dot2 = lane_group_sum(dot2, self.lanes)
            if (row < rows) & (lane == 0):
                gate_row = row * self.spec.gate_width
                d_gates[gate_row + columns[0]] = dot0
                if const_expr(term1 is not None):
                    d_gates[gate_row + columns[1]] = dot1
                if const_expr(term2 is not None):
                    d_gates[gate_row + columns[2]] = dot2


def fake_arguments(spec: GatedSumSpec):
    """Fake flat tensors (gates, out, o_0..o_2) for a CPU build (CUTE_DSL_ARCH=sm_90a)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    elements = cute.sym_int()  # as at run time: nothing known of its divisibility
    gates = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    tensors = [make_fake_compact_tensor(CUTLASS_DTYPES[spec.dtype], (elements,), assumed_align=16)
               for _ in range(1 + len(spec.columns))]
    terms = tensors[1:] + [None] * (MAX_TERMS - len(spec.columns))
    return gates, tensors[0], *terms


def fake_backward_arguments(spec: GatedSumBackwardSpec):
    """Fake flat tensors (gates, d_gates, dout, term_0..term_2, d_term) for a CPU build."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    gate_elements, elements = cute.sym_int(), cute.sym_int()
    gates, d_gates = (make_fake_compact_tensor(Float32, (gate_elements,), assumed_align=4)
                      for _ in range(2))
    dout, *terms = (make_fake_compact_tensor(CUTLASS_DTYPES[spec.dtype], (elements,),
                                             assumed_align=16)
                    for _ in range(1 + len(spec.columns)))
    terms += [None] * (MAX_TERMS - len(terms))
    d_term = None
    if spec.term_gradient:
        d_term = make_fake_compact_tensor(CUTLASS_DTYPES[spec.dtype], (elements,),
                                          assumed_align=16)
    else:
        gates = None
    return gates, d_gates, dout, *terms, d_term


def compile_gated_sum_on_fake_tensors(spec: GatedSumSpec | GatedSumBackwardSpec):
    """`spec` (the sum or a term's backward) built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    kernel, arguments = _KERNELS[type(spec)]
    return cute.compile(kernel(spec), *arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches on (T, H, D) tensors, compiling each spec once
# per process.
# ------------------------------------------------------------------------------------------------


def can_run(like, backward: bool = False) -> tuple[bool, str]:
    """(ok, reason): whether the kernel sums terms shaped like `like` (with `backward`: takes a
    term's backward), the device already checked."""
    dtype = str(like.dtype).removeprefix("torch.")
    if dtype not in CUTLASS_DTYPES:
        return False, f"dtype {like.dtype} (the kernel takes {'/'.join(CUTLASS_DTYPES)})"
    multiple = VECTOR * BACKWARD_MIN_LANES if backward else VECTOR
    if like.dim() != 3 or like.shape[-1] % multiple:
        return False, (f"shape {tuple(like.shape)} (the kernel takes (T, H, D), "
                       f"D % {multiple} == 0)")
    if like.numel() == 0:
        return False, "no elements (a kernel grid cannot be empty)"
    return True, "sm90 CuTe DSL kernel"


_KERNELS = {GatedSumSpec: (GatedSumSm90, fake_arguments),
            GatedSumBackwardSpec: (GatedSumBackwardSm90, fake_backward_arguments)}


def _launch(spec, args, like):
    """Compile `spec` once per process and launch it on torch tensors `args`."""
    from kernels.sm90.launch import launch_on_current_stream

    kernel, fake = _KERNELS[type(spec)]
    launch_on_current_stream(kernel, spec, fake, args, like.device)


def run(terms, columns, gates, into=None):
    """sum_i gates[..., columns[i]] * terms[i], written into `into` (a contiguous tensor like
    terms[0]) or, without it, into terms[0]; returned.

    terms: 1-3 contiguous, 16-byte aligned (T, H, D) bf16/fp16 tensors of one shape and dtype;
    gates: a contiguous (T, H, G) float32 tensor; the caller (`kernels.gated_sum.GatedSum`) has
    made sure.
    """
    first = terms[0]
    spec = GatedSumSpec(str(first.dtype).removeprefix("torch."), first.shape[-1],
                        tuple(columns), gates.shape[-1])
    tensors = [gates, first if into is None else into, *terms]
    tensors += [None] * (MAX_TERMS - len(terms))
    for flat in _launch_chunks(tensors, first):
        _launch(spec, flat, first)
    return first if into is None else into


def run_backward(dout, terms, gates, columns, d_gates, term_gradient=True):
    """rowsum(dout * terms[i]) written into d_gates[..., columns[i]] (0 where dout is 0), dout
    read once for all terms, and, with `term_gradient` (one term), gates[..., columns[0]] *
    dout returned in dout's dtype (else None). dout, terms: contiguous, 16-byte aligned
    (T, H, D) bf16/fp16 tensors (1-3 terms); gates, d_gates: contiguous (T, H, G) float32 (the
    caller, `kernels.gated_sum`, has made sure)."""
    import torch

    spec = GatedSumBackwardSpec(str(dout.dtype).removeprefix("torch."), dout.shape[-1],
                                tuple(columns), d_gates.shape[-1], term_gradient)
    d_term = torch.empty_like(dout) if term_gradient else None
    tensors = [gates if term_gradient else None, d_gates, dout, *terms]
    tensors += [None] * (MAX_TERMS - len(terms)) + [d_term]
    for flat in _launch_chunks(tensors, dout):
        _launch(spec, flat, dout)
    return d_term


def _launch_chunks(tensors, like):
    """Per launch, the flat views of `tensors` (contiguous tensors whose leading dims are like's
    (T, H) rows; None stays None) over one range of rows, each launch at most LAUNCH_ELEMENTS
    elements of `like`: the kernels index their flat tensors in 32 bits (q at 1M tokens, H=32,
    D=128 has 2**32). A range starts at a multiple of D elements: 16-byte aligned. One range
    (the usual case) passes each tensor's flat view itself: no slices, one view op a tensor."""
    flat = [None if t is None else t.view(-1) for t in tensors]
    row_elements = like.shape[-1]
    rows = like.numel() // row_elements
    per_launch = LAUNCH_ELEMENTS // row_elements
    if rows <= per_launch:
        return [flat]
    widths = [None if t is None else t.numel() // rows for t in flat]
    return [[None if t is None else t[r0 * w:min(r0 + per_launch, rows) * w]
             for t, w in zip(flat, widths)] for r0 in range(0, rows, per_launch)]
