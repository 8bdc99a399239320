"""How the dense fallback cuts a sequence into chunks of rows (issue 16, item 3).

Rows per chunk used to be sized by the whole sequence (budget / (heads x N)), not by the keys the
rows can see: the window-512 branch at H=32 split into ~43,700 chunks of 2-3 rows at 128K tokens
and ~1M chunks of one row at 1M, each a few dozen small ops, so its cost grew with N^2 although
its work grows with N. Chunks are now sized by the keys visible to the chunk, so the number of
chunks, like the work, follows the attended pairs. Shapes only: meta tensors, no compute.
"""
from __future__ import annotations

import pytest
import torch

from kernels import fallback
from kernels.validate import validate_attention_forward


def _problem(seqlen, heads=32, kv_heads=8, head_dim=128, **options):
    q = torch.empty(1, seqlen, heads, head_dim, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, seqlen // options.get("compress_factor", 1), kv_heads, head_dim,
                    device="meta", dtype=torch.bfloat16)
    return validate_attention_forward(q, k, k, **options)


def _chunks(problem, num_rows, num_keys, budget=fallback.CHUNK_BUDGET_BYTES):
    return list(fallback._chunks(problem, num_rows, num_keys, torch.float32, budget))


def _attended_pairs(seqlen: int, window: int) -> int:
    """Pairs (row, key) a causal window of `window` keys attends in a sequence."""
    return sum(min(row + 1, window) for row in range(seqlen))


@pytest.mark.parametrize("window", [512, 4096])
def test_window_chunks_follow_the_window_not_the_sequence(window):
    """NSA's window branch (H = 32, D = 128): the same rows per chunk at 128K and 1M tokens,
    derived from the window (an eighth of it, at least MIN_CHUNK_ROWS, fewer where the budget
    holds rows x (window + rows) pairs), so the number of chunks is N / rows_per_chunk and the
    pairs computed stay within 1.15x those attended."""
    by_window = max(window // 8 + 1, 64)  # SPAN_GROWTH 8, MIN_CHUNK_ROWS 64 (checked below)
    by_budget = max(rows for rows in range(1, by_window + 1) if rows * (window - 1 + rows)
                    * (32 * (4 * 4 + 4) + 8) <= fallback.CHUNK_BUDGET_BYTES)
    expected_rows = min(by_window, by_budget)  # 65 for 512 keys, 98 (the budget) for 4096
    rows_per_chunk = {}
    for seqlen in (128 * 1024, 1024 * 1024):
        problem = _problem(seqlen, causal=True, window_size=(window - 1, 0))
        chunks = _chunks(problem, seqlen, seqlen)
        sizes = [r1 - r0 for r0, r1, _, _ in chunks]
        assert chunks[0][0] == 0 and chunks[-1][1] == seqlen
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), "contiguous, no overlap"
        for r0, r1, c0, c1 in chunks:
            assert (c0, c1) == fallback._visible_key_range(problem, r0, r1, seqlen)
        steady = set(sizes[len(sizes) // 10:-1])  # past the first window, before the tail
        assert len(steady) == 1
        rows_per_chunk[seqlen] = steady.pop()
        assert rows_per_chunk[seqlen] == expected_rows
        assert len(chunks) <= seqlen // expected_rows + window // 64
        computed = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in chunks)
        assert computed <= 1.15 * _attended_pairs(seqlen, window)
    assert rows_per_chunk[128 * 1024] == rows_per_chunk[1024 * 1024]
    assert fallback.SPAN_GROWTH == 8 and fallback.MIN_CHUNK_ROWS == 64


def test_window_512_at_128k_is_about_2k_chunks_not_44k():
    """Sized by the sequence, 128K tokens at H = 32 gave budget / (32 heads x 128K keys x 20
    bytes) = 3 rows per chunk: 43,691 chunks. Now 128K / 65 rows."""
    seqlen = 128 * 1024
    chunks = _chunks(_problem(seqlen, causal=True, window_size=(511, 0)), seqlen, seqlen)
    assert len(chunks) < 2100


@pytest.mark.parametrize("options, seqlen", [
    (dict(causal=True), 20000),
    (dict(causal=True, window_size=(511, 0)), 20000),
    (dict(causal=True, window_size=(4095, 0)), 20000),
    (dict(causal=True, compress_factor=64), 65536),
    (dict(window_size=(300, 200)), 20000),
    (dict(window_size=(300, -1)), 20000),
    (dict(), 20000),
], ids=["causal", "window-512", "window-4096", "compressed-cf64", "two-sided-window",
        "left-window-noncausal", "dense"])
@pytest.mark.parametrize("heads", [4, 32])
def test_chunks_cover_every_row_within_the_budget_and_the_waste_bound(options, seqlen, heads):
    """Every chunk: contiguous rows, exactly the keys they may see, temporaries under the
    budget; and either at most MIN_CHUNK_ROWS rows, or one row (the budget's floor), or a key
    span at most 9/8 of what its first row sees (at most an eighth of its pairs unseen by the
    causal triangle or a window edge)."""
    problem = _problem(seqlen, heads=heads, kv_heads=4, head_dim=64, **options)
    num_keys = seqlen // problem.compress_factor
    budget = 64 << 20
    bytes_per_pair = fallback._bytes_per_pair(problem, torch.float32)
    assert bytes_per_pair >= heads * (4 * 4 + 4)  # scores, P, dS, a copy (fp32) and the mask
    previous_end = 0
    for r0, r1, c0, c1 in _chunks(problem, seqlen, num_keys, budget):
        assert r0 >= previous_end and r1 > r0  # rows that see nothing may be skipped
        assert all(fallback._visible_key_range(problem, row, row + 1, num_keys)[0]
                   >= fallback._visible_key_range(problem, row, row + 1, num_keys)[1]
                   for row in range(previous_end, r0)), "only blind rows are skipped"
        previous_end = r1
        assert (c0, c1) == fallback._visible_key_range(problem, r0, r1, num_keys)
        assert (r1 - r0) * (c1 - c0) * bytes_per_pair <= budget or r1 - r0 == 1
        first_c0, first_c1 = fallback._visible_key_range(problem, r0, r0 + 1, num_keys)
        first_span = max(0, first_c1 - first_c0)
        assert (r1 - r0 <= fallback.MIN_CHUNK_ROWS or c1 - c0 <= first_span * 9 // 8
                or r1 - r0 == 1)
    assert previous_end == seqlen


def test_chunking_tracks_the_keys_not_the_sequence_for_a_small_budget():
    """With a budget of 2,048 (row, key) pairs, a 512-key window packs 3 rows per chunk (the
    chunk's span, not the sequence, meets the budget) at every length; sized by the sequence it
    was one row per chunk at 8K tokens already."""
    for seqlen in (8192, 65536):
        problem = _problem(seqlen, heads=4, kv_heads=4, head_dim=64, causal=True,
                           window_size=(511, 0))
        budget = 2048 * (4 * (4 * 4 + 4) + 8)  # 2,048 pairs at 4 heads (_bytes_per_pair)
        chunks = _chunks(problem, seqlen, seqlen, budget)
        steady = {r1 - r0 for r0, r1, _, _ in chunks[len(chunks) // 10:-1]}
        assert steady == {3}  # 3 x (511 + 3) keys <= 2048 < 4 x (511 + 4)
        assert budget == 2048 * fallback._bytes_per_pair(problem, torch.float32)
