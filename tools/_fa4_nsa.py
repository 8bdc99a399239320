"""The seed's NSA design assembled from FA4's public pieces (flash-attn-4), the `fa4-nsa` method
of tools/bench_nsa_vs_dense.py: what a user can build without this library, to measure what our
kernels and glue add on the same design.

The design (issue 15), for padded (B, N, H, D) inputs, mean gating:

- compression: the mean of each l-token block of K and V (torch);
- compressed branch: FA4 over the N / l compressed keys with a `mask_mod` for the compressed
  causal rule (row i sees compressed token c when (c + 1) l <= i + 1);
- selection (no gradient): the mean query of each 128-row tile scored against the compressed
  keys, summed over the query heads of a KV group; the top n of the l'-key blocks (l' = l, so a
  compressed token scores its block) the tile can reach; those blocks mapped to FA4's 128 x 128
  block-sparse lists, the tile's diagonal block always listed and masked (causal `mask_mod`),
  the others full;
- window: FA4's `window_size`;
- out = the mean of the three branch outputs.

Forward and backward both run on FA4 (its autograd, with the transposed lists for the
backward). FA4 is imported when the method is built: without it the method reports why.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table_lists  # noqa: E402

FA4_TILE = 128  # FA4's SM90 block-sparse tiles at D = 128: 128 query rows x 128 keys


def compressed_causal_mask(block: int):
    """FA4 mask_mod: row q_idx sees compressed token kv_idx when its whole block is in the past."""
    def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx * block + (block - 1) <= q_idx
    mask_mod.__name__ = f"compressed_causal_{block}"
    return mask_mod


def causal_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """FA4 mask_mod for the diagonal (masked) blocks of the selected branch."""
    return kv_idx <= q_idx


def selected_tiles(q: torch.Tensor, k_cmp: torch.Tensor, *, block: int, num_selected: int,
                   tile: int = FA4_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(full (B, Hkv, M, C) bool, diagonal (M, C) bool): the tile-level lists of the selected
    branch over M = ceil(N / tile) query tiles and C = ceil(N / tile) key tiles. A query tile
    lists the key tiles holding its top `num_selected` blocks of `block` keys (scored by the
    tile's mean query against the compressed keys, summed over the KV group, among the blocks
    that start at or before the tile's last row), except its diagonal tile, which it always lists
    as a masked tile (the other tiles of the list are full: entirely in the past)."""
    batch, seqlen, heads, dim = q.shape
    kv_heads, num_blocks = k_cmp.shape[2], k_cmp.shape[1]
    tiles = -(-seqlen // tile)
    padded = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, tiles * tile - seqlen))
    counts = torch.full((tiles, 1), tile, device=q.device, dtype=torch.float32)
    counts[-1] = seqlen - (tiles - 1) * tile
    q_mean = padded.float().view(batch, tiles, tile, heads, dim).sum(2) / counts[None, :, :, None]
    grouped = q_mean.view(batch, tiles, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("btgjd,bcgd->bgtc", grouped, k_cmp.float())  # summed over the group
    last_row = torch.clamp(torch.arange(tiles, device=q.device) * tile + tile - 1, max=seqlen - 1)
    block_start = torch.arange(num_blocks, device=q.device) * block
    reachable = block_start[None, :] <= last_row[:, None]  # (M, blocks)
    scores = scores.masked_fill(~reachable, float("-inf"))
    top = scores.topk(min(num_selected, num_blocks), dim=-1)
    key_tile = torch.div(top.indices * block, tile, rounding_mode="floor")
    key_tiles = tiles
    full = torch.zeros(batch, kv_heads, tiles, key_tiles + 1, dtype=torch.bool, device=q.device)
    # Unreachable picks (fewer reachable blocks than num_selected) go to a spare last column.
    full.scatter_(3, torch.where(torch.isfinite(top.values), key_tile, key_tiles), True)
    full = full[..., :key_tiles]
    diagonal = torch.eye(tiles, key_tiles, dtype=torch.bool, device=q.device)
    return full & ~diagonal, diagonal


def fa4_block_sparse(full: torch.Tensor, diagonal: torch.Tensor, heads: int):
    """FA4's (forward, backward) BlockSparseTensorsTorch of `selected_tiles`' tables, per query
    head (each KV group's lists repeated over its heads)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    group = heads // full.shape[1]
    full = full.repeat_interleave(group, dim=1)
    masked = diagonal.expand_as(full)
    lists = []
    for full_table, mask_table in ((full, masked), (full.transpose(-1, -2),
                                                   masked.transpose(-1, -2))):
        full_count, full_index = table_lists(full_table)
        mask_count, mask_index = table_lists(mask_table)
        lists.append(BlockSparseTensorsTorch(
            mask_block_cnt=mask_count, mask_block_idx=mask_index, full_block_cnt=full_count,
            full_block_idx=full_index, block_size=(FA4_TILE, FA4_TILE)))
    return lists


def fa4_nsa_method(*, compress_block_size: int, selected_block_size: int,
                   num_selected_blocks: int, window_size: int):
    """A function (q, k, v) -> out running the design above on FA4; raises without FA4 or for
    a shape it does not cover."""
    if compress_block_size != selected_block_size:
        raise RuntimeError("the seed's design scores l'-key blocks by compressed tokens: "
                           "l must equal l'")
    flash_attn_func = importlib.import_module("flash_attn.cute").flash_attn_func
    block = compress_block_size
    compressed_mask = compressed_causal_mask(block)

    def attend(q, k, v, **kwargs):
        out = flash_attn_func(q, k, v, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run(q, k, v):
        batch, seqlen, heads, dim = q.shape
        num_blocks = seqlen // block
        k_cmp = k[:, :num_blocks * block].unflatten(1, (num_blocks, block)).mean(2)
        v_cmp = v[:, :num_blocks * block].unflatten(1, (num_blocks, block)).mean(2)
        out = attend(q, k_cmp, v_cmp, mask_mod=compressed_mask)
        with torch.no_grad():
            full, diagonal = selected_tiles(q, k_cmp, block=block,
                                            num_selected=num_selected_blocks)
            forward_lists, backward_lists = fa4_block_sparse(full, diagonal, heads)
        out = out + attend(q, k, v, mask_mod=causal_mask, block_sparse_tensors=forward_lists,
                           block_sparse_tensors_bwd=backward_lists)
        branches = 2
        if window_size:
            out = out + attend(q, k, v, causal=True, window_size=(window_size - 1, 0))
            branches = 3
        return out / branches
    return run
