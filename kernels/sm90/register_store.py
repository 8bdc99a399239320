"""Rows of a wgmma accumulator stored straight from registers into a (T, heads, D) tensor, each
row predicated on the sequence's length: the backward's dK, dV (KV-centric kernel) and dQ
(query-centric kernel). A TMA store of the tile would also write the rows past the sequence
end, which belong to the next sequence in a packed batch."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.layouts import acc_mn_view


def _tile_rows(thr_mma, m_out: cute.Tensor, offset: Int32, head: Int32, block: Int32,
               tile_rows: int, head_dim: int):
    """(g_mn, c_mn): this thread's cells of rows [block * tile_rows, +tile_rows) of the sequence
    starting at `offset` in m_out[:, head, :] and their (row, column) coordinates in the tile,
    both as (rows, columns) views of the accumulator's fragment (`acc_mn_view`)."""
    m_seq = cute.domain_offset((offset, 0), m_out[None, head, None])
    g_mn = acc_mn_view(thr_mma.partition_C(
        cute.local_tile(m_seq, (tile_rows, head_dim), (block, 0))))
    c_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_rows, head_dim))))
    return g_mn, c_mn


def _column_pair(c: int, col_groups: int):
    """The fragment's c-th pair of adjacent columns in an `acc_mn_view` row."""
    return (None, c % col_groups, c // col_groups)


@cute.jit
def store_rows_from_registers(thr_mma, acc: cute.Tensor, m_out: cute.Tensor, offset: Int32,
                              head: Int32, block: Int32, tile_rows: cutlass.Constexpr[int],
                              head_dim: cutlass.Constexpr[int], seqlen: Int32, dtype,
                              accumulate: cutlass.Constexpr[bool] = False):
    """acc (this thread's fragment of a tile_rows x head_dim accumulator of `thr_mma`) converted
    to `dtype` and written to rows [block * tile_rows, +tile_rows) of the sequence starting at
    `offset` in m_out[:, head, :], rows at or past `seqlen` skipped; one 32-bit store per pair
    of adjacent columns (64-bit for float32; m_out's row strides must be known multiples of 8
    elements). With `accumulate` the values m_out holds are added first (in float32, rounded
    once)."""
    out = cute.make_rmem_tensor_like(acc, dtype)
    if const_expr(not accumulate):
        out.store(acc.load().to(dtype))
    g_mn, c_mn = _tile_rows(thr_mma, m_out, offset, head, block, tile_rows, head_dim)
    o_mn = acc_mn_view(out)
    a_mn = acc_mn_view(acc)
    pair_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                                     num_bits_per_copy=2 * dtype.width)
    col_groups = cute.size(o_mn.shape[1][1])
    num_pairs = cute.size(o_mn, mode=[1]) // 2
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        if block * tile_rows + c_mn[r, 0][0] < seqlen:
            for c in cutlass.range_constexpr(num_pairs):
                pair = _column_pair(c, col_groups)
                if const_expr(accumulate):
                    held = cute.make_rmem_tensor_like(o_mn[r, pair], dtype)
                    cute.copy(pair_store, g_mn[r, pair], held)
                    o_mn[r, pair].store(
                        (a_mn[r, pair].load() + held.load().to(Float32)).to(dtype))
                cute.copy(pair_store, o_mn[r, pair], g_mn[r, pair])


@cute.jit
def reduce_rows_from_registers(thr_mma, acc: cute.Tensor, m_out: cute.Tensor, offset: Int32,
                               head: Int32, block: Int32, tile_rows: cutlass.Constexpr[int],
                               head_dim: cutlass.Constexpr[int], seqlen: Int32):
    """acc (float32, as in `store_rows_from_registers`) added into the float32 rows of m_out
    that several CTAs share, rows at or past `seqlen` skipped: one `red.global.add.v2.f32` per
    pair of adjacent columns (m_out's row strides must be known multiples of 2 elements). Half
    the reductions of one per value; the split-list backward issues them at the end of each
    work unit, a burst no compute hides (32K values per 128-key unit)."""
    g_mn, c_mn = _tile_rows(thr_mma, m_out, offset, head, block, tile_rows, head_dim)
    a_mn = acc_mn_view(acc)
    col_groups = cute.size(a_mn.shape[1][1])
    num_pairs = cute.size(a_mn, mode=[1]) // 2
    for r in cutlass.range_constexpr(cute.size(a_mn, mode=[0])):
        if block * tile_rows + c_mn[r, 0][0] < seqlen:
            for c in cutlass.range_constexpr(num_pairs):
                pair = _column_pair(c, col_groups)
                cute.arch.red(g_mn[r, pair].iterator, a_mn[r, pair].load(), op="add",
                              dtype="f32", sem="relaxed", scope="gpu")
