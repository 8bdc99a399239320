"""out[r] = mean of x[starts[r] : starts[r] + counts[r]] in float32: NSA's mean pooling.

Two stages of nsa()'s forward average runs of consecutive rows of a (T, H, D) tensor: the
compression of K and V (every complete block of l rows) and selection's scoring queries (per
128-row query tile, the mean of the 128 rows of q ending at its first row). In torch both were a
gather of the rows, a float32 copy and a reduction: at 64K tokens, H=32, D=128 on an H100 about
1.5 ms of the forward's 7.9 ms of device time for the scoring queries (the whole of q gathered,
masked and summed, in four chunks) and 0.7 ms for the compression (docs/history.md,
2026-11-24). This kernel reads each row once and writes only the means.

Layout: x is a (T, W) view (W = H * D elements per row, row stride 64-bit: q has more than
2**31 elements from 512K tokens on at H=32), out (R, W) float32. CTA (r, c) owns output r and
`threads` 8-element column vectors of it, walked by ROW_LANES threads each: lane j sums rows j,
j + ROW_LANES, ... of the run (one 16-byte load per row; a warp reads 512 contiguous bytes) in
float32, lane 0 adds the other lanes' sums from shared memory in lane order and divides once by
the run's length (a run of no rows gives 0). `pair` averages two tensors over the same runs in
one launch (K and V), grid z picks which. One thread per column vector walking every row kept
too few loads in flight: at 8K tokens, H=32, the scoring queries' 64 MB took 0.035 ms (H200,
2026-11-30), half of what the bytes need.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.layouts import with_row_strides_divisible

VECTOR = 8  # elements per load: 16 bytes of bf16/fp16
MAX_THREADS = 128  # column vectors per CTA
ROW_LANES = 4     # threads per column vector, each summing every ROW_LANES-th row of the run


@dataclass(frozen=True)
class RowMeansSpec:
    """What a compiled build fixes: the input dtype, the row length, per-output run lengths
    (`counted`; else every run has the launch's `count` rows) and two inputs (`pair`)."""
    dtype: str
    width: int
    counted: bool
    pair: bool = False

    def __post_init__(self):
        if self.dtype not in CUTLASS_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {sorted(CUTLASS_DTYPES)})")
        if self.width <= 0 or self.width % VECTOR:
            raise ValueError(f"width {self.width} (expected a positive multiple of {VECTOR})")

    @property
    def vectors(self) -> int:
        return self.width // VECTOR

    @property
    def threads(self) -> int:
        return min(MAX_THREADS, self.vectors)

    @property
    def smem_bytes(self) -> int:
        """The other lanes' float32 sums, 16-byte aligned."""
        return (ROW_LANES - 1) * self.threads * VECTOR * 4 + 16


class RowMeansSm90:
    """The kernel for one `RowMeansSpec`; called with (x0, out0, x1, out1, starts, counts,
    count): x (T, W), out (R, W) float32, starts and counts (R,) int64 (counts None unless
    `counted`), x1/out1 None unless `pair`."""

    def __init__(self, spec: RowMeansSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, x0: cute.Tensor, out0: cute.Tensor, x1: cute.Tensor | None,
                 out1: cute.Tensor | None, starts: cute.Tensor, counts: cute.Tensor | None,
                 count: Int32, stream):
        spec = self.spec
        # Rows start 16 bytes apart (the launcher admits only such strides): vector loads.
        x0, out0 = with_row_strides_divisible(x0, VECTOR), with_row_strides_divisible(out0, 4)
        if const_expr(spec.pair):
            x1 = with_row_strides_divisible(x1, VECTOR)
            out1 = with_row_strides_divisible(out1, 4)
        grid = [cute.size(out0.shape[0]), cute.ceil_div(spec.vectors, spec.threads),
                2 if const_expr(spec.pair) else 1]
        self.kernel(x0, out0, x1, out1, starts, counts, count).launch(
            grid=grid, block=[spec.threads, ROW_LANES, 1], smem=spec.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, x0: cute.Tensor, out0: cute.Tensor, x1: cute.Tensor | None,
               out1: cute.Tensor | None, starts: cute.Tensor, counts: cute.Tensor | None,
               count: Int32):
        tidx, lane, _ = cute.arch.thread_idx()
        r, column_block, which = cute.arch.block_idx()
        vector = column_block * self.spec.threads + tidx
        smem = cutlass.utils.SmemAllocator()
        # Lanes 1.. park their sums here for lane 0: (lane - 1, thread, element).
        lane_sums = smem.allocate_tensor(Float32, cute.make_layout(
            (ROW_LANES - 1, self.spec.threads, VECTOR),
            stride=(self.spec.threads * VECTOR, VECTOR, 1)), byte_alignment=16)
        rows = count
        if const_expr(counts is not None):
            rows = Int32(counts[r])
        start = Int64(starts[r])
        if const_expr(self.spec.pair):
            if which == 0:  # uniform over the CTA: both sides reach the barrier
                self.mean_of_run(x0, out0, r, start, rows, vector, tidx, lane, lane_sums)
            else:
                self.mean_of_run(x1, out1, r, start, rows, vector, tidx, lane, lane_sums)
        else:
            self.mean_of_run(x0, out0, r, start, rows, vector, tidx, lane, lane_sums)

    @cute.jit
    def mean_of_run(self, x: cute.Tensor, out: cute.Tensor, r: Int32, start: Int64, rows: Int32,
                    vector: Int32, tidx: Int32, lane: Int32, lane_sums: cute.Tensor):
        """Every thread of the CTA calls this (it holds the barrier); threads past the row's
        column vectors sum nothing and store nothing."""
        valid = vector < self.spec.vectors
        acc = cute.make_rmem_tensor((VECTOR,), Float32)
        acc.fill(0.0)
        if valid:
            for i in cutlass.range(lane, rows, ROW_LANES, unroll=4):
                row = cute.local_tile(x[start + i, None], (VECTOR,), (vector,))
                acc.store(acc.load() + row.load().to(Float32))
        if lane > 0:
            lane_sums[lane - 1, tidx, None].store(acc.load())
        cute.arch.sync_threads()
        if valid and lane == 0:
            for j in cutlass.range_constexpr(ROW_LANES - 1):
                acc.store(acc.load() + lane_sums[j, tidx, None].load())
            result = cute.local_tile(out[r, None], (VECTOR,), (vector,))
            if rows > 0:
                result.store(acc.load() / Float32(rows))
            else:
                result.store(acc.load())


def fake_arguments(spec: RowMeansSpec):
    """Fake (x0, out0, x1, out1, starts, counts, count) for a CPU build (CUTE_DSL_ARCH=sm_90a),
    as the launcher passes them: rows with a dynamic 64-bit stride, starts and counts strided
    (the compression's starts are a column of its (Tc, l) block rows)."""
    from cutlass.cute.runtime import make_fake_tensor

    def rows_of(element, align):
        return make_fake_tensor(element, (cute.sym_int(), spec.width),
                                stride=(cute.sym_int64(), 1), assumed_align=align)

    outputs = cute.sym_int()

    def per_output():
        return make_fake_tensor(Int64, (outputs,), stride=(cute.sym_int64(),), assumed_align=8)

    x0, x1 = (rows_of(CUTLASS_DTYPES[spec.dtype], 16) for _ in range(2))
    out0, out1 = (make_fake_tensor(Float32, (outputs, spec.width),
                                   stride=(cute.sym_int64(), 1), assumed_align=16)
                  for _ in range(2))
    if not spec.pair:
        x1 = out1 = None
    return x0, out0, x1, out1, per_output(), per_output() if spec.counted else None, Int32(1)


def compile_on_fake_tensors(spec: RowMeansSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(RowMeansSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches on (T, W) views (kernels/row_means.py).
# ------------------------------------------------------------------------------------------------


def can_run(x) -> bool:
    """Whether the kernel averages rows of x, a (T, W) view, the device already checked:
    bf16/fp16, W a multiple of 8, unit column stride, rows 16 bytes apart and aligned."""
    dtype = str(x.dtype).removeprefix("torch.")
    return (dtype in CUTLASS_DTYPES and x.dim() == 2 and x.shape[1] % VECTOR == 0 and x.shape[1] > 0
            and x.stride(1) == 1 and x.stride(0) % VECTOR == 0 and x.data_ptr() % 16 == 0)


def run(rows, starts, counts, count):
    """[means of rows[i]] as float32 (R, W) tensors; rows: one or two (T, W) views that
    `can_run` accepts, of one shape and dtype; starts, counts (R,) integer tensors (counts
    may be None: every run has `count` rows)."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    x0 = rows[0]
    pair = len(rows) == 2
    spec = RowMeansSpec(str(x0.dtype).removeprefix("torch."), x0.shape[1], counts is not None,
                        pair)
    means = [torch.empty(starts.shape[0], x0.shape[1], dtype=torch.float32, device=x0.device)
             for _ in rows]
    starts = starts.to(torch.int64)
    counts = None if counts is None else counts.to(torch.int64)
    launch_on_current_stream(
        RowMeansSm90, spec, fake_arguments,
        (x0, means[0], rows[1] if pair else None, means[1] if pair else None, starts, counts,
         count), x0.device)
    return means
