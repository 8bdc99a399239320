"""The dS tiles a 64-key backward hands its dQ kernel (`BwdSpec.stores_ds`, `DqSpec.reads_ds`).

A tile is one KV-centric step's dS^T: 64 keys x 64 query rows of one head, 16-bit, 8 KiB. The
KV-centric kernel holds it as a wgmma accumulator fragment with keys as rows; the dQ kernel
needs dS with query rows as rows, as the register A operand of dQ = dS K. Both fragments are
made of 8 x 8 matrices in the ldmatrix lane layout (lane l: row l / 4, columns 2 (l % 4) and
+1, one 32-bit register), so the tile is stored as those registers and each matrix is
transposed in registers by `movmatrix.trans` on the way in. Neither kernel transposes
through shared memory (the dQ kernel stages the stored bytes as they are), and every access is
a 16-byte vector of a warp's 512 contiguous bytes:

- KV side, thread t = 32 w' + l of the consumer warpgroup (keys 16 w' + l / 4 + 8 r2', query
  rows 8 g' + 2 (l % 4) + c2, register order c2 + 2 r2' + 4 g'): its values [8 p, 8 p + 8), the
  four matrices (key octets 2 w', 2 w' + 1) x (row octets 2 p, 2 p + 1), go to elements
  (p x 128 + t) x 8 of the tile;
- dQ side, thread 32 w + l (query rows 16 w + l / 4 + 8 r2, keys 8 g + 2 (l % 4) + c2): its
  rows are row octets 2 w, 2 w + 1, so it loads the vectors p = w of the four KV warps w',
  and A register (r2 + 2 g) is the transpose of register (g % 2) + 2 r2 of warp g // 2's
  vector.

Tile t of a call = (forward-list slot x heads per list + head in the list) x 2 + 64-row half
(kernels/sm90/bwd_sm90.py `walk_list`, kernels/sm90/bwd_dq_from_ds.py).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.sm90.spec import DS_TILE_ELEMENTS

_WARPGROUP = 128
_VECTOR = 8  # 16-bit values per 16-byte vector
_VECTORS = DS_TILE_ELEMENTS // _WARPGROUP // _VECTOR  # per thread: 4


def _kv_side_layout() -> cute.Layout:
    """(value, thread) -> element of a tile, for the KV-centric kernel's consumer thread."""
    return cute.make_layout(((_VECTOR, _VECTORS), _WARPGROUP),
                            stride=((1, _VECTOR * _WARPGROUP), _VECTOR))


def _dq_side_layout() -> cute.Layout:
    """(32-bit register, (lane, warp)) -> 32-bit word of a tile, for a dQ consumer thread:
    four words of warp w' 's vector p = w, for w' = 0..3."""
    words = _VECTOR // 2
    return cute.make_layout(((words, 4), (32, 4)),
                            stride=((1, 32 * words), (words, _WARPGROUP * words)))


@cute.jit
def store_ds_tile(values: cute.Tensor, tile: cute.Pointer, tidx: Int32):
    """The KV-centric side: `values` (this thread's 32 16-bit dS^T values in the accumulator's
    register order) into the tile at `tile` (16-byte aligned): four 16-byte stores."""
    mine = cute.make_tensor(tile, _kv_side_layout())[None, tidx % _WARPGROUP]
    cute.autovec_copy(cute.make_tensor(values.iterator, cute.make_layout(cute.size(mine))), mine)


@cute.jit
def load_ds_words(tile: cute.Pointer, tidx: Int32, words: cute.Tensor):
    """The dQ side, first half: this thread's 16 32-bit words of the tile at `tile` (16-byte
    aligned; the dQ kernel's stage in shared memory) into `words` (Int32 registers): four
    16-byte loads."""
    g = cute.make_tensor(cute.recast_ptr(tile, dtype=Int32), _dq_side_layout())
    cute.autovec_copy(g[None, tidx % _WARPGROUP], words)


@cute.jit
def ds_words_as_a_operand(words: cute.Tensor, a_words: cute.Tensor):
    """The dQ side, second half: the words `load_ds_words` read, transposed matrix by matrix,
    into `a_words` (an Int32 view of the dQ product's 16-bit A fragment, 64 rows x 64 keys)."""
    for g in cutlass.range_constexpr(8):
        for r2 in cutlass.range_constexpr(2):
            a_words[r2 + 2 * g] = transpose_8x8(words[(g % 2) + 2 * r2 + 4 * (g // 2)])


@dsl_user_op
def transpose_8x8(word: Int32, *, loc=None, ip=None) -> Int32:
    """This lane's register of the transpose of a warp's 8 x 8 16-bit matrix (ldmatrix lane
    layout in and out): `movmatrix.sync.aligned.m8n8.trans.b16`."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
