"""The bias gradient's float32 sums, touched only in the tiles a row can see.

The sm90 backward sums dS into a float32 (slabs, Nq, Nk) tensor by reductions (several heads or
batch entries add into one cell of a shared bias) and the result is that tensor in the bias's
dtype. Zeroing the whole float32 tensor and converting the whole of it cost 0.26 ms and 0.41 ms
at 16K x 16K on an H200, more than the attention itself under a narrow window
(docs/history.md, 2026-11-29). Only the tiles some list visits ever receive a sum: this kernel
zeroes the float32 sums of those tiles alone before the backward ("zero"), and after it writes
the output whole, the converted sums of those tiles and zeros everywhere else ("convert"), so
the float32 cells of the other tiles are never read or written. Where the backward stores dS
into the gradient itself (`BwdSpec.score_dbias_stores`: a slab per batch entry and query head,
nothing to sum) there are no sums: "zero_unlisted" writes zeros in the tiles no list visits and
leaves the others to the backward.

Where the backward sums into the visited tiles' sums alone (`BwdSpec.score_dbias_tiles`: a
(slots, 128, 128) float32 tensor, zeroed whole, and an int32 map of each tile's slot),
"convert_slots" writes the gradient from them.

Layout: listed (S, Tq, Tk) int8, nonzero where some list of the slab's heads visits the 128 x
128 tile ("convert_slots": int32, the tile's slot in the sums or -1); sums (S, Nq, Nk) float32
("convert_slots": (slots, 128, 128)) and out (S, Nq, Nk) in the bias's dtype ("zero" passes
the sums as out), 64-bit strides, every row 16 bytes apart in sums and 8 in a 16-bit out (Nk
a multiple of 4: a 4-element vector is in or out whole). A CTA takes one tile; its warps take
every WARPS-th row, a lane one 4-element vector of the row.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.layouts import with_row_strides_divisible

TILE = 128
WARPS = 8
VECTOR = 4  # elements per lane: 16 bytes of float32, TILE / 32 lanes
MODES = ("zero", "convert", "zero_unlisted", "convert_slots")
OUT_DTYPES = ("float32", "bfloat16", "float16")
MAX_GRID_YZ = 65535


def _cutlass_dtype(name: str):
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
            "float32": cutlass.Float32}[name]


@dataclass(frozen=True)
class DbiasTilesSpec:
    """The compile key: the pass and the output's element type ("zero": float32, the sums;
    "zero_unlisted": the gradient's, which stands for the sums too)."""
    mode: str
    dtype: str = "float32"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} (expected one of {MODES})")
        if self.dtype not in OUT_DTYPES or (self.mode == "zero" and self.dtype != "float32"):
            raise ValueError(f"dtype {self.dtype!r} for mode {self.mode!r}")


class DbiasTilesSm90:
    """The kernel for one `DbiasTilesSpec`; called with (listed, sums, out)."""

    def __init__(self, spec: DbiasTilesSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, listed: cute.Tensor, sums: cute.Tensor, out: cute.Tensor, stream):
        # Rows start 16 bytes apart in the sums, 4 elements apart in the output (the launcher
        # admits only such strides): the vectors' loads and stores are provably aligned.
        sums = with_row_strides_divisible(sums, VECTOR)
        out = with_row_strides_divisible(out, VECTOR)
        grid = [cute.size(listed.shape[2]), cute.size(listed.shape[1]),
                cute.size(listed.shape[0])]
        self.kernel(listed, sums, out).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                              stream=stream)

    @cute.kernel
    def kernel(self, listed: cute.Tensor, sums: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tile_col, tile_row, slab = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        key = tile_col * TILE + lane * VECTOR
        seqlen_q, seqlen_k = out.shape[1], out.shape[2]
        entry = Int32(listed[slab, tile_row, tile_col])
        visited = entry != Int32(0)
        if const_expr(self.spec.mode == "convert_slots"):
            visited = entry >= Int32(0)
        if key < seqlen_k:
            for step in cutlass.range_constexpr(TILE // WARPS):
                row = tile_row * TILE + step * WARPS + warp
                if row < seqlen_q:
                    if const_expr(self.spec.mode == "convert_slots"):
                        # The tile's slot (`entry`) holds the row at its own row and vector.
                        self.convert_vector(visited, sums[entry, row - tile_row * TILE, None],
                                            lane, out[slab, row, None], key // VECTOR)
                    else:
                        self.row_vector(visited, sums, out, slab, row, key // VECTOR)

    @cute.jit
    def row_vector(self, visited, sums: cute.Tensor, out: cute.Tensor, slab: Int32, row: Int32,
                   vector: Int32):
        """One lane's 4 cells of one row."""
        if const_expr(self.spec.mode != "convert"):
            # "zero" clears a visited tile's sums, "zero_unlisted" the gradient's tiles that no
            # list visits.
            cells, clear = sums, visited
            if const_expr(self.spec.mode == "zero_unlisted"):
                cells, clear = out, not visited
            if clear:
                zeros = cute.make_rmem_tensor((VECTOR,), _cutlass_dtype(self.spec.dtype))
                zeros.fill(0.0)
                cute.local_tile(cells[slab, row, None], (VECTOR,), (vector,)).store(zeros.load())
        else:
            self.convert_vector(visited, sums[slab, row, None], vector, out[slab, row, None],
                                vector)

    @cute.jit
    def convert_vector(self, visited, source: cute.Tensor, source_vector: Int32,
                       target: cute.Tensor, target_vector: Int32):
        """Vector `target_vector` of the output row `target` = vector `source_vector` of the
        float32 row `source` in the output's dtype where `visited`, else 0."""
        cells = cute.make_rmem_tensor((VECTOR,), _cutlass_dtype(self.spec.dtype))
        cells.fill(0.0)
        if visited:
            summed = cute.make_rmem_tensor((VECTOR,), Float32)
            summed.store(cute.local_tile(source, (VECTOR,), (source_vector,)).load())
            cells.store(summed.load().to(cells.element_type))
        cute.local_tile(target, (VECTOR,), (target_vector,)).store(cells.load())


def fake_arguments(spec: DbiasTilesSpec):
    """Fake (listed, sums, out) for a CPU build (CUTE_DSL_ARCH=sm_90a), as the launcher passes
    them: every extent and the leading strides dynamic (64-bit), unit last strides."""
    from cutlass.cute.runtime import make_fake_tensor

    slabs, rows, keys = cute.sym_int(), cute.sym_int(), cute.sym_int()
    slots = spec.mode == "convert_slots"
    listed = make_fake_tensor(cutlass.Int32 if slots else cutlass.Int8,
                              (slabs, cute.sym_int(), cute.sym_int()),
                              stride=(cute.sym_int64(), cute.sym_int64(), 1),
                              assumed_align=4 if slots else 1)

    def cells(dtype, shape=(slabs, rows, keys)):
        return make_fake_tensor(_cutlass_dtype(dtype), shape,
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)

    if slots:
        sums = cells("float32", (cute.sym_int(), TILE, TILE))
    else:
        sums = cells(spec.dtype if spec.mode == "zero_unlisted" else "float32")
    return listed, sums, cells(spec.dtype)


def compile_on_fake_tensors(spec: DbiasTilesSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(DbiasTilesSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `zero_listed`, `convert` and `zero_unlisted` launch
# (kernels/masked.py).
# ------------------------------------------------------------------------------------------------


def can_run(listed, sums, out) -> bool:
    """Whether the kernel takes these (the device already checked): listed (S, Tq, Tk) int8
    with unit last stride over sums (S, Nq, Nk) float32 (out itself for `zero_unlisted`) and
    out (S, Nq, Nk) of an output dtype, unit last strides, Nk and the leading strides
    multiples of 4 elements, 16-byte aligned starts, the tiles and slabs within the launch
    grid."""
    import torch

    return (listed.dtype == torch.int8 and _tiles_ok(listed, out)
            and _cells_ok(sums, out.shape, ("float32",) if sums is not out else OUT_DTYPES))


def can_run_slots(slots, sums, out) -> bool:
    """Whether "convert_slots" takes these: slots (S, Tq, Tk) int32 over out as `can_run` has
    them, sums (n, 128, 128) float32, contiguous and 16-byte aligned."""
    import torch

    return (slots.dtype == torch.int32 and _tiles_ok(slots, out)
            and sums.dtype == torch.float32 and sums.dim() == 3
            and tuple(sums.shape[1:]) == (TILE, TILE) and sums.is_contiguous()
            and sums.data_ptr() % 16 == 0)


def _tiles_ok(listed, out) -> bool:
    """listed: one entry per TILE x TILE tile of out's cells, unit last stride; out as
    `can_run` has it; the tiles and slabs within the launch grid."""
    slabs, rows, keys = out.shape if out.dim() == 3 else (0, 0, 0)
    return (listed.dim() == 3 and listed.stride(2) == 1 and 0 not in (slabs, rows, keys)
            and keys % VECTOR == 0
            and tuple(listed.shape) == (slabs, -(-rows // TILE), -(-keys // TILE))
            and _cells_ok(out, out.shape, OUT_DTYPES)
            and slabs <= MAX_GRID_YZ and listed.shape[1] <= MAX_GRID_YZ)


def _cells_ok(x, shape, dtypes) -> bool:
    return (str(x.dtype).removeprefix("torch.") in dtypes and x.dim() == 3
            and tuple(x.shape) == tuple(shape) and x.stride(2) == 1
            and x.stride(0) % VECTOR == 0 and x.stride(1) % VECTOR == 0
            and x.data_ptr() % 16 == 0)


def zero_listed(listed, sums) -> None:
    """Zero the float32 sums of every listed tile (the others are left as they are)."""
    _launch(DbiasTilesSpec("zero"), listed, sums, sums)


def zero_unlisted(listed, out) -> None:
    """Zero the gradient `out` in every tile no list visits (the others are left as they are:
    the backward stores them)."""
    _launch(DbiasTilesSpec("zero_unlisted", str(out.dtype).removeprefix("torch.")), listed, out,
            out)


def convert(listed, sums, out) -> None:
    """out = the sums in out's dtype in every listed tile, 0 in every other one."""
    _launch(DbiasTilesSpec("convert", str(out.dtype).removeprefix("torch.")), listed, sums, out)


def convert_slots(slots, sums, out) -> None:
    """out = the tiles' sums (slot slots[s, i, j] of sums for tile (i, j) of slab s) in out's
    dtype where a tile has one, 0 in every other tile."""
    _launch(DbiasTilesSpec("convert_slots", str(out.dtype).removeprefix("torch.")), slots,
            sums, out)


def _launch(spec, listed, sums, out) -> None:
    from kernels.sm90.launch import launch_on_current_stream

    launch_on_current_stream(DbiasTilesSm90, spec, fake_arguments, (listed, sums, out),
                             sums.device)
