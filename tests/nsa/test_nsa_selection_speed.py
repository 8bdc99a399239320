"""What makes select_blocks cheap on a GPU, checked on the CPU: a fixed number of torch ops per
call whatever the number of sequences, one device -> host read, and a chunk plan equal to the
plain greedy one (so the score tensor stays bounded the same way)."""

import pytest
import torch

import nsa.selection as selection_module
from nsa.compression import compress_kv
from nsa.selection import select_blocks
from nsa_testing import cu_seqlens_of
from op_counting import OpCounter

RULE = dict(compress_block_size=16, selected_block_size=32, num_selected_blocks=6, q_tile=64,
            cmp_kv_block=4, num_cmp_selected_blocks=2)


def _count(lengths, monkeypatch, causal=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths), 8, 16, generator=gen)
    k = torch.randn(sum(lengths), 2, 16, generator=gen)
    cu = cu_seqlens_of(lengths)
    k_cmp, _, cu_cmp = compress_kv(k, k, cu, RULE["compress_block_size"])
    counter = OpCounter(monkeypatch)
    with counter:
        selection = select_blocks(q, k_cmp, cu, cu_cmp, softmax_scale=0.25, causal=causal,
                                  **RULE)
    assert selection.selected.shape[0] == sum(-(-n // 64) for n in lengths)
    return counter


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_op_count_does_not_grow_with_sequences_or_length(causal, monkeypatch):
    one = _count([2048], monkeypatch, causal)
    eight = _count([300, 1, 517, 64, 200, 333, 129, 504], monkeypatch, causal)
    longer = _count([8192], monkeypatch, causal)
    assert sum(one.ops.values()) == sum(eight.ops.values()) == sum(longer.ops.values())
    assert sum(one.ops.values()) < 250


def test_reads_the_device_once(monkeypatch):
    counter = _count([300, 1, 517, 64, 200], monkeypatch)
    assert counter.reads == 1


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("budget", [300, 2000, 40000])
def test_chunk_plan_is_the_greedy_plan(causal, budget, monkeypatch):
    """Each chunk is the longest run of tiles whose score elements fit (at least one tile)."""
    monkeypatch.setattr(selection_module, "SCORE_CHUNK_ELEMENTS", budget)
    gen = torch.Generator().manual_seed(budget)
    lengths = torch.randint(0, 400, (9,), generator=gen).tolist()
    q_tile, l, heads, extra = 16, 4, 4, 8
    cu_cmp = cu_seqlens_of([n // l for n in lengths]).tolist()
    chunks = selection_module._plan_chunks(lengths, cu_cmp, q_tile, l, causal, heads, extra)

    # Tile by tile: (tile, its sequence's first token, one past its last visible token, length).
    tiles = [(cu_cmp[s], cu_cmp[s] + ((t * q_tile + 1) // l if causal else n // l), n)
             for s, n in enumerate(lengths) for t in range(-(-n // q_tile))]
    expected, first = [], 0
    while first < len(tiles):
        last = first
        while last + 1 < len(tiles) and heads * (last + 2 - first) * (
                tiles[last + 1][1] - tiles[first][0] + extra) <= budget:
            last += 1
        expected.append((first, last + 1, tiles[first][0], tiles[last][1],
                         max(n for _, _, n in tiles[first:last + 1])))
        first = last + 1
    assert [(c.tiles.start, c.tiles.stop, c.tokens.start, c.tokens.stop, c.longest)
            for c in chunks] == expected
    assert len(expected) > 1 or budget == 40000
