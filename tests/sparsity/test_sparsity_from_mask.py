"""build_block_sparse_from_mask: hand-checked cases and properties against a loop oracle."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsity import (build_block_sparse_from_mask, build_block_sparse_from_tile_classes,
                      build_selected_block_sparse)
from sparsity_oracle import (FULL_BLOCK, MASK_BLOCK, as_lists, assert_well_formed, ceil_div,
                             cu_from_lengths, sequence_rows)


def test_bool_mask_by_hand():
    # 5 queries x 6 keys; tiles of 2 rows (0-1, 2-3, 4), blocks of 4 keys (0-3, 4-5).
    mask = torch.tensor([[1, 1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1, 0],
                         [0, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0],
                         [0, 1, 0, 0, 1, 1]], dtype=torch.bool)[None, None]
    bs = build_block_sparse_from_mask(mask, q_tile=2, kv_block=4)
    assert as_lists(bs) == [[([0], [1])], [([], [])], [([1], [0])]]  # last tile/block are partial
    assert bs.row_block_offsets.tolist() == [0, 3]


def test_additive_mask_equals_bool_mask_and_rejects_bias():
    attend = torch.rand(2, 3, 9, 7, generator=torch.Generator().manual_seed(0)) < 0.7
    additive = torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))
    a = build_block_sparse_from_mask(attend, q_tile=4, kv_block=2)
    b = build_block_sparse_from_mask(additive, q_tile=4, kv_block=2)
    assert a.equals(b) and a.num_heads == 3 and a.num_rows == 2 * 3
    with pytest.raises(ValueError, match="additive float mask"):
        build_block_sparse_from_mask(additive + 0.5, q_tile=4, kv_block=2)


def test_shared_batch_mask_is_repeated_for_batch_size():
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    one = build_block_sparse_from_mask(causal, q_tile=4, kv_block=4)
    three = build_block_sparse_from_mask(causal, q_tile=4, kv_block=4, batch_size=3)
    assert three.row_block_offsets.tolist() == [0, 3, 6, 9]
    assert torch.equal(three.full_index, one.full_index.repeat(3, 1, 1))
    assert torch.equal(three.mask_index, one.mask_index.repeat(3, 1, 1))


def test_packed_mask_ignores_cross_sequence_entries():
    lengths = [5, 0, 3]
    cu = cu_from_lengths(lengths)
    attend = torch.ones(1, 1, 8, 8, dtype=torch.bool)  # everything, across sequences too
    bs = build_block_sparse_from_mask(attend, q_tile=4, kv_block=4, cu_seqlens=cu)
    assert bs.row_block_offsets.tolist() == [0, 2, 2, 3]
    assert as_lists(bs) == [[([0, 1], [])], [([0, 1], [])], [([0], [])]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=torch.ones(4, 4, dtype=torch.bool)), "mask must have shape"),
    (dict(mask=torch.ones(1, 1, 4, 4, dtype=torch.int32)), "mask must be bool"),
    (dict(mask=torch.ones(2, 1, 4, 4, dtype=torch.bool), batch_size=3), "batch_size"),
    (dict(mask=torch.ones(1, 1, 4, 4, dtype=torch.bool),
          cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)), "T = cu_seqlens"),
    (dict(mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), kv_block=0), "kv_block"),
])
def test_bad_arguments_raise_naming_them(kwargs, match):
    kw = dict(q_tile=2, kv_block=2)
    kw.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        build_block_sparse_from_mask(kw.pop("mask"), **kw)


def test_a_side_without_tokens_lists_nothing():
    no_rows = build_block_sparse_from_mask(torch.ones(1, 1, 0, 8, dtype=torch.bool), q_tile=4,
                                           kv_block=4)
    assert no_rows.row_block_offsets.tolist() == [0, 0] and no_rows.full_count.numel() == 0
    no_keys = build_block_sparse_from_mask(torch.ones(2, 1, 8, 0, dtype=torch.bool), q_tile=4,
                                           kv_block=4)
    assert no_keys.row_block_offsets.tolist() == [0, 2, 4]
    assert as_lists(no_keys) == [[([], [])]] * 4


@pytest.mark.parametrize("classes, kwargs, match", [
    ("not a tensor", {}, "classes must be a torch.Tensor"),
    (torch.zeros(1, 1, 2, 4), {}, r"int8 \(B, Hs, Tq, Tk\) tensor with \(Tq, Tk\) = \(2, 4\)"),
    (torch.zeros(1, 1, 2, 3, dtype=torch.int8), {}, r"got torch.int8 of shape \(1, 1, 2, 3\)"),
    (torch.zeros(2, 4, dtype=torch.int8), {}, r"\(B, Hs, Tq, Tk\)"),
    (torch.zeros(1, 1, 2, 4, dtype=torch.int8), dict(seqlen_k=-1), "seqlen_k must be a non-neg"),
    (torch.zeros(1, 1, 2, 4, dtype=torch.int8), dict(q_tile=0), "q_tile must be a positive"),
])
def test_tile_classes_bad_arguments_raise_naming_them(classes, kwargs, match):
    kw = dict(seqlen_q=8, seqlen_k=16, q_tile=4, kv_block=4)
    kw.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        build_block_sparse_from_tile_classes(classes, **kw)


def loop_classes(attend, q_tile, kv_block, num_blocks):
    """(H, nq, nk) bool -> (tiles, H, num_blocks) classes by explicit loops over tiles, blocks."""
    heads, nq, nk = attend.shape
    out = torch.zeros(ceil_div(nq, q_tile), heads, num_blocks, dtype=torch.int8)
    for t in range(ceil_div(nq, q_tile)):
        for b in range(ceil_div(nk, kv_block)):
            for h in range(heads):
                tile = attend[h, t * q_tile:(t + 1) * q_tile, b * kv_block:(b + 1) * kv_block]
                if bool(tile.all()):
                    out[t, h, b] = FULL_BLOCK
                elif bool(tile.any()):
                    out[t, h, b] = MASK_BLOCK
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=8),
       heads=st.integers(1, 2), q_tile=st.sampled_from([2, 4, 8]),
       kv_block=st.sampled_from([2, 4, 8]), density=st.sampled_from([0.1, 0.5, 0.95]),
       seed=st.integers(0, 2**31 - 1))
def test_packed_mask_matches_loop_oracle(lengths, heads, q_tile, kv_block, density, seed):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(seed)
    attend = torch.rand(1, heads, total, total, generator=gen) < density
    bs = build_block_sparse_from_mask(attend, q_tile=q_tile, kv_block=kv_block, cu_seqlens=cu)
    assert_well_formed(bs, cu_seqlens_q=cu, cu_seqlens_k=cu)
    num_blocks = max(1, ceil_div(max(lengths), kv_block))
    bounds = cu.tolist()
    for classes, a, b in zip(sequence_rows(bs, num_blocks), bounds[:-1], bounds[1:]):
        expected = loop_classes(attend[0, :, a:b, a:b], q_tile, kv_block, num_blocks)
        assert torch.equal(classes, expected)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), seqlen=st.integers(1, 48), kv_block=st.sampled_from([4, 8]),
       seed=st.integers(0, 2**31 - 1))
def test_mask_of_a_selection_gives_the_selected_builder_lists(batch, seqlen, kv_block, seed):
    # The dense mask "causal and inside the selected blocks" is causal-shaped inside partial
    # tiles, so the dense builder must agree exactly with the selected builder.
    q_tile, heads = 8, 2
    tiles = ceil_div(seqlen, q_tile)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, ceil_div(seqlen, kv_block) + 1, (batch * tiles, heads, 3),
                          generator=gen)
    rows, keys = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    per_row_picks = picks.view(batch, tiles, heads, 3)[:, rows[:, 0] // q_tile]  # (B, N, H, 3)
    chosen = (keys[..., None] // kv_block == per_row_picks[:, :, :, None, :]).any(-1)  # B,N,H,N
    mask = (chosen & (keys <= rows)[None, :, None, :]).permute(0, 2, 1, 3)
    from_mask = build_block_sparse_from_mask(mask, q_tile=q_tile, kv_block=kv_block)
    cu = torch.arange(batch + 1, dtype=torch.int32) * seqlen
    selected = build_selected_block_sparse(picks.to(torch.int32), cu_seqlens_q=cu,
                                           cu_seqlens_k=cu, q_tile=q_tile,
                                           selected_block_size=kv_block, kv_block=kv_block)
    assert from_mask.equals(selected)
