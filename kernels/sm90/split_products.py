"""Float32 dot products on bf16 tensor cores, by splitting each operand into three bf16 pieces.

A float32 x is hi + mid + lo with hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid):
three 8-bit significands cover x's 24 bits (each remainder is exact in float32). A product
x * y is then the sum of the nine piece products; the six whose pieces' ranks add up to at most
2 (`TERMS`) keep it to about float32's precision (the three dropped terms are below 2**-24 of
it), and each piece product is exact in float32. The tensor core's own float32 additions may
truncate rather than round, so each k-block's six products go into a fresh accumulator, added
to the running sum by an ordinary (rounding) float32 add: truncation then touches sums of 16
products only, never the running total. So a (M x K) by
(K x N) float32 product costs six bf16 `mma.sync` products instead of M N K float32 FMAs: the
ranking in `select_blocks.py` needs float32 scores (near-ties must fall as the torch path and the
reference let them fall), and the FMA version of its scoring is bound by shared-memory reads.

Pieces live in shared memory as bf16 rows of `row_stride(D)` elements: 8 elements of padding
per row make the row stride 4 banks mod 32, so the 32-bit fragment loads of the 8 rows one
load instruction touches fall on distinct banks.

Non-finite values: a piece split of +-inf (or of a finite value beyond bf16's range) keeps
hi = +-inf and zero remainders, so the product is +-inf as in float32 (no inf - inf = NaN from
the remainders); a NaN stays NaN.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import warp

PIECES = 3
# (query piece, key piece) products kept, smallest first so the large terms are added last.
TERMS = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))
MMA_M, MMA_N, MMA_K = 16, 8, 16
_ROW_PAD = 8  # bf16 elements after each row


def row_stride(dim: int) -> int:
    """Elements from one bf16 piece row to the next in shared memory."""
    return dim + _ROW_PAD


def piece_layout(rows: int, dim: int):
    """The shared-memory layout of one piece: (rows, dim) bf16, padded rows."""
    return cute.make_layout((rows, dim), stride=(row_stride(dim), 1))


def piece_bytes(rows: int, dim: int) -> int:
    """Shared-memory bytes of the PIECES pieces of a (rows, dim) operand."""
    return PIECES * rows * row_stride(dim) * 2


@cute.jit
def store_pieces(values: cute.Tensor, pieces, row, part, vector: cutlass.Constexpr):
    """The float32 vector `values` (`vector` elements) split into its three bf16 pieces, each
    stored at (row, vector elements number `part`) of its piece tensor in `pieces`."""
    rest = values.load()
    for p in cutlass.range_constexpr(PIECES):
        piece = cute.make_rmem_tensor(cute.make_layout(vector), BFloat16)
        piece.store(rest.to(BFloat16))
        if cutlass.const_expr(p + 1 < PIECES):
            taken = piece.load().to(Float32)
            # taken - taken is 0 for a finite piece and NaN for +-inf or NaN: then the
            # remainders are 0 (the module docstring's non-finite values).
            rest = cute.where((taken - taken) == Float32(0.0), rest - taken, Float32(0.0))
        cute.autovec_copy(piece, cute.local_tile(pieces[p][row, None], (vector,), (part,)))


def make_tiled_mma(warps: int):
    """bf16 m16n8k16 products with float32 accumulators, the `warps` warps side by side along N
    (each takes its own columns: the rows are few, the columns many)."""
    return cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (MMA_M, MMA_N, MMA_K)),
                               (1, warps, 1))


@cute.jit
def split_products(tiled_mma: cute.TiledMma, tidx, a_pieces, b_pieces, out: cute.Tensor,
                   rows: cutlass.Constexpr, cols: cutlass.Constexpr):
    """out[r, c] = sum_k A[r, k] B[c, k] in float32 precision, for the (rows, K) operand A and
    the (cols, K) operand B given as their bf16 pieces in shared memory (`store_pieces`); out a
    float32 (rows, cols) shared-memory tensor. Every thread of the tiled MMA takes part; the
    caller synchronises before reading `out` (and before rewriting the pieces)."""
    thr_mma = tiled_mma.get_slice(tidx)
    a_views = [thr_mma.partition_A(a_pieces[p]) for p in range(PIECES)]
    b_views = [thr_mma.partition_B(b_pieces[p]) for p in range(PIECES)]
    a_frags = [thr_mma.make_fragment_A(view) for view in a_views]
    b_frags = [thr_mma.make_fragment_B(view) for view in b_views]
    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((rows, cols)), Float32)
    acc.fill(0.0)
    block = cute.make_rmem_tensor(thr_mma.partition_shape_C((rows, cols)), Float32)
    for k in cutlass.range_constexpr(cute.size(a_views[0], mode=[2])):
        for p in cutlass.range_constexpr(PIECES):
            cute.autovec_copy(a_views[p][None, None, k], a_frags[p][None, None, k])
            cute.autovec_copy(b_views[p][None, None, k], b_frags[p][None, None, k])
        # This k-block's products in a fresh accumulator, then one rounding add (docstring).
        block.fill(0.0)
        for pa, pb in TERMS:
            cute.gemm(tiled_mma, block, a_frags[pa][None, None, k],
                      b_frags[pb][None, None, k], block)
        acc.store(acc.load() + block.load())
    # Each accumulator element's (row, column), from the same partition of an identity tensor.
    coords = thr_mma.partition_C(cute.make_identity_tensor((rows, cols)))
    for i in cutlass.range_constexpr(cute.size(acc)):
        r, c = coords[i]
        out[r, c] = acc[i]
