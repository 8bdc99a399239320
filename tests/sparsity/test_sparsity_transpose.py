"""transpose_block_sparse: hand-checked case, round trip and dense equivalence properties."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsity import (build_selected_block_sparse, row_block_offsets_from_cu_seqlens,
                      transpose_block_sparse, transposed_list_lengths)
from sparsity.testing import dense_block_mask
from sparsity_oracle import (as_lists, assert_well_formed, ceil_div, cu_from_lengths,
                             from_dense_classes)


def test_transpose_by_hand():
    # Two sequences: q tiles [0, 1] and [2]; KV blocks 3 and 2 (global rows 0-2 and 3-4).
    classes = torch.tensor([[[2, 1, 0]],
                            [[2, 2, 1]],
                            [[1, 0, 0]]], dtype=torch.int8)
    bs = from_dense_classes(classes, [0, 2, 3], row_block_size=8, col_block_size=4)
    t = transpose_block_sparse(bs, col_block_offsets=torch.tensor([0, 3, 5], dtype=torch.int32))
    assert as_lists(t) == [[([0, 1], [])], [([1], [0])], [([], [1])], [([], [0])], [([], [])]]
    assert t.row_block_offsets.tolist() == [0, 3, 5]
    assert (t.row_block_size, t.col_block_size) == (4, 8)
    same = transpose_block_sparse(bs, cu_seqlens_k=torch.tensor([0, 12, 17], dtype=torch.int32))
    assert same.equals(t)
    assert transpose_block_sparse(t, bs.row_block_offsets).equals(bs)


def test_transpose_argument_errors():
    classes = torch.tensor([[[2, 1, 1]]], dtype=torch.int8)
    bs = from_dense_classes(classes, [0, 1], row_block_size=8, col_block_size=4)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="exactly one of col_block_offsets and cu_seqlens_k"):
        transpose_block_sparse(bs)
    with pytest.raises(ValueError, match="exactly one"):
        transpose_block_sparse(bs, col_block_offsets=offsets, cu_seqlens_k=offsets)
    with pytest.raises(ValueError, match="col_block_offsets describes 2 sequences"):
        transpose_block_sparse(bs, col_block_offsets=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="bs.mask_index names a column block past the end"):
        transpose_block_sparse(bs, col_block_offsets=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        transpose_block_sparse(bs, cu_seqlens_k=torch.tensor([1, 12], dtype=torch.int32))


@st.composite
def random_block_sparse(draw):
    """Arbitrary valid lists (not causal-shaped): per row and head, random classes of the
    columns of the row's sequence."""
    tiles = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    col_blocks = draw(st.lists(st.integers(0, 7), min_size=len(tiles), max_size=len(tiles)))
    heads = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    width = max(col_blocks + [1])
    classes = torch.randint(0, 3, (sum(tiles), heads, width), generator=gen, dtype=torch.int8)
    limit = torch.tensor([c for c, n in zip(col_blocks, tiles) for _ in range(n)]).long()
    beyond = (torch.arange(width)[None, None, :] >= limit.view(-1, 1, 1)).expand(classes.shape)
    classes[beyond] = 0
    row_offsets = [0]
    col_offsets = [0]
    for n, c in zip(tiles, col_blocks):
        row_offsets.append(row_offsets[-1] + n)
        col_offsets.append(col_offsets[-1] + c)
    bs = from_dense_classes(classes, row_offsets, row_block_size=draw(st.sampled_from([16, 64])),
                            col_block_size=draw(st.sampled_from([8, 32])))
    return bs, classes, torch.tensor(col_offsets, dtype=torch.int32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_block_sparse())
def test_transpose_is_the_dense_transpose_and_round_trips(case):
    bs, classes, col_offsets = case
    t = transpose_block_sparse(bs, col_block_offsets=col_offsets)
    assert_well_formed(t)
    assert t.num_rows == int(col_offsets[-1]) and t.num_heads == bs.num_heads
    assert torch.equal(t.row_block_offsets, col_offsets)
    assert int(t.full_count.sum()) == int(bs.full_count.sum())
    assert int(t.mask_count.sum()) == int(bs.mask_count.sum())
    # Entry by entry: T[global column block g, h, local tile t] == F[global tile, h, local column].
    row_offsets = bs.row_block_offsets.tolist()
    max_tiles = max(b - a for a, b in zip(row_offsets[:-1], row_offsets[1:]))
    dense_t = dense_block_mask(t, max(1, max_tiles))
    cols = col_offsets.tolist()
    for s in range(len(cols) - 1):
        forward = classes[row_offsets[s]:row_offsets[s + 1], :, :cols[s + 1] - cols[s]]
        backward = dense_t[cols[s]:cols[s + 1], :, :row_offsets[s + 1] - row_offsets[s]]
        assert torch.equal(backward, forward.permute(2, 1, 0))
        assert not bool(dense_t[cols[s]:cols[s + 1], :, row_offsets[s + 1] - row_offsets[s]:].any())
    back = transpose_block_sparse(t, col_block_offsets=bs.row_block_offsets)
    assert back.equals(bs)
    full_count, mask_count = transposed_list_lengths(bs, col_block_offsets=col_offsets)
    assert torch.equal(full_count, t.full_count) and torch.equal(mask_count, t.mask_count)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 5), st.integers(0, 300)), min_size=1,
                        max_size=8),
       seed=st.integers(0, 2**31 - 1))
def test_transpose_of_selected_branch_round_trips(lengths, seed):
    cu = cu_from_lengths(lengths)
    tiles = int(row_block_offsets_from_cu_seqlens(cu, 32)[-1])
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, ceil_div(max(lengths), 16) + 1, (tiles, 2, 4), generator=gen)
    bs = build_selected_block_sparse(picks.to(torch.int32), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     q_tile=32, selected_block_size=16, kv_block=16)
    t = transpose_block_sparse(bs, cu_seqlens_k=cu)
    assert_well_formed(t, cu_seqlens_q=cu, cu_seqlens_k=cu)  # rows: KV blocks, columns: q tiles
    assert transpose_block_sparse(t, col_block_offsets=bs.row_block_offsets).equals(bs)
