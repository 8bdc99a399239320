"""The tile classes of a mask or bias (kernels/sm90/tile_classes.py) and the lists made of them
(kernels/sm90/class_lists.py), both used by kernels/masked.py `tile_lists`: which 128 x 128
tiles see every cell, some, or none, and the full / mask lists of each query tile.

CPU: the sm_90a builds, what the launchers refuse, the torch path against an explicit count of
seen cells per tile. GPU (sm_90): the classes kernel against the same count over masks and
biases of every element type, lengths that are no multiple of the tile, strided rows, slabs
whose batch and head strides do not merge, -inf and NaN cells; the lists kernel equal to
`sparsity.build_block_sparse_from_tile_classes` on random and expanded classes.
"""
from __future__ import annotations

import itertools

import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from gpu_marks import requires_sm90
from kernels import masked
from sparsity import build_block_sparse_from_tile_classes
from sparsity.builders import FULL_BLOCK, MASK_BLOCK, NOT_LISTED

TILE = 128
DTYPES = ["uint8", "bfloat16", "float16", "float32"]


def _expected_classes(x: torch.Tensor) -> torch.Tensor:
    """(Bx, Hx, Tq, Tk) classes of x (Bx, Hx, Nq, Nk) by counting, per tile, the cells that let
    their key through (a mask byte that is not 0, a bias cell above -inf) against the cells
    that exist."""
    seen = (x != 0) if x.dtype in (torch.bool, torch.uint8) else (x > float("-inf"))
    *lead, seqlen_q, seqlen_k = x.shape
    tiles_q, tiles_k = -(-seqlen_q // TILE), -(-seqlen_k // TILE)
    padded = torch.zeros(*lead, tiles_q * TILE, tiles_k * TILE, dtype=torch.int32,
                         device=x.device)
    exists = torch.zeros_like(padded)
    padded[..., :seqlen_q, :seqlen_k] = seen.int()
    exists[..., :seqlen_q, :seqlen_k] = 1

    def per_tile(t):
        return t.unflatten(-1, (tiles_k, TILE)).unflatten(-3, (tiles_q, TILE)).sum((-3, -1))

    seen_cells, cells = per_tile(padded), per_tile(exists)
    classes = torch.full_like(seen_cells, MASK_BLOCK)
    classes[seen_cells == cells] = FULL_BLOCK
    classes[seen_cells == 0] = NOT_LISTED
    return classes.to(torch.int8)


def _cells(shape, dtype: str, gen, device) -> torch.Tensor:
    """Random cells with whole tiles seen, hidden, and rows hidden: a mask (about a third of the
    cells True) or a bias (normal, hidden cells -inf)."""
    hide = torch.rand(shape, generator=gen, device=device) < 0.66
    hide[..., :TILE, TILE:2 * TILE] = False        # a tile seen whole
    hide[..., TILE:2 * TILE, :TILE] = True         # a tile hidden whole
    hide[..., 5, :] = True                         # a row that sees nothing
    hide[..., -3:, -5:] = False                    # the last partial tile's corner seen
    if dtype == "uint8":
        return ~hide
    values = torch.randn(shape, generator=gen, device=device).to(getattr(torch, dtype))
    return values.masked_fill(hide, float("-inf"))


def _as_read(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def test_torch_path_equals_the_count():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x = _cells((2, 3, 300, 400), dtype, gen, "cpu")
        got = masked._cell_classes_from_extremes(
            _as_read(x), (lambda c: c != 0) if dtype == "uint8" else
            (lambda c: c > float("-inf")), TILE)
        assert torch.equal(got, _expected_classes(x)), dtype


@pytest.mark.parametrize("reads_prior", [False, True], ids=["whole", "prior"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_builds_for_sm90(dtype, reads_prior):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.tile_classes import TileClassesSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(TileClassesSpec(dtype, reads_prior))


def test_lists_kernel_builds_for_sm90():
    from kernels.sm90.class_lists import ClassListsSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(ClassListsSpec())


def test_the_launchers_refuse_what_the_kernels_cannot_read():
    from kernels.sm90.class_lists import can_run as lists_can_run
    from kernels.sm90.tile_classes import TileClassesSpec, can_run

    with pytest.raises(ValueError, match="dtype 'float64'"):
        TileClassesSpec("float64")
    mask = torch.zeros(2, 256, 1024, dtype=torch.uint8)
    assert can_run(mask)
    assert not can_run(mask[:, :, :1000])             # keys not a multiple of 16 bytes
    assert not can_run(mask[:, :, 8:])                # rows off the 16-byte grid
    assert not can_run(mask.transpose(1, 2))          # no unit key stride
    assert not can_run(mask.double())                 # no such bias type
    assert not can_run(mask[0])                       # not (S, Nq, Nk)
    assert not can_run(mask[:, :0])                   # no rows
    assert can_run(torch.zeros(3, 100, 1000, dtype=torch.bfloat16)[:, :, 8:1000])
    classes = torch.zeros(2, 3, 4, 5, dtype=torch.int8)
    assert lists_can_run(classes) and lists_can_run(classes[:1].expand(2, 3, 4, 5))
    assert not lists_can_run(classes.int())
    assert not lists_can_run(classes.transpose(2, 3))
    assert not lists_can_run(classes[:, :, :0])


def test_the_launcher_refuses_a_prior_it_cannot_read():
    from kernels.sm90.tile_classes import can_run

    mask = torch.zeros(2, 256, 1000 + 24, dtype=torch.uint8)
    prior = torch.zeros(2, 2, 8, dtype=torch.int8)
    assert can_run(mask, prior)
    assert not can_run(mask, prior[:1])                # not one per slab
    assert not can_run(mask, prior[..., :7])           # not one per tile
    assert not can_run(mask, prior.int())              # not int8
    assert not can_run(mask, prior.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("classes_form", [(1, 1), (2, 1), (1, 8), (2, 8)])
@pytest.mark.parametrize("slab_form", [(1, 1), (2, 1), (1, 2), (2, 8), (1, 8)])
def test_prior_lists_a_tile_where_any_served_list_does(classes_form, slab_form):
    """`_prior_for`: the classes before a source (rule and mask: (1 or B, 1 or `heads`)) as
    one per slab of the source ((1 or B, 1, Hkv or H)); a slab's tile is unlisted only where
    it is for every (batch entry, list head) the slab serves (B=2, heads=8, Hkv=2)."""
    batch, heads = 2, 8
    gen = torch.Generator().manual_seed(sum(classes_form) + 10 * sum(slab_form))
    classes = torch.randint(0, 3, (*classes_form, 3, 5), generator=gen).to(torch.int8)
    prior = masked._prior_for(classes, slab_form, heads)
    assert prior.shape == (*slab_form, 3, 5) and prior.is_contiguous()
    full = classes.expand(batch, heads, 3, 5)
    for b, h in itertools.product(range(slab_form[0]), range(slab_form[1])):
        served_batch = range(batch) if slab_form[0] == 1 else [b]
        group = heads // slab_form[1]
        served = full[list(served_batch)][:, h * group:(h + 1) * group]
        assert torch.equal(prior[b, h], served.amax((0, 1))), (b, h)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1024, 2048), (2, 3, 1000, 1296), (1, 2, 129, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_count(dtype, shape):
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = _cells(shape, dtype, gen, "cuda")
    got = masked._cell_classes_on_kernel(_as_read(x), TILE)
    assert got is not None  # the kernel, not the torch path
    torch.cuda.synchronize()
    assert torch.equal(got, _expected_classes(x))


@pytest.mark.gpu
@requires_sm90
def test_kernel_reads_strided_rows_and_unmerged_slabs():
    gen = torch.Generator(device="cuda").manual_seed(3)
    # Rows of a wider tensor (row stride 1312 keys), and batch/head strides that do not merge
    # (the heads' stride is larger than the batch's): one launch per batch entry.
    wide = _cells((3, 2, 700, 1312), "bfloat16", gen, "cuda")
    x = wide[..., 16:1296].transpose(0, 1)
    assert x.stride(0) != x.stride(1) * x.shape[1]
    got = masked._cell_classes_on_kernel(x, TILE)
    assert got is not None
    assert torch.equal(got, _expected_classes(x))
    # The same through `_cell_classes`, with the broadcast heads of an expanded mask narrowed.
    mask = _cells((2, 1, 512, 640), "uint8", gen, "cuda").expand(2, 4, 512, 640)
    got = masked._cell_classes(mask, lambda m: m != 0, TILE)
    assert got.shape == (2, 1, 4, 5)
    assert torch.equal(got, _expected_classes(mask[:, :1]))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
def test_kernel_skips_the_tiles_a_prior_leaves_unlisted(dtype):
    """With a prior, the kernel's classes are the count's where the prior lists the tile and
    NOT_LISTED where it does not, per slab, also over unmerged slabs (one launch each)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = _cells((2, 3, 1000, 1296), dtype, gen, "cuda")
    prior = torch.randint(0, 3, (2, 3, 8, 11), generator=gen, device="cuda").to(torch.int8)
    expected = torch.where(prior == NOT_LISTED, NOT_LISTED, _expected_classes(x))
    got = masked._cell_classes_on_kernel(_as_read(x), TILE, prior)
    assert got is not None
    assert torch.equal(got, expected)
    unmerged = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(masked._cell_classes_on_kernel(_as_read(unmerged), TILE, prior),
                       expected)


@pytest.mark.gpu
@requires_sm90
def test_nan_bias_cells_count_as_hidden():
    """NaN is not above -inf: the kernel counts it hidden, so a tile whose other cells are all
    -inf is not listed, and a tile with seen cells beside it is listed in part."""
    bias = torch.full((1, 1, 256, 256), float("-inf"), device="cuda")
    bias[..., 0, 0] = float("nan")           # tile (0, 0): NaN among -inf
    bias[..., 0, 128] = float("nan")         # tile (0, 1): NaN beside seen cells
    bias[..., 1, 128:] = 0.0
    bias[..., 128:, :128] = 0.0              # tile (1, 0): every cell seen
    got = masked._cell_classes_on_kernel(bias, TILE)
    assert got.flatten().tolist() == [NOT_LISTED, MASK_BLOCK, FULL_BLOCK, NOT_LISTED]


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("shape", [(2, 3, 5, 77), (1, 1, 40, 7), (3, 2, 9, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_lists_kernel_equals_the_torch_builder(shape):
    batch, heads, tiles, blocks = shape
    gen = torch.Generator(device="cuda").manual_seed(blocks)
    classes = torch.randint(0, 3, shape, generator=gen, device="cuda").to(torch.int8)
    classes[0, 0, 0] = NOT_LISTED   # a list with nothing
    classes[-1, -1, -1] = FULL_BLOCK  # a list of full blocks only
    for form in (classes, classes[:1, :1].expand(shape)):
        got = masked._lists_on_kernel(form, TILE)
        assert got is not None  # the kernel, not the torch builder
        expected = build_block_sparse_from_tile_classes(
            form, seqlen_q=tiles * TILE - 3, seqlen_k=blocks * TILE - 5, q_tile=TILE,
            kv_block=TILE)
        assert got.equals(expected)
