"""build_compressed_block_sparse: hand-checked cases and properties against a token-level oracle."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsity import build_compressed_block_sparse
from sparsity_oracle import (as_lists, assert_well_formed, ceil_div, classify_cells,
                             cu_from_lengths, kernel_attended, key_visibility, sequence_rows)


def build(lengths, compress_factor, **kw):
    cu_q = cu_from_lengths(lengths)
    cu_k_cmp = cu_from_lengths([n // compress_factor for n in lengths])
    return build_compressed_block_sparse(cu_seqlens_q=cu_q, cu_seqlens_k_cmp=cu_k_cmp,
                                         compress_factor=compress_factor, **kw)


def test_dense_compressed_by_hand():
    # 12 tokens, cf 2 -> 6 compressed keys; row i sees key j iff 2(j+1) <= i+1.
    # Tiles of 4 rows, blocks of 2 compressed keys. Rows 0-3: row 0 sees nothing, row 3 sees
    # keys 0, 1. Rows 4-7: row 4 sees keys 0, 1, row 7 keys 0-3. Rows 8-11: row 8 sees 0-3.
    bs = build([12], 2, q_tile=4, kv_block=2)
    assert as_lists(bs) == [[([], [0])], [([0], [1])], [([0, 1], [2])]]
    assert bs.num_heads == 1


def test_row_seeing_nothing_gives_empty_lists():
    # cf 8: rows 0-3 of a 4-token sequence see no compressed key at all.
    bs = build([4, 16], 8, q_tile=4, kv_block=1)
    assert as_lists(bs) == [[([], [])], [([], [])], [([], [0])], [([0], [])], [([0], [1])]]
    assert bs.full_index.shape == (5, 1, 1) and bs.mask_index.shape == (5, 1, 1)


def test_sparse_compressed_restricts_to_selection_block0_and_diagonal():
    # 32 tokens, cf 2 -> 16 compressed keys in 8 blocks of 2. Tile 3 (rows 24-31): row 24
    # sees keys 0-11 (blocks 0-5 full), row 31 sees 0-15 (blocks 6, 7 diagonal).
    selected = torch.full((4, 2, 3), -1, dtype=torch.int32)
    selected[3, 0] = torch.tensor([3, 3, 7])  # 7 is diagonal anyway
    selected[3, 1] = torch.tensor([5, 2, -1])
    selected[0, 0, 0] = 5  # future for rows 0-7: dropped
    bs = build([32], 2, q_tile=8, kv_block=2, selected=selected)
    assert as_lists(bs)[3] == [([0, 3], [6, 7]), ([0, 2, 5], [6, 7])]
    assert as_lists(bs)[0] == [([], [0, 1]), ([], [0, 1])]
    assert bs.num_heads == 2


def test_block_the_anchor_partly_sees_is_not_diagonal():
    # 32 tokens, cf 8 -> 4 compressed keys, blocks of 2. Rows 24-27 all see keys 0-2 and none
    # sees key 3: block 1 needs the mask but holds nothing the anchor (row 24) cannot see, so
    # it is not forced (the anchor can score it); it is listed only when selected.
    unselected = torch.full((8, 1, 1), -1, dtype=torch.int32)
    assert as_lists(build([32], 8, q_tile=4, kv_block=2, selected=unselected))[6] == [([0], [])]
    chosen = unselected.clone()
    chosen[6, 0, 0] = 1
    assert as_lists(build([32], 8, q_tile=4, kv_block=2, selected=chosen))[6] == [([0], [1])]
    assert as_lists(build([32], 8, q_tile=4, kv_block=2))[6] == [([0], [1])]  # dense: all blocks


@pytest.mark.parametrize("bad, match", [
    (dict(compress_factor=0), "compress_factor"),
    (dict(kv_block=-1), "kv_block"),
    (dict(cu_seqlens_k_cmp=torch.tensor([0, 1, 2], dtype=torch.int32)), "same number"),
    (dict(cu_seqlens_q=[0, 8]), "cu_seqlens_q must be a torch.Tensor"),
    (dict(selected=torch.zeros(1, 1, 1, dtype=torch.int32)), "selected has 1 rows"),
    (dict(selected=torch.full((2, 1, 1), 2**40, dtype=torch.int64)),
     "selected entries must be block indices <= 2147483647"),
])
def test_bad_arguments_raise_naming_them(bad, match):
    kw = dict(cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
              cu_seqlens_k_cmp=torch.tensor([0, 4], dtype=torch.int32),
              compress_factor=2, q_tile=4, kv_block=2)
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        build_compressed_block_sparse(**kw)


# ---- properties against the token-level oracle ------------------------------------------------

@st.composite
def compressed_cases(draw):
    return dict(lengths=draw(st.lists(st.one_of(st.integers(0, 8), st.integers(0, 200)),
                                      min_size=1, max_size=8)),
                compress_factor=draw(st.sampled_from([1, 2, 4, 8, 16])),
                q_tile=draw(st.sampled_from([4, 8, 16, 32])),
                kv_block=draw(st.sampled_from([1, 2, 4, 8])),
                heads=draw(st.integers(1, 3)), n=draw(st.integers(0, 4)),
                sparse=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def oracle_cells(case, nq, picks):
    """(H, nq, nk) cells the compressed branch attends, dense or restricted to picks (tiles, H, n)
    plus block 0 plus the blocks some row of the tile sees and its first row does not see all of."""
    cf, kv, q_tile = case["compress_factor"], case["kv_block"], case["q_tile"]
    nk = nq // cf
    visible = key_visibility(nq, nk, compress_factor=cf)
    heads = picks.shape[1] if picks is not None else 1
    if picks is None:
        return visible[None].clone()
    cells = torch.zeros(heads, nq, nk, dtype=torch.bool)
    block_of_key = torch.arange(nk) // kv
    for t in range(ceil_div(nq, q_tile)):
        rows = slice(t * q_tile, (t + 1) * q_tile)
        seen_by_tile = visible[rows].any(0)
        diagonal_keys = seen_by_tile & ~visible[t * q_tile]
        diagonal = block_of_key[diagonal_keys].unique()
        for h in range(heads):
            allowed = torch.cat([picks[t, h][picks[t, h] >= 0], torch.tensor([0]), diagonal])
            in_allowed = (block_of_key[:, None] == allowed[None, :]).any(1)
            cells[h, rows] = visible[rows] & in_allowed[None, :]
    return cells


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compressed_cases())
def test_compressed_matches_token_oracle(case):
    cf, kv, q_tile = case["compress_factor"], case["kv_block"], case["q_tile"]
    lengths = case["lengths"]
    tiles = [ceil_div(n, q_tile) for n in lengths]
    num_blocks = max(1, ceil_div(max(lengths) // cf, kv))
    picks = None
    if case["sparse"]:
        gen = torch.Generator().manual_seed(case["seed"])
        picks = torch.randint(-1, num_blocks + 2, (sum(tiles), case["heads"], case["n"]),
                              generator=gen)
    bs = build(lengths, cf, q_tile=q_tile, kv_block=kv,
               selected=None if picks is None else picks.to(torch.int32))
    cu_q = cu_from_lengths(lengths)
    cu_k = cu_from_lengths([n // cf for n in lengths])
    assert_well_formed(bs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert bs.num_heads == (case["heads"] if case["sparse"] else 1)
    start = 0
    for classes, nq, count in zip(sequence_rows(bs, num_blocks), lengths, tiles):
        seq_picks = None if picks is None else picks[start:start + count]
        start += count
        cells = oracle_cells(case, nq, seq_picks)
        assert torch.equal(classes, classify_cells(cells, q_tile, kv, num_blocks))
        attended = kernel_attended(classes, nq, nq // cf, q_tile, kv, compress_factor=cf)
        assert torch.equal(attended, cells)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compressed_cases())
def test_trusted_sparse_builder_lists_what_the_checked_one_lists_without_reading(case):
    """The builder nsa() calls with host bounds for the sparse compressed branch (no device
    read): exactly the checked builder's blocks, padded to host bounds, still valid lists."""
    from op_counting import OpCounter
    from sparsity import build_compressed_block_sparse_trusted, validate_block_sparse

    cf, kv, q_tile = case["compress_factor"], case["kv_block"], case["q_tile"]
    lengths = case["lengths"]
    num_blocks = max(1, ceil_div(max(lengths) // cf, kv))
    gen = torch.Generator().manual_seed(case["seed"])
    picks = torch.randint(-1, num_blocks + 2, (sum(ceil_div(n, q_tile) for n in lengths),
                                               case["heads"], case["n"]), generator=gen)
    cu_q = cu_from_lengths(lengths)
    cu_k = cu_from_lengths([n // cf for n in lengths])
    kw = dict(compress_factor=cf, q_tile=q_tile, kv_block=kv)
    checked = build_compressed_block_sparse(cu_seqlens_q=cu_q, cu_seqlens_k_cmp=cu_k,
                                            selected=picks.to(torch.int32), **kw)
    host = tuple(cu_q.tolist())
    # (a context: hypothesis's @given does not take the monkeypatch fixture)
    with pytest.MonkeyPatch.context() as monkeypatch:
        counter = OpCounter(monkeypatch)
        with counter:
            trusted = build_compressed_block_sparse_trusted(
                picks.to(torch.int32), cu_seqlens_q=cu_q, cu_seqlens_k_cmp=cu_k,
                host_cu_seqlens_q=host, **kw)
        assert counter.reads == 0
    assert as_lists(trusted) == as_lists(checked)
    assert torch.equal(trusted.row_block_offsets, checked.row_block_offsets)
    validate_block_sparse(trusted, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
