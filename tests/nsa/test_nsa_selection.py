"""The batched block selection against the one-tile-at-a-time reference of the rule."""
import pytest
import torch

import nsa.selection as selection_module
from nsa.compression import compress_kv
from nsa.reference import compress_kv_reference, select_blocks_reference
from nsa.selection import select_blocks
from nsa_testing import cu_seqlens_of
from gpu_marks import requires_sm90

RULE = dict(compress_block_size=4, selected_block_size=8, num_selected_blocks=5, q_tile=16,
            cmp_kv_block=4, num_cmp_selected_blocks=2)


@pytest.fixture(params=[False, True], ids=["sort", "sm90"])
def ranking_kernel(request):
    """Both ways of ranking a tile's blocks, `select_blocks`'s ranking_kernel: the stable sort,
    and on an sm90 GPU the ranking kernel (elsewhere both take the sort)."""
    return request.param


def _tie_heavy_keys(shape, seed):
    """Keys full of exact ties (a few distinct values), forced blocks (+inf), excluded ones
    (-inf), NaN, -0.0 beside 0.0, negative values and a subnormal."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, -0.0, 0.25, 0.5, -1.5, float("inf"), -float("inf"),
                           float("nan"), 3.0e-39])
    return values[torch.randint(len(values), shape, generator=gen)]


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("width,candidates", [(5, None), (5, 2), (19, 16), (32, None), (7, 0),
                                              (1, None), (40, None)])
def test_sm90_ranking_equals_the_stable_sort(width, candidates):
    """The ranking kernel (kernels/sm90/top_blocks.py) gives the stable descending sort's lists
    bit for bit: tie-heavy keys, rows shorter than the width, and nsa()'s shape at 256K tokens
    (4096 blocks of 64, causal: a tile sees the blocks up to its own) with random scores.
    Width 40 is past one rank per lane: the sort serves it."""
    from kernels.sm90 import top_blocks

    causal = torch.rand(64, 8, 4096, generator=torch.Generator().manual_seed(width))
    visible = torch.arange(4096) <= torch.arange(64)[:, None, None] * 64
    causal = causal.masked_fill(~visible, -float("inf"))
    causal[..., 0] = float("inf")
    for key in (_tie_heavy_keys((6, 3, 31), width), _tie_heavy_keys((5, 2, 3), width), causal):
        key = key.cuda()
        lists = {}
        for name in ("sort", "sm90"):
            lists[name] = selection_module._top_blocks(key, width, candidates,
                                                       ranking_kernel=name == "sm90")
        assert selection_module._top_blocks_on_sm90(key, width) == (width <= 32)
        assert torch.equal(lists["sort"], lists["sm90"]), (width, candidates, key.shape)
    assert top_blocks.can_run(key, width) == (width <= top_blocks.MAX_WIDTH)


def _select_both(q, k, cu_seqlens, ranking_kernel=True, **rule):
    """Fast selection (float32 inputs) and reference selection (float64) on the same values."""
    k_cmp, _, cu_cmp = compress_kv(k, k, cu_seqlens, rule["compress_block_size"])
    k_ref, _, cu_ref = compress_kv_reference(k.double(), k.double(), cu_seqlens,
                                             rule["compress_block_size"])
    assert torch.equal(cu_cmp, cu_ref)
    scale = q.shape[-1] ** -0.5
    fast = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, softmax_scale=scale,
                         ranking_kernel=ranking_kernel, **rule)
    ref = select_blocks_reference(q.double(), k_ref, cu_seqlens, cu_cmp, softmax_scale=scale,
                                  **rule)
    return fast, ref


def _assert_same_selection(fast, ref):
    assert torch.equal(fast.row_block_offsets, ref.row_block_offsets)
    assert torch.equal(fast.selected, ref.selected), (fast.selected, ref.selected)
    if ref.cmp_selected is None:
        assert fast.cmp_selected is None
    else:
        assert torch.equal(fast.cmp_selected, ref.cmp_selected)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("heads,kv_heads,lengths", [
    (2, 2, [200]),
    (4, 1, [37, 3, 0, 130, 64]),
    (16, 1, [90, 17]),
    (8, 2, [1, 2, 5, 8, 15, 33, 70, 121]),
], ids=["group1", "group4-varlen", "group16", "group4-8seqs"])
def test_selection_matches_reference(causal, heads, kv_heads, lengths, ranking_kernel):
    gen = torch.Generator().manual_seed(len(lengths) * 100 + heads)
    total = sum(lengths)
    q = torch.randn(total, heads, 8, generator=gen)
    k = torch.randn(total, kv_heads, 8, generator=gen)
    fast, ref = _select_both(q, k, cu_seqlens_of(lengths), causal=causal,
                             ranking_kernel=ranking_kernel, **RULE)
    _assert_same_selection(fast, ref)
    assert fast.selected.shape == (sum(-(-n // 16) for n in lengths), kv_heads, 5)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_queries_from_a_position_select_as_the_whole_sequence(chunked, monkeypatch):
    """q holding each sequence's rows from a tile-aligned position on (`QueryRows`, sequence
    parallelism) selects, for every tile after its first, what the whole sequence's tile at
    that position selects (selected and sparse compressed blocks); the first tile scores only
    the rows it has."""
    from sparsity import QueryRows

    if chunked:  # a few tiles per scoring chunk
        monkeypatch.setattr(selection_module, "SCORE_CHUNK_ELEMENTS", 2000)
    lengths, starts, q_tile = [300, 200, 70], [64, 32, 0], RULE["q_tile"]
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k = torch.randn(sum(lengths), 2, 8, generator=gen)
    cu = cu_seqlens_of(lengths)
    k_cmp, _, cu_cmp = compress_kv(k, k, cu, RULE["compress_block_size"])
    whole = select_blocks(q, k_cmp, cu, cu_cmp, softmax_scale=0.3, **RULE)
    rows = torch.cat([torch.arange(a + p, b) for a, b, p in zip(cu[:-1], cu[1:], starts)])
    window_lengths = [n - p for n, p in zip(lengths, starts)]
    queries = QueryRows(cu_seqlens_of(window_lengths), tuple(cu_seqlens_of(window_lengths)
                                                             .tolist()), tuple(starts))
    part = select_blocks(q[rows], k_cmp, cu, cu_cmp, softmax_scale=0.3, queries=queries, **RULE)
    whole_first = whole.row_block_offsets.tolist()
    part_first = part.row_block_offsets.tolist()
    for s, p in enumerate(starts):
        skip = 0 if p == 0 else 1  # the first tile after a start scores truncated rows
        count = part_first[s + 1] - part_first[s] - skip
        mine = slice(part_first[s] + skip, part_first[s + 1])
        theirs = slice(whole_first[s] + p // q_tile + skip,
                       whole_first[s] + p // q_tile + skip + count)
        assert torch.equal(part.selected[mine], whole.selected[theirs]), s
        assert torch.equal(part.cmp_selected[mine], whole.cmp_selected[theirs]), s
    with pytest.raises(ValueError, match="causal selection only"):
        select_blocks(q[rows], k_cmp, cu, cu_cmp, softmax_scale=0.3, queries=queries,
                      causal=False, **RULE)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_chunked_scoring_gives_the_same_selection(causal, monkeypatch):
    lengths = [150, 7, 260, 40]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k = torch.randn(sum(lengths), 2, 8, generator=gen)
    whole, _ = _select_both(q, k, cu_seqlens_of(lengths), causal=causal, **RULE)
    # Small enough to split the long sequences over several chunks, one tile each at worst.
    monkeypatch.setattr(selection_module, "SCORE_CHUNK_ELEMENTS", 2000)
    chunks = selection_module._plan_chunks(lengths, cu_seqlens_of([n // 4 for n in lengths])
                                           .tolist(), 16, 4, causal, 4, 8 * 16)
    assert len(chunks) > 10
    chunked, ref = _select_both(q, k, cu_seqlens_of(lengths), causal=causal, **RULE)
    _assert_same_selection(chunked, whole)
    _assert_same_selection(chunked, ref)


def test_exact_ties_go_to_the_lower_block(ranking_kernel):
    # Identical keys everywhere: every compressed token scores the same, every candidate block
    # has the same importance, so the lowest-numbered candidates must win.
    n = 160
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(n, 4, 8, generator=gen)
    k = torch.randn(1, 2, 8, generator=gen).expand(n, 2, 8).contiguous()
    fast, ref = _select_both(q, k, cu_seqlens_of([n]), causal=True,
                             ranking_kernel=ranking_kernel, **RULE)
    _assert_same_selection(fast, ref)
    # Tile 5 (rows 80..95): forced blocks 0, 10, 11; candidates 1..9 all tied -> 1, 2.
    assert fast.selected[5, 0].tolist() == [0, 1, 2, 10, 11]
    # Sparse compressed, tile 5: anchor 80 sees 20 tokens = blocks 0..4 whole; rows up to 95 see
    # 24 tokens -> diagonal block 5; the two tied best of 1..4 are 1 and 2.
    assert fast.cmp_selected[5, 0].tolist()[:4] == [0, 1, 2, 5]


def test_ties_between_duplicated_blocks_match_the_reference(ranking_kernel):
    # Random keys, but some selection blocks are exact copies of others: their importances tie
    # exactly, in float32 and in float64, and both paths must keep the lower copy.
    n = 256
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(n, 4, 8, generator=gen) + 1.0
    k = torch.randn(n, 2, 8, generator=gen)
    for source, copy in ((2, 9), (3, 12), (5, 20), (1, 25)):
        k[copy * 8:(copy + 1) * 8] = k[source * 8:(source + 1) * 8]
    fast, ref = _select_both(q, k, cu_seqlens_of([n]), causal=True,
                             ranking_kernel=ranking_kernel, **RULE)
    _assert_same_selection(fast, ref)


@pytest.mark.parametrize("row", [0, 15, 16, 47, 100])
def test_selection_does_not_see_rows_after_the_tile_anchor(row):
    # Perturbing q and k after `row` may change only tiles whose anchor is after `row`.
    n = 140
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(n, 4, 8, generator=gen)
    k = torch.randn(n, 2, 8, generator=gen)
    before, _ = _select_both(q, k, cu_seqlens_of([n]), causal=True, **RULE)
    q2, k2 = q.clone(), k.clone()
    q2[row + 1:] = torch.randn(n - row - 1, 4, 8, generator=gen) * 3
    k2[row + 1:] = torch.randn(n - row - 1, 2, 8, generator=gen) * 3
    after, _ = _select_both(q2, k2, cu_seqlens_of([n]), causal=True, **RULE)
    tiles = row // 16 + 1  # tiles whose anchor (first row) is <= row
    assert torch.equal(before.selected[:tiles], after.selected[:tiles])
    assert torch.equal(before.cmp_selected[:tiles], after.cmp_selected[:tiles])
    assert not torch.equal(before.selected, after.selected)  # the perturbation mattered


def test_selected_lists_hold_the_forced_blocks_and_earlier_candidates():
    lengths = [100, 45]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lengths), 2, 8, generator=gen)
    k = torch.randn(sum(lengths), 1, 8, generator=gen)
    fast, _ = _select_both(q, k, cu_seqlens_of(lengths), causal=True, **RULE)
    offsets = fast.row_block_offsets.tolist()
    for s, n in enumerate(lengths):
        for tile in range(offsets[s + 1] - offsets[s]):
            a, e = tile * 16, min(tile * 16 + 16, n)
            blocks = [b for b in fast.selected[offsets[s] + tile, 0].tolist() if b >= 0]
            forced = {0} | {c for c in range(-(-n // 8)) if c * 8 < e and (c + 1) * 8 > a}
            candidates = [c for c in range(1, a // 8) if (c + 1) * 8 <= a]
            assert blocks == sorted(set(blocks))
            assert forced <= set(blocks)
            assert set(blocks) - forced <= set(candidates)
            assert len(blocks) == min(5, len(forced | set(candidates)))


def test_selection_given_the_host_bounds_reads_nothing_and_selects_the_same(monkeypatch):
    from op_counting import OpCounter

    generator = torch.Generator().manual_seed(4)
    lengths = [40, 17, 0, 29]
    q = torch.randn(sum(lengths), 4, 8, generator=generator)
    k = torch.randn(sum(lengths), 2, 8, generator=generator)
    cu_seqlens = cu_seqlens_of(lengths)
    k_cmp, _, cu_cmp = compress_kv(k, k, cu_seqlens, RULE["compress_block_size"])
    kwargs = dict(softmax_scale=8 ** -0.5, **RULE)
    read = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, **kwargs)
    host_bounds = (cu_seqlens.tolist(), cu_cmp.tolist())
    counter = OpCounter(monkeypatch)
    with counter:
        given = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, **kwargs, host_bounds=host_bounds)
    assert counter.reads == 0
    _assert_same_selection(given, read)
    assert torch.equal(given.cmp_selected, read.cmp_selected)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("heads,kv_heads,lengths", [
    (4, 4, [3000]),
    (16, 4, [1000, 77, 2900, 129]),
    (16, 1, [700, 1500]),
], ids=["gqa1", "gqa4-varlen", "gqa16-varlen"])
def test_selection_on_the_gpu_matches_the_reference(heads, kv_heads, lengths, ranking_kernel):
    """nsa()'s defaults (blocks of 64, 16 selected, 128-row tiles, sparse compressed branch)
    on bf16 inputs: the GPU path (K compression and the scoring queries on the row-means
    kernel) selects the blocks the float64 reference selects from the same values."""
    from kernels.row_means import runs_on_sm90

    rule = dict(compress_block_size=64, selected_block_size=64, num_selected_blocks=16,
                q_tile=128, cmp_kv_block=128, num_cmp_selected_blocks=2)
    gen = torch.Generator().manual_seed(heads + len(lengths))
    total = sum(lengths)
    q = torch.randn(total, heads, 128, generator=gen).to(torch.bfloat16)
    k = (torch.randn(total, kv_heads, 128, generator=gen) + 0.5).to(torch.bfloat16)
    cu_seqlens = cu_seqlens_of(lengths)
    q_gpu, k_gpu, cu_gpu = q.cuda(), k.cuda(), cu_seqlens.cuda()
    assert runs_on_sm90([q_gpu.flatten(1), k_gpu.flatten(1)])
    k_cmp, _, cu_cmp = compress_kv(k_gpu, k_gpu, cu_gpu, 64)
    scale = 128 ** -0.5
    fast = select_blocks(q_gpu, k_cmp, cu_gpu, cu_cmp, softmax_scale=scale,
                         ranking_kernel=ranking_kernel, **rule)
    k_ref, _, cu_ref = compress_kv_reference(k.double(), k.double(), cu_seqlens, 64)
    ref = select_blocks_reference(q.double(), k_ref, cu_seqlens, cu_ref, softmax_scale=scale,
                                  **rule)
    torch.testing.assert_close(k_cmp.cpu().double(), k_ref, rtol=1e-6, atol=1e-6)
    _assert_same_selection(_on_cpu(fast), ref)


def _on_cpu(selection):
    from nsa.selection_rule import BlockSelection

    return BlockSelection(*(None if t is None else t.cpu() for t in (
        selection.selected, selection.cmp_selected, selection.row_block_offsets)))


# --- the fused selection kernel (kernels/sm90/select_blocks.py) ----------------------------------

FUSED_RULE = dict(compress_block_size=16, selected_block_size=16, num_selected_blocks=6,
                  q_tile=32)


def _gpu_selections(q, k, cu_seqlens, monkeypatch, causal=True, tensor_cores=False, **rule):
    """Selection of q, k (bf16, on the GPU) by the fused kernel (its tensor-core build with
    tensor_cores), by the torch path (the stable sort), and by the float64 reference on the same
    compressed keys; checks the kernel ran."""
    from kernels.sm90 import select_blocks as kernel

    calls = []
    run = kernel.run

    def counted_run(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)
    monkeypatch.setattr(kernel, "run", counted_run)
    k_cmp, _, cu_cmp = compress_kv(k, k, cu_seqlens, rule["compress_block_size"])
    scale = q.shape[-1] ** -0.5
    results = {}
    for path in ("fused", "torch"):
        results[path] = _on_cpu(select_blocks(
            q, k_cmp, cu_seqlens, cu_cmp, causal=causal, softmax_scale=scale,
            selection_kernel=path == "fused", ranking_kernel=False, tensor_cores=tensor_cores,
            **rule))
    assert len(calls) == 1  # the fused path ran the kernel, the torch path did not
    _assert_kernel_lists_equal_the_builders(q, k_cmp, cu_seqlens, cu_cmp, causal, scale, rule,
                                            tensor_cores)
    ref = select_blocks_reference(q.cpu().double(), k_cmp.cpu().double(), cu_seqlens.cpu(),
                                  cu_cmp.cpu(), causal=causal, softmax_scale=scale, **rule)
    return results["fused"], results["torch"], ref


def _assert_kernel_lists_equal_the_builders(q, k_cmp, cu_seqlens, cu_cmp, causal, scale, rule,
                                            tensor_cores):
    """The selected branch's lists that the kernel writes beside its selection equal the
    trusted builder's lists of that selection, entry for entry."""
    from sparsity import build_selected_block_sparse_trusted

    selection = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, causal=causal, softmax_scale=scale,
                              write_selected_lists=True, tensor_cores=tensor_cores, **rule)
    built = build_selected_block_sparse_trusted(
        selection.selected, cu_seqlens=cu_seqlens, host_cu_seqlens=cu_seqlens.tolist(),
        q_tile=rule["q_tile"], selected_block_size=rule["selected_block_size"],
        kv_block=rule["selected_block_size"], causal=causal)
    written = selection.selected_lists
    assert written is not None
    for name in ("full_count", "full_index", "mask_count", "mask_index", "row_block_offsets"):
        assert torch.equal(getattr(written, name), getattr(built, name)), name
    assert (written.row_block_size, written.col_block_size) == (built.row_block_size,
                                                                built.col_block_size)


@pytest.fixture(params=[False, True], ids=["fma", "tensor-cores"])
def tensor_cores(request):
    """The selection kernel's scoring, `select_blocks`'s tensor_cores: float32 FMAs
    (dispatched) or the tensor-core build (`split_products`, not dispatched)."""
    return request.param


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("heads,kv_heads,dim,lengths,num_cmp", [
    (8, 2, 128, [9000, 300, 5000], 2),
    (16, 1, 64, [7000, 2100, 15], 1),
    (4, 4, 128, [12000], 3),
], ids=["gqa4-varlen", "gqa16-d64", "gqa1-long"])
def test_sm90_selection_kernel_ranks_the_sparse_compressed_blocks(
        causal, heads, kv_heads, dim, lengths, num_cmp, tensor_cores, monkeypatch):
    """With num_cmp_selected_blocks the kernel also sums each KV block of 128 compressed tokens
    (16-token compression: blocks of 2048 tokens, so these sequences have up to 6, partial last
    ones included) and ranks them: the same lists as the torch path and the float64 reference,
    for the selected and the sparse compressed branch."""
    gen = torch.Generator().manual_seed(heads * 5 + len(lengths) + dim)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    k = (torch.randn(total, kv_heads, dim, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    rule = dict(FUSED_RULE, cmp_kv_block=128, num_cmp_selected_blocks=num_cmp)
    fused, torch_path, ref = _gpu_selections(q, k, cu_seqlens_of(lengths).cuda(), monkeypatch,
                                             causal=causal, tensor_cores=tensor_cores, **rule)
    # Candidates were ranked: lists hold blocks past block 0 and the first candidate.
    assert fused.cmp_selected is not None and (fused.cmp_selected >= 2).any()
    _assert_same_selection(fused, ref)
    _assert_same_selection(torch_path, ref)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("heads,kv_heads,dim,lengths,width", [
    (4, 4, 128, [3000], 16),
    (16, 4, 128, [1000, 77, 5, 0, 2900, 129, 16, 15], 16),
    (16, 1, 64, [700, 1500], 6),
    (8, 1, 256, [333, 31, 1200], 32),
    (6, 2, 192, [64, 65, 900], 3),
], ids=["gqa1", "gqa4-varlen", "gqa16-d64", "gqa8-d256", "gqa3-d192-width3"])
def test_sm90_selection_kernel_matches_the_torch_path_and_the_reference(
        causal, heads, kv_heads, dim, lengths, width, tensor_cores, monkeypatch):
    """Scores, softmax, group sum and ranking in one kernel select what the torch path and the
    float64 reference select: varlen with sequences shorter than a tile and than a block,
    group sizes 1..16, head dims 64..256, widths 3 (the forced blocks alone) to 32 (nsa()'s
    64-token blocks at 128-row tiles in the first cases)."""
    gen = torch.Generator().manual_seed(heads * 7 + len(lengths) + dim)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    k = (torch.randn(total, kv_heads, dim, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    rule = dict(compress_block_size=64, selected_block_size=64, num_selected_blocks=width,
                q_tile=128) if dim == 128 else dict(FUSED_RULE, num_selected_blocks=width)
    fused, torch_path, ref = _gpu_selections(q, k, cu_seqlens_of(lengths).cuda(), monkeypatch,
                                             causal=causal, tensor_cores=tensor_cores, **rule)
    _assert_same_selection(fused, ref)
    _assert_same_selection(torch_path, ref)


@pytest.mark.gpu
@requires_sm90
def test_sm90_selection_kernel_breaks_exact_ties_toward_the_lower_block(tensor_cores,
                                                                        monkeypatch):
    """Identical compressed keys (every candidate ties) and duplicated ones (pairs tie): the
    lower block wins, as in the sort and the reference."""
    gen = torch.Generator().manual_seed(11)
    n, dim = 400, 64
    q = torch.randn(n, 4, dim, generator=gen).to(torch.bfloat16).cuda()
    same = torch.randn(1, 2, dim, generator=gen).expand(n, 2, dim).to(torch.bfloat16).cuda()
    fused, torch_path, ref = _gpu_selections(q, same.contiguous(), cu_seqlens_of([n]).cuda(),
                                             monkeypatch, tensor_cores=tensor_cores,
                                             **FUSED_RULE)
    _assert_same_selection(fused, ref)
    _assert_same_selection(torch_path, ref)
    # Tile 5 (rows 160..191): forced 0 and the diagonal 10, 11; candidates 1..9 all tie.
    assert fused.selected[5, 0].tolist() == [0, 1, 2, 3, 10, 11]
    k = torch.randn(n, 2, dim, generator=gen)
    for source, copy in ((2, 9), (3, 12), (5, 20), (1, 17)):
        k[copy * 16:(copy + 1) * 16] = k[source * 16:(source + 1) * 16]
    fused, torch_path, ref = _gpu_selections(q, k.to(torch.bfloat16).cuda(),
                                             cu_seqlens_of([n]).cuda(), monkeypatch,
                                             tensor_cores=tensor_cores, **FUSED_RULE)
    _assert_same_selection(fused, ref)
    _assert_same_selection(torch_path, fused)


@pytest.mark.gpu
@requires_sm90
def test_sm90_selection_kernel_ranks_a_nan_score_as_the_sort_does(tensor_cores, monkeypatch):
    """A NaN in one scoring query makes its tile's importances NaN (softmax of a row with a
    NaN): the kernel's lists equal the torch path's (NaN ranks first and is never kept)."""
    gen = torch.Generator().manual_seed(12)
    n, dim = 600, 64
    q = torch.randn(n, 4, dim, generator=gen)
    q[200, 1, 7] = float("nan")  # a scoring row of tiles 6 and 7 (rows 192..255), head 1
    k = torch.randn(n, 2, dim, generator=gen)
    fused, torch_path, _ = _gpu_selections(q.to(torch.bfloat16).cuda(),
                                           k.to(torch.bfloat16).cuda(),
                                           cu_seqlens_of([n]).cuda(), monkeypatch,
                                           tensor_cores=tensor_cores, **FUSED_RULE)
    _assert_same_selection(fused, torch_path)
    # Tile 7 (anchor 224) averages rows 193..224: its 13 candidates score NaN, rank above the
    # forced blocks and are not kept, so its KV head 0 keeps nothing (the sort's rule); head 1
    # and the other tiles are untouched.
    assert fused.selected[7, 0].tolist() == [-1] * 6
    assert fused.selected[7, 1].tolist()[0] == 0 and fused.selected[6, 0].tolist()[0] == 0


@pytest.mark.gpu
@requires_sm90
def test_sm90_selection_kernel_lists_do_not_depend_on_tokens_per_lane(monkeypatch):
    """Scoring 1, 2 or 4 tokens per lane sums each score in the same order: the same lists,
    entry for entry (varlen, group 4, a sequence shorter than one chunk of 4 x 32 tokens)."""
    from kernels.sm90 import select_blocks as kernel

    gen = torch.Generator().manual_seed(21)
    lengths = [5000, 130, 2100]
    q = torch.randn(sum(lengths), 16, 128, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(sum(lengths), 4, 128, generator=gen).to(torch.bfloat16).cuda()
    cu_seqlens = cu_seqlens_of(lengths).cuda()
    k_cmp, _, cu_cmp = compress_kv(k, k, cu_seqlens, 64)
    lists = {}
    for tokens in (1, 2, 4):
        monkeypatch.setattr(kernel, "default_tokens_per_lane",
                            lambda group, tensor_cores=False, t=tokens: t)
        selection = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, compress_block_size=64,
                                  selected_block_size=64, num_selected_blocks=16,
                                  softmax_scale=128 ** -0.5, write_selected_lists=True)
        lists[tokens] = (selection.selected, selection.selected_lists.full_index)
    for tokens in (2, 4):
        assert torch.equal(lists[tokens][0], lists[1][0]), tokens
        assert torch.equal(lists[tokens][1], lists[1][1]), tokens


def test_selection_kernel_builds_for_sm90():
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.select_blocks import SelectBlocksSpec, compile_on_fake_tensors

    for spec in (SelectBlocksSpec(128, 4, 16), SelectBlocksSpec(64, 1, 1),
                 SelectBlocksSpec(256, 16, 32), SelectBlocksSpec(192, 3, 19),
                 SelectBlocksSpec(128, 4, 16, True, 2, tokens_per_lane=1),
                 SelectBlocksSpec(128, 8, 19, True, 2, tokens_per_lane=2)):
        assert compile_on_fake_tensors(spec)
    # The tensor-core scoring (split_products): groups that fill, pad and overfill 16 rows.
    for spec in (SelectBlocksSpec(128, 4, 16, True, 2, tensor_cores=True),
                 SelectBlocksSpec(64, 1, 6, tensor_cores=True),
                 SelectBlocksSpec(192, 3, 19, True, 2, tensor_cores=True),
                 SelectBlocksSpec(256, 16, 32, tensor_cores=True)):
        assert compile_on_fake_tensors(spec)
        assert spec.score_rows % 16 == 0 and spec.smem_bytes <= 227 * 1024
    # With the sparse compressed branch's ranking (its KV blocks summed in pass 2).
    for spec in (SelectBlocksSpec(128, 4, 16, True, 2, cmp_width=19),
                 SelectBlocksSpec(64, 1, 6, cmp_width=4, tokens_per_lane=1, cmp_kv_block=32),
                 SelectBlocksSpec(128, 4, 16, True, 2, tensor_cores=True, cmp_width=19)):
        assert compile_on_fake_tensors(spec)
    # Up to 4 tokens per lane, fewer where the group's scores would crowd the registers.
    assert [SelectBlocksSpec(128, g, 16).tokens_per_lane for g in (1, 4, 6, 8, 16)] == \
        [4, 4, 2, 2, 1]


def test_selection_kernel_spec_rejects_what_it_cannot_hold():
    from kernels.sm90.select_blocks import SelectBlocksSpec

    with pytest.raises(ValueError, match="head_dim 96"):
        SelectBlocksSpec(96, 4, 16)
    with pytest.raises(ValueError, match="group 17"):
        SelectBlocksSpec(128, 17, 16)
    with pytest.raises(ValueError, match="width 33"):
        SelectBlocksSpec(128, 4, 33)
    with pytest.raises(ValueError, match="tokens_per_lane 5"):
        SelectBlocksSpec(128, 4, 16, tokens_per_lane=5)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        SelectBlocksSpec(256, 16, 16, tokens_per_lane=4, tensor_cores=True)
    with pytest.raises(ValueError, match="cmp_width 33"):
        SelectBlocksSpec(128, 4, 16, cmp_width=33)
    with pytest.raises(ValueError, match="cmp_kv_block 64"):  # 128 tokens a chunk
        SelectBlocksSpec(128, 4, 16, cmp_width=16, cmp_kv_block=64)
