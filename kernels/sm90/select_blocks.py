"""Selection's scoring and ranking in one kernel: per (query tile, KV head) the selected blocks,
straight from the scoring queries and the compressed keys.

`nsa.selection` computes, per query tile and KV head, the softmax of each group head's scoring
query against the compressed tokens its anchor sees, sums it over the group, and ranks the
blocks (forced ones first, candidates by that importance, ties to the lower block). In torch
that is ~60 launches per call and a (heads x tiles x tokens) score tensor (1 GiB at 256K tokens,
chunked beyond); here it is one launch and nothing but the lists is written. This kernel serves
selected blocks of one compressed token each (selected_block_size == compress_block_size, the
default), where a block's importance is its token's weight; other sizes take the torch path.

- One CTA per TILES_PER_CTA consecutive tiles and one KV head, one warp per tile. The tiles'
  compressed keys (float32) are staged in shared memory `tokens_per_chunk` rows at a time and
  shared by the warps; lane l scores tokens `chunk + l + 32 j` (j < tokens_per_lane) against
  its tile's group heads (the scaled scoring queries sit in shared memory, read as
  broadcasts). Shared memory bandwidth is the limit (ncu, H200, 256K tokens, one token per
  lane: L1 92% busy, issue 47%): per 4 head-dim elements a lane reads each of its tokens' key
  (4 wavefronts per warp) and each group head's query (1 wavefront), for 4 x group FMAs per
  token. Several tokens per lane share the query reads, so the reads per FMA fall from
  (4 + group) / (4 group) toward 1 / group.
- Two passes over the tokens the tile's anchor sees: the first keeps each lane's running max
  and sum per head and merges them over the warp (the softmax's max and denominator); the second
  scores the candidate blocks again, sums the group's probabilities and keeps each lane's best
  `width` rank keys in registers (kernels/sm90/top_blocks.py's ranking: the same keys, the same
  warp merge, so ties and NaNs rank as the sort ranks them).
- Forced blocks (block 0 and the tile's diagonal blocks) enter the ranking as +inf without a
  score.
- The sparse compressed branch's lists too, where a build has `cmp_width` (nsa()'s
  num_cmp_selected_blocks): pass 2 then weighs every token the anchor sees, and the warp sums
  each KV block of `cmp_kv_block` compressed tokens (a chunk of at most that many tokens
  touches two blocks: the one open since the last chunk and the next); a block's sum is ranked
  by lane `block % 32` once the block is complete, and the second ranking is merged as the
  first (forced: block 0 where the sequence has one, and the diagonal blocks; at most the
  forced ones + `num_cmp_candidates` kept).
- The tensor-core build (`SelectBlocksSpec.tensor_cores`, `run(..., tensor_cores=True)`; not
  dispatched: the argument defaults to False) stages the queries and each 64-key chunk as bf16
  pieces and has all four warps compute the CTA's (tiles x group) x 64 scores with `mma.sync`
  (kernels/sm90/split_products.py: float32 precision from six bf16 products); the scores go
  through shared memory to the warps, and passes 1 and 2 go on as above.

Inputs: q_bar (R, H, D) float32, keys (Tc, Hkv, D) float32, tiles (R, TILE_FIELDS) int32 per
tile: its sequence's first packed compressed token, the tokens its anchor sees, the candidates'
end and the forced blocks' end (`nsa.selection`'s `_BlockRanges`), the selected lists' class
bounds, and the sparse compressed branch's candidates' end and forced end; out (R, Hkv, width)
int32, cmp_out (R, Hkv, cmp_width) int32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from kernels.sm90 import split_products
from kernels.sm90.layouts import with_row_strides_divisible
from kernels.sm90.row_dot import lane_group_reduce, lane_group_sum
from kernels.sm90.spec import SMEM_PER_CTA
from kernels.sm90.top_blocks import (MAX_WIDTH, WARP, forced_key, keep_best, merge_ranks,
                                     new_ranks, ordered_key)

TILES_PER_CTA = 4
MAX_TOKENS_PER_LANE = 4
# The tensor-core build's chunk: 2 tokens per lane (64 keys), 16 per warp in the products.
TENSOR_CORE_TOKENS_PER_LANE = 2
_SCORE_PAD = 4  # floats after each row of the tensor-core build's staged scores
VECTOR = 4  # float32 per 16-byte access
_PAD = VECTOR  # floats after each staged key row: 16-byte reads of 8 lanes hit distinct banks
MAX_GROUP = 16  # per lane: a score, a running max and a running sum per head in registers
HEAD_DIMS = (64, 128, 192, 256)
# Per tile: token start, tokens seen, candidate end, forced end; the selected branch's list
# classes: blocks below n_full are full, those below n_visible need the mask, later ones are
# dropped (sparsity._geometry.visible_block_range); the sparse compressed branch's candidate
# end and forced end (0 and 0 without that branch).
TILE_FIELDS = 8
_LOG2_E = math.log2(math.e)


def default_tokens_per_lane(group: int, tensor_cores: bool = False) -> int:
    """Tokens each lane scores per chunk: up to MAX_TOKENS_PER_LANE, fewer for large groups (a
    lane keeps tokens x group scores in registers, and at group 16 the query reads already
    outnumber the key reads 4 to 1); TENSOR_CORE_TOKENS_PER_LANE for the tensor-core build."""
    if tensor_cores:
        return TENSOR_CORE_TOKENS_PER_LANE
    return max(1, min(MAX_TOKENS_PER_LANE, MAX_GROUP // group))


@dataclass(frozen=True)
class SelectBlocksSpec:
    """What a build fixes: the head dim, the query heads per KV head, the ranks kept, and
    whether the selected branch's forward lists are written too (full lists of `width`, mask
    lists of `mask_width` entries: sparsity's trusted builder's layout and widths); the tokens
    each lane scores per chunk (None: `default_tokens_per_lane`); whether the scores come from
    tensor cores (`split_products`: six bf16 products per float32 one) instead of FMAs; the
    sparse compressed branch's ranks kept (`cmp_width`, 0: no such branch) and its KV block of
    compressed tokens."""
    head_dim: int
    group: int
    width: int
    writes_lists: bool = False
    mask_width: int = 0
    tokens_per_lane: int | None = None
    tensor_cores: bool = False
    cmp_width: int = 0
    cmp_kv_block: int = 128

    def __post_init__(self):
        if self.tokens_per_lane is None:
            object.__setattr__(self, "tokens_per_lane",
                               default_tokens_per_lane(self.group, self.tensor_cores))
        if not 1 <= self.tokens_per_lane <= MAX_TOKENS_PER_LANE:
            raise ValueError(f"tokens_per_lane {self.tokens_per_lane} (expected "
                             f"1..{MAX_TOKENS_PER_LANE})")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} (expected one of {HEAD_DIMS})")
        if not 1 <= self.group <= MAX_GROUP:
            raise ValueError(f"group {self.group} (expected 1..{MAX_GROUP})")
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width {self.width} (expected 1..{MAX_WIDTH})")
        if not 0 <= self.mask_width <= (WARP if self.writes_lists else 0):
            raise ValueError(f"mask_width {self.mask_width} (expected 0..{WARP} with lists, "
                             f"else 0)")
        if not 0 <= self.cmp_width <= MAX_WIDTH:
            raise ValueError(f"cmp_width {self.cmp_width} (expected 0..{MAX_WIDTH})")
        if self.cmp_width and self.cmp_kv_block < self.tokens_per_chunk:
            # A chunk must touch at most two KV blocks (the module docstring).
            raise ValueError(f"cmp_kv_block {self.cmp_kv_block} (expected at least the "
                             f"{self.tokens_per_chunk} tokens of a chunk)")
        if self.smem_bytes > SMEM_PER_CTA:
            raise ValueError(f"tokens_per_lane {self.tokens_per_lane} at head_dim "
                             f"{self.head_dim}, group {self.group}: {self.smem_bytes} bytes of "
                             f"shared memory (at most {SMEM_PER_CTA})")

    @property
    def tokens_per_chunk(self) -> int:
        return WARP * self.tokens_per_lane

    @property
    def score_rows(self) -> int:
        """The CTA's scoring queries (TILES_PER_CTA x group), in the tensor-core build rounded
        up to the products' 16 rows (the extra rows are zeros)."""
        rows = TILES_PER_CTA * self.group
        if not self.tensor_cores:
            return rows
        return -(-rows // split_products.MMA_M) * split_products.MMA_M

    @property
    def smem_bytes(self) -> int:
        if self.tensor_cores:
            scores = 4 * self.score_rows * (self.tokens_per_chunk + _SCORE_PAD)
            return (split_products.piece_bytes(self.score_rows, self.head_dim)
                    + split_products.piece_bytes(self.tokens_per_chunk, self.head_dim)
                    + scores + 16 * (2 * split_products.PIECES + 2))
        queries = TILES_PER_CTA * self.group * self.head_dim
        keys = self.tokens_per_chunk * (self.head_dim + _PAD)
        return 4 * (queries + keys) + 16


class SelectBlocksSm90:
    """The kernel for one `SelectBlocksSpec`; called with (q_bar, keys, tiles, out, full_count,
    full_index, mask_count, mask_index, cmp_out, num_cmp_candidates, scale), the four lists
    None without `writes_lists` (mask_index None also for a mask width of 0), cmp_out None
    without `cmp_width`."""

    def __init__(self, spec: SelectBlocksSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, q_bar: cute.Tensor, keys: cute.Tensor, tiles: cute.Tensor,
                 out: cute.Tensor, full_count: cute.Tensor | None, full_index: cute.Tensor | None,
                 mask_count: cute.Tensor | None, mask_index: cute.Tensor | None,
                 cmp_out: cute.Tensor | None, num_cmp_candidates: Int32, scale: Float32,
                 stream):
        # Rows of D float32 start 16 bytes apart (D is a multiple of 4): vector loads.
        q_bar, keys = with_row_strides_divisible(q_bar, VECTOR), with_row_strides_divisible(keys, VECTOR)
        grid = [cute.ceil_div(cute.size(q_bar.shape[0]), TILES_PER_CTA),
                cute.size(keys.shape[1]), 1]
        lists = (full_count, full_index, mask_count, mask_index)
        self.kernel(q_bar, keys, tiles, out, *lists, cmp_out, num_cmp_candidates,
                    scale * Float32(_LOG2_E)).launch(
            grid=grid, block=[WARP * TILES_PER_CTA, 1, 1], smem=self.spec.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, q_bar: cute.Tensor, keys: cute.Tensor, tiles: cute.Tensor,
               out: cute.Tensor, full_count: cute.Tensor | None, full_index: cute.Tensor | None,
               mask_count: cute.Tensor | None, mask_index: cute.Tensor | None,
               cmp_out: cute.Tensor | None, num_cmp_candidates: Int32, scale_log2: Float32):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        cta, kv_head, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        num_tiles = cute.size(q_bar.shape[0])
        first_tile = cta * TILES_PER_CTA
        tile = first_tile + warp

        smem = cutlass.utils.SmemAllocator()
        # The CTA's scoring queries, scaled by softmax_scale * log2(e): row warp * group + g;
        # the staged keys. Float32 rows for the FMA scoring; for the tensor-core build the bf16
        # pieces of both (split_products) and the chunk's scores.
        scores_stage = None
        tiled_mma = None
        if const_expr(spec.tensor_cores):
            query_stage = [smem.allocate_tensor(
                BFloat16, split_products.piece_layout(spec.score_rows, spec.head_dim),
                byte_alignment=16) for _ in range(split_products.PIECES)]
            key_stage = [smem.allocate_tensor(
                BFloat16, split_products.piece_layout(spec.tokens_per_chunk, spec.head_dim),
                byte_alignment=16) for _ in range(split_products.PIECES)]
            scores_stage = smem.allocate_tensor(Float32, cute.make_layout(
                (spec.score_rows, spec.tokens_per_chunk),
                stride=(spec.tokens_per_chunk + _SCORE_PAD, 1)), byte_alignment=16)
            tiled_mma = split_products.make_tiled_mma(TILES_PER_CTA)
        else:
            query_stage = smem.allocate_tensor(Float32, cute.make_layout(
                (spec.score_rows, spec.head_dim), stride=(spec.head_dim, 1)), byte_alignment=16)
            key_stage = smem.allocate_tensor(Float32, cute.make_layout(
                (spec.tokens_per_chunk, spec.head_dim), stride=(spec.head_dim + _PAD, 1)),
                byte_alignment=16)
        vectors_per_row = spec.head_dim // VECTOR
        for i in cutlass.range(tidx, spec.score_rows * vectors_per_row, WARP * TILES_PER_CTA):
            row, part = i // vectors_per_row, i % vectors_per_row
            t = first_tile + row // spec.group
            values = cute.make_rmem_tensor(cute.make_layout(VECTOR), Float32)
            values.fill(0.0)
            # Rows past the CTA's tiles (the tensor-core build's padding to 16) stay zero.
            if (t < num_tiles) & (row < TILES_PER_CTA * spec.group):
                cute.autovec_copy(cute.local_tile(
                    q_bar[t, kv_head * spec.group + row % spec.group, None], (VECTOR,), (part,)),
                    values)
            values.store(values.load() * scale_log2)
            self.store_row_part(values, query_stage, row, part)

        # This warp's tile, and the token range the CTA's tiles see together.
        start, seen, candidate_end, forced_end = Int32(0), Int32(0), Int32(0), Int32(0)
        if tile < num_tiles:
            start, seen = tiles[tile, 0], tiles[tile, 1]
            # Block 0 is forced in every tile, also where the rule's forced range is empty (a
            # non-causal sequence shorter than one block).
            candidate_end, forced_end = tiles[tile, 2], cutlass.max(tiles[tile, 3], Int32(1))
        first_token, end_token = Int32(2**31 - 1), Int32(0)
        for t in cutlass.range_constexpr(TILES_PER_CTA):
            if first_tile + t < num_tiles:
                if tiles[first_tile + t, 1] > 0:
                    first_token = cutlass.min(first_token, tiles[first_tile + t, 0])
                    end_token = cutlass.max(end_token,
                                            tiles[first_tile + t, 0] + tiles[first_tile + t, 1])
        cute.arch.sync_threads()

        # Pass 1: per head the max and the sum of exp2 over the seen tokens.
        running_max = cute.make_rmem_tensor(cute.make_layout(spec.group), Float32)
        running_sum = cute.make_rmem_tensor(cute.make_layout(spec.group), Float32)
        running_max.fill(-math.inf)
        running_sum.fill(0.0)
        lanes_tokens = spec.tokens_per_lane
        # scores[j, g]: the lane's j-th token of the chunk against group head g.
        scores = cute.make_rmem_tensor(cute.make_layout((lanes_tokens, spec.group)), Float32)
        for chunk in cutlass.range(first_token, end_token, spec.tokens_per_chunk, unroll=1):
            self.stage_keys(keys, key_stage, kv_head, chunk, end_token, tidx)
            self.chunk_scores(query_stage, key_stage, scores_stage, tiled_mma, tidx, warp, lane,
                              (chunk + spec.tokens_per_chunk > start) & (chunk < start + seen),
                              scores)
            for j in cutlass.range_constexpr(lanes_tokens):
                token = chunk + lane + WARP * j
                if (token >= start) & (token < start + seen):
                    for g in cutlass.range_constexpr(spec.group):
                        score = scores[j, g]
                        new_max = cute.arch.fmax(running_max[g], score)
                        if new_max != -math.inf:  # -inf - -inf would be NaN: nothing to add yet
                            running_sum[g] = (running_sum[g]
                                              * cute.math.exp2(running_max[g] - new_max)
                                              + cute.math.exp2(score - new_max))
                        if score != score:  # a NaN score makes the head's softmax NaN
                            running_sum[g] = score
                        running_max[g] = new_max
        inverse_sum = cute.make_rmem_tensor(cute.make_layout(spec.group), Float32)
        for g in cutlass.range_constexpr(spec.group):
            head_max = lane_group_reduce(running_max[g], WARP, cute.arch.fmax)
            part = Float32(0.0)
            if running_max[g] != -math.inf:
                part = running_sum[g] * cute.math.exp2(running_max[g] - head_max)
            if running_sum[g] != running_sum[g]:
                part = running_sum[g]
            running_max[g] = head_max
            inverse_sum[g] = Float32(1.0) / lane_group_sum(part, WARP)

        # Pass 2: rank the candidates 1 <= b < candidate_end by the group's probabilities (and,
        # with the sparse compressed branch, sum every seen token's into its KV block).
        sums_blocks = const_expr(spec.cmp_width > 0)
        cmp_candidate_end, cmp_forced_end = Int32(0), Int32(0)
        if const_expr(sums_blocks):
            if tile < num_tiles:
                cmp_candidate_end, cmp_forced_end = tiles[tile, 6], tiles[tile, 7]
        cmp_bound = cutlass.max(cmp_forced_end, Int32(1))  # above every ranked block
        # Tokens whose weight pass 2 needs: the candidates, or with block sums all seen ones.
        weighed_start, weighed_end = Int32(1), candidate_end
        if const_expr(sums_blocks):
            weighed_start, weighed_end = Int32(0), seen
        top = new_ranks(spec.width)
        cmp_top = new_ranks(spec.cmp_width) if const_expr(sums_blocks) else None
        open_block, open_sum = Int32(0), Float32(0.0)  # the KV block being summed
        for chunk in cutlass.range(first_token, end_token, spec.tokens_per_chunk, unroll=1):
            self.stage_keys(keys, key_stage, kv_head, chunk, end_token, tidx)
            self.chunk_scores(
                query_stage, key_stage, scores_stage, tiled_mma, tidx, warp, lane,
                (chunk + spec.tokens_per_chunk > start + weighed_start)
                & (chunk < start + weighed_end), scores)
            # The chunk's first KV block (of its tokens in the sequence) and the next one.
            first_block = Int32(0)
            if const_expr(sums_blocks):
                first_block = cutlass.max(chunk - start, Int32(0)) // spec.cmp_kv_block
            part_first, part_next = Float32(0.0), Float32(0.0)
            for j in cutlass.range_constexpr(lanes_tokens):
                block = chunk + lane + WARP * j - start
                if (block >= weighed_start) & (block < weighed_end):
                    weight = Float32(0.0)
                    for g in cutlass.range_constexpr(spec.group):
                        weight += cute.math.exp2(scores[j, g] - running_max[g]) * inverse_sum[g]
                    if (block >= 1) & (block < candidate_end):
                        keep_best(top, ordered_key(weight, block, forced_end))
                    if const_expr(sums_blocks):
                        if block // spec.cmp_kv_block == first_block:
                            part_first += weight
                        else:
                            part_next += weight
            if const_expr(sums_blocks):
                sum_first = lane_group_sum(part_first, WARP)
                sum_next = lane_group_sum(part_next, WARP)
                if first_block != open_block:  # the open block got all its tokens
                    self.rank_cmp_block(cmp_top, open_block, open_sum, cmp_candidate_end,
                                        cmp_bound, lane)
                    open_block = first_block
                    open_sum = Float32(0.0)
                open_sum += sum_first
                if chunk + spec.tokens_per_chunk > start + (first_block + 1) * spec.cmp_kv_block:
                    self.rank_cmp_block(cmp_top, open_block, open_sum, cmp_candidate_end,
                                        cmp_bound, lane)
                    open_block = first_block + 1
                    open_sum = sum_next
        # Block 0 and the diagonal blocks: forced, without a score.
        for block in cutlass.range(lane, forced_end, WARP, unroll=1):
            if (block == 0) | (block >= candidate_end):
                keep_best(top, forced_key(block, forced_end))
        if tile < num_tiles:
            block, kept, place, num_kept = merge_ranks(top, lane, Int32(spec.width), forced_end)
            if lane < spec.width:
                if kept:
                    out[tile, kv_head, place] = block
                else:
                    out[tile, kv_head, num_kept + place] = Int32(-1)
            if const_expr(spec.writes_lists):
                self.write_lists(full_count, full_index, mask_count, mask_index, tiles, tile,
                                 kv_head, lane, block, kept, place)
        if const_expr(sums_blocks):
            self.rank_cmp_block(cmp_top, open_block, open_sum, cmp_candidate_end, cmp_bound,
                                lane)
            self.write_cmp_ranks(cmp_top, cmp_out, tile, num_tiles, kv_head, lane,
                                 cmp_candidate_end, cmp_forced_end, cmp_bound,
                                 num_cmp_candidates)

    @cute.jit
    def rank_cmp_block(self, cmp_top: cute.Tensor, block: Int32, total: Float32,
                       candidate_end: Int32, bound: Int32, lane: Int32):
        """KV block `block` of the sparse compressed branch, summed (`total`, the same in every
        lane), into the ranking of lane block % 32 if it is a candidate."""
        if (block >= 1) & (block < candidate_end) & (lane == block % WARP):
            keep_best(cmp_top, ordered_key(total, block, bound))

    @cute.jit
    def write_cmp_ranks(self, cmp_top: cute.Tensor, cmp_out: cute.Tensor, tile: Int32,
                        num_tiles: Int32, kv_head: Int32, lane: Int32, candidate_end: Int32,
                        forced_end: Int32, bound: Int32, num_candidates: Int32):
        """The sparse compressed branch's list of the tile: its forced blocks (block 0 where the
        sequence has one, i.e. forced_end > 0, and candidate_end <= b < forced_end) and the best
        `num_candidates` candidates, ascending, -1 padded, as `nsa.selection._top_blocks`."""
        forced = Int32(0)
        for block in cutlass.range(lane, forced_end, WARP, unroll=1):
            if (block == 0) | (block >= candidate_end):
                keep_best(cmp_top, forced_key(block, bound))
                forced += 1
        limit = cutlass.min(Int32(self.spec.cmp_width),
                            lane_group_sum(forced, WARP) + num_candidates)
        if tile < num_tiles:
            block, kept, place, num_kept = merge_ranks(cmp_top, lane, limit, bound)
            if lane < self.spec.cmp_width:
                if kept:
                    cmp_out[tile, kv_head, place] = block
                else:
                    cmp_out[tile, kv_head, num_kept + place] = Int32(-1)

    @cute.jit
    def write_lists(self, full_count: cute.Tensor, full_index: cute.Tensor,
                    mask_count: cute.Tensor, mask_index: cute.Tensor | None, tiles: cute.Tensor,
                    tile: Int32, kv_head: Int32, lane: Int32, block: Int32, kept, place: Int32):
        """The tile's forward lists from its ranks (lane r: rank r's block, kept or not, and its
        place in ascending order): kept blocks below n_full are full, those below n_visible
        mask, later ones dropped; ascending, so each class is a run of the kept blocks."""
        spec = self.spec
        n_full, n_visible = tiles[tile, 4], tiles[tile, 5]
        full = kept & (block < n_full)
        masked = kept & (block >= n_full) & (block < n_visible)
        num_full = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(full)))
        num_masked = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(masked)))
        if full:
            full_index[tile, kv_head, place] = block
        if (lane >= num_full) & (lane < spec.width):
            full_index[tile, kv_head, lane] = Int32(-1)
        if const_expr(spec.mask_width > 0):
            if masked & (place - num_full < spec.mask_width):
                mask_index[tile, kv_head, place - num_full] = block
            if (lane >= num_masked) & (lane < spec.mask_width):
                mask_index[tile, kv_head, lane] = Int32(-1)
        if lane == 0:
            full_count[tile, kv_head] = num_full
            mask_count[tile, kv_head] = cutlass.min(num_masked, Int32(spec.mask_width))

    @cute.jit
    def store_row_part(self, values: cute.Tensor, stage, row, part):
        """Float32 `values` (VECTOR of them) at (row, part) of a query or key stage: as they
        are, or as their bf16 pieces in the tensor-core build."""
        if const_expr(self.spec.tensor_cores):
            split_products.store_pieces(values, stage, row, part, VECTOR)
        else:
            cute.autovec_copy(values, cute.local_tile(stage[row, None], (VECTOR,), (part,)))

    @cute.jit
    def stage_keys(self, keys: cute.Tensor, key_stage, kv_head: Int32, chunk: Int32,
                   end_token: Int32, tidx: Int32):
        """Tokens chunk .. chunk + tokens_per_chunk - 1 (those below end_token) of kv_head into
        the key stage, between two CTA barriers (the previous chunk's readers are done, then
        all see it). Rows past end_token keep stale keys: their scores are never used."""
        vectors_per_row = self.spec.head_dim // VECTOR
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(0, self.spec.tokens_per_chunk * vectors_per_row,
                                         WARP * TILES_PER_CTA):
            row = (i + tidx) // vectors_per_row
            part = (i + tidx) % vectors_per_row
            if chunk + row < end_token:
                values = cute.make_rmem_tensor(cute.make_layout(VECTOR), Float32)
                cute.autovec_copy(
                    cute.local_tile(keys[chunk + row, kv_head, None], (VECTOR,), (part,)),
                    values)
                self.store_row_part(values, key_stage, row, part)
        cute.arch.sync_threads()

    @cute.jit
    def chunk_scores(self, query_stage, key_stage, scores_stage, tiled_mma, tidx: Int32,
                     warp: Int32, lane: Int32, needed, scores: cute.Tensor):
        """scores[j, g] for the warp's tile and the staged chunk (see `score`). The FMA build
        scores only where the warp's tile needs the chunk; the tensor-core build computes the
        whole CTA's (rows x chunk) scores with every thread (`split_products`), then each warp
        reads its own."""
        spec = self.spec
        if const_expr(spec.tensor_cores):
            split_products.split_products(tiled_mma, tidx, query_stage, key_stage,
                                          scores_stage, spec.score_rows, spec.tokens_per_chunk)
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(spec.tokens_per_lane):
                for g in cutlass.range_constexpr(spec.group):
                    scores[j, g] = scores_stage[warp * spec.group + g, lane + WARP * j]
        else:
            if needed:
                self.score(query_stage, key_stage, warp, lane, scores)

    @cute.jit
    def score(self, sQ: cute.Tensor, sK: cute.Tensor, warp: Int32, lane: Int32,
              scores: cute.Tensor):
        """scores[j, g] = the scaled query of group head g of the warp's tile . staged key
        `lane + 32 j`, summed in head-dim order (a token's score does not depend on where it was
        staged, nor on how many tokens a lane scores). Rows past the staged tokens hold stale
        keys; their scores are never used. Each query vector is read once for all the lane's
        tokens: that is what several tokens per lane buy."""
        spec = self.spec
        scores.fill(0.0)
        key = cute.make_rmem_tensor(cute.make_layout((VECTOR, spec.tokens_per_lane)), Float32)
        query = cute.make_rmem_tensor(cute.make_layout(VECTOR), Float32)
        for part in cutlass.range(spec.head_dim // VECTOR, unroll=2):
            for j in cutlass.range_constexpr(spec.tokens_per_lane):
                cute.autovec_copy(cute.local_tile(sK[lane + WARP * j, None], (VECTOR,), (part,)),
                                  key[None, j])
            for g in cutlass.range_constexpr(spec.group):
                cute.autovec_copy(cute.local_tile(sQ[warp * spec.group + g, None], (VECTOR,),
                                                  (part,)), query)
                for j in cutlass.range_constexpr(spec.tokens_per_lane):
                    total = scores[j, g]
                    for e in cutlass.range_constexpr(VECTOR):
                        total = total + query[e] * key[e, j]
                    scores[j, g] = total


def fake_arguments(spec: SelectBlocksSpec):
    """Fake (q_bar, keys, tiles, out, four lists, cmp_out, num_cmp_candidates, scale) for a CPU
    build (CUTE_DSL_ARCH=sm_90a), contiguous as the launcher passes them."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    rows, tokens, kv_heads = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def per_head(*extra):
        return make_fake_compact_tensor(Int32, (rows, kv_heads, *extra),
                                        stride_order=tuple(range(1 + len(extra), -1, -1)),
                                        assumed_align=4)

    q_bar = make_fake_compact_tensor(Float32, (rows, cute.sym_int(), spec.head_dim),
                                     stride_order=(2, 1, 0), assumed_align=16)
    keys = make_fake_compact_tensor(Float32, (tokens, kv_heads, spec.head_dim),
                                    stride_order=(2, 1, 0), assumed_align=16)
    tiles = make_fake_compact_tensor(Int32, (rows, TILE_FIELDS), stride_order=(1, 0),
                                     assumed_align=4)
    lists = (None,) * 4
    if spec.writes_lists:
        lists = (per_head(), per_head(spec.width), per_head(),
                 per_head(spec.mask_width) if spec.mask_width else None)
    cmp_out = per_head(spec.cmp_width) if spec.cmp_width else None
    return q_bar, keys, tiles, per_head(spec.width), *lists, cmp_out, Int32(0), Float32(1.0)


def compile_on_fake_tensors(spec: SelectBlocksSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(SelectBlocksSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side: `can_run` decides, `run` launches (nsa/selection.py).
# ------------------------------------------------------------------------------------------------


class KernelSelection(NamedTuple):
    """What one launch wrote: the selected blocks, the sparse compressed branch's blocks (None
    without cmp_width), the selected branch's forward lists (None without mask_width)."""
    selected: object
    cmp_selected: object
    lists: tuple | None


def can_run(q_bar, keys, width: int, cmp_width: int = 0, cmp_kv_block: int = 128) -> bool:
    """Whether the kernel selects for scoring queries q_bar (R, H, D) and compressed keys
    (Tc, Hkv, D), both float32, keeping `width` blocks (and `cmp_width` of the sparse compressed
    branch's KV blocks of `cmp_kv_block` tokens where cmp_width > 0); the device is
    `kernels.dispatch`'s question."""
    import torch

    heads, dim = q_bar.shape[1:]
    kv_heads = keys.shape[1]
    if not (q_bar.dtype == torch.float32 and keys.dtype == torch.float32
            and dim in HEAD_DIMS and heads % kv_heads == 0
            and 1 <= heads // kv_heads <= MAX_GROUP and 1 <= width <= MAX_WIDTH
            and 0 <= cmp_width <= MAX_WIDTH and q_bar.shape[0] > 0):
        return False
    tokens_per_chunk = WARP * default_tokens_per_lane(heads // kv_heads)
    return cmp_width == 0 or cmp_kv_block >= tokens_per_chunk


def run(q_bar, keys, tiles, width: int, softmax_scale: float, mask_width: int | None = None, *,
        tensor_cores: bool = False, cmp_width: int = 0, cmp_kv_block: int = 128,
        num_cmp_candidates: int = 0):
    """The selected blocks of each tile, (R, Hkv, width) int32 ascending and -1 padded, as
    `nsa.selection` ranks them; tiles (R, TILE_FIELDS) int32 (module docstring). With a
    mask_width also the selected branch's forward lists (full_count, full_index, mask_count,
    mask_index), as sparsity.build_selected_block_sparse_trusted builds them from the blocks.
    With cmp_width > 0 also the sparse compressed branch's lists, (R, Hkv, cmp_width) int32 (KV
    blocks of cmp_kv_block compressed tokens, at most the forced ones + num_cmp_candidates
    kept). Returns a `KernelSelection` (None where a list was not asked for).

    tensor_cores: score on tensor cores (`SelectBlocksSpec.tensor_cores`, module docstring).
    False (the default) is the dispatched float32 FMA build: the tensor-core one selects the
    same blocks on a GPU but measured slower (docs/kernels.md, split_products.py); switch the
    default once `pytest -m gpu tests/nsa/test_nsa_selection.py` passes with it and
    `tools/bench_selection.py` shows it faster."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    rows, kv_heads = q_bar.shape[0], keys.shape[1]

    def per_head(*extra):
        return torch.empty(rows, kv_heads, *extra, dtype=torch.int32, device=q_bar.device)

    selected = per_head(width)
    cmp_selected = per_head(cmp_width) if cmp_width else None
    lists = (None,) * 4
    if mask_width is not None:
        lists = (per_head(), per_head(width), per_head(), per_head(mask_width))
    spec = SelectBlocksSpec(q_bar.shape[2], q_bar.shape[1] // kv_heads, width,
                            writes_lists=mask_width is not None, mask_width=mask_width or 0,
                            tensor_cores=tensor_cores, cmp_width=cmp_width,
                            cmp_kv_block=cmp_kv_block)
    launch_on_current_stream(SelectBlocksSm90, spec, fake_arguments,
                             (q_bar.contiguous(), keys.contiguous(), tiles.contiguous(), selected,
                              *lists[:3], lists[3] if mask_width else None, cmp_selected,
                              num_cmp_candidates, softmax_scale),
                             q_bar.device)
    return KernelSelection(selected, cmp_selected, None if mask_width is None else lists)
