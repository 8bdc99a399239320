"""The shortcuts that keep the builders cheap on a GPU, each against the plain computation it
replaces, and the number of device reads and ops they are left with."""

import pytest
import torch

from sparsity import build_compressed_block_sparse, build_selected_block_sparse
from sparsity._geometry import diagonal_block_range, max_diagonal_blocks, tile_geometry
from sparsity._lists import compact_block_lists, compact_block_lists_below
from op_counting import OpCounter


def _cu(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("q_tile,compress_factor,block_size", [
    (16, 4, 4), (128, 64, 128), (128, 16, 3), (96, 5, 7), (64, 1, 48), (8, 32, 1), (128, 1, 64),
])
def test_diagonal_width_bound_holds_for_every_tile(q_tile, compress_factor, block_size):
    gen = torch.Generator().manual_seed(q_tile + block_size)
    lengths = torch.randint(1, 40 * q_tile, (12,), generator=gen).tolist()
    cu = _cu(lengths).to(torch.int64)
    cu_k = _cu([n // compress_factor for n in lengths]).to(torch.int64)
    start, stop = diagonal_block_range(tile_geometry(cu, cu_k, q_tile), block_size=block_size,
                                       compress_factor=compress_factor)
    assert int((stop - start).max()) <= max_diagonal_blocks(q_tile, compress_factor, block_size)


def test_threshold_compaction_equals_the_general_one():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(-3, 30, (50, 3, 12), generator=gen)  # holes and duplicates
    full_end = torch.randint(0, 31, (50, 1, 1), generator=gen)
    fast = compact_block_lists_below(blocks, full_end)
    general = compact_block_lists(blocks, blocks < full_end)
    for a, b in zip(fast, general):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(fast[0].sum()) > 0 and int(fast[2].sum()) > 0  # both kinds of list occur


def _random_selection(lengths, heads, width, rows_per_block, gen):
    """(tiles of 128 rows, heads, width) block indices, -1 holes, some past the sequence."""
    tiles = sum(-(-n // 128) for n in lengths)
    return torch.randint(-1, max(lengths) // rows_per_block + 2, (tiles, heads, width),
                         generator=gen, dtype=torch.int32)


def test_selected_builder_reads_the_device_a_few_times(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    counts = []
    for lengths in ([4096], [700, 1, 1300, 64, 999, 1032]):
        cu = _cu(lengths)
        picks = _random_selection(lengths, 4, 16, 64, gen)
        counter = OpCounter(monkeypatch)
        with counter:
            bs = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=128,
                                             selected_block_size=64, kv_block=64)
        assert int(bs.full_count.sum()) > 0
        # cu_seqlens check (1), tiles (1), selected >= -1 (1), list widths (1).
        assert counter.reads == 4
        counts.append(sum(counter.ops.values()))
    assert counts[0] == counts[1]


def test_compressed_builder_reads_the_device_a_few_times(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    counts = []
    for lengths in ([8192], [3000, 7, 2100, 64, 3021]):
        cu = _cu(lengths)
        cu_cmp = _cu([n // 16 for n in lengths])
        picks = _random_selection(lengths, 2, 3, 16 * 4, gen)  # blocks of 4 compressed keys
        counter = OpCounter(monkeypatch)
        with counter:
            bs = build_compressed_block_sparse(cu_seqlens_q=cu, cu_seqlens_k_cmp=cu_cmp,
                                               compress_factor=16, q_tile=128, kv_block=4,
                                               selected=picks)
        assert int(bs.mask_count.sum()) > 0
        # Two cu_seqlens checks (1 each), tiles (1), selected >= -1 (1), list widths (1).
        assert counter.reads == 5
        counts.append(sum(counter.ops.values()))
    assert counts[0] == counts[1]
