"""The window standing for the selected branch near documents' starts (nsa/window_covered.py):
the rule's premise on the reference selection, the tiles and rows it covers, and nsa() with it
against nsa() without it and the float64 reference (CPU; the sm90 path: test_nsa_gpu.py)."""
from __future__ import annotations

import pytest
import torch

import nsa.function as function
from nsa import nsa
from nsa.branches import SELECTED, WINDOW
from nsa.config import NSAConfig
from nsa.reference import compress_kv_reference, nsa_reference, select_blocks_reference
from nsa.window_covered import (MIN_COVERED_PAIR_SHARE, covered_pair_share,
                                covered_tile_counts, folded_gates, unfold_gate_gradients,
                                window_covered_rows, without_covered_tiles)
from sparsity import build_selected_block_sparse
from gpu_marks import requires_sm90
from nsa_testing import (SMALL, bf16_reference_inputs, cu_seqlens_of, differentiable, grads_of,
                         random_cuda_inputs, random_inputs, rel_err)

# Documents shorter than the cover, one row past it, one 16-row tile, and longer ones.
LENGTHS = [100, 7, 40, 41, 33, 64, 16]


def _config(window_size: int, num_selected_blocks: int = 6, selected_block_size: int = 8,
            causal: bool = True) -> NSAConfig:
    return NSAConfig(compress_block_size=4, selected_block_size=selected_block_size,
                     num_selected_blocks=num_selected_blocks, window_size=window_size,
                     causal=causal, softmax_scale=0.25, q_tile=16, cmp_kv_block=4)


@pytest.mark.parametrize("window_size,num_selected_blocks", [(40, 6), (100, 6), (16, 6), (48, 3)])
def test_covered_tiles_select_every_block_of_their_rows(window_size, num_selected_blocks):
    """The rule's premise, on the reference selection: every tile that covered_tile_counts
    leaves to the window selects all blocks up to its last row (so its rows see [0, i], as the
    window's rows i < window_size do), and its rows are all before window_size."""
    config = _config(window_size, num_selected_blocks)
    x = random_inputs(LENGTHS, 4, 2, 16, seed=3)
    k_cmp, _, cu_cmp = compress_kv_reference(x["k"], x["v"], x["cu_seqlens"], 4, x["W_k"],
                                             x["W_v"])
    selection = select_blocks_reference(
        x["q"], k_cmp, x["cu_seqlens"], cu_cmp, compress_block_size=4, selected_block_size=8,
        num_selected_blocks=num_selected_blocks, softmax_scale=0.25, q_tile=16)
    counts = covered_tile_counts(tuple(x["cu_seqlens"].tolist()), config)
    assert any(counts)
    offsets = selection.row_block_offsets.tolist()
    for sequence, (length, count) in enumerate(zip(LENGTHS, counts)):
        for tile in range(count):
            end = min(16 * (tile + 1), length)
            assert end <= window_size
            expected = list(range(-(-end // 8)))
            for head_list in selection.selected[offsets[sequence] + tile].tolist():
                assert sorted(b for b in head_list if b >= 0) == expected, (sequence, tile)
        # The first tile past the cover (if any) is not covered.
        if count < -(-length // 16):
            assert min(16 * (count + 1), length) > min(window_size, num_selected_blocks * 8)


def test_covered_tiles_and_rows_of_a_packing():
    config = _config(40)
    host = tuple(cu_seqlens_of(LENGTHS).tolist())
    # cover = min(40, 6 x 8) = 40: two 16-row tiles of a longer document, all of one up to 40.
    assert covered_tile_counts(host, config) == [2, 1, 3, 2, 3, 2, 1]
    covered = window_covered_rows(cu_seqlens_of(LENGTHS), host, config)
    starts = [0, 7, 8, 11, 14, 17, 21]  # each sequence's first row block: ceil(length / 16)
    assert covered.tiles.tolist() == [t for s, c in zip(starts, [2, 1, 3, 2, 3, 2, 1])
                                      for t in range(s, s + c)]
    expected_rows = [start + row for start, rows in zip(host, [32, 7, 40, 32, 33, 32, 16])
                     for row in range(rows)]
    assert covered.rows.dtype == torch.int64 and covered.rows.tolist() == expected_rows
    for off in (_config(0), _config(40, causal=False)):
        assert window_covered_rows(cu_seqlens_of(LENGTHS), host, off) is None


def test_no_covering_where_it_holds_too_few_of_the_selected_pairs():
    """A long single sequence: two covered tiles, 0.28% of the selected pairs (32 x 33 / 2 of
    48 x 49 / 2 + 3952 x 48): below MIN_COVERED_PAIR_SHARE, so nothing is folded; the packing
    of short documents is far above it."""
    config = _config(40)
    host = (0, 4000)
    assert covered_tile_counts(host, config) == [2]
    share = covered_pair_share(host, config)
    assert share == pytest.approx(528 / (1176 + 3952 * 48))
    assert share < MIN_COVERED_PAIR_SHARE
    assert window_covered_rows(torch.tensor(host, dtype=torch.int32), host, config) is None
    assert covered_pair_share(tuple(cu_seqlens_of(LENGTHS).tolist()), config) > 0.3


def test_without_covered_tiles_empties_those_tiles_only():
    cu = cu_seqlens_of(LENGTHS)
    host = tuple(cu.tolist())
    tiles = sum(-(-n // 16) for n in LENGTHS)
    generator = torch.Generator().manual_seed(0)
    selected = torch.randint(0, 13, (tiles, 2, 6), generator=generator, dtype=torch.int32)
    lists = build_selected_block_sparse(selected, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=16,
                                        selected_block_size=8, kv_block=8, causal=True)
    covered = window_covered_rows(cu, host, _config(40))
    emptied = without_covered_tiles(lists, covered)
    gone = torch.zeros(tiles, dtype=torch.bool)
    gone[covered.tiles] = True
    for name in ("full_count", "mask_count", "full_index", "mask_index"):
        before, after = getattr(lists, name), getattr(emptied, name)
        assert torch.equal(after[~gone], before[~gone]), name
        assert (after[gone] == (0 if name.endswith("count") else -1)).all(), name
    assert lists.full_count[gone].any() or lists.mask_count[gone].any()  # it removed entries


def test_folded_gates_and_their_gradients():
    """out = g_c o_c + (g_w + g_s) o_w on covered rows: the folded gates, and the gradients
    with respect to the gates (dL/dg_s = dL/dg_w there) from those with respect to them."""
    cu = cu_seqlens_of(LENGTHS)
    covered = window_covered_rows(cu, tuple(cu.tolist()), _config(40))
    generator = torch.Generator().manual_seed(1)
    gates = torch.rand(sum(LENGTHS), 4, 3, generator=generator, dtype=torch.float64)
    folded = folded_gates(gates, covered)
    rows = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    rows[covered.rows] = True
    assert torch.equal(folded[rows, :, WINDOW], gates[rows, :, WINDOW] + gates[rows, :, SELECTED])
    assert (folded[rows, :, SELECTED] == 0).all()
    assert torch.equal(folded[~rows], gates[~rows])
    assert torch.equal(folded[..., 0], gates[..., 0])
    d_folded = torch.rand(gates.shape, generator=generator, dtype=torch.float64)
    d_gates = d_folded.clone()
    unfold_gate_gradients(d_gates, covered)
    assert torch.equal(d_gates[rows, :, SELECTED], d_folded[rows, :, WINDOW])
    assert torch.equal(d_gates[~rows], d_folded[~rows])
    assert folded_gates(gates, None) is gates


@pytest.mark.parametrize("learned_gates", [True, False], ids=["learned", "mean"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_nsa_with_the_window_covering_matches_nsa_without_it(monkeypatch, learned_gates,
                                                            recompute):
    """float64 on the CPU: nsa() with covered tiles left to the window gives nsa()'s values
    without (to rounding: the same softmax over the same keys) and the reference's, every
    gradient too (W_gate's through the unfolded gate gradients); the lists it ran had the
    covered tiles removed, and the gates were folded once a step where the outputs were kept
    (the backward reads the forward's), twice where the backward recomputes."""
    options = dict(SMALL, window_size=40)
    x = random_inputs(LENGTHS, 4, 2, 16, seed=5)
    if not learned_gates:
        x.pop("W_gate")
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(2),
                       dtype=torch.float64)
    removed = []
    original = function.without_covered_tiles

    def spying(lists, covered):
        removed.append(covered.tiles.numel())
        return original(lists, covered)
    monkeypatch.setattr(function, "without_covered_tiles", spying)
    folds = []
    original_fold = function.folded_gates

    def folding(gates, covered):
        folds.append(covered is not None)
        return original_fold(gates, covered)
    monkeypatch.setattr(function, "folded_gates", folding)
    runs = {}
    for covering in (True, False):
        monkeypatch.setattr(function, "WINDOW_COVERS_SELECTED", covering)
        removed.clear()
        folds.clear()
        inputs = differentiable(x, torch.float64)
        out = nsa(**inputs, max_seqlen=max(LENGTHS), recompute=recompute, capture=False,
                  **options)
        runs[covering] = (out.detach(), grads_of(out, inputs, dout))
        assert (len(removed) > 0 and removed[0] == 14) if covering else not removed
        # (without covered rows the backward asks again: the gates come back as they are)
        assert folds == ([True] * (2 if recompute else 1) if covering else [False] * 2), folds
    (out_on, grads_on), (out_off, grads_off) = runs[True], runs[False]
    assert rel_err(out_on, out_off) < 1e-12
    for name, grad in grads_on.items():
        assert rel_err(grad, grads_off[name]) < 1e-12, name
    ref_in = differentiable(x, torch.float64)
    ref = nsa_reference(**ref_in, max_seqlen=max(LENGTHS), **options)
    assert rel_err(out_on, ref) < 1e-12
    for name, grad in grads_of(ref, ref_in, dout).items():
        assert rel_err(grads_on[name], grad) < 1e-10, name


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_nsa_with_the_window_covering_on_the_kernels(monkeypatch, recompute):
    """On the sm90 kernels (bf16, the default sizes: 512 rows covered): nsa() with the covered
    tiles left to the window against nsa() without (both roundings of one function) and the
    float64 reference, learned gates, every gradient; documents shorter than the window, one
    ending inside a tile and one longer than n l'."""
    lengths = [1500, 77, 700, 300, 2100]
    x = random_cuda_inputs(lengths, 16, 4, 128, seed=21)
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(4),
                       dtype=torch.float64).cuda()
    runs = {}
    for covering in (True, False):
        monkeypatch.setattr(function, "WINDOW_COVERS_SELECTED", covering)
        inputs = differentiable(x, torch.bfloat16)
        out = nsa(**inputs, max_seqlen=max(lengths), recompute=recompute, capture=False)
        runs[covering] = (out.detach().double(), grads_of(out, inputs, dout))
    ref_in = bf16_reference_inputs(x)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths))
    ref_grads = grads_of(ref, ref_in, dout)
    (out_on, grads_on), (out_off, grads_off) = runs[True], runs[False]
    assert rel_err(out_on, out_off) < 1e-2
    assert rel_err(out_on, ref) < 1e-2
    for name, grad in grads_on.items():
        assert rel_err(grad, grads_off[name]) < 2e-2, name
        assert rel_err(grad, ref_grads[name]) < 2e-2, name
