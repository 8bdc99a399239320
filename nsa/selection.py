"""Block selection, batched: the causal selection rule of docs/interfaces.md on whole tensors.

`nsa.reference.select_blocks_reference` spells the rule out one tile at a time; this module
computes the same lists for all tiles of all sequences at once, in chunks of tiles so that the
score tensor stays bounded (SCORE_CHUNK_ELEMENTS) whatever the sequence lengths:

1. scoring queries: per tile, the mean of the q_tile rows ending at its anchor (float32);
2. one batched GEMM per chunk (all KV groups at once) against the compressed keys of the chunk's
   sequences, a softmax per query head over the tokens the anchor sees, a sum over the group;
3. per tile, the token probabilities summed per block, forced blocks ranked first, candidates by
   importance, everything else last; a stable descending sort keeps ties at the lower index;
   the first num_selected_blocks entries are the selection.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nsa.compression import compute_dtype
from nsa.selection_rule import (CMP_KV_BLOCK, SELECTION_Q_TILE, BlockSelection,
                                cmp_selection_width)

# Upper bound on the elements of one chunk's score tensor (heads x tiles x compressed tokens),
# counting the gathered scoring rows too; a chunk holds at least one tile.
SCORE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _Tiles:
    """Per q tile (R,) int64 on the device: where it sits and what its anchor may see."""

    seq_start: Tensor  # first packed row of the tile's sequence
    seq_len: Tensor  # rows of the sequence
    anchor: Tensor  # local row a of the tile's first row (a multiple of q_tile)
    cmp_start: Tensor  # first packed compressed token of the sequence
    cmp_seen: Tensor  # compressed tokens the scoring query is scored against

    def __getitem__(self, rows: slice) -> "_Tiles":
        return _Tiles(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class _Chunk:
    tiles: slice  # global tile range
    tokens: slice  # packed compressed tokens the chunk's tiles may score
    longest: int  # rows of the chunk's longest sequence


def select_blocks(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, *,
                  compress_block_size: int, selected_block_size: int, num_selected_blocks: int,
                  softmax_scale: float, causal: bool = True,
                  num_cmp_selected_blocks: int | None = None, q_tile: int = SELECTION_Q_TILE,
                  cmp_kv_block: int = CMP_KV_BLOCK) -> BlockSelection:
    """Selected blocks per (q tile, KV head) for the selected and the sparse compressed branch.

    q (T, H, D) and k_cmp (Tc, Hkv, D) packed; the result's lists are local block indices,
    ascending, -1 padded (see BlockSelection). Not differentiable (selection is discrete).
    """
    l, l_sel = compress_block_size, selected_block_size
    heads, kv_heads = q.shape[1], k_cmp.shape[1]
    device = q.device
    cu_host, cu_cmp_host = cu_seqlens.tolist(), cu_seqlens_cmp.tolist()
    lengths = [end - start for start, end in zip(cu_host, cu_host[1:])]
    tiles_per_seq = [-(-n // q_tile) for n in lengths]
    num_tiles = sum(tiles_per_seq)
    offsets = torch.tensor([0] + tiles_per_seq, device=device).cumsum(0).to(torch.int32)
    tiles = _tile_layout(cu_seqlens, cu_seqlens_cmp, offsets, num_tiles, q_tile, l, causal)

    selected = torch.full((num_tiles, kv_heads, num_selected_blocks), -1, dtype=torch.int32,
                          device=device)
    cmp_selected = None
    if num_cmp_selected_blocks is not None:
        width = cmp_selection_width(q_tile, l, cmp_kv_block, num_cmp_selected_blocks)
        cmp_selected = torch.full((num_tiles, kv_heads, width), -1, dtype=torch.int32,
                                  device=device)

    for chunk in _plan_chunks(lengths, cu_cmp_host, q_tile, l, causal, heads,
                              q.shape[-1] * q_tile):
        part = tiles[chunk.tiles]
        q_bar = _scoring_queries(q, part, q_tile, causal)
        token_weight = _anchor_token_weights(q_bar, k_cmp[chunk.tokens], part,
                                             chunk.tokens.start, softmax_scale)
        max_blocks = -(-chunk.longest // l_sel)
        forced, candidate = _selection_masks(part, max_blocks, l_sel, q_tile, causal)
        importance = _block_sums(token_weight, part, chunk.tokens.start, l_sel // l, max_blocks)
        selected[chunk.tiles] = _top_blocks(importance, forced, candidate, num_selected_blocks)
        if cmp_selected is not None:
            max_cmp_blocks = -(-(chunk.longest // l) // cmp_kv_block)
            forced, candidate = _cmp_selection_masks(part, max_cmp_blocks, l, cmp_kv_block,
                                                     q_tile, causal)
            importance = _block_sums(token_weight, part, chunk.tokens.start, cmp_kv_block,
                                     max_cmp_blocks)
            cmp_selected[chunk.tiles] = _top_blocks(importance, forced, candidate,
                                                    cmp_selected.shape[-1],
                                                    num_cmp_selected_blocks)
    return BlockSelection(selected=selected, cmp_selected=cmp_selected, row_block_offsets=offsets)


# --- layout and chunking -------------------------------------------------------------------------

def _tile_layout(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, offsets: Tensor, num_tiles: int,
                 q_tile: int, l: int, causal: bool) -> _Tiles:
    cu, cu_cmp = cu_seqlens.to(torch.int64), cu_seqlens_cmp.to(torch.int64)
    offsets = offsets.to(torch.int64)
    sequence = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device),
                                       offsets.diff(), output_size=num_tiles)
    anchor = (torch.arange(num_tiles, device=cu.device) - offsets[sequence]) * q_tile
    cmp_len = cu_cmp.diff()[sequence]
    return _Tiles(seq_start=cu[sequence], seq_len=cu.diff()[sequence], anchor=anchor,
                  cmp_start=cu_cmp[sequence],
                  cmp_seen=(anchor + 1) // l if causal else cmp_len)


def _plan_chunks(lengths: list[int], cu_cmp: list[int], q_tile: int, l: int, causal: bool,
                 heads: int, rows_per_tile: int) -> list[_Chunk]:
    """Consecutive tiles grouped so that heads x tiles x (tokens + gathered rows) stays under
    SCORE_CHUNK_ELEMENTS. Short sequences share a chunk; a long one is split over several.

    Tiles come in packed order, so the last token a tile may score never decreases: a chunk's
    tokens run from its first tile's sequence start to its last tile's last visible token.
    """
    chunks: list[_Chunk] = []
    first_tile = tile = 0
    first_token = last_token = longest = 0
    for s, n in enumerate(lengths):
        for t in range(-(-n // q_tile)):
            seen = (t * q_tile + 1) // l if causal else cu_cmp[s + 1] - cu_cmp[s]
            if tile == first_tile:
                first_token = cu_cmp[s]
            cost = heads * (tile - first_tile + 1) * (cu_cmp[s] + seen - first_token
                                                      + rows_per_tile)
            if tile > first_tile and cost > SCORE_CHUNK_ELEMENTS:
                chunks.append(_Chunk(slice(first_tile, tile), slice(first_token, last_token),
                                     longest))
                first_tile, first_token, longest = tile, cu_cmp[s], 0
            last_token, longest = cu_cmp[s] + seen, max(longest, n)
            tile += 1
    if tile > first_tile:
        chunks.append(_Chunk(slice(first_tile, tile), slice(first_token, last_token), longest))
    return chunks


# --- scores --------------------------------------------------------------------------------------

def _scoring_queries(q: Tensor, tiles: _Tiles, q_tile: int, causal: bool) -> Tensor:
    """(tiles, H, D): per tile the mean of q over its scoring rows.

    Causal: the q_tile rows ending at the anchor; otherwise the tile's own rows. Summed directly
    (not as a difference of prefix sums, whose float32 cancellation grows with the sequence).
    """
    offset = torch.arange(q_tile, device=q.device)
    local = tiles.anchor[:, None] + (offset - (q_tile - 1) if causal else offset)
    valid = (local >= 0) & (local < tiles.seq_len[:, None])
    rows = (tiles.seq_start[:, None] + local).clamp(0, q.shape[0] - 1)
    gathered = q[rows.flatten()].unflatten(0, rows.shape).to(compute_dtype(q.dtype))
    summed = (gathered * valid[..., None, None]).sum(dim=1)
    return summed / valid.sum(dim=1)[:, None, None]


def _anchor_token_weights(q_bar: Tensor, k_cmp: Tensor, tiles: _Tiles, first_token: int,
                          softmax_scale: float) -> Tensor:
    """(Hkv, tiles, tokens): softmax over the tokens each anchor sees, summed over the group.

    k_cmp holds the chunk's packed compressed tokens; a tile's visible ones are the contiguous
    range [cmp_start, cmp_start + cmp_seen) of its own sequence.
    """
    num_tiles, heads, dim = q_bar.shape
    num_tokens, kv_heads = k_cmp.shape[:2]
    if num_tokens == 0:  # no anchor of the chunk sees a compressed token yet
        return q_bar.new_zeros(kv_heads, num_tiles, 0)
    group = heads // kv_heads
    queries = q_bar.view(num_tiles, kv_heads, group, dim).permute(1, 0, 2, 3)
    queries = queries.reshape(kv_heads, num_tiles * group, dim)
    keys = k_cmp.to(q_bar.dtype).permute(1, 2, 0)  # (Hkv, D, tokens)
    scores = torch.bmm(queries, keys).view(kv_heads, num_tiles, group, num_tokens)

    token = torch.arange(num_tokens, device=q_bar.device)
    first = tiles.cmp_start - first_token
    seen = (token >= first[:, None]) & (token < (first + tiles.cmp_seen)[:, None])
    seen = seen[None, :, None, :]
    # A masked softmax that gives an anchor seeing nothing all-zero weights instead of NaN.
    scores.mul_(softmax_scale).masked_fill_(~seen, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    weights = scores.sub_(row_max).exp_()
    weights.div_(weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny))
    return weights.sum(dim=2)


def _block_sums(token_weight: Tensor, tiles: _Tiles, first_token: int, tokens_per_block: int,
                num_blocks: int) -> Tensor:
    """(Hkv, tiles, num_blocks): the weights of each tile's own tokens summed per block."""
    kv_heads, num_tiles, num_tokens = token_weight.shape
    local = torch.arange(num_blocks * tokens_per_block, device=token_weight.device)
    column = tiles.cmp_start[:, None] - first_token + local
    own = local < tiles.cmp_seen[:, None]
    if num_tokens == 0:
        return token_weight.new_zeros(kv_heads, num_tiles, num_blocks)
    gathered = token_weight.gather(2, column.clamp(0, num_tokens - 1).expand(kv_heads, -1, -1))
    gathered = gathered * own
    return gathered.view(kv_heads, num_tiles, num_blocks, tokens_per_block).sum(dim=-1)


# --- the rule ------------------------------------------------------------------------------------

def _selection_masks(tiles: _Tiles, num_blocks: int, l_sel: int, q_tile: int, causal: bool
                     ) -> tuple[Tensor, Tensor]:
    """(tiles, blocks) forced and candidate masks of the selected branch."""
    block = torch.arange(num_blocks, device=tiles.anchor.device)[None, :]
    a, n = tiles.anchor[:, None], tiles.seq_len[:, None]
    if causal:
        e = torch.minimum(a + q_tile, n)
        forced = (block == 0) | ((block * l_sel < e) & ((block + 1) * l_sel > a))
        candidate = (block >= 1) & ((block + 1) * l_sel <= a)
    else:
        forced = block == 0
        candidate = (block >= 1) & ((block + 1) * l_sel <= n)
    return forced.expand(tiles.anchor.numel(), -1), candidate & ~forced


def _cmp_selection_masks(tiles: _Tiles, num_blocks: int, l: int, cmp_kv_block: int, q_tile: int,
                         causal: bool) -> tuple[Tensor, Tensor]:
    """(tiles, blocks) forced and candidate masks of the sparse compressed branch."""
    block = torch.arange(num_blocks, device=tiles.anchor.device)[None, :]
    num_cmp = (tiles.seq_len // l)[:, None]
    exists = block * cmp_kv_block < num_cmp
    if not causal:
        return exists & (block == 0), exists & (block >= 1)
    anchor_seen = tiles.cmp_seen[:, None]
    tile_seen = torch.minimum(tiles.anchor + q_tile, tiles.seq_len)[:, None] // l
    # Blocks [1, seen_whole) are candidates, [seen_whole, ceil(tile_seen / B)) the diagonal.
    seen_whole = torch.where(anchor_seen >= num_cmp, -(-num_cmp // cmp_kv_block),
                             anchor_seen // cmp_kv_block)
    diagonal = (block >= seen_whole) & (block < -(-tile_seen // cmp_kv_block))
    forced = exists & ((block == 0) | diagonal)
    candidate = (block >= 1) & (block < seen_whole)
    return forced, candidate


def _top_blocks(importance: Tensor, forced: Tensor, candidate: Tensor, width: int,
                num_candidates: int | None = None) -> Tensor:
    """(tiles, Hkv, width) int32: forced blocks, then the best candidates, ascending, -1 padded.

    Keeps the forced blocks plus num_candidates candidates, or as many as fit in `width` when
    None. A stable descending sort on (forced: +inf, candidate: importance, other: -inf) puts
    equal importances in block order, so ties go to the lower block index.
    """
    key = torch.where(candidate[None], importance, float("-inf"))
    key = torch.where(forced[None], float("inf"), key).permute(1, 0, 2)  # (tiles, Hkv, blocks)
    if key.shape[-1] < width:
        key = torch.nn.functional.pad(key, (0, width - key.shape[-1]), value=float("-inf"))
    ranked_key, ranked = key.sort(dim=-1, descending=True, stable=True)
    keep = ranked_key[..., :width] > float("-inf")
    if num_candidates is not None:
        position = torch.arange(width, device=key.device)
        keep &= position < forced.sum(dim=-1)[:, None, None] + num_candidates
    past_end = key.shape[-1]  # sorts after every real block, then becomes the -1 padding
    chosen = torch.where(keep, ranked[..., :width], past_end).sort(dim=-1).values
    return torch.where(chosen == past_end, -1, chosen).to(torch.int32)
