"""Selection's block ranking: per row, the `width` best blocks, in ascending block order.

nsa()'s selection scores every block of every (query tile, KV head) row and keeps the forced
blocks (score +inf) plus the best candidates, equal scores going to the lower block index
(`nsa.selection._top_blocks`, whose torch path is a stable descending sort of every row). At
256K tokens that is 16K rows of 4096 blocks and the sort took 2.7 ms of a 40 ms forward (H100,
2026-11-25; an int64 top-k with the index in the key took 5.3 ms). A row needs only its first
`width` ranks (16 + 3 at the defaults), so this kernel ranks by repeated selection instead:

- one warp per row, four rows per CTA; lane l reads blocks l, l + 32, ... (coalesced, from L1
  after the first round);
- each block's key is one int64: the float32 score made order-preserving as a signed integer
  (-0.0 as +0.0, every NaN as one positive NaN above +inf, as torch.sort ranks them) in the
  high half, the reversed block index in the low half, so keys are distinct and "larger" is
  "ranked first";
- each lane keeps its best `width` keys in registers over one pass of its blocks, then
  `width` rounds of a butterfly max over the lanes' heads (the winner pops its head) leave
  rank r in lane r. (The first version, 2026-11-25, scanned the row once per rank: 2.68 ms at
  256K, no faster than the sort.)

A rank is kept if it is below the row's limit (width, or the forced blocks + num_candidates
when that is given) and its score is neither -inf (a block the tile cannot see) nor NaN; the
kept blocks are written in ascending order, then -1. Equal to the sort's lists bit for bit
(tests/nsa/test_nsa_selection.py, GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from kernels.sm90.row_dot import lane_group_reduce, lane_group_sum

WARP = 32
ROWS_PER_CTA = 4
MAX_WIDTH = WARP  # one rank per lane
_NAN_BITS = 0x7FC00000
_NEG_ZERO_BITS = -0x80000000  # 0x80000000 as a signed 32-bit value
_MINUS_INF_ORDERED = -0x7F800001  # order_preserving(bits of -inf)
_PLUS_INF_ORDERED = 0x7F800000  # positive bits keep their value
_NAN_ORDERED = _NAN_BITS  # positive bits keep their value
_NONE = -0x7FFFFFFFFFFFFFFF - 1  # below every key: no block


@dataclass(frozen=True)
class TopBlocksSpec:
    """What a build fixes: the ranks per row and whether a candidate limit applies."""
    width: int
    limited: bool  # keep the forced blocks + `num_candidates` only (else `width`)

    def __post_init__(self):
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width {self.width} (expected 1..{MAX_WIDTH})")


class TopBlocksSm90:
    """Called with (key, out, num_candidates): key (R, B) float32 rows with unit column
    stride, out (R, width) int32 contiguous."""

    def __init__(self, spec: TopBlocksSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, key: cute.Tensor, out: cute.Tensor, num_candidates: Int32, stream):
        rows = cute.size(key.shape[0])
        self.kernel(key, out, num_candidates).launch(
            grid=[cute.ceil_div(rows, ROWS_PER_CTA), 1, 1], block=[WARP * ROWS_PER_CTA, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, key: cute.Tensor, out: cute.Tensor, num_candidates: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        row = cta * ROWS_PER_CTA + tidx // WARP
        if row < cute.size(key.shape[0]):
            self.rank_row(key, out, row, lane, num_candidates)

    @cute.jit
    def rank_row(self, key: cute.Tensor, out: cute.Tensor, row: Int32, lane: Int32,
                 num_candidates: Int32):
        width = self.spec.width
        blocks = cute.size(key.shape[1])
        # Each lane keeps its own best `width` keys in registers, and counts the forced blocks
        # (+inf) it reads.
        top = new_ranks(width)
        forced = Int32(0)
        for block in cutlass.range(lane, blocks, WARP, unroll=2):
            candidate = ordered_key(key[row, block], block, blocks)
            if const_expr(self.spec.limited):
                if Int32(candidate >> 32) == Int32(_PLUS_INF_ORDERED):
                    forced += 1
            keep_best(top, candidate)
        limit = Int32(width)
        if const_expr(self.spec.limited):
            limit = cutlass.min(limit, lane_group_sum(forced, WARP) + num_candidates)
        write_ranks(top, out[row, None], lane, limit, blocks)


# ------------------------------------------------------------------------------------------------
# The ranking, shared with the fused selection kernel (kernels/sm90/select_blocks.py): a row is
# ranked by one warp, each lane keeping its best keys in an rmem tensor of `width` Int64.
# ------------------------------------------------------------------------------------------------


def new_ranks(width: int) -> cute.Tensor:
    """A lane's empty ranking: `width` keys, all below every block's key."""
    top = cute.make_rmem_tensor(cute.make_layout(width), Int64)
    for j in range(width):  # traced once per key: unrolled
        top[j] = Int64(_NONE)
    return top


@cute.jit
def ordered_key(value: Float32, block: Int32, blocks: Int32) -> Int64:
    """Block `block`'s int64 rank key for score `value` (module docstring); `blocks` bounds the
    row's block indices (the low half holds blocks - 1 - block)."""
    bits = _float_bits(value)
    if value != value:
        bits = Int32(_NAN_BITS)
    if bits == Int32(_NEG_ZERO_BITS):
        bits = Int32(0)
    ordered = bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))
    return (Int64(ordered) << 32) | Int64(blocks - 1 - block)


def forced_key(block: Int32, blocks: Int32) -> Int64:
    """The rank key of a forced block (score +inf)."""
    return (Int64(_PLUS_INF_ORDERED) << 32) | Int64(blocks - 1 - block)


@cute.jit
def keep_best(top: cute.Tensor, candidate: Int64):
    """Insert `candidate` into the lane's descending keys `top` if it beats the last (then it
    bubbles up: unrolled max/min pairs; the last key falls out)."""
    width = cute.size(top.shape)
    if candidate > top[width - 1]:
        for j in cutlass.range_constexpr(width):
            higher = cutlass.max(top[j], candidate)
            candidate = cutlass.min(top[j], candidate)
            top[j] = higher


@cute.jit
def merge_ranks(top: cute.Tensor, lane: Int32, limit: Int32, blocks: Int32):
    """Merge the warp's lanes' keys: lane r gets rank r's block, whether it is kept (rank below
    `limit`, score neither -inf nor NaN) and its place among the kept blocks in ascending order
    (or, not kept, among the others by rank); also the number kept. Every lane of the warp must
    call it (warp shuffles); `top` is emptied."""
    width = cute.size(top.shape)
    # Round r takes the largest head over the warp (keys are distinct, so one lane holds it)
    # and that lane pops it.
    mine = Int64(_NONE)  # lane r: rank r's key
    for rank in cutlass.range_constexpr(width):
        head = top[0]
        best = lane_group_reduce(head, WARP, cutlass.max)
        if lane == rank:
            mine = best
        if head == best:
            for j in cutlass.range_constexpr(width - 1):
                top[j] = top[j + 1]
            top[width - 1] = Int64(_NONE)
    # Lane r: rank r's block if kept (limit <= width; no block, _NONE, orders below -inf),
    # then its place in ascending order.
    ordered = Int32(mine >> 32)
    block = blocks - 1 - Int32(mine & Int64(0xFFFFFFFF))
    kept = (lane < limit) & (ordered > Int32(_MINUS_INF_ORDERED)) & (
        ordered != Int32(_NAN_ORDERED))
    num_kept = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(kept)))
    place = Int32(0)
    for other in cutlass.range_constexpr(width):
        other_block = cute.arch.shuffle_sync(block, other)
        other_kept = cute.arch.shuffle_sync(Int32(kept), other)
        if kept:
            if (other_kept != 0) & (other_block < block):
                place += 1
        else:
            if (other_kept == 0) & (other < lane):
                place += 1
    return block, kept, place, num_kept


@cute.jit
def write_ranks(top: cute.Tensor, out_row: cute.Tensor, lane: Int32, limit: Int32,
                blocks: Int32):
    """`merge_ranks`, then the kept blocks written in ascending order, then -1, to out_row
    (`width` int32). Every lane of the warp must call it."""
    width = cute.size(top.shape)
    block, kept, place, num_kept = merge_ranks(top, lane, limit, blocks)
    if lane < width:
        if kept:
            out_row[place] = block
        else:
            out_row[num_kept + place] = Int32(-1)


def _float_bits(value: Float32) -> Int32:
    """The IEEE bits of a float32 as a signed 32-bit integer."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Int32(llvm.bitcast(T.i32(), value.ir_value()))


def fake_arguments(spec: TopBlocksSpec):
    """Fake (key, out, num_candidates) for a CPU build (CUTE_DSL_ARCH=sm_90a)."""
    from cutlass.cute.runtime import make_fake_tensor

    rows = cute.sym_int()
    key = make_fake_tensor(Float32, (rows, cute.sym_int()), stride=(cute.sym_int64(), 1),
                           assumed_align=4)
    out = make_fake_tensor(Int32, (rows, spec.width), stride=(spec.width, 1), assumed_align=4)
    return key, out, Int32(0)


def compile_on_fake_tensors(spec: TopBlocksSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(TopBlocksSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches (nsa/selection.py `_top_blocks`).
# ------------------------------------------------------------------------------------------------


def can_run(key, width: int) -> bool:
    """Whether the kernel ranks `key` (..., B) float32 for `width` ranks (the device is
    `kernels.dispatch`'s question)."""
    import torch

    return (key.dtype == torch.float32 and 1 <= width <= MAX_WIDTH and key.shape[-1] > 0
            and key.numel() > 0)


def run(key, width: int, num_candidates: int | None):
    """(..., width) int32: `nsa.selection._top_blocks`'s lists for key (..., B) float32."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    rows = key.reshape(-1, key.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=torch.int32, device=key.device)
    spec = TopBlocksSpec(width, num_candidates is not None)
    launch_on_current_stream(TopBlocksSm90, spec, fake_arguments,
                             (rows, out, num_candidates or 0), key.device)
    return out.view(*key.shape[:-1], width)
