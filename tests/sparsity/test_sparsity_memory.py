"""Selected-branch metadata at 1M tokens: O(tiles x selected) bytes, never O(tiles x blocks).

Run with `pytest -s` to see the measured bytes.
"""
import torch

from sparsity import (build_selected_block_sparse, transpose_block_sparse,
                      transposed_list_lengths, uniform_cu_seqlens, validate_block_sparse)

Q_TILE, BLOCK, SELECTED = 128, 64, 16  # NSA defaults: 16 selected blocks of 64 per 128-row tile


def random_valid_selection(seqlen: int, heads: int, seed: int) -> torch.Tensor:
    """(tiles, heads, 16) picks obeying the causal selection rule of docs/interfaces.md: block
    0, the two diagonal blocks of the tile, and 13 random candidates complete before the tile
    (drawn with replacement, so duplicates occur; early tiles pad with -1)."""
    tiles = seqlen // Q_TILE
    tile = torch.arange(tiles)[:, None, None]
    per_tile = Q_TILE // BLOCK
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(tiles, heads, SELECTED - 1 - per_tile, generator=gen)
    complete_before = tile * per_tile - 1  # candidates c in [1, complete_before]
    candidates = torch.where(complete_before >= 1,
                             1 + (draws * complete_before.clamp(min=1)).long(), -1)
    forced = torch.cat([torch.zeros_like(tile), tile * per_tile, tile * per_tile + 1], dim=-1)
    return torch.cat([forced.expand(-1, heads, -1), candidates], dim=-1).to(torch.int32)


def build(seqlen: int, heads: int, seed: int):
    cu = uniform_cu_seqlens(1, seqlen)
    picks = random_valid_selection(seqlen, heads, seed)
    bs = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=Q_TILE,
                                     selected_block_size=BLOCK, kv_block=BLOCK)
    return bs, cu


def test_selected_metadata_at_one_million_tokens_is_o_tiles_times_selected():
    seqlen, kv_heads = 1 << 20, 8  # H = 32 query heads in groups of 4 share one selection
    bs, cu = build(seqlen, kv_heads, seed=0)
    validate_block_sparse(bs, num_heads=32, num_kv_heads=kv_heads, cu_seqlens_q=cu,
                          cu_seqlens_k=cu)
    tiles, blocks = seqlen // Q_TILE, seqlen // BLOCK
    # Every tile: both diagonal blocks need the causal mask; block 0 and the candidates are full.
    assert bool((bs.mask_count == 2).all())
    assert bool((bs.full_count[1:] >= 1).all()) and bool((bs.full_count <= SELECTED - 2).all())
    assert bs.full_index.shape[-1] + bs.mask_index.shape[-1] <= SELECTED

    selection_bytes = tiles * kv_heads * SELECTED * 4  # the int32 selection itself
    dense_table_bytes = tiles * kv_heads * blocks  # even at 1 byte per (tile, head, block)
    assert bs.nbytes <= 1.25 * selection_bytes + 64
    assert bs.nbytes * 200 < dense_table_bytes
    # Per query head (Hs = H = 32) the lists are 4x larger: about 18.9 MB at these sizes.
    print(f"\nselected metadata, N={seqlen}, Hs={kv_heads}, {tiles} tiles x {SELECTED} blocks: "
          f"{bs.nbytes / 2**20:.2f} MiB (selection itself {selection_bytes / 2**20:.2f} MiB, "
          f"dense 1-byte (tiles x blocks) table {dense_table_bytes / 2**20:.0f} MiB)")

    # The transpose holds the same entries, but padded to its longest list: block 0 is listed
    # by every tile, so its row is `tiles` long and the padded layout is O(blocks x tiles).
    full_count, mask_count = transposed_list_lengths(bs, cu_seqlens_k=cu)
    assert int(full_count.sum()) == int(bs.full_count.sum())
    assert int(mask_count.sum()) == int(bs.mask_count.sum())
    assert int(full_count[0].min()) == tiles - 1  # block 0: full for every tile but the first
    entries = int(full_count.sum() + mask_count.sum())
    padded_bytes = blocks * kv_heads * (int(full_count.max()) + int(mask_count.max())) * 4
    longest_without_block0 = int(full_count[1:].max())
    print(f"transposed: {entries} entries ({entries * 4 / 2**20:.2f} MiB as flat lists), but "
          f"padded (blocks, Hs, Kf + Km) = ({blocks}, {kv_heads}, {int(full_count.max())} + "
          f"{int(mask_count.max())}) would take {padded_bytes / 2**30:.2f} GiB; "
          f"longest list without block 0: {longest_without_block0}")


def test_transpose_measured_at_131072_tokens_matches_its_predicted_size():
    seqlen, kv_heads = 1 << 17, 8
    bs, cu = build(seqlen, kv_heads, seed=1)
    transposed = transpose_block_sparse(bs, cu_seqlens_k=cu)
    full_count, mask_count = transposed_list_lengths(bs, cu_seqlens_k=cu)
    assert torch.equal(transposed.full_count, full_count)
    assert torch.equal(transposed.mask_count, mask_count)
    blocks = seqlen // BLOCK
    widths = int(full_count.max()) + int(mask_count.max())
    assert transposed.nbytes == 4 * (blocks * kv_heads * (2 + widths) + 2)
    assert transpose_block_sparse(transposed, col_block_offsets=bs.row_block_offsets).equals(bs)
    print(f"\nN={seqlen}: forward {bs.nbytes / 2**20:.2f} MiB, transposed "
          f"{transposed.nbytes / 2**20:.2f} MiB (padded to {widths} tiles per block)")
