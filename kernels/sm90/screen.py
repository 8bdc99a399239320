"""A diagnostic of the sm90 forward (`FwdSpec.screen_masked_v`): the V stage of every masked KV
tile read once more for non-finite values before its P V product.

Why it exists: a probability masked to exactly 0 still multiplies its V row inside the P V
wgmma, so a NaN or inf at a key that a row cannot see reaches that row when its CTA loads the
key's tile (docs/interfaces.md lists where). Any exact fix must first know whether a masked
tile holds such a value, so it pays at least this read of the tile on every masked tile; the
fix itself (a sanitised V stage and a per-row correction for the rare tile that holds one) comes
on top. This build pays the read and only records what it found, which makes it the lower bound
of that cost, with one reservation: so that the read precedes the P V, the build waits for
each tile's V before issuing its Q K^T, on every tile (a fix would pay that too). The tool:
tools/tune_sm90_forward.py, variant "dispatched+screen" (issue 16, docs/history.md "Non-finite
values in masked tiles").
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Uint32

from kernels.sm90.pipelines import stage_index

# Exponent bits of both 16-bit halves of a 32-bit word, and the add that carries into each
# half's top bit exactly when its exponent is all ones (inf or NaN).
_EXPONENTS = {"bfloat16": (0x7F807F80, 0x00800080), "float16": (0x7C007C00, 0x04000400)}
_TOP_BITS = 0x80008000
_VECTOR = 4  # 32-bit words per load: 16 bytes


@dataclass(frozen=True)
class MaskedValueScreen:
    """Reads a V stage as raw 32-bit words, one warpgroup at a time (each warpgroup masks its
    own rows), and sets flag[0] = 1 when any element is non-finite. The swizzle does not
    matter: the whole stage is read. Build it with `masked_value_screen`."""
    words: cute.Tensor     # (VECTOR, 128 threads, rounds, stage): the V stages as uint32
    flag: cute.Tensor      # (1,) int32 in global memory
    exponents: cutlass.Constexpr[int]
    carry: cutlass.Constexpr[int]
    num_stages: cutlass.Constexpr[int]

    @cute.jit
    def __call__(self, v_handle, tidx):
        """Screen the stage `v_handle` holds; tidx is the thread's index among the consumers."""
        mine = self.words[None, tidx % 128, None, stage_index(v_handle, self.num_stages)]
        loaded = cute.make_rmem_tensor(cute.make_layout(_VECTOR), Uint32)
        seen = Uint32(0)
        for r in cutlass.range_constexpr(cute.size(mine, mode=[1])):
            cute.autovec_copy(mine[None, r], loaded)
            for e in cutlass.range_constexpr(_VECTOR):
                seen = seen | ((loaded[e] & Uint32(self.exponents)) + Uint32(self.carry))
        if (seen & Uint32(_TOP_BITS)) != Uint32(0):
            self.flag[0] = 1


def masked_value_screen(sV_base, flag, dtype: str, tile_n: int, head_dim: int,
                        num_stages: int) -> MaskedValueScreen:
    """The screen of the V buffer starting at `sV_base` (num_stages stages of tile_n x
    head_dim 16-bit elements)."""
    words = tile_n * head_dim // 2
    assert words % (_VECTOR * 128) == 0
    rounds = words // (_VECTOR * 128)
    view = cute.make_tensor(
        cute.recast_ptr(sV_base, dtype=Uint32),
        cute.make_layout((_VECTOR, 128, rounds, num_stages),
                         stride=(1, _VECTOR, _VECTOR * 128, words)))
    exponents, carry = _EXPONENTS[dtype]
    return MaskedValueScreen(view, flag, exponents, carry, num_stages)
