"""The tile classes of a mask or a bias in one pass: which 128 x 128 tiles a row sees whole, in
part, or not at all.

`kernels.masked.tile_lists` lists the tiles the attention kernels visit from the user's mask
(seen: a cell that is True) and bias (seen: a cell above -inf). In torch that was one `aminmax`
over the cells along each tile's keys and a second over its rows: at 16K x 16K on an H200
0.87 ms for a bool mask and 0.94 ms for a bfloat16 bias (about 330 GB/s and 570 GB/s), most of
a small window's forward (docs/history.md, 2026-11-29). This kernel reads each cell once with
16-byte loads and writes only the classes.

Layout: x is an (S, Nq, Nk) view (S slabs: the mask's or bias's (batch, head) pairs; 64-bit
strides, rows 16 bytes apart), classes (S, Tq, Tk) int8 with Tq, Tk the tiles of Nq, Nk. A
warp reads one row of `tiles_per_warp` adjacent tiles (a 16-byte vector per lane, `lanes` lanes
per tile row); the CTA's warps take every `WARPS`-th row of the tile row. Each lane keeps "every
cell seen" and "some cell seen" over its vectors, its tile's lanes combine them by shuffles,
the warps through shared memory, and one thread per tile writes FULL_BLOCK, MASK_BLOCK or
NOT_LISTED. Cells past Nk do not exist and count for neither flag (Nk is a multiple of the
vector, so a vector is in or out whole); a row past Nq reads row Nq - 1 again, which changes
neither.

With a prior (`TileClassesSpec.reads_prior`: classes (S, Tq, Tk) that the caller combines with
these by their minimum, a bias's after the causal rule and the mask), a tile the prior leaves
NOT_LISTED is not read: its lanes skip their loads and it is written NOT_LISTED, which the
minimum gives anyway. A bias under a small window's mask is then read where the window is
(at 16K, window 32: 1/64 of the tiles) instead of whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.memory
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from sparsity.builders import FULL_BLOCK, MASK_BLOCK, NOT_LISTED

TILE = 128
WARPS = 8
VECTOR_BYTES = 16
# uint8: a bool mask's bytes (seen: not 0); the others a bias (seen: above -inf).
ELEMENT_BYTES = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
# Grid limits of the launch's y (tile rows) and z (slabs) dimensions.
MAX_GRID_YZ = 65535


def _cutlass_dtype(name: str):
    return {"uint8": cutlass.Uint8, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
            "float32": cutlass.Float32}[name]


@dataclass(frozen=True)
class TileClassesSpec:
    """The compile key: the cells' element type (a mask's bytes or a bias's floats), and
    whether tiles a prior leaves unlisted are skipped."""
    dtype: str
    reads_prior: bool = False

    def __post_init__(self):
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {sorted(ELEMENT_BYTES)})")

    @property
    def vector(self) -> int:
        """Elements per 16-byte load."""
        return VECTOR_BYTES // ELEMENT_BYTES[self.dtype]

    @property
    def lanes(self) -> int:
        """Lanes that read one row of a tile (8 for bytes, 16 for 16-bit, 32 for float32)."""
        return TILE // self.vector

    @property
    def tiles_per_warp(self) -> int:
        return 32 // self.lanes


class TileClassesSm90:
    """The kernel for one `TileClassesSpec`; called with (x (S, Nq, Nk), classes (S, Tq, Tk)
    int8, prior (S, Tq, Tk) int8 or None)."""

    def __init__(self, spec: TileClassesSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, x: cute.Tensor, classes: cute.Tensor, prior, stream):
        spec = self.spec
        # Rows and slabs start 16 bytes apart (the launcher admits only such strides).
        strides = (cute.assume(x.stride[0], divby=spec.vector),
                   cute.assume(x.stride[1], divby=spec.vector), x.stride[2])
        x = cute.make_tensor(x.iterator, cute.make_layout(x.shape, stride=strides))
        grid = [cute.ceil_div(cute.size(classes.shape[2]), spec.tiles_per_warp),
                cute.size(classes.shape[1]), cute.size(classes.shape[0])]
        self.kernel(x, classes, prior).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                              smem=4 * 2 * WARPS * spec.tiles_per_warp + 16,
                                              stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, classes: cute.Tensor, prior):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        column_group, tile_row, slab = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        tile_in_group = lane // spec.lanes
        tile_col = column_group * spec.tiles_per_warp + tile_in_group
        key = tile_col * TILE + (lane % spec.lanes) * spec.vector
        seqlen_q, seqlen_k = x.shape[1], x.shape[2]

        every = Int32(1)  # every existing cell this lane read was seen
        some = Int32(0)  # some cell was seen
        reads = Int32(key < seqlen_k)
        if const_expr(spec.reads_prior):
            if key < seqlen_k:
                reads = Int32(Int32(prior[slab, tile_row, tile_col]) != Int32(NOT_LISTED))
        if reads != 0:
            for step in cutlass.range_constexpr(TILE // WARPS):
                # A row past Nq reads the last row again instead (the flags do not change when
                # a cell is read twice): no branch between the loads.
                row = cutlass.min(tile_row * TILE + step * WARPS + warp, seqlen_q - 1)
                cells = cute.make_rmem_tensor((spec.vector,), x.element_type)
                cells.store(cute.local_tile(x[slab, row, None], (spec.vector,),
                                            (key // spec.vector,)).load())
                for i in cutlass.range_constexpr(spec.vector):
                    seen = self.seen(cells[i])
                    every = every & seen
                    some = some | seen

        # The tile's lanes, then the warps.
        for level in cutlass.range_constexpr(spec.lanes.bit_length() - 1):
            offset = spec.lanes >> (level + 1)
            every = every & cute.arch.shuffle_sync_bfly(every, offset)
            some = some | cute.arch.shuffle_sync_bfly(some, offset)
        smem = cutlass.memory.SmemAllocator()
        flags = smem.allocate_tensor(Int32, cute.make_layout((2, WARPS, spec.tiles_per_warp)))
        if lane % spec.lanes == 0:
            flags[0, warp, tile_in_group] = every
            flags[1, warp, tile_in_group] = some
        cute.arch.barrier()
        if tidx < spec.tiles_per_warp:
            tile_col = column_group * spec.tiles_per_warp + tidx
            if tile_col < classes.shape[2]:
                every, some = Int32(1), Int32(0)
                for w in cutlass.range_constexpr(WARPS):
                    every = every & flags[0, w, tidx]
                    some = some | flags[1, w, tidx]
                value = Int32(NOT_LISTED)
                if every != 0:
                    value = Int32(FULL_BLOCK)
                elif some != 0:
                    value = Int32(MASK_BLOCK)
                if const_expr(spec.reads_prior):  # skipped: not read, and unlisted anyway
                    if Int32(prior[slab, tile_row, tile_col]) == Int32(NOT_LISTED):
                        value = Int32(NOT_LISTED)
                classes[slab, tile_row, tile_col] = cutlass.Int8(value)

    @cute.jit
    def seen(self, cell) -> Int32:
        """1 where a cell lets its key through: a mask byte that is not 0, a bias above -inf
        (NaN is not above it: a NaN cell hides nothing it did not already spoil)."""
        if const_expr(self.spec.dtype == "uint8"):
            return Int32(cell != cutlass.Uint8(0))
        return Int32(Float32(cell) > Float32(-float("inf")))


def fake_arguments(spec: TileClassesSpec):
    """Fake (x, classes, prior) for a CPU build (CUTE_DSL_ARCH=sm_90a), as the launcher passes
    them: every extent and the leading strides dynamic (64-bit), unit last strides; prior None
    unless the spec reads one."""
    from cutlass.cute.runtime import make_fake_tensor

    slabs, rows, keys = cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = make_fake_tensor(_cutlass_dtype(spec.dtype), (slabs, rows, keys),
                         stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)

    def tile_classes():
        return make_fake_tensor(cutlass.Int8, (slabs, cute.sym_int(), cute.sym_int()),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=1)
    return x, tile_classes(), tile_classes() if spec.reads_prior else None


def compile_on_fake_tensors(spec: TileClassesSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(TileClassesSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches (kernels/masked.py).
# ------------------------------------------------------------------------------------------------


def can_run(x, prior=None) -> bool:
    """Whether the kernel classifies x, an (S, Nq, Nk) view (bool as uint8 or a float bias),
    the device already checked: unit last stride, Nk and the leading strides multiples of the
    16-byte vector, 16-byte aligned, the tiles and slabs within the launch grid; a prior, where
    given, (S, Tq, Tk) int8 with a unit last stride."""
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in ELEMENT_BYTES or x.dim() != 3 or 0 in x.shape:
        return False
    tiles = _tile_shape(x)
    if prior is not None and (prior.dtype != torch.int8 or tuple(prior.shape) != tiles
                              or prior.stride(-1) != 1 or prior.device != x.device):
        return False
    vector = VECTOR_BYTES // ELEMENT_BYTES[dtype]
    return (x.stride(2) == 1 and x.shape[2] % vector == 0 and x.stride(0) % vector == 0
            and x.stride(1) % vector == 0 and x.data_ptr() % VECTOR_BYTES == 0
            and x.shape[0] <= MAX_GRID_YZ and tiles[1] <= MAX_GRID_YZ)


def _tile_shape(x) -> tuple[int, int, int]:
    """(S, Tq, Tk): the classes' shape for x (S, Nq, Nk), the last tiles partial."""
    return x.shape[0], -(-x.shape[1] // TILE), -(-x.shape[2] // TILE)


def run(x, prior=None):
    """The (S, Tq, Tk) int8 classes of x, an (S, Nq, Nk) view that `can_run` accepts (with
    `prior`: NOT_LISTED, unread, where the prior is)."""
    from kernels.sm90.launch import launch_on_current_stream

    spec = TileClassesSpec(str(x.dtype).removeprefix("torch."), reads_prior=prior is not None)
    classes = torch.empty(_tile_shape(x), dtype=torch.int8, device=x.device)
    launch_on_current_stream(TileClassesSm90, spec, fake_arguments, (x, classes, prior),
                             x.device)
    return classes
