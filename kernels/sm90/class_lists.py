"""Block-sparse lists from tile classes in one launch: the attention kernels' "full" and "mask"
lists of every (query tile, list head) from its row of FULL_BLOCK / MASK_BLOCK / NOT_LISTED
classes.

`kernels.masked.tile_lists` built them with `sparsity.build_block_sparse_from_tile_classes`:
two sorts, gathers and masks, some 50 torch ops whose host time (about 1 ms per call on an H200
at 16K, docs/history.md 2026-11-29) made a masked forward host-bound once its classes took one
pass (`kernels.sm90.tile_classes`). One warp per list walks the row's classes 32 at a time and
writes each class's blocks in ascending order at the place a ballot of the lanes below gives,
then pads both lists with -1: the same tensors as the torch builder with bounded widths (Tk
slots per list).

Layout: classes (B, Hs, Tq, Tk) int8 with any strides (an expanded batch or head is read in
place); lists: full_count, mask_count (B * Tq, Hs) int32 and full_index, mask_index
(B * Tq, Hs, Tk) int32, row r = b * Tq + tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from sparsity.builders import FULL_BLOCK, MASK_BLOCK

WARP = 32
WARPS = 4  # lists per CTA
MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class ClassListsSpec:
    """The compile key: nothing to specialise but the kernel."""
    warps: int = WARPS


class ClassListsSm90:
    """Called with (classes (B, Hs, Tq, Tk) int8, full_count, full_index, mask_count,
    mask_index)."""

    def __init__(self, spec: ClassListsSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, classes: cute.Tensor, full_count: cute.Tensor, full_index: cute.Tensor,
                 mask_count: cute.Tensor, mask_index: cute.Tensor, stream):
        lists = cute.size(full_count.shape[0]) * cute.size(full_count.shape[1])
        self.kernel(classes, full_count, full_index, mask_count, mask_index).launch(
            grid=[cute.ceil_div(lists, self.spec.warps), 1, 1],
            block=[WARP * self.spec.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, classes: cute.Tensor, full_count: cute.Tensor, full_index: cute.Tensor,
               mask_count: cute.Tensor, mask_index: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        heads, tiles, blocks = classes.shape[1], classes.shape[2], classes.shape[3]
        list_id = cta * self.spec.warps + tidx // WARP
        if list_id < full_count.shape[0] * heads:
            row, head = list_id // heads, list_id % heads
            batch, tile = row // tiles, row % tiles
            below = (Int32(1) << lane) - Int32(1)  # the lanes before this one
            num_full, num_mask = Int32(0), Int32(0)
            for start in cutlass.range(0, blocks, WARP):
                block = start + lane
                value = Int32(-1)
                if block < blocks:
                    value = Int32(classes[batch, head, tile, block])
                full = value == Int32(FULL_BLOCK)
                masked = value == Int32(MASK_BLOCK)
                full_votes = cute.arch.vote_ballot_sync(full)
                mask_votes = cute.arch.vote_ballot_sync(masked)
                if full:
                    full_index[row, head, num_full + cute.arch.popc(full_votes & below)] = block
                if masked:
                    mask_index[row, head, num_mask + cute.arch.popc(mask_votes & below)] = block
                num_full += Int32(cute.arch.popc(full_votes))
                num_mask += Int32(cute.arch.popc(mask_votes))
            for slot in cutlass.range(num_full + lane, blocks, WARP):
                full_index[row, head, slot] = Int32(-1)
            for slot in cutlass.range(num_mask + lane, blocks, WARP):
                mask_index[row, head, slot] = Int32(-1)
            if lane == 0:
                full_count[row, head] = num_full
                mask_count[row, head] = num_mask


def fake_arguments(spec: ClassListsSpec):
    """Fake (classes, full_count, full_index, mask_count, mask_index) for a CPU build
    (CUTE_DSL_ARCH=sm_90a), as the launcher passes them: dynamic extents and strides."""
    from cutlass.cute.runtime import make_fake_tensor

    rows, heads, blocks = cute.sym_int(), cute.sym_int(), cute.sym_int()
    classes = make_fake_tensor(cutlass.Int8, tuple(cute.sym_int() for _ in range(4)),
                               stride=(*(cute.sym_int64() for _ in range(3)), 1),
                               assumed_align=1)

    def counts():
        return make_fake_tensor(Int32, (rows, heads), stride=(cute.sym_int64(), 1),
                                assumed_align=4)

    def index():
        return make_fake_tensor(Int32, (rows, heads, blocks),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    return classes, counts(), index(), counts(), index()


def compile_on_fake_tensors(spec: ClassListsSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(ClassListsSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `run` launches (kernels/masked.py).
# ------------------------------------------------------------------------------------------------


def can_run(classes) -> bool:
    """Whether the kernel lists these (B, Hs, Tq, Tk) int8 classes (the device checked): unit
    last stride, the lists within the launch grid."""
    import torch

    return (classes.dtype == torch.int8 and classes.dim() == 4 and classes.numel() > 0
            and classes.stride(3) == 1 and classes.shape[0] * classes.shape[1] * classes.shape[2] <= MAX_GRID_X)


def run(classes):
    """(full_count, full_index, mask_count, mask_index) of classes that `can_run` accepts."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    batch, heads, tiles, blocks = classes.shape
    device = classes.device
    counts = [torch.empty(batch * tiles, heads, dtype=torch.int32, device=device)
              for _ in range(2)]
    indices = [torch.empty(batch * tiles, heads, blocks, dtype=torch.int32, device=device)
               for _ in range(2)]
    launch_on_current_stream(ClassListsSm90, ClassListsSpec(), fake_arguments,
                             (classes, counts[0], indices[0], counts[1], indices[1]), device)
    return counts[0], indices[0], counts[1], indices[1]
