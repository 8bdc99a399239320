"""build_selected_block_sparse: hand-checked cases and properties against a token-level oracle."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsity import build_selected_block_sparse
from sparsity_oracle import (as_lists, assert_well_formed, ceil_div, classify_cells,
                             cu_from_lengths, kernel_attended, key_visibility,
                             selected_token_mask, sequence_rows)


def build(selected, lengths_q, lengths_k=None, **kw):
    cu_q = cu_from_lengths(lengths_q)
    cu_k = cu_from_lengths(lengths_q if lengths_k is None else lengths_k)
    selected = torch.tensor(selected, dtype=torch.int32)
    return build_selected_block_sparse(selected, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)


def test_causal_single_sequence_by_hand():
    # 10 tokens, q tiles of 4 (rows 0-3, 4-7, 8-9), blocks of 2 tokens.
    bs = build([[[1, 0, 3]], [[2, 0, 0]], [[4, 3, -1]]], [10],
               q_tile=4, selected_block_size=2, kv_block=2)
    assert as_lists(bs) == [
        [([], [0, 1])],  # block 3 = keys 6,7 is in the future of rows 0-3: dropped
        [([0], [2])],  # duplicate 0 once; keys 4,5 need the mask for row 4
        [([3], [4])],
    ]
    assert bs.full_index.shape == (3, 1, 1) and bs.mask_index.shape == (3, 1, 2)
    assert bs.full_index[0, 0, 0] == -1 and bs.mask_index[1, 0, 1] == -1
    assert bs.row_block_offsets.tolist() == [0, 3]
    assert (bs.row_block_size, bs.col_block_size) == (4, 2)


def test_partial_last_tile_and_block_are_full_when_fully_visible():
    # 9 tokens: the last tile is row 8 alone and the last block is key 8 alone; row 8 sees it.
    bs = build([[[0, -1]], [[1, 1]], [[4, 0]]], [9], q_tile=4, selected_block_size=2, kv_block=2)
    assert as_lists(bs) == [[([], [0])], [([1], [])], [([0, 4], [])]]


def test_selected_blocks_split_into_smaller_kernel_blocks():
    bs = build([[[0, -1]], [[1, 0]]], [8], q_tile=4, selected_block_size=4, kv_block=2)
    assert as_lists(bs) == [[([], [0, 1])], [([0, 1], [2, 3])]]


def test_merge_into_larger_kernel_blocks_ignores_parts_no_row_can_see():
    # kv_block 4 = selected blocks {0, 1}. Rows 0-1 cannot see block 1 (keys 2, 3), so
    # selecting only block 0 is exact; rows 2-3 can, so it would be a superset.
    bs = build([[[0, -1, -1, -1]], [[0, 1, -1, -1]], [[1, 0, -1, -1]], [[1, 0, 3, 2]]], [8],
               q_tile=2, selected_block_size=2, kv_block=4)
    assert as_lists(bs) == [[([], [0])], [([], [0])], [([0], [])], [([0], [1])]]
    with pytest.raises(ValueError, match=r"kernel block 0 of q tile 1 .*superset"):
        build([[[0, -1]], [[0, -1]], [[0, 1]], [[0, 1]]], [8], q_tile=2, selected_block_size=2,
              kv_block=4)


def test_varlen_with_empty_sequence_and_non_causal():
    lengths = [3, 0, 4]  # the empty sequence owns no tile
    causal = build([[[1, 0]], [[2, 1]]], lengths, q_tile=4, selected_block_size=2, kv_block=2)
    assert causal.row_block_offsets.tolist() == [0, 1, 1, 2]
    # Block 2 lies past the end of the 4-token sequence: dropped.
    assert as_lists(causal) == [[([], [0, 1])], [([], [1])]]
    dense = build([[[1, 0]], [[2, 1]]], lengths, q_tile=4, selected_block_size=2, kv_block=2,
                  causal=False)
    assert as_lists(dense) == [[([0, 1], [])], [([1], [])]]


def test_cross_attention_is_top_left_aligned():
    # 4 queries, 8 keys: row i sees keys <= i, never the later keys.
    bs = build([[[0, 1, 2, 3]]], [4], [8], q_tile=4, selected_block_size=2, kv_block=2)
    assert as_lists(bs) == [[([], [0, 1])]]


@pytest.mark.parametrize("bad, match", [
    (dict(q_tile=0), "q_tile"),
    (dict(kv_block=12), r"kv_block \(12\) must divide selected_block_size"),
    (dict(selected=torch.zeros(3, 1, 2)), "selected must be int32 or int64"),
    (dict(selected=torch.zeros(2, 1, 2, dtype=torch.int32)), "selected has 2 rows"),
    (dict(selected=torch.full((3, 1, 2), -2, dtype=torch.int32)), "selected entries"),
    (dict(selected=torch.full((3, 1, 2), 2**31, dtype=torch.int64)),
     r"selected entries must be block indices <= 2147483647"),
    (dict(selected=torch.zeros(3, 2, dtype=torch.int32)), r"selected must have shape"),
    (dict(cu_seqlens_q=torch.tensor([1, 10], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 3], dtype=torch.int32)), "cu_seqlens_k"),
    (dict(cu_seqlens_k=torch.tensor([0.0, 10.0])), "cu_seqlens_k must be int32"),
    (dict(causal=1), "causal"),
])
def test_bad_arguments_raise_naming_them(bad, match):
    kw = dict(selected=torch.zeros(3, 1, 2, dtype=torch.int32),
              cu_seqlens_q=torch.tensor([0, 10], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32),
              q_tile=4, selected_block_size=8, kv_block=4)
    kw.update(bad)
    selected = kw.pop("selected")
    with pytest.raises((ValueError, TypeError), match=match):
        build_selected_block_sparse(selected, **kw)


def test_int64_index_beyond_int32_is_refused_not_wrapped():
    # Selected blocks of 256 keys split into 4 kernel blocks of 64: 4 * (2**62 + 1) wraps in
    # int64 to 4, so block 1 (kernel blocks 4..7) would be listed though nobody selected it.
    selected = torch.full((8, 1, 2), -1, dtype=torch.int64)
    selected[:, 0, 0] = 0
    selected[7, 0, 1] = 2**62 + 1
    cu = cu_from_lengths([1024])
    with pytest.raises(ValueError, match=r"^selected entries must be block indices <= "):
        build_selected_block_sparse(selected, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=128,
                                    selected_block_size=256, kv_block=64)
    selected[7, 0, 1] = 2**31 - 1  # the largest index is accepted (and dropped: past the end)
    bs = build_selected_block_sparse(selected, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=128,
                                     selected_block_size=256, kv_block=64)
    assert as_lists(bs)[7] == [([0, 1, 2, 3], [])]


# ---- properties against the token-level oracle ------------------------------------------------

lengths_st = st.lists(st.one_of(st.integers(0, 6), st.integers(0, 150)), min_size=1, max_size=8)


@st.composite
def selected_cases(draw):
    lengths_q = draw(lengths_st)
    lengths_k = lengths_q if draw(st.booleans()) else draw(
        st.lists(st.integers(0, 150), min_size=len(lengths_q), max_size=len(lengths_q)))
    kv_block = draw(st.sampled_from([4, 8, 16, 32]))
    return dict(lengths_q=lengths_q, lengths_k=lengths_k,
                q_tile=draw(st.sampled_from([8, 16, 32, 64])),
                selected_block_size=draw(st.sampled_from([4, 8, 16, 32])), kv_block=kv_block,
                heads=draw(st.integers(1, 3)), k=draw(st.integers(1, 6)),
                causal=draw(st.booleans()), whole_kernel_blocks=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def random_selection(case) -> torch.Tensor:
    """Random picks with padding, duplicates, future and out-of-range blocks. With
    whole_kernel_blocks (and kv_block > selected_block_size) picks cover whole kernel blocks,
    some of their parts the tile cannot see left out, so that merging succeeds."""
    gen = torch.Generator().manual_seed(case["seed"])
    sbs, kv, q_tile = case["selected_block_size"], case["kv_block"], case["q_tile"]
    tiles = [(n, t) for n in case["lengths_q"] for t in range(ceil_div(n, q_tile))]
    top = ceil_div(max(case["lengths_k"]), sbs) + 2
    picks = torch.randint(-1, top, (len(tiles), case["heads"], case["k"]), generator=gen)
    ratio = kv // sbs
    if not (case["whole_kernel_blocks"] and ratio > 1):
        return picks
    picks = (picks[..., None] * ratio + torch.arange(ratio)).masked_fill(picks[..., None] < 0, -1)
    last_row = torch.tensor([min((t + 1) * q_tile, n) - 1 for n, t in tiles])
    unseen = picks * sbs > last_row[:, None, None, None]
    drop = unseen & (torch.rand(picks.shape, generator=gen) < 0.5)
    return picks.masked_fill(drop, -1).flatten(2)


def intended_cells(picks, nq, nk, case):
    """(H, nq, nk): the cells the selected branch should attend: visible and selected."""
    visible = key_visibility(nq, nk, causal=case["causal"])
    intended = torch.zeros(case["heads"], nq, nk, dtype=torch.bool)
    q_tile = case["q_tile"]
    for t in range(ceil_div(nq, q_tile)):
        rows = slice(t * q_tile, (t + 1) * q_tile)
        chosen = selected_token_mask(picks[t], nk, case["selected_block_size"])
        intended[:, rows] = visible[rows][None] & chosen[:, None, :]
    return intended


def needs_superset(intended, nq, nk, case) -> bool:
    """Some kernel block holds an intended cell and a visible cell that is not selected."""
    visible = key_visibility(nq, nk, causal=case["causal"])
    q_tile, kv = case["q_tile"], case["kv_block"]
    for t in range(ceil_div(nq, q_tile)):
        for b in range(ceil_div(nk, kv)):
            cells = (slice(t * q_tile, (t + 1) * q_tile), slice(b * kv, (b + 1) * kv))
            wanted = intended[:, cells[0], cells[1]]
            unwanted_visible = visible[cells][None] & ~wanted
            if bool((wanted.flatten(1).any(1) & unwanted_visible.flatten(1).any(1)).any()):
                return True
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selected_cases())
def test_selected_matches_token_oracle(case):
    picks = random_selection(case)
    cu_q, cu_k = cu_from_lengths(case["lengths_q"]), cu_from_lengths(case["lengths_k"])
    kv, q_tile = case["kv_block"], case["q_tile"]
    num_blocks = max(1, ceil_div(max(case["lengths_k"]), kv))
    offsets = [0]
    for n in case["lengths_q"]:
        offsets.append(offsets[-1] + ceil_div(n, q_tile))
    oracle = [intended_cells(picks[a:b], nq, nk, case) for a, b, nq, nk in
              zip(offsets[:-1], offsets[1:], case["lengths_q"], case["lengths_k"])]
    superset = any(needs_superset(cells, nq, nk, case) for cells, nq, nk in
                   zip(oracle, case["lengths_q"], case["lengths_k"]))
    try:
        bs = build_selected_block_sparse(
            picks.to(torch.int32), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_tile=q_tile,
            selected_block_size=case["selected_block_size"], kv_block=kv, causal=case["causal"])
    except ValueError as error:
        assert "superset" in str(error) and superset
        return
    assert not superset
    assert_well_formed(bs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert bs.num_heads == case["heads"]
    for classes, cells, nq, nk in zip(sequence_rows(bs, num_blocks), oracle, case["lengths_q"],
                                      case["lengths_k"]):
        # Classification is exact: full = every existing cell intended, mask = some, else none.
        assert torch.equal(classes, classify_cells(cells, q_tile, kv, num_blocks))
        # And a kernel following the lists attends exactly the selection, never a superset.
        attended = kernel_attended(classes, nq, nk, q_tile, kv, causal=case["causal"])
        assert torch.equal(attended, cells)


@st.composite
def self_attention_cases(draw):
    case = draw(selected_cases())
    kv_block = draw(st.sampled_from([d for d in (4, 8, 16, 32)
                                     if case["selected_block_size"] % d == 0]))
    return dict(case, lengths_k=case["lengths_q"], kv_block=kv_block)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(self_attention_cases())
def test_trusted_builder_lists_what_the_checked_one_lists_without_reading_the_device(case):
    """The builder nsa() calls with host bounds (no device read, so CUDA graphs can capture it)
    lists exactly the checked builder's blocks; only the padding differs (host bounds instead
    of the longest list), and the lists stay valid."""
    from op_counting import OpCounter
    from sparsity import build_selected_block_sparse_trusted, validate_block_sparse

    picks = random_selection(case).to(torch.int32)
    cu = cu_from_lengths(case["lengths_q"])
    kw = dict(q_tile=case["q_tile"], selected_block_size=case["selected_block_size"],
              kv_block=case["kv_block"], causal=case["causal"])
    checked = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    host = tuple(cu.tolist())
    # (a context: hypothesis's @given does not take the monkeypatch fixture)
    with pytest.MonkeyPatch.context() as monkeypatch:
        counter = OpCounter(monkeypatch)
        with counter:
            trusted = build_selected_block_sparse_trusted(picks, cu_seqlens=cu,
                                                          host_cu_seqlens=host, **kw)
        assert counter.reads == 0
    assert as_lists(trusted) == as_lists(checked)
    assert torch.equal(trusted.full_count, checked.full_count)
    assert torch.equal(trusted.mask_count, checked.mask_count)
    assert torch.equal(trusted.row_block_offsets, checked.row_block_offsets)
    validate_block_sparse(trusted, cu_seqlens_q=cu, cu_seqlens_k=cu)
