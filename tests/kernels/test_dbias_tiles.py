"""The bias gradient's tile passes (kernels/sm90/dbias_tiles.py, used by kernels/masked.py's
sm90 backward): the float32 sums zeroed in the listed tiles only, and the gradient written
whole from them, zeros in every tile no list visits; or, where the backward stores the gradient
itself, zeros in the unlisted tiles alone; or, where the sums hold the visited tiles alone, the
gradient written from each tile's slot.

CPU: the sm_90a builds and what the launcher refuses. GPU (sm_90): both passes against torch on
random listings, lengths that are no multiple of the tile, strided rows, and every output type.
"""
from __future__ import annotations

import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from gpu_marks import requires_sm90

TILE = 128
SPECS = [("zero", "float32"), ("convert", "bfloat16"), ("convert", "float16"),
         ("convert", "float32"), ("zero_unlisted", "bfloat16"), ("zero_unlisted", "float16"),
         ("zero_unlisted", "float32"), ("convert_slots", "bfloat16"),
         ("convert_slots", "float16")]
# The GPU tests' (slabs, Nq, Nk): tiles whole and partial, keys no multiple of the tile, one
# tile column.
ON_SHAPES = pytest.mark.parametrize("shape", [(1, 1024, 2048), (3, 1000, 1300), (2, 129, 4)],
                                    ids=lambda s: "x".join(map(str, s)))


@pytest.mark.parametrize("mode, dtype", SPECS)
def test_kernel_builds_for_sm90(mode, dtype):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.dbias_tiles import DbiasTilesSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(DbiasTilesSpec(mode, dtype))


def test_the_launcher_refuses_what_the_kernel_cannot_write():
    from kernels.sm90.dbias_tiles import DbiasTilesSpec, can_run

    with pytest.raises(ValueError, match="mode 'sum'"):
        DbiasTilesSpec("sum")
    with pytest.raises(ValueError, match="dtype 'bfloat16' for mode 'zero'"):
        DbiasTilesSpec("zero", "bfloat16")
    sums = torch.zeros(2, 300, 520)
    out = torch.zeros(2, 300, 520, dtype=torch.bfloat16)
    listed = torch.zeros(2, 3, 5, dtype=torch.int8)
    assert can_run(listed, sums, out) and can_run(listed, sums, sums)
    assert can_run(listed, out, out)                                 # zero_unlisted's form
    assert not can_run(listed, out, out.clone())                     # 16-bit sums of another
    assert not can_run(listed[:, :2], sums, out)                     # tiles do not match
    assert not can_run(listed.int(), sums, out)                      # not int8
    assert not can_run(listed, sums.double(), out)                   # sums not float32
    assert not can_run(listed, sums, out.double())                   # no such output type
    assert not can_run(listed, sums, out[:, :299])                   # shapes differ
    assert not can_run(listed[..., :4], sums[..., :518], out[..., :518])  # keys not by 4
    assert not can_run(listed, sums, torch.zeros(2, 520, 300).transpose(1, 2))  # no unit stride
    assert not can_run(listed[..., :4], sums[..., 2:514], out[..., 2:514])  # rows off 16 bytes
    assert not can_run(listed[:, :0], sums[:, :0], out[:, :0])       # no rows


def test_the_slots_launcher_refuses_what_the_kernel_cannot_read():
    from kernels.sm90.dbias_tiles import can_run_slots

    out = torch.zeros(2, 300, 520, dtype=torch.bfloat16)
    slots = torch.full((2, 3, 5), -1, dtype=torch.int32)
    sums = torch.zeros(4, TILE, TILE)
    assert can_run_slots(slots, sums, out)
    assert not can_run_slots(slots.to(torch.int8), sums, out)        # not int32
    assert not can_run_slots(slots[:, :2], sums, out)                # tiles do not match
    assert not can_run_slots(slots, sums[:, :64], out)               # slots not 128 x 128
    assert not can_run_slots(slots, sums.double(), out)              # sums not float32
    assert not can_run_slots(slots, sums.transpose(1, 2), out)       # not contiguous
    assert not can_run_slots(slots[..., :4], sums, out[..., :518])   # keys not by 4


def _listed(slabs, rows, keys, gen, device):
    listed = (torch.rand(slabs, -(-rows // TILE), -(-keys // TILE), generator=gen,
                         device=device) < 0.4).to(torch.int8)
    listed[:, -1, -1] = 1  # the partial corner tile
    listed[:, 0, 0] = 0
    return listed


def _per_cell(listed, rows, keys):
    return listed.bool().repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[:, :rows, :keys]


@pytest.mark.gpu
@requires_sm90
@ON_SHAPES
def test_zero_listed_touches_only_the_listed_tiles(shape):
    from kernels.sm90 import dbias_tiles

    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    listed = _listed(*shape, gen, "cuda")
    # Rows strided past the keys (a view of a wider tensor): the strides are honoured.
    sums = torch.randn(*shape[:2], shape[2] + 12, generator=gen, device="cuda")[..., :shape[2]]
    before = sums.clone()
    assert dbias_tiles.can_run(listed, sums, sums)
    dbias_tiles.zero_listed(listed, sums)
    cells = _per_cell(listed, *shape[1:])
    assert torch.equal(sums, before.masked_fill(cells, 0.0))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@ON_SHAPES
def test_convert_writes_the_sums_where_listed_and_zeros_elsewhere(dtype, shape):
    from kernels.sm90 import dbias_tiles

    gen = torch.Generator(device="cuda").manual_seed(7 * sum(shape))
    listed = _listed(*shape, gen, "cuda")
    sums = torch.randn(shape, generator=gen, device="cuda") * 100
    out = torch.randn(shape, generator=gen, device="cuda").to(dtype)  # stale values
    assert dbias_tiles.can_run(listed, sums, out)
    dbias_tiles.convert(listed, sums, out)
    cells = _per_cell(listed, *shape[1:])
    assert torch.equal(out, sums.masked_fill(~cells, 0.0).to(dtype))
    if dtype == torch.float32:  # a float32 bias's gradient is its own sums: in place
        in_place = sums.clone()
        dbias_tiles.convert(listed, in_place, in_place)
        assert torch.equal(in_place, sums.masked_fill(~cells, 0.0))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@ON_SHAPES
def test_zero_unlisted_zeroes_only_the_tiles_no_list_visits(dtype, shape):
    from kernels.sm90 import dbias_tiles

    gen = torch.Generator(device="cuda").manual_seed(3 * sum(shape))
    listed = _listed(*shape, gen, "cuda")
    out = torch.randn(shape, generator=gen, device="cuda").to(dtype)  # the backward's stores
    before = out.clone()
    assert dbias_tiles.can_run(listed, out, out)
    dbias_tiles.zero_unlisted(listed, out)
    cells = _per_cell(listed, *shape[1:])
    assert torch.equal(out, before.masked_fill(~cells, 0.0))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@ON_SHAPES
def test_convert_slots_writes_each_tiles_slot_and_zeros_elsewhere(dtype, shape):
    from kernels.sm90 import dbias_tiles

    gen = torch.Generator(device="cuda").manual_seed(5 * sum(shape))
    listed = _listed(*shape, gen, "cuda")
    # Slots in a shuffled order: the kernel reads the map, not the tiles' order.
    count = int(listed.sum())
    order = torch.randperm(count, generator=torch.Generator().manual_seed(1)).to("cuda")
    slots = torch.full(listed.shape, -1, dtype=torch.int32, device="cuda")
    slots[listed.bool()] = order.to(torch.int32)
    sums = torch.randn(count, TILE, TILE, generator=gen, device="cuda") * 100
    out = torch.randn(shape, generator=gen, device="cuda").to(dtype)  # stale values
    assert dbias_tiles.can_run_slots(slots, sums, out)
    dbias_tiles.convert_slots(slots, sums, out)
    expected = torch.zeros(shape, device="cuda")
    slabs, rows, keys = shape
    for s_, i, j in listed.nonzero().tolist():
        r, c = min(TILE, rows - i * TILE), min(TILE, keys - j * TILE)
        expected[s_, i * TILE:i * TILE + r, j * TILE:j * TILE + c] = \
            sums[slots[s_, i, j], :r, :c]
    assert torch.equal(out, expected.to(dtype))
