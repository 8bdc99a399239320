"""transpose_block_sparse_csr: the dense oracle, agreement with the padded transpose, O(entries)
memory, validation errors that name the field, and no device reads with check=False."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from op_counting import OpCounter
from sparsity import (BlockSparseCSR, build_selected_block_sparse, check_csr_matches,
                      row_block_offsets_from_cu_seqlens, transpose_block_sparse,
                      transpose_block_sparse_csr, transposed_list_lengths, uniform_cu_seqlens,
                      validate_block_sparse_csr)
from sparsity_oracle import (FULL_BLOCK, MASK_BLOCK, as_lists, ceil_div, cu_from_lengths,
                             from_dense_classes)


def csr_lists(csr: BlockSparseCSR):
    """Per KV block and head, (full tiles, mask tiles) as python lists: as_lists' layout."""
    offsets, index = csr.offsets.tolist(), csr.index.tolist()
    mask_count = csr.mask_count.tolist()
    out = []
    for r in range(csr.num_rows):
        row = []
        for h in range(csr.num_heads):
            g = r * csr.num_heads + h
            entries = index[offsets[g]:offsets[g + 1]]
            row.append((entries[mask_count[r][h]:], entries[:mask_count[r][h]]))
        out.append(row)
    return out


def dense_transpose_lists(classes, row_offsets, col_offsets):
    """The oracle: per global KV block and head, (full tiles, mask tiles) read off the forward's
    dense (tiles, Hs, columns) classes, tile by tile."""
    heads = classes.shape[1]
    out = []
    for s in range(len(col_offsets) - 1):
        tiles = range(row_offsets[s + 1] - row_offsets[s])
        for c in range(col_offsets[s + 1] - col_offsets[s]):
            out.append([([t for t in tiles if classes[row_offsets[s] + t, h, c] == FULL_BLOCK],
                         [t for t in tiles if classes[row_offsets[s] + t, h, c] == MASK_BLOCK])
                        for h in range(heads)])
    return out


def widen(bs, extra_full: int, extra_mask: int):
    """bs with its lists padded past the longest one: the CSR must not care about the width."""
    def pad(index, extra):
        return torch.nn.functional.pad(index, (0, extra), value=-1).contiguous()
    return dataclasses.replace(bs, full_index=pad(bs.full_index, extra_full),
                               mask_index=pad(bs.mask_index, extra_mask))


def by_hand():
    # Two sequences: q tiles [0, 1] and [2]; KV blocks 3 and 2 (global rows 0-2 and 3-4).
    classes = torch.tensor([[[2, 1, 0]],
                            [[2, 2, 1]],
                            [[1, 0, 0]]], dtype=torch.int8)
    return from_dense_classes(classes, [0, 2, 3], row_block_size=8, col_block_size=4)


COL_OFFSETS = torch.tensor([0, 3, 5], dtype=torch.int32)


def test_csr_by_hand():
    bs = by_hand()
    csr = transpose_block_sparse_csr(bs, COL_OFFSETS)
    # Per group mask tiles first, then full tiles; -1 after the 6 entries of 9 slots.
    assert csr.offsets.tolist() == [0, 2, 4, 5, 6, 6]
    assert csr.index.tolist() == [0, 1, 0, 1, 1, 0, -1, -1, -1]
    assert csr.mask_count.flatten().tolist() == [0, 1, 1, 1, 0]
    assert csr_lists(csr) == [[([0, 1], [])], [([1], [0])], [([], [1])], [([], [0])], [([], [])]]
    assert (csr.row_block_size, csr.col_block_size) == (4, 8)
    assert csr.row_block_offsets.tolist() == [0, 3, 5]
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in csr._tensors())
    assert (csr.num_rows, csr.num_heads, csr.num_sequences, csr.capacity) == (5, 1, 2, 9)
    assert csr.nbytes == 4 * (6 + 9 + 5 + 3 + 9)  # offsets, index, mask_count, offsets, slot
    assert "rows=5" in repr(csr) and "nbytes=128" in repr(csr)
    same = transpose_block_sparse_csr(bs, cu_seqlens_k=torch.tensor([0, 12, 17],
                                                                   dtype=torch.int32))
    assert same.equals(csr) and csr.to("cpu").equals(csr)
    assert csr.to("meta").index.is_meta
    assert not dataclasses.replace(csr, row_block_size=8).equals(csr)
    assert not csr.equals(transpose_block_sparse(bs, COL_OFFSETS))
    with pytest.raises(dataclasses.FrozenInstanceError):
        csr.row_block_size = 16
    trusted = transpose_block_sparse_csr(bs, COL_OFFSETS, num_col_blocks=5, check=False)
    assert trusted.equals(csr)
    validate_block_sparse_csr(csr, num_heads=1, device="cpu")
    check_csr_matches(csr, bs, num_col_blocks=5, check_contents=True)


def test_sort_keys_are_int32_where_they_fit_and_int64_beyond(monkeypatch):
    """The transpose sorts int32 keys where every key fits (half the radix passes of int64's)
    and int64 beyond; both give the same lists."""
    from sparsity import csr as csr_module

    assert csr_module.sort_key_dtype(2**31 - 1) == torch.int32
    assert csr_module.sort_key_dtype(2**31) == torch.int64
    bs = by_hand()
    narrow = transpose_block_sparse_csr(bs, COL_OFFSETS)
    monkeypatch.setattr(csr_module, "sort_key_dtype", lambda unlisted: torch.int64)
    wide = transpose_block_sparse_csr(bs, COL_OFFSETS)
    assert wide.equals(narrow) and narrow.offsets.tolist() == [0, 2, 4, 5, 6, 6]


def test_empty_lists_sequences_and_blocks():
    # No q tiles at all, KV blocks that nobody lists, and lists of width 0.
    bs = from_dense_classes(torch.zeros(0, 2, 1, dtype=torch.int8), [0, 0, 0],
                            row_block_size=16, col_block_size=8)
    csr = transpose_block_sparse_csr(bs, torch.tensor([0, 2, 3], dtype=torch.int32))
    assert csr.offsets.tolist() == [0] * 7 and csr.capacity == 0
    assert csr.mask_count.shape == (3, 2)
    validate_block_sparse_csr(csr)
    nothing = transpose_block_sparse_csr(bs, torch.tensor([0, 0, 0], dtype=torch.int32),
                                         num_col_blocks=0, check=False)
    assert nothing.offsets.tolist() == [0] and nothing.mask_count.shape == (0, 2)
    validate_block_sparse_csr(nothing)
    # Tiles that list nothing.
    listless = from_dense_classes(torch.zeros(3, 1, 2, dtype=torch.int8), [0, 3],
                                  row_block_size=16, col_block_size=8)
    csr = transpose_block_sparse_csr(listless, torch.tensor([0, 2], dtype=torch.int32))
    assert csr.offsets.tolist() == [0, 0, 0] and csr.capacity == 0


@st.composite
def random_block_sparse(draw):
    """Arbitrary valid lists (not causal-shaped): varlen with empty and short sequences, per row
    and head random classes of the columns of the row's sequence at a random density (empty
    tiles, KV blocks nobody lists), lists padded wider than needed at times."""
    tiles = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    col_blocks = draw(st.lists(st.integers(0, 7), min_size=len(tiles), max_size=len(tiles)))
    heads = draw(st.sampled_from([1, 2, 4]))  # Hs: H, or Hkv of a GQA group
    density = draw(st.sampled_from([0.0, 0.15, 0.5, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    width = max(col_blocks + [1])
    shape = (sum(tiles), heads, width)
    kinds = torch.randint(1, 3, shape, generator=gen, dtype=torch.int8)
    classes = torch.where(torch.rand(shape, generator=gen) < density, kinds, 0).to(torch.int8)
    limit = torch.tensor([c for c, n in zip(col_blocks, tiles) for _ in range(n)]).long()
    classes[(torch.arange(width) >= limit.view(-1, 1, 1)).expand(shape)] = 0
    row_offsets, col_offsets = [0], [0]
    for n, c in zip(tiles, col_blocks):
        row_offsets.append(row_offsets[-1] + n)
        col_offsets.append(col_offsets[-1] + c)
    bs = from_dense_classes(classes, row_offsets, row_block_size=draw(st.sampled_from([16, 64])),
                            col_block_size=draw(st.sampled_from([8, 32])))
    bs = widen(bs, draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    return bs, classes, row_offsets, col_offsets


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_block_sparse())
def test_csr_is_the_dense_transpose(case):
    bs, classes, row_offsets, col_offsets = case
    col_block_offsets = torch.tensor(col_offsets, dtype=torch.int32)
    csr = transpose_block_sparse_csr(bs, col_block_offsets)
    validate_block_sparse_csr(csr, num_heads=bs.num_heads)
    assert csr_lists(csr) == dense_transpose_lists(classes, row_offsets, col_offsets)
    assert torch.equal(csr.row_block_offsets, col_block_offsets)
    entries = int(bs.full_count.sum() + bs.mask_count.sum())
    assert int(csr.offsets[-1]) == entries
    assert csr.capacity == bs.num_rows * bs.num_heads * (bs.full_index.shape[-1]
                                                         + bs.mask_index.shape[-1])
    assert int(csr.mask_count.sum()) == int(bs.mask_count.sum())

    trusted = transpose_block_sparse_csr(bs, col_block_offsets, num_col_blocks=col_offsets[-1],
                                         check=False)
    assert trusted.equals(csr)
    check_csr_matches(csr, bs, num_col_blocks=col_offsets[-1], check_contents=True)
    assert_slots_name_the_forward_entries(csr, bs, row_offsets, col_offsets)

    # The padded transpose holds the same entries per (KV block, head).
    padded = transpose_block_sparse(bs, col_block_offsets)
    assert as_lists(padded) == csr_lists(csr)
    full_count, mask_count = transposed_list_lengths(bs, col_block_offsets=col_block_offsets)
    assert torch.equal(csr.mask_count, mask_count)
    assert torch.equal(csr.offsets.diff().view_as(full_count) - csr.mask_count, full_count)


def assert_slots_name_the_forward_entries(csr, bs, row_offsets, col_offsets):
    """Each listed entry's `slot` is a forward slot of its own head, kind, q tile and KV block
    (flat over (R, Hs, Kf + Km), full slots first), and no two entries share one."""
    full_width = bs.full_index.shape[-1]
    width = full_width + bs.mask_index.shape[-1]
    seen = set()
    for group in range(csr.num_rows * csr.num_heads):
        kv_row, head = divmod(group, csr.num_heads)
        sequence = max(s for s in range(len(col_offsets) - 1) if col_offsets[s] <= kv_row)
        start, end = int(csr.offsets[group]), int(csr.offsets[group + 1])
        for entry in range(start, end):
            slot = int(csr.slot[entry])
            assert slot not in seen
            seen.add(slot)
            row, rest = divmod(slot, bs.num_heads * width)
            slot_head, j = divmod(rest, width)
            is_mask = entry - start < int(csr.mask_count[kv_row, head])
            assert slot_head == head and (j >= full_width) == is_mask
            assert row - row_offsets[sequence] == int(csr.index[entry])
            listed = bs.mask_index[row, head, j - full_width] if is_mask else (
                bs.full_index[row, head, j])
            assert int(listed) == kv_row - col_offsets[sequence]
    assert len(seen) == int(csr.offsets[-1])


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 5), st.integers(0, 300)), min_size=1,
                        max_size=8),
       heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
def test_csr_of_selected_branch_lists_matches_the_padded_transpose(lengths, heads, seed):
    cu = cu_from_lengths(lengths)
    tiles = int(row_block_offsets_from_cu_seqlens(cu, 32)[-1])
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, ceil_div(max(lengths), 16) + 1, (tiles, heads, 4), generator=gen)
    bs = build_selected_block_sparse(picks.to(torch.int32), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     q_tile=32, selected_block_size=16, kv_block=16)
    csr = transpose_block_sparse_csr(bs, cu_seqlens_k=cu)
    validate_block_sparse_csr(csr, num_heads=heads)
    assert csr_lists(csr) == as_lists(transpose_block_sparse(bs, cu_seqlens_k=cu))
    num_col_blocks = int(row_block_offsets_from_cu_seqlens(cu, 16)[-1])
    trusted = transpose_block_sparse_csr(bs, cu_seqlens_k=cu, num_col_blocks=num_col_blocks,
                                         check=False)
    assert trusted.equals(csr)


Q_TILE, BLOCK, SELECTED = 128, 64, 16


def nsa_like_lists(seqlen: int, heads: int, seed: int):
    """Lists shaped like NSA's selection: every tile lists block 0, its two diagonal blocks and
    random earlier blocks, so block 0's transposed list is as long as the sequence's tiles."""
    tiles, per_tile = seqlen // Q_TILE, Q_TILE // BLOCK
    tile = torch.arange(tiles)[:, None, None]
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(tiles, heads, SELECTED - 1 - per_tile, generator=gen)
    complete_before = tile * per_tile - 1
    candidates = torch.where(complete_before >= 1,
                             1 + (draws * complete_before.clamp(min=1)).long(), -1)
    forced = torch.cat([torch.zeros_like(tile), tile * per_tile, tile * per_tile + 1], dim=-1)
    picks = torch.cat([forced.expand(-1, heads, -1), candidates], dim=-1).to(torch.int32)
    cu = uniform_cu_seqlens(1, seqlen)
    bs = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=Q_TILE,
                                     selected_block_size=BLOCK, kv_block=BLOCK)
    return bs, cu


def test_csr_memory_is_linear_in_the_entries_where_the_padded_transpose_is_quadratic():
    seqlen, heads = 1 << 16, 2
    bs, cu = nsa_like_lists(seqlen, heads, seed=0)
    csr = transpose_block_sparse_csr(bs, cu_seqlens_k=cu)
    tiles, blocks = seqlen // Q_TILE, seqlen // BLOCK
    full_count, mask_count = transposed_list_lengths(bs, cu_seqlens_k=cu)
    assert int(full_count[0].min()) == tiles - 1  # block 0's list: every tile but the diagonal
    entries = int(full_count.sum() + mask_count.sum())
    assert int(csr.offsets[-1]) == entries
    # index and slot: the forward's slots (<= 16 per tile and head); offsets and mask_count: 2
    # per group.
    assert csr.capacity == bs.num_rows * heads * (bs.full_index.shape[-1]
                                                  + bs.mask_index.shape[-1])
    assert csr.capacity <= tiles * heads * SELECTED
    assert csr.nbytes == 4 * (2 * csr.capacity + 2 * blocks * heads + 1 + 2)
    padded_bytes = transpose_block_sparse(bs, cu_seqlens_k=cu).nbytes
    assert padded_bytes >= 4 * blocks * heads * (tiles - 1)  # O(blocks x tiles)
    assert csr.nbytes * 25 < padded_bytes
    # Doubling the sequence doubles the CSR, but quadruples the padded transpose.
    bs2, cu2 = nsa_like_lists(2 * seqlen, heads, seed=0)
    csr2 = transpose_block_sparse_csr(bs2, cu_seqlens_k=cu2)
    assert csr2.nbytes <= 2.01 * csr.nbytes
    full2, mask2 = transposed_list_lengths(bs2, cu_seqlens_k=cu2)
    assert 2 * blocks * heads * (int(full2.max()) + int(mask2.max())) * 4 > 3.9 * padded_bytes


# --- no device reads with check=False ---------------------------------------------------------

def _raise_on_read(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a device -> host read")
    for method in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, refuse)


@pytest.mark.parametrize("by", ["col_block_offsets", "cu_seqlens_k"])
def test_unchecked_transpose_reads_nothing_from_the_device(by, monkeypatch):
    lengths = [300, 0, 17, 129, 64]
    cu = cu_from_lengths(lengths)
    tiles = int(row_block_offsets_from_cu_seqlens(cu, 32)[-1])
    gen = torch.Generator().manual_seed(7)
    picks = torch.randint(-1, 12, (tiles, 2, 5), generator=gen).to(torch.int32)
    bs = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=32,
                                     selected_block_size=16, kv_block=16)
    col_offsets = row_block_offsets_from_cu_seqlens(cu, 16)
    num_col_blocks = int(col_offsets[-1])
    checked = transpose_block_sparse_csr(bs, col_offsets)
    arguments = ({"col_block_offsets": col_offsets} if by == "col_block_offsets"
                 else {"cu_seqlens_k": cu})

    counter = OpCounter(monkeypatch)
    with counter:
        transpose_block_sparse_csr(bs, **arguments)
    assert counter.reads > 0  # the counter sees the checked path's reads

    with monkeypatch.context() as patch:
        counter = OpCounter(patch)
        _raise_on_read(patch)
        with counter:
            trusted = transpose_block_sparse_csr(bs, **arguments, num_col_blocks=num_col_blocks,
                                                 check=False)
            check_csr_matches(trusted, bs, num_col_blocks=num_col_blocks)
            validate_block_sparse_csr(trusted, check_contents=False)
        assert counter.reads == 0
    assert trusted.equals(checked)


@pytest.mark.parametrize("start, end", [(0, 4), (1, 3), (3, 4), (0, 1)])
def test_csr_rows_is_the_transpose_of_those_kv_blocks_alone(start, end, monkeypatch):
    """csr_rows (kernels.masked's chunks of keys): the transpose restricted to KV blocks
    [start, end) of every sequence is the transpose of the lists of those blocks alone (the
    forward's classes cut to those columns), the same capacity, built without a read."""
    from sparsity.csr import csr_rows

    sequences, tiles, blocks, heads = 3, 5, 4, 2
    gen = torch.Generator().manual_seed(11)
    classes = torch.randint(0, 3, (sequences * tiles, heads, blocks), generator=gen)
    classes = classes.to(torch.int8)
    row_offsets = [0, tiles, 2 * tiles, 3 * tiles]

    def transpose(cut):
        width = cut.shape[-1]
        bs = from_dense_classes(cut.contiguous(), row_offsets, row_block_size=8,
                                col_block_size=4)
        return transpose_block_sparse_csr(
            bs, torch.arange(0, sequences * width + 1, width, dtype=torch.int32))

    full = transpose(classes)
    with monkeypatch.context() as patch:
        _raise_on_read(patch)
        part = csr_rows(full, blocks, start, end)
    validate_block_sparse_csr(part)
    expected = transpose(classes[:, :, start:end])
    assert part.capacity == full.capacity
    assert csr_lists(part) == csr_lists(expected)
    assert torch.equal(part.row_block_offsets, expected.row_block_offsets)
    assert (part.index[int(part.offsets[-1]):] == -1).all()
    with pytest.raises(ValueError, match="rows"):
        csr_rows(full, blocks, 2, 2)
    with pytest.raises(ValueError, match="rows"):
        csr_rows(full, 5, 0, 1)  # 12 rows are not sequences of 5


def test_transpose_layout_kept_by_its_key_serves_other_lists_of_the_packing():
    """layout_key: the per-tile geometry of one packing is built once (sparsity/host_cache.py)
    and reused for other lists over the same sequences; each transpose still equals the
    checked one."""
    from sparsity import host_cache

    host_cache.clear()
    lengths = [300, 0, 17, 129, 64]
    cu = cu_from_lengths(lengths)
    tiles = int(row_block_offsets_from_cu_seqlens(cu, 32)[-1])
    num_col_blocks = int(row_block_offsets_from_cu_seqlens(cu, 16)[-1])
    key = (tuple(cu.tolist()), tuple(cu.tolist()))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        picks = torch.randint(-1, 12, (tiles, 2, 5), generator=gen).to(torch.int32)
        bs = build_selected_block_sparse(picks, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=32,
                                         selected_block_size=16, kv_block=16)
        kept = transpose_block_sparse_csr(bs, cu_seqlens_k=cu, num_col_blocks=num_col_blocks,
                                          check=False, layout_key=key)
        assert kept.equals(transpose_block_sparse_csr(bs, cu_seqlens_k=cu))
        assert len(host_cache._entries) == 1  # the second lists found the first one's layout
    host_cache.clear()


# --- errors that name the argument or field ---------------------------------------------------

def test_transpose_argument_errors():
    bs = by_hand()
    with pytest.raises(ValueError, match="exactly one of col_block_offsets and cu_seqlens_k"):
        transpose_block_sparse_csr(bs)
    with pytest.raises(ValueError, match="exactly one"):
        transpose_block_sparse_csr(bs, COL_OFFSETS, cu_seqlens_k=COL_OFFSETS)
    with pytest.raises(ValueError, match="col_block_offsets describes 1 sequences"):
        transpose_block_sparse_csr(bs, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="bs.mask_index names a column block past the end"):
        transpose_block_sparse_csr(bs, torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        transpose_block_sparse_csr(bs, cu_seqlens_k=torch.tensor([1, 12, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="col_block_offsets must be int32"):
        transpose_block_sparse_csr(bs, COL_OFFSETS.float(), num_col_blocks=5, check=False)
    with pytest.raises(ValueError, match="check=False needs num_col_blocks"):
        transpose_block_sparse_csr(bs, COL_OFFSETS, check=False)
    with pytest.raises(ValueError, match="num_col_blocks=4 but col_block_offsets gives 5"):
        transpose_block_sparse_csr(bs, COL_OFFSETS, num_col_blocks=4)
    with pytest.raises(ValueError, match="num_col_blocks must be an int >= 0"):
        transpose_block_sparse_csr(bs, COL_OFFSETS, num_col_blocks=-1, check=False)
    unsorted = bs.full_index.clone()
    unsorted[1, 0, :2] = unsorted[1, 0, :2].flip(0)
    with pytest.raises(ValueError, match="bs.full_index lists must be strictly ascending"):
        transpose_block_sparse_csr(dataclasses.replace(bs, full_index=unsorted), COL_OFFSETS)
    with pytest.raises(ValueError, match="bs.full_count must be int32"):
        transpose_block_sparse_csr(dataclasses.replace(bs, full_count=bs.full_count.long()),
                                   COL_OFFSETS, num_col_blocks=5, check=False)


def _broken(**changes):
    return dataclasses.replace(transpose_block_sparse_csr(by_hand(), COL_OFFSETS), **changes)


def _csr():
    return transpose_block_sparse_csr(by_hand(), COL_OFFSETS)


def _with(field, position, value):
    tensor = getattr(_csr(), field).clone()
    tensor.view(-1)[position] = value
    return _broken(**{field: tensor})


F = r"^block_sparse_transposed\."  # every message names the field


@pytest.mark.parametrize("make,message", [
    (lambda: _broken(offsets=_csr().offsets.long()), F + r"offsets must be int32"),
    (lambda: _broken(index=torch.zeros(2, 9, dtype=torch.int32)[:, 0]),
     F + r"index must be contiguous"),
    (lambda: _broken(mask_count=_csr().mask_count[:4]),
     F + r"offsets must have shape \(Rk \* Hs \+ 1,\) = \(5,\)"),
    (lambda: _broken(mask_count=_csr().mask_count.flatten()),
     F + r"mask_count must have shape \(Rk, Hs\)"),
    (lambda: _broken(index=_csr().index.view(3, 3)), F + r"index must be 1-D"),
    (lambda: _broken(row_block_offsets=torch.zeros((), dtype=torch.int32)),
     F + r"row_block_offsets must have shape \(S\+1,\)"),
    (lambda: _broken(row_block_size=0), F + r"row_block_size must be a positive"),
    (lambda: _broken(mask_count=[1]), F + r"mask_count must be a torch.Tensor"),
    (lambda: _with("row_block_offsets", 2, 4),
     F + r"row_block_offsets must start at 0, be non-decreasing and end at"),
    (lambda: _with("offsets", 2, 1), F + r"offsets must start at 0, be non-decreasing"),
    (lambda: _with("offsets", 5, 10), F + r"offsets .* end at most at the capacity"),
    (lambda: _with("mask_count", 0, 3), F + r"mask_count entries must lie"),
    (lambda: _with("index", 7, 0), F + r"index must hold -1 after offsets"),
    (lambda: _with("index", 1, -1), F + r"index entries before offsets\[-1\]"),
    (lambda: _with("index", 0, 2), F + r"index must be strictly ascending"),
    (lambda: _with("index", 3, 0), F + r"index lists a q tile as both mask and full"),
    (lambda: _broken(slot=_csr().slot[:-1].clone()), F + r"slot must have index's shape"),
    (lambda: _broken(slot=_csr().slot.long()), F + r"slot must be int32"),
])
def test_validation_errors_name_the_field(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        validate_block_sparse_csr(make())


def test_validation_options():
    csr = _csr()
    with pytest.raises(TypeError, match="block_sparse_transposed must be a BlockSparseCSR"):
        validate_block_sparse_csr(by_hand())
    with pytest.raises(ValueError, match=r"mask_count has 1 heads, expected 4"):
        validate_block_sparse_csr(csr, num_heads=4)
    with pytest.raises(ValueError, match=r"^bt\.offsets is on cpu, expected meta"):
        validate_block_sparse_csr(csr, name="bt", device="meta")
    with pytest.raises(ValueError, match=r"block_sparse_transposed\.index is on meta"):
        validate_block_sparse_csr(dataclasses.replace(csr, index=csr.index.to("meta")),
                                  check_contents=False)
    # Contents are trusted without check_contents; a CSR cut to its entries is still valid.
    validate_block_sparse_csr(_with("index", 0, 2), check_contents=False)
    validate_block_sparse_csr(dataclasses.replace(csr, index=csr.index[:6].contiguous(),
                                                  slot=csr.slot[:6].contiguous()))


def test_check_csr_matches():
    bs = by_hand()
    csr = transpose_block_sparse_csr(bs, COL_OFFSETS)
    check_csr_matches(dataclasses.replace(csr, index=csr.index[:6].contiguous(),
                                          slot=csr.slot[:6].contiguous()), bs,
                      check_contents=True)
    with pytest.raises(ValueError, match="must swap the block sizes of block_sparse: expected "
                                         "row_block_size=4, col_block_size=8, got 8, 4"):
        check_csr_matches(dataclasses.replace(csr, row_block_size=8, col_block_size=4), bs)
    two_heads = from_dense_classes(torch.zeros(3, 2, 3, dtype=torch.int8), [0, 2, 3],
                                   row_block_size=8, col_block_size=4)
    with pytest.raises(ValueError, match="block_sparse_transposed has 1 heads but block_sparse "
                                         "has 2"):
        check_csr_matches(csr, two_heads)
    one_sequence = from_dense_classes(torch.zeros(3, 1, 3, dtype=torch.int8), [0, 3],
                                      row_block_size=8, col_block_size=4)
    with pytest.raises(ValueError, match="has 2 sequences but block_sparse has 1"):
        check_csr_matches(csr, one_sequence)
    with pytest.raises(ValueError, match=r"has 5 KV blocks \(rows\), expected 6"):
        check_csr_matches(csr, bs, num_col_blocks=6)
    with pytest.raises(TypeError, match="block_sparse_transposed must be a BlockSparseCSR"):
        check_csr_matches(transpose_block_sparse(bs, COL_OFFSETS), bs)

    # Same shapes, other lists: only the contents tell.
    other = from_dense_classes(torch.tensor([[[2, 1, 0]], [[2, 2, 1]], [[1, 1, 0]]],
                                            dtype=torch.int8), [0, 2, 3], 8, 4)
    check_csr_matches(csr, other)
    with pytest.raises(ValueError, match="is not the transpose of block_sparse: the q tiles of "
                                         "KV block 4, head 0 differ"):
        check_csr_matches(csr, other, check_contents=True)
    swapped_kind = from_dense_classes(torch.tensor([[[2, 1, 0]], [[2, 2, 1]], [[2, 0, 0]]],
                                                   dtype=torch.int8), [0, 2, 3], 8, 4)
    with pytest.raises(ValueError, match="KV block 3, head 0 differ"):
        check_csr_matches(csr, swapped_kind, check_contents=True)
    other_tiles = from_dense_classes(torch.tensor([[[1, 1, 0]], [[2, 2, 1]], [[1, 0, 0]]],
                                                  dtype=torch.int8), [0, 2, 3], 8, 4)
    with pytest.raises(ValueError, match="KV block 0, head 0 differ"):
        check_csr_matches(transpose_block_sparse_csr(other_tiles, COL_OFFSETS), bs,
                          check_contents=True)
    with pytest.raises(ValueError, match="does not match block_sparse: block_sparse.mask_index "
                                         "names a column block past the end"):
        check_csr_matches(dataclasses.replace(csr, row_block_offsets=torch.tensor(
            [0, 2, 5], dtype=torch.int32)), bs, check_contents=True)
