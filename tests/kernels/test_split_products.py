"""kernels/sm90/split_products.py on its own: float32 products from three-piece bf16 splits on
tensor cores, through a small test kernel that stages two float32 operands as pieces and writes
the products. Builds for sm_90a on the CPU; against float64 on the GPU. The selection kernel's
tensor-core scoring (tests/nsa/test_nsa_selection.py) is this plus its staging and ranking: a
failure here points at the products, one there alone at the rest."""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import BFloat16, Float32

from gpu_marks import requires_sm90
from kernels.sm90 import split_products


@dataclass(frozen=True)
class ProductsSpec:
    rows: int  # a multiple of 16
    cols: int  # a multiple of 32 (4 warps x 8 columns)
    dim: int  # a multiple of 16


class SplitProductsCheck:
    """out (rows, cols) float32 = a (rows, dim) float32 . b (cols, dim)^T, one CTA of 4 warps."""

    def __init__(self, spec: ProductsSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, stream):
        spec = self.spec
        smem = (split_products.piece_bytes(spec.rows, spec.dim)
                + split_products.piece_bytes(spec.cols, spec.dim)
                + 4 * spec.rows * spec.cols + 16 * 8)
        self.kernel(a, b, out).launch(grid=[1, 1, 1], block=[128, 1, 1], smem=smem,
                                      stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        a_pieces = [smem.allocate_tensor(BFloat16, split_products.piece_layout(
            spec.rows, spec.dim), byte_alignment=16) for _ in range(split_products.PIECES)]
        b_pieces = [smem.allocate_tensor(BFloat16, split_products.piece_layout(
            spec.cols, spec.dim), byte_alignment=16) for _ in range(split_products.PIECES)]
        products = smem.allocate_tensor(Float32, cute.make_layout(
            (spec.rows, spec.cols), stride=(spec.cols, 1)), byte_alignment=16)
        self.stage(a, a_pieces, spec.rows, tidx)
        self.stage(b, b_pieces, spec.cols, tidx)
        cute.arch.sync_threads()
        split_products.split_products(split_products.make_tiled_mma(4), tidx, a_pieces,
                                      b_pieces, products, spec.rows, spec.cols)
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, spec.rows * spec.cols, 128):
            out[i // spec.cols, i % spec.cols] = products[i // spec.cols, i % spec.cols]

    @cute.jit
    def stage(self, source: cute.Tensor, pieces, rows: cutlass.Constexpr, tidx):
        vectors = self.spec.dim // 4
        for i in cutlass.range(tidx, rows * vectors, 128):
            values = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            cute.autovec_copy(cute.local_tile(source[i // vectors, None], (4,), (i % vectors,)),
                              values)
            split_products.store_pieces(values, pieces, i // vectors, i % vectors, 4)


def _fake_arguments(spec: ProductsSpec):
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_compact_tensor

    def matrix(rows, cols):
        return make_fake_compact_tensor(Float32, (rows, cols), stride_order=(1, 0),
                                        assumed_align=16)
    return matrix(spec.rows, spec.dim), matrix(spec.cols, spec.dim), matrix(spec.rows, spec.cols)


SPECS = [ProductsSpec(16, 64, 128), ProductsSpec(64, 32, 64), ProductsSpec(32, 64, 256)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.rows}x{s.cols}x{s.dim}")
def test_split_products_build_for_sm90(spec):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    assert cute.compile(SplitProductsCheck(spec), *_fake_arguments(spec), make_fake_stream())


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.rows}x{s.cols}x{s.dim}")
def test_split_products_equal_float64_products_to_float32_precision(spec):
    """Random float32 operands (of mixed magnitudes, so every piece matters): the products
    within 2**-18 of the sum of |a_k b_k| of the float64 ones (float32 accumulation over up to
    256 terms, allowing the tensor core's adds to truncate), and 100x closer than a plain bf16
    product; every (row, column) in its place (a misplaced one misses by O(1))."""
    from kernels.sm90.launch import launch_on_current_stream

    gen = torch.Generator().manual_seed(spec.rows + spec.cols + spec.dim)
    scale = torch.exp(torch.randn(1, spec.dim, generator=gen))
    a = (torch.randn(spec.rows, spec.dim, generator=gen) * scale).cuda()
    b = (torch.randn(spec.cols, spec.dim, generator=gen) * scale).cuda()
    out = torch.full((spec.rows, spec.cols), float("nan"), device="cuda")
    launch_on_current_stream(SplitProductsCheck, spec, _fake_arguments, (a, b, out), a.device)
    expected = a.double() @ b.double().T
    bound = (a.double().abs() @ b.double().abs().T) * 2 ** -18
    assert torch.all((out.double() - expected).abs() <= bound)
    bf16_error = ((a.bfloat16().double() @ b.bfloat16().double().T) - expected).abs()
    assert bf16_error.max() > 100 * (out.double() - expected).abs().max()
