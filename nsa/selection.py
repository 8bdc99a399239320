"""Block selection, batched: the causal selection rule of docs/interfaces.md on whole tensors.

`nsa.reference.select_blocks_reference` spells the rule out one tile at a time; this module
computes the same lists for all tiles of all sequences at once:

1. scoring queries: per tile, the mean of the q_tile rows ending at its anchor (float32):
   `kernels.row_means`, one pass over q on sm90 (a chunked gather elsewhere);
2. one batched GEMM per chunk of tiles (all KV groups at once) against the compressed keys of the
   chunk's sequences, a softmax per query head over the tokens the anchor sees, a sum over the
   group; chunks bound the score tensor (SCORE_CHUNK_ELEMENTS), and up to long contexts
   (~128K tokens with 32 heads) one chunk holds every tile;
3. per tile, the token probabilities summed per block, forced blocks ranked first, candidates by
   importance, everything else last; a stable descending sort keeps ties at the lower index;
   the first num_selected_blocks entries are the selection.

On sm90, with blocks of one compressed token (selected_block_size == compress_block_size, the
default) and a dense compressed branch, steps 2 and 3 are one kernel
(kernels/sm90/select_blocks.py): no chunks, no score tensor, the lists written directly
(`select_blocks`'s selection_kernel, ranking_kernel and tensor_cores choose the kernels; the
defaults are the dispatched paths).

Cost on a GPU is launches and host syncs, not math, so the work is a fixed number of whole-tensor
ops per chunk and the host reads the sequence bounds once (one sync per call), or none when the
caller hands them over (`host_bounds`: nsa() does). The per-tile geometry is derived on the device
from cu_seqlens; the chunk plan is host arithmetic on the host bounds.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch
from torch import Tensor

from kernels import selection as selection_kernels
from kernels.row_means import row_means
from nsa.selection_rule import (CMP_KV_BLOCK, SELECTION_Q_TILE, BlockSelection,
                                cmp_selection_width)
from sparsity import QueryRows, selected_block_sparse_from_lists, selected_list_classes
from sparsity.host_cache import cached

# Upper bound on one chunk's heads x tiles x (compressed tokens + D): the score tensor plus the
# scoring queries it is computed from; a chunk holds at least one tile.
SCORE_CHUNK_ELEMENTS = 1 << 26

_INF = float("inf")



@dataclass(frozen=True)
class _Tiles:
    """Per q tile (R,) int64 on the device: where it sits and what its anchor may see."""

    seq_start: Tensor  # first packed row of the tile's sequence in q
    seq_len: Tensor  # tokens of the sequence (its keys)
    anchor: Tensor  # position a of the tile's first row (a multiple of q_tile)
    cmp_start: Tensor  # first packed compressed token of the sequence
    cmp_seen: Tensor  # compressed tokens the scoring query is scored against
    q_start: Tensor | None = None  # position of the sequence's first row in q (`QueryRows`)

    def __getitem__(self, rows: slice) -> "_Tiles":
        return _Tiles(*(None if getattr(self, f) is None else getattr(self, f)[rows]
                        for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class _BlockRanges:
    """Per q tile (R,) int64: what the rule makes of each block b of one branch.

    Block 0 is forced where `block0` is +inf (-inf: the sequence has no block); blocks
    1 <= b < candidate_end are candidates, candidate_end <= b < forced_end forced (the diagonal),
    the rest never selected. Every branch of the rule has this shape (docs/interfaces.md).
    """

    candidate_end: Tensor
    forced_end: Tensor
    block0: Tensor | float  # (R,) float32 or a constant: the ranking key of block 0

    def __getitem__(self, rows: slice) -> "_BlockRanges":
        block0 = self.block0 if isinstance(self.block0, float) else self.block0[rows]
        return _BlockRanges(self.candidate_end[rows], self.forced_end[rows], block0)


@dataclass(frozen=True)
class _Chunk:
    tiles: slice  # global tile range
    tokens: slice  # packed compressed tokens the chunk's tiles may score
    longest: int  # rows of the chunk's longest sequence


def select_blocks(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, *,
                  compress_block_size: int, selected_block_size: int, num_selected_blocks: int,
                  softmax_scale: float, causal: bool = True,
                  num_cmp_selected_blocks: int | None = None, q_tile: int = SELECTION_Q_TILE,
                  cmp_kv_block: int = CMP_KV_BLOCK,
                  host_bounds: tuple[Sequence[int], Sequence[int]] | None = None,
                  write_selected_lists: bool = False, selection_kernel: bool = True,
                  ranking_kernel: bool = True, tensor_cores: bool = False,
                  queries: QueryRows | None = None) -> BlockSelection:
    """Selected blocks per (q tile, KV head) for the selected and the sparse compressed branch.

    q (T, H, D) and k_cmp (Tc, Hkv, D) packed; the result's lists are local block indices,
    ascending, -1 padded (see BlockSelection). Not differentiable (selection is discrete).
    host_bounds: the values of (cu_seqlens, cu_seqlens_cmp) when the caller has them on the
    host (nsa() does): then nothing is read from the device.
    write_selected_lists: where the selection kernel runs, it also writes the selected branch's
    forward lists (`BlockSelection.selected_lists`, equal to
    sparsity.build_selected_block_sparse_trusted's from `selected` with kv_block =
    selected_block_size); elsewhere that field stays None.

    The kernels (each only where it serves the call: float32 scoring on an sm90 GPU; the
    defaults are the dispatched paths, nsa()'s):
    selection_kernel: score and rank in one kernel (kernels/sm90/select_blocks.py) where the
    selected blocks are single compressed tokens (selected_block_size == compress_block_size,
    the default) and the compressed branch is dense: one launch instead of ~60 torch ops, no
    score tensor. False: the chunked torch scoring below.
    ranking_kernel: on the torch scoring path, rank with one warp per row
    (kernels/sm90/top_blocks.py: each lane's best keys kept in registers over one pass, then a
    warp merge) instead of a stable sort of the whole row (H100, 256K tokens: 0.84 ms against
    the sort's 2.63; one int64 top-k with the block index in the key measured 5.3 ms,
    2026-11-25). Both give the same lists.
    tensor_cores: where the selection kernel runs, its tensor-core scoring build
    (`kernels.sm90.select_blocks.run`'s tensor_cores); False, the float32 FMA build, is the
    dispatched one.
    queries (causal only): q holds each sequence's rows from a position on (`QueryRows`, a
    multiple of q_tile), against all of the keys cu_seqlens bounds: tiles start at that
    position and select by the rule at their positions. A tile's scoring rows before the first
    row of q are not there: the first tile of such a sequence scores the rows it has (its
    selection is not the whole sequence's; sequence-parallel callers hold one tile before the
    rows they keep, for that).
    """
    l, l_sel = compress_block_size, selected_block_size
    heads, dim = q.shape[1:]
    kv_heads = k_cmp.shape[1]
    if host_bounds is None:
        # The only device -> host read: the sequence bounds, for the shapes and the chunk plan.
        bounds = torch.cat([cu_seqlens.to(torch.int64), cu_seqlens_cmp.to(torch.int64)]).tolist()
        host_bounds = bounds[:cu_seqlens.numel()], bounds[cu_seqlens.numel():]
    cu_host, cu_cmp_host = (list(b) for b in host_bounds)
    lengths = [end - start for start, end in zip(cu_host, cu_host[1:])]
    q_lengths, starts = lengths, [0] * len(lengths)
    if queries is not None:
        if not causal:
            raise ValueError("queries: causal selection only (non-causal rows see every key)")
        q_host = queries.host_cu_seqlens
        q_lengths = [end - start for start, end in zip(q_host, q_host[1:])]
        starts = list(queries.start_positions)
    num_tiles = sum(-(-n // q_tile) for n in q_lengths)
    width = None
    if num_cmp_selected_blocks is not None:
        width = cmp_selection_width(q_tile, l, cmp_kv_block, num_cmp_selected_blocks)

    def layout():
        offsets, tiles = _tile_layout(cu_seqlens, cu_seqlens_cmp, num_tiles, q_tile, l, causal,
                                      queries)
        ranges = _selection_ranges(tiles, l_sel, q_tile, causal)
        cmp_ranges = None if width is None else _cmp_selection_ranges(tiles, l, cmp_kv_block,
                                                                      q_tile, causal)
        scoring = _scoring_rows(tiles, q_tile, causal)
        classes = selected_list_classes(cu_seqlens, cu_host, q_tile=q_tile, kv_block=l_sel,
                                        causal=causal, queries=queries)
        return (offsets, tiles, ranges, cmp_ranges, scoring,
                _kernel_tile_fields(tiles, ranges, classes[:2], cmp_ranges), classes[2])

    # Functions of the host bounds and the rule's sizes only: kept across calls
    # (sparsity/host_cache.py).
    offsets, tiles, ranges, cmp_ranges, scoring, tile_fields, mask_width = cached(
        ("selection layout", tuple(cu_host), tuple(cu_cmp_host), q_tile, l, l_sel, causal,
         None if width is None else cmp_kv_block, None if queries is None else queries.key()),
        cu_seqlens, layout)
    if num_tiles == 0:
        return _empty_selection(q.device, kv_heads, num_selected_blocks, width, offsets)

    q_bar = _scoring_queries(q, *scoring, q_tile)
    k_score = k_cmp.to(q_bar.dtype)  # both paths score in the scoring queries' dtype
    cmp_width = width or 0
    if l_sel == l and _selects_on_sm90(q_bar, k_score, num_selected_blocks, cmp_width,
                                       cmp_kv_block, selection_kernel=selection_kernel):
        found = selection_kernels.select_blocks(
            q_bar, k_score, tile_fields, num_selected_blocks, softmax_scale,
            mask_width if write_selected_lists else None, tensor_cores=tensor_cores,
            cmp_width=cmp_width, cmp_kv_block=cmp_kv_block,
            num_cmp_candidates=num_cmp_selected_blocks or 0)
        selected_lists = None
        if write_selected_lists:
            selected_lists = selected_block_sparse_from_lists(
                found.lists, cu_seqlens, cu_host, q_tile=q_tile, kv_block=l_sel, causal=causal,
                queries=queries)
        return BlockSelection(selected=found.selected, cmp_selected=found.cmp_selected,
                              row_block_offsets=offsets, selected_lists=selected_lists)
    keys = k_score.permute(1, 2, 0)  # (Hkv, D, Tc)
    selected, cmp_selected = [], []
    for chunk in _plan_chunks(lengths, cu_cmp_host, q_tile, l, causal, heads, dim, q_lengths,
                              starts):
        part = tiles[chunk.tiles]
        token_weight = _anchor_token_weights(q_bar[chunk.tiles], keys[..., chunk.tokens], part,
                                             chunk.tokens.start, softmax_scale)
        importance = _block_sums(token_weight, part, chunk.tokens.start, l_sel // l,
                                 -(-chunk.longest // l_sel))
        selected.append(_top_blocks(_ranking_keys(importance, ranges[chunk.tiles]),
                                    num_selected_blocks, ranking_kernel=ranking_kernel))
        if cmp_ranges is not None:
            importance = _block_sums(token_weight, part, chunk.tokens.start, cmp_kv_block,
                                     -(-(chunk.longest // l) // cmp_kv_block))
            cmp_selected.append(_top_blocks(_ranking_keys(importance, cmp_ranges[chunk.tiles]),
                                            width, num_cmp_selected_blocks,
                                            ranking_kernel=ranking_kernel))
    return BlockSelection(selected=_cat(selected),
                          cmp_selected=_cat(cmp_selected) if cmp_ranges is not None else None,
                          row_block_offsets=offsets)


def _selects_on_sm90(q_bar: Tensor, k_cmp: Tensor, width: int, cmp_width: int,
                     cmp_kv_block: int, *, selection_kernel: bool = True) -> bool:
    """Whether the selection kernel (kernels/sm90/select_blocks.py) serves this call: float32
    scoring on an sm90 GPU, selection_kernel set (the default, the dispatched path), and the
    sparse compressed branch's ranks (cmp_width, 0 without it) in the kernel's bounds; the caller
    checks the rule's sizes (blocks of one compressed token)."""
    return selection_kernel and selection_kernels.selection_kernel_serves(
        q_bar, k_cmp, width, cmp_width, cmp_kv_block)


def _kernel_tile_fields(tiles: _Tiles, ranges: _BlockRanges,
                        list_classes: tuple[Tensor, Tensor],
                        cmp_ranges: _BlockRanges | None) -> Tensor:
    """(tiles, 8) int32, the selection kernel's per-tile input: the sequence's first compressed
    token, the tokens the anchor sees, the candidates' end, the forced blocks' end, the
    selected lists' class bounds (n_full, n_visible: `sparsity.selected_list_classes`), and the
    sparse compressed branch's candidates' end and forced end (zeros without it; its block 0 is
    forced exactly where that forced end is positive: where the sequence has a compressed
    token, as `_cmp_selection_ranges`'s block0 says)."""
    if cmp_ranges is None:
        cmp_fields = [torch.zeros_like(ranges.forced_end)] * 2
    else:
        cmp_fields = [cmp_ranges.candidate_end, cmp_ranges.forced_end]
    return torch.stack([tiles.cmp_start, tiles.cmp_seen, ranges.candidate_end,
                        ranges.forced_end, *list_classes, *cmp_fields],
                       1).to(torch.int32).contiguous()


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _empty_selection(device: torch.device, kv_heads: int, num_selected_blocks: int,
                     width: int | None, offsets: Tensor) -> BlockSelection:
    def lists(n):
        return torch.empty((0, kv_heads, n), dtype=torch.int32, device=device)
    return BlockSelection(selected=lists(num_selected_blocks),
                          cmp_selected=None if width is None else lists(width),
                          row_block_offsets=offsets)


# --- layout and chunking -------------------------------------------------------------------------

def _tile_layout(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, num_tiles: int, q_tile: int,
                 l: int, causal: bool, queries: QueryRows | None = None
                 ) -> tuple[Tensor, _Tiles]:
    """(S+1,) int32 first tile of each sequence, and the tiles, computed on the device
    (num_tiles, known on the host, sizes the result without a sync). queries: see
    `select_blocks`."""
    cu, cu_cmp = cu_seqlens.to(torch.int64), cu_seqlens_cmp.to(torch.int64)
    seq_len = cu.diff()
    cu_q, fields = cu, []
    if queries is not None:
        cu_q = queries.cu_seqlens.to(torch.int64)
        fields = [torch.tensor(queries.start_positions, dtype=torch.int64).to(cu.device)]
    offsets = torch.cat([cu.new_zeros(1), ((cu_q.diff() + q_tile - 1) // q_tile).cumsum(0)])
    tile = torch.arange(num_tiles, device=cu.device)
    sequence = torch.searchsorted(offsets[1:], tile, right=True)
    # Per sequence: q row start, tokens, compressed start, compressed tokens, first tile (and
    # the first row's position with queries); one gather to tiles.
    per_sequence = torch.stack([cu_q[:-1], seq_len, cu_cmp[:-1], cu_cmp.diff(), offsets[:-1],
                                *fields], 1)
    seq_start, seq_len, cmp_start, cmp_len, first_tile, *q_start = \
        per_sequence[sequence].unbind(1)
    q_start = q_start[0] if q_start else None
    anchor = (tile - first_tile) * q_tile
    if q_start is not None:
        anchor = anchor + q_start
    tiles = _Tiles(seq_start=seq_start, seq_len=seq_len, anchor=anchor, cmp_start=cmp_start,
                   cmp_seen=(anchor + 1) // l if causal else cmp_len, q_start=q_start)
    return offsets.to(torch.int32), tiles


def _plan_chunks(lengths: list[int], cu_cmp: list[int], q_tile: int, l: int, causal: bool,
                 heads: int, rows_per_tile: int, q_lengths: list[int] | None = None,
                 starts: list[int] | None = None) -> list[_Chunk]:
    """Consecutive tiles grouped so that heads x tiles x (tokens + rows_per_tile) stays under
    SCORE_CHUNK_ELEMENTS. Short sequences share a chunk; a long one is split over several.

    Tiles come in packed order, so the last token a tile may score never decreases and a chunk's
    cost grows with its last tile: each chunk is the longest run that fits, found by bisection
    (host arithmetic, O(chunks x log tiles)). A chunk's tokens run from its first tile's sequence
    start to its last tile's last visible token. q_lengths, starts: the q rows of each sequence
    and the position of its first (`select_blocks`' queries; default: lengths and 0).
    """
    q_lengths = lengths if q_lengths is None else q_lengths
    starts = [0] * len(lengths) if starts is None else starts
    tile_offsets = list(accumulate((-(-n // q_tile) for n in q_lengths), initial=0))
    num_tiles = tile_offsets[-1]

    def sequence_of(tile: int) -> int:
        return bisect_right(tile_offsets, tile) - 1

    def token_end(tile: int) -> int:  # one past the last packed token the tile may score
        s = sequence_of(tile)
        if not causal:
            return cu_cmp[s + 1]
        return cu_cmp[s] + (starts[s] + (tile - tile_offsets[s]) * q_tile + 1) // l

    chunks: list[_Chunk] = []
    first = 0
    while first < num_tiles:
        first_token = cu_cmp[sequence_of(first)]

        def cost(last: int) -> int:
            return heads * (last - first + 1) * (token_end(last) - first_token + rows_per_tile)

        last = first + bisect_right(range(first + 1, num_tiles), SCORE_CHUNK_ELEMENTS, key=cost)
        longest = max(lengths[sequence_of(first):sequence_of(last) + 1])
        chunks.append(_Chunk(slice(first, last + 1), slice(first_token, token_end(last)),
                             longest))
        first = last + 1
    return chunks


# --- scores --------------------------------------------------------------------------------------

def _scoring_rows(tiles: _Tiles, q_tile: int, causal: bool) -> tuple[Tensor, Tensor]:
    """(starts, counts), (tiles,) int64: per tile the run of packed rows its scoring query
    averages. Causal: the q_tile rows ending at the anchor, cut at the sequence start;
    otherwise the tile's own rows, cut at the sequence end."""
    if causal and tiles.q_start is not None:  # only the rows q holds
        first = torch.maximum(tiles.anchor - (q_tile - 1), tiles.q_start)
        return tiles.seq_start + first - tiles.q_start, tiles.anchor - first + 1
    if causal:
        first = (tiles.anchor - (q_tile - 1)).clamp_min(0)
        return tiles.seq_start + first, tiles.anchor - first + 1
    return tiles.seq_start + tiles.anchor, (tiles.seq_len - tiles.anchor).clamp_max(q_tile)


def _scoring_queries(q: Tensor, starts: Tensor, counts: Tensor, q_tile: int) -> Tensor:
    """(tiles, H, D) in the compute dtype: per tile the mean of q over its scoring rows
    (`_scoring_rows`), summed directly (not as a difference of prefix sums, whose float32
    cancellation grows with the sequence): `kernels.row_means`, one pass over q on sm90."""
    return row_means((q,), starts, counts, count=q_tile)[0]


def _anchor_token_weights(q_bar: Tensor, keys: Tensor, tiles: _Tiles, first_token: int,
                          softmax_scale: float) -> Tensor:
    """(Hkv, tiles, tokens): softmax over the tokens each anchor sees, summed over the group.

    keys (Hkv, D, tokens) holds the chunk's packed compressed tokens; a tile's visible ones are the
    contiguous range [cmp_start, cmp_start + cmp_seen) of its own sequence.
    """
    num_tiles, heads, dim = q_bar.shape
    kv_heads, _, num_tokens = keys.shape
    if num_tokens == 0:  # no anchor of the chunk sees a compressed token yet
        return q_bar.new_zeros(kv_heads, num_tiles, 0)
    group = heads // kv_heads
    # The scale goes into the (small) queries: the scores are the largest tensor of selection
    # (tiles x heads x tokens: 1 GiB at 256K tokens, H=32), and each pass over them counts.
    queries = (q_bar * softmax_scale).view(num_tiles, kv_heads, group, dim).permute(1, 0, 2, 3)
    queries = queries.reshape(kv_heads, num_tiles * group, dim)
    scores = torch.bmm(queries, keys).view(kv_heads, num_tiles, group, num_tokens)

    token = torch.arange(num_tokens, device=q_bar.device)
    first = (tiles.cmp_start - first_token)[:, None]
    unseen = (token < first) | (token >= first + tiles.cmp_seen[:, None])
    scores.masked_fill_(unseen[None, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).sum(dim=2)
    # An anchor that sees nothing softmaxes a row of -inf into NaN: all-zero weights instead.
    return weights.masked_fill_((tiles.cmp_seen == 0)[None, :, None], 0)


def _block_sums(token_weight: Tensor, tiles: _Tiles, first_token: int, tokens_per_block: int,
                num_blocks: int) -> Tensor:
    """(Hkv, tiles, num_blocks): the weights of each tile's own tokens summed per block."""
    kv_heads, num_tiles, num_tokens = token_weight.shape
    if num_tokens == 0:
        return token_weight.new_zeros(kv_heads, num_tiles, num_blocks)
    local = torch.arange(num_blocks * tokens_per_block, device=token_weight.device)
    column = (tiles.cmp_start[:, None] - first_token + local).clamp_(0, num_tokens - 1)
    gathered = token_weight.gather(2, column.expand(kv_heads, -1, -1))
    gathered.mul_(local < tiles.cmp_seen[:, None])
    if tokens_per_block == 1:
        return gathered
    return gathered.view(kv_heads, num_tiles, num_blocks, tokens_per_block).sum(dim=-1)


# --- the rule ------------------------------------------------------------------------------------

def _selection_ranges(tiles: _Tiles, l_sel: int, q_tile: int, causal: bool) -> _BlockRanges:
    """The selected branch: block 0 always forced.

    Causal: candidates c >= 1 with (c+1) l' <= a, i.e. c < a // l'; forced diagonal: the blocks
    overlapping [a, e), i.e. a // l' <= c < ceil(e / l'), right after the candidates.
    Non-causal: candidates are the complete blocks, c < n // l'; nothing else is forced.
    """
    if not causal:
        complete = tiles.seq_len // l_sel
        return _BlockRanges(complete, complete, _INF)
    end = torch.minimum(tiles.anchor + q_tile, tiles.seq_len)
    return _BlockRanges(tiles.anchor // l_sel, (end + l_sel - 1) // l_sel, _INF)


def _cmp_selection_ranges(tiles: _Tiles, l: int, cmp_kv_block: int, q_tile: int,
                          causal: bool) -> _BlockRanges:
    """The sparse compressed branch: blocks of cmp_kv_block compressed tokens.

    Block 0 is forced when the sequence has a compressed token. Causal: candidates are the blocks
    the anchor sees whole (a partial last block counts once all its tokens are seen), the
    diagonal runs from there to the last block the tile's last row sees part of.
    Non-causal: every other existing block is a candidate.
    """
    num_cmp = tiles.seq_len // l
    exists = (num_cmp + cmp_kv_block - 1) // cmp_kv_block
    block0 = torch.where(exists > 0, _INF, -_INF)
    if not causal:
        return _BlockRanges(exists, exists, block0)
    tile_seen = torch.minimum(tiles.anchor + q_tile, tiles.seq_len) // l
    seen_whole = torch.where(tiles.cmp_seen >= num_cmp, exists, tiles.cmp_seen // cmp_kv_block)
    return _BlockRanges(seen_whole, (tile_seen + cmp_kv_block - 1) // cmp_kv_block, block0)


def _ranking_keys(importance: Tensor, ranges: _BlockRanges) -> Tensor:
    """(tiles, Hkv, blocks) float32: +inf forced, importance for candidates, -inf otherwise."""
    block = torch.arange(importance.shape[-1], device=importance.device)
    candidate = (block < ranges.candidate_end[:, None])[:, None]
    rest = torch.where(block < ranges.forced_end[:, None], _INF, -_INF)[:, None]
    key = torch.where(candidate, importance.permute(1, 0, 2), rest)
    if key.shape[-1]:
        block0 = ranges.block0
        if isinstance(block0, float):
            key[..., 0].fill_(block0)  # not `= block0`: a host copy, refused in graph capture
        else:
            key[..., 0] = block0[:, None]
    return key


def _top_blocks_on_sm90(key: Tensor, width: int, *, ranking_kernel: bool = True) -> bool:
    """Whether the ranking kernel (kernels/sm90/top_blocks.py) serves this call: float32 keys
    on an sm90 GPU, at most 32 ranks (one per lane), ranking_kernel set (the default, the
    dispatched path)."""
    return ranking_kernel and selection_kernels.ranking_kernel_serves(key, width)


def _top_blocks(key: Tensor, width: int, num_candidates: int | None = None, *,
                ranking_kernel: bool = True) -> Tensor:
    """(tiles, Hkv, width) int32: forced blocks, then the best candidates, ascending, -1 padded.

    Keeps the forced blocks (key +inf) plus num_candidates candidates, or as many as fit in
    `width` when None. A stable descending sort puts equal importances in block order, so ties go
    to the lower block index; on sm90 the ranking kernel gives the same lists (ranking_kernel:
    use it where it serves, the default and dispatched path; False: always the sort).
    """
    if _top_blocks_on_sm90(key, width, ranking_kernel=ranking_kernel):
        return selection_kernels.top_blocks(key, width, num_candidates)
    if key.shape[-1] < width:
        key = torch.nn.functional.pad(key, (0, width - key.shape[-1]), value=-_INF)
    ranked_key, ranked = key.sort(dim=-1, descending=True, stable=True)
    keep = ranked_key[..., :width] > -_INF
    if num_candidates is not None:
        position = torch.arange(width, device=key.device)
        keep &= position < (key == _INF).sum(dim=-1, keepdim=True) + num_candidates
    past_end = key.shape[-1]  # sorts after every real block, then becomes the -1 padding
    chosen = torch.where(keep, ranked[..., :width], past_end).sort(dim=-1).values
    return chosen.masked_fill_(chosen == past_end, -1).to(torch.int32)
