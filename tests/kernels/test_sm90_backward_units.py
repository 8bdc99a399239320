"""The backward's host-side layouts, on the CPU: work units of split lists and the 64-row
query tile layout of the row statistics and dQ (kernels/sm90/backward.py)."""
import math

import pytest
import torch

from kernels.sm90.backward import (DqSums, QueryTiles, gate_folded_lse, query_tiles,
                                   work_units, work_units_torch)
from sparsity import build_block_sparse_from_mask, transpose_block_sparse_csr
from gpu_marks import requires_sm90


def _random_bf16_problem(tokens: int, generator: torch.Generator):
    """(q, k, v, dout) on the GPU, bf16, H=8, Hkv=2, D=128, random normal."""
    q, dout = (torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for _ in range(2))
    k, v = (torch.randn(tokens, 2, 128, device="cuda", dtype=torch.bfloat16,
                        generator=generator) for _ in range(2))
    return q, k, v, dout


def _nsa_like_lists(lengths, heads, kv_block, seed=0):
    """Causal lists that always hold block 0 (NSA's forced block) plus random others."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    mask = torch.zeros(1, heads, total, total, dtype=torch.bool)
    start = 0
    for length in lengths:
        if length == 0:  # an empty sequence lists nothing
            continue
        tiles, blocks = -(-length // 128), -(-length // kv_block)
        pick = torch.rand(heads, tiles, blocks, generator=gen) < 0.3
        pick[..., 0] = True
        dense = pick.repeat_interleave(128, 1).repeat_interleave(kv_block, 2)[:, :length, :length]
        dense &= torch.ones(length, length, dtype=torch.bool).tril()
        mask[0, :, start:start + length, start:start + length] = dense
        start += length
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    bs = build_block_sparse_from_mask(mask, q_tile=128, kv_block=kv_block, cu_seqlens=cu)
    return bs, cu


@pytest.mark.parametrize("head_major", [False, True], ids=["csr-order", "head-major"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_work_units_cover_every_list_entry_once_in_chunks(chunk, head_major):
    lengths = [1000, 1, 300, 2100]
    bs, cu = _nsa_like_lists(lengths, heads=3, kv_block=64)
    csr = transpose_block_sparse_csr(bs, cu_seqlens_k=cu)
    units = work_units(csr, chunk, head_major=head_major)
    assert units.dtype == torch.int32 and units.shape[1] == 5
    offsets = csr.offsets.tolist()
    blocks = csr.row_block_offsets.tolist()
    covered = torch.zeros(offsets[-1], dtype=torch.int64)
    taken = []  # (list head, global KV block) of the real units, in unit order
    for sequence, n_block, head, first, end in units.tolist():
        if first == end:
            continue  # an empty unit past the real ones
        taken.append((head, blocks[sequence] + n_block) if head_major
                     else (blocks[sequence] + n_block, head))
        assert 0 < end - first <= chunk
        kv_row = blocks[sequence] + n_block
        assert blocks[sequence] <= kv_row < blocks[sequence + 1]
        group = kv_row * csr.num_heads + head
        assert offsets[group] <= first < end <= offsets[group + 1]
        covered[first:end] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    # Units run list by list in the asked order: KV block by KV block, or head by head (the
    # fused dQ's: the CTAs running together add into one head's accumulator).
    assert taken == sorted(taken) and len({t[0 if head_major else 1] for t in taken}) == 3
    # The longest unit is bounded by the chunk, whatever the longest list (block 0's).
    longest_list = max(b - a for a, b in zip(offsets, offsets[1:]))
    assert longest_list > chunk


def test_list_chunk_keeps_even_lists_whole_only_for_the_fused_dq():
    """Beside the dQ kernel units hold LIST_CHUNK entries (NSA's block 0 spread out); with the
    fused dQ twice the mean list from the capacity, at least LIST_CHUNK."""
    import dataclasses

    from kernels.sm90.backward import LIST_CHUNK, list_chunk
    from kernels.sm90.spec import ListShape, choose_backward_spec

    bs, cu = _nsa_like_lists([3000, 700], heads=2, kv_block=128)
    csr = transpose_block_sparse_csr(bs, cu_seqlens_k=cu)
    lists = csr.offsets.numel() - 1
    per_head = ListShape(spans_kv_groups=False, per_query_head=True, width=64)
    fused = choose_backward_spec(dtype="bfloat16", head_dim=128, causal=True,
                                 window_size=(-1, -1), sparse_block_size=128, lists=per_head)
    assert fused.fuses_dq
    assert list_chunk(csr, dataclasses.replace(fused, dq_separate=True)) == LIST_CHUNK
    mean = -(-csr.index.numel() // lists)
    assert list_chunk(csr, fused) == max(LIST_CHUNK, 2 * mean)
    empty = dataclasses.replace(csr, index=csr.index[:LIST_CHUNK])  # a capacity below 2 x 16
    assert list_chunk(empty, fused) == LIST_CHUNK


@pytest.mark.parametrize("head_major", [False, True], ids=["csr-order", "head-major"])
def test_work_units_of_no_lists_are_all_empty(head_major):
    """No KV block at all (every sequence empty), spare capacity: units bounded from the
    capacity, every one empty."""
    from sparsity.csr import BlockSparseCSR

    csr = BlockSparseCSR(offsets=torch.zeros(1, dtype=torch.int32),
                         index=torch.full((5,), -1, dtype=torch.int32),
                         mask_count=torch.zeros(0, 2, dtype=torch.int32),
                         row_block_size=64, col_block_size=128,
                         row_block_offsets=torch.zeros(2, dtype=torch.int32))
    units = work_units_torch(csr, 2, head_major)
    assert units.shape == (2, 5) and units.dtype == torch.int32
    assert not units.any()


def test_query_tiles_pad_each_sequence_to_whole_64_row_tiles():
    cu = torch.tensor([0, 1, 65, 65, 300], dtype=torch.int32)
    tiles = QueryTiles(cu, 300)
    assert tiles.tile_offsets.tolist() == [0, 1, 2, 2, 6]
    assert tiles.slot[:2].tolist() == [0, 64]          # sequence 1 starts at tile 1
    assert tiles.slot[65].tolist() == 2 * 64           # the empty sequence takes no tile
    assert tiles.num_slots >= 64 * 6
    heads, dim = 3, 8
    dout, out = torch.randn(300, heads, dim), torch.randn(300, heads, dim)
    lse = torch.randn(heads, 300)
    lse[1, 5] = -math.inf  # a row that sees nothing
    lse_log2, dpsum = tiles.row_statistics(dout, out, lse)
    assert torch.allclose(lse_log2[:, tiles.slot], torch.where(
        torch.isneginf(lse), math.inf, lse * 1.4426950408889634))
    assert lse_log2[1, tiles.slot[5]] == math.inf
    assert torch.allclose(dpsum[:, tiles.slot], (dout * out).sum(-1).t())
    padding = torch.ones(tiles.num_slots, dtype=torch.bool)
    padding[tiles.slot] = False
    assert torch.isinf(lse_log2[:, padding]).all() and (dpsum[:, padding] == 0).all()
    # The same from given row dots (nsa()'s gate pass writes them): O is not read.
    given_lse, given_dpsum = tiles.row_statistics(dout, None, lse, (dout * out).sum(-1))
    assert torch.equal(given_lse, lse_log2) and torch.allclose(given_dpsum, dpsum)


def test_fused_dq_accumulator_blocks_are_read_back_in_row_order():
    """The fused backward's dQ accumulator holds, per 64-row tile, blocks of 64 x cols values
    in the dQ wgmma fragment's register order: value v of thread t at float
    ((v // 4) * 128 + t) * 4 + v % 4 of its block, where the fragment puts it at row
    16 (t // 32) + (t % 32) // 4 + 8 ((v // 2) % 2), column 8 (v // 4) + 2 (t % 4) + v % 2.
    gather_dq reads it back in row order (scaled, at the rows' slots), or adds it into dq."""
    cu = torch.tensor([0, 1, 65, 65, 300], dtype=torch.int32)
    tiles = QueryTiles(cu, 300)
    heads, dim, cols = 2, 32, 16
    natural = torch.randn(heads, tiles.num_slots, dim)
    acc = torch.empty_like(natural).view(heads, -1, dim // cols, 64 * cols)
    for t in range(128):
        for v in range(64 * cols // 128):
            row = 16 * (t // 32) + (t % 32) // 4 + 8 * ((v // 2) % 2)
            col = 8 * (v // 4) + 2 * (t % 4) + v % 2
            flat = ((v // 4) * 128 + t) * 4 + v % 4
            for block in range(dim // cols):
                acc[:, :, block, flat] = natural.view(heads, -1, 64, dim)[:, :, row,
                                                                           block * cols + col]
    acc = acc.view(heads, tiles.num_slots, dim)
    dq = tiles.gather_dq(acc, cols, 0.5, torch.float32)
    assert torch.equal(dq, (natural[:, tiles.slot] * 0.5).transpose(0, 1))
    running = torch.randn(300, heads, dim)
    summed = tiles.gather_dq(acc, cols, 0.5, torch.float32, into=running.clone())
    assert torch.allclose(summed, running + dq)


def test_dq_sums_are_shared_by_one_layout_and_converted_once():
    """DqSums: the first call of a layout gets zeroed sums, a later call of the same layout
    the same tensor, any other layout (tiles, block columns, scale, dtype) None; finish
    converts the sum of every call's blocks once, fresh or added into a running dq, and leaves
    the sums empty (a finish without calls returns `into` untouched)."""
    cu = torch.tensor([0, 1, 65, 65, 300], dtype=torch.int32)
    tiles = QueryTiles(cu, 300)
    heads, dim, cols = 2, 32, 16
    shape = (heads, tiles.num_slots, dim)
    sums = DqSums()
    first = sums.take(tiles, shape, cols, 0.5, torch.float32, "cpu")
    assert first is not None and torch.count_nonzero(first) == 0
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=gen) for _ in range(2))
    first.add_(a)
    assert sums.take(tiles, shape, cols, 0.5, torch.float32, "cpu") is first
    first.add_(b)
    assert sums.take(QueryTiles(cu, 300), shape, cols, 0.5, torch.float32, "cpu") is None
    # Built from the same host bounds (a capture builds its own object): the same layout.
    keyed = QueryTiles(cu, 300, host_key=((0, 1, 65, 65, 300), 300))
    again = QueryTiles(cu, 300, host_key=((0, 1, 65, 65, 300), 300))
    assert keyed.same_layout(again) and not keyed.same_layout(tiles)
    assert not tiles.same_layout(QueryTiles(cu, 300)) and tiles.same_layout(tiles)
    assert sums.take(tiles, shape, 2 * cols, 0.5, torch.float32, "cpu") is None
    assert sums.take(tiles, shape, cols, 0.25, torch.float32, "cpu") is None
    assert sums.take(tiles, shape, cols, 0.5, torch.float64, "cpu") is None
    running = torch.randn(300, heads, dim, generator=gen)
    summed = sums.finish(into=running.clone())
    assert torch.allclose(summed, running + tiles.gather_dq(a + b, cols, 0.5, torch.float32))
    assert sums.finish(into=running) is running
    assert sums.finish() is None
    sums.take(tiles, shape, cols, 0.5, torch.float32, "cpu").add_(a)
    assert torch.equal(sums.finish(), tiles.gather_dq(a, cols, 0.5, torch.float32))


def test_dq_sums_are_consumed_by_one_call_of_their_layout_when_allowed():
    """DqSums.consume: (sums, block columns) once for a call of the sums' layout where
    `consumes` is on, after which finish converts nothing; (None, 0) without sums, with
    `consumes` off, or for another layout (tiles, scale, dtype), and the sums stay."""
    cu = torch.tensor([0, 70, 300], dtype=torch.int32)
    tiles = QueryTiles(cu, 300)
    shape, cols = (2, tiles.num_slots, 32), 16
    for consumes in (False, True):
        sums = DqSums(consumes=consumes)
        assert sums.consume(tiles, 0.5, torch.bfloat16) == (None, 0)
        held = sums.take(tiles, shape, cols, 0.5, torch.bfloat16, "cpu")
        held.add_(1.0)
        assert sums.consume(QueryTiles(cu, 300), 0.5, torch.bfloat16) == (None, 0)
        # nor for another layout of the same bounds' key
        assert sums.consume(QueryTiles(cu, 300, host_key=((0, 70, 300), 301)), 0.5,
                            torch.bfloat16) == (None, 0)
        assert sums.consume(tiles, 0.25, torch.bfloat16) == (None, 0)
        assert sums.consume(tiles, 0.5, torch.float16) == (None, 0)
        taken, taken_cols = sums.consume(tiles, 0.5, torch.bfloat16)
        running = torch.zeros(300, 2, 32, dtype=torch.bfloat16)
        if consumes:
            assert taken is held and taken_cols == cols
            assert sums.finish(into=running) is running and torch.count_nonzero(running) == 0
        else:
            assert (taken, taken_cols) == (None, 0)
            assert torch.count_nonzero(sums.finish(into=running)) > 0


def test_dq_sums_are_opened_for_a_store_once_where_asked():
    """DqSums.open_for_store: unwritten sums of the call's layout (never zeroed: the caller's
    dQ kernel stores every value) only with `stores_first` and only before any call opened
    them; later calls of the layout `take` them and the consuming call gets them; a second
    open, or an open after `take`, gets None."""
    cu = torch.tensor([0, 70, 300], dtype=torch.int32)
    tiles = QueryTiles(cu, 300)
    shape, cols = (2, tiles.num_slots, 32), 16
    assert DqSums(consumes=True).open_for_store(tiles, shape, cols, 0.5, torch.bfloat16,
                                                "cpu") is None
    sums = DqSums(consumes=True, stores_first=True)
    assert sums.awaits_store and not DqSums(consumes=True).awaits_store
    opened = sums.open_for_store(tiles, shape, cols, 0.5, torch.bfloat16, "cpu")
    assert opened is not None and opened.shape == shape and opened.dtype == torch.float32
    assert not sums.awaits_store
    assert sums.open_for_store(tiles, shape, cols, 0.5, torch.bfloat16, "cpu") is None
    assert sums.take(tiles, shape, cols, 0.5, torch.bfloat16, "cpu") is opened
    taken, taken_cols = sums.consume(tiles, 0.5, torch.bfloat16)
    assert taken is opened and taken_cols == cols and sums.finish() is None
    later = DqSums(stores_first=True)
    assert later.take(tiles, shape, cols, 0.5, torch.bfloat16, "cpu") is not None
    assert not later.awaits_store
    assert later.open_for_store(tiles, shape, cols, 0.5, torch.bfloat16, "cpu") is None


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("cols", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_conversion_kernel_matches_torch(dtype, head_dim, cols):
    """The fused backward's dQ out of its float32 tile-layout accumulator
    (kernels/sm90/dq_convert.py, which takes each value's place from CuTe's wgmma fragment)
    against the torch path (which computes it): varlen with an empty and a one-row sequence,
    written fresh and added into a running dq (one rounding), blocks of 32 and 64 columns
    (64: the dispatched fused kernels, a column share at head dim 128, a warpgroup's whole
    rows with 128-row steps at head dim 64)."""
    cu = torch.tensor([0, 1, 1, 200, 1000], dtype=torch.int32, device="cuda")
    heads = 5
    gen = torch.Generator(device="cuda").manual_seed(4)
    tiles = QueryTiles(cu, 1000)
    acc = torch.randn(heads, tiles.num_slots, head_dim, device="cuda", generator=gen)
    running = torch.randn(1000, heads, head_dim, device="cuda", generator=gen).to(dtype)
    fresh = tiles.gather_dq(acc, cols, 0.125, dtype)
    summed = tiles.gather_dq(acc, cols, 0.125, dtype, into=running.clone())
    cpu_tiles = QueryTiles(cu.cpu(), 1000)
    ref = cpu_tiles.gather_dq(acc.cpu(), cols, 0.125, torch.float32)
    assert torch.equal(fresh.cpu(), ref.to(dtype))
    assert torch.equal(summed.cpu(), (running.cpu().float() + ref).to(dtype))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_statistics_kernel_matches_torch(dtype, head_dim):
    """The CuTe DSL preprocess (kernels/sm90/bwd_preprocess.py) against the torch path: varlen
    with an empty and a one-row sequence, a row that sees nothing, O a strided view."""
    cu = torch.tensor([0, 1, 1, 200, 1000], dtype=torch.int32, device="cuda")
    heads = 5
    gen = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(1000, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    wide = torch.randn(1000, heads + 2, head_dim, device="cuda", dtype=dtype, generator=gen)
    out = wide[:, 1:heads + 1]  # row stride (heads + 2) * D
    lse = torch.randn(heads, 1000, device="cuda", generator=gen)
    lse[2, 7] = -math.inf
    tiles = QueryTiles(cu, 1000)
    lse_log2, dpsum = tiles.row_statistics(dout, out, lse)
    cpu_tiles = QueryTiles(cu.cpu(), 1000)
    ref_lse, ref_dpsum = cpu_tiles.row_statistics(dout.cpu().float(), out.cpu().float(),
                                                  lse.cpu())
    assert torch.equal(lse_log2.cpu().isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    assert torch.allclose(lse_log2.cpu()[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)
    assert torch.allclose(dpsum.cpu(), ref_dpsum, rtol=1e-4, atol=1e-3)
    assert (dpsum.cpu() != 0).sum() > 0.9 * heads * 1000  # the test is not vacuous


def _gated_statistics_inputs(lengths, heads, device, seed=0):
    """(cu_seqlens, lse (H, T), gates (T, H, 3), row dots (H, T)) float32 with the edge cases
    of the gate fold: gates of 0 and NaN, rows that see nothing (lse = -inf)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    lse = torch.randn(heads, total, generator=gen) * 3
    lse[:, ::7] = -math.inf
    gates = torch.rand(total, heads, 3, generator=gen)
    gates[::5, :, 1] = 0.0
    gates[3::11, :, 1] = math.nan
    row_dots = torch.randn(heads, total, generator=gen)
    return tuple(t.to(device) for t in (cu, lse, gates, row_dots))


def test_row_statistics_fold_the_gate_into_lse():
    """`lse_gate`: the row statistics of (lse, gate) equal those of the torch-folded lse
    (`gate_folded_lse`): +inf where the gate is 0 or NaN or the row sees nothing, the row dots
    as dO.O, at each row's slot."""
    cu, lse, gates, row_dots = _gated_statistics_inputs([130, 1, 64, 200], heads=3, device="cpu")
    tiles = QueryTiles(cu, 395)
    dout = torch.empty(395, 3, 8)
    got = tiles.row_statistics(dout, None, lse, row_dots.t(), lse_gate=(gates, 1))
    expected = tiles.row_statistics(dout, None, gate_folded_lse(lse, gates[..., 1]),
                                    row_dots.t())
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    lse_log2 = got[0][:, tiles.slot]
    assert torch.isposinf(lse_log2[:, ::5]).all() and torch.isposinf(lse_log2[:, 3::11]).all()
    assert torch.isposinf(lse_log2[:, ::7]).all() and not torch.isnan(lse_log2).any()
    assert lse_log2.isfinite().sum() > 0.6 * lse_log2.numel()  # not vacuous


def test_backward_run_refuses_a_gate_without_row_dots():
    """`lse_gate` goes with `dout_dot_out` (the kernel folds the gate only there): alone it is
    refused by name, not ignored."""
    from kernels.sm90 import backward

    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lse_gate: only taken with dout_dot_out"):
        backward.run(q, q, q, q, q, torch.zeros(2, 8), lse_gate=(torch.rand(8, 2, 3), 0))


def test_query_tiles_are_kept_by_their_host_bounds():
    """With the host bounds, the tile layout is built once per packing (sparsity/host_cache.py)
    and equals a fresh build; another packing gets its own."""
    from sparsity import host_cache

    host_cache.clear()
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    first = query_tiles(cu, 300, (0, 100, 101, 300))
    assert query_tiles(cu, 300, (0, 100, 101, 300)) is first
    fresh = QueryTiles(cu, 300)
    for field in ("tile_offsets", "cu_seqlens", "slot", "slot32"):
        assert torch.equal(getattr(first, field), getattr(fresh, field))
    assert first.num_slots == fresh.num_slots
    other_cu = torch.tensor([0, 200, 300], dtype=torch.int32)
    other = query_tiles(other_cu, 300, (0, 200, 300))
    assert other is not first and torch.equal(other.slot, QueryTiles(other_cu, 300).slot)
    assert query_tiles(cu, 300) is not first  # no host bounds: built each call
    host_cache.clear()


@pytest.mark.gpu
@requires_sm90
def test_gate_fold_kernel_equals_the_torch_fold():
    """`GateFoldedStatistics` (one launch) against the torch fold on the CPU, varlen slots,
    gates of 0 and NaN and rows that see nothing: the same +inf marks, values to float32
    rounding of the log (libdevice logf against torch's), the row dots exact. The kernel
    writes every slot of outputs it does not fill first (their memory here was NaN before),
    and reads the row dots as nsa() passes them: a column of (T, H, 3) gate gradients."""
    lengths = [130, 1, 64, 2000]
    cu, lse, gates, row_dots = _gated_statistics_inputs(lengths, heads=4, device="cuda", seed=2)
    total = sum(lengths)
    tiles = QueryTiles(cu, total)
    dout = torch.empty(total, 4, 64, device="cuda", dtype=torch.bfloat16)
    d_gates = torch.randn(total, 4, 3, device="cuda")
    d_gates[..., 1] = row_dots.t()
    torch.cuda.synchronize()
    poison = [torch.full((1 << 18,), math.nan, device="cuda") for _ in range(16)]
    poison.clear()  # 1 MiB blocks of the small pool, freed: the (H, P) outputs land on them
    got_lse, got_dpsum = tiles.row_statistics(dout, None, lse, d_gates[..., 1],
                                              lse_gate=(gates, 1))
    cpu_tiles = QueryTiles(cu.cpu(), total)
    ref_lse, ref_dpsum = cpu_tiles.row_statistics(dout.cpu(), None, lse.cpu(), row_dots.t().cpu(),
                                                  lse_gate=(gates.cpu(), 1))
    got_lse, got_dpsum = got_lse.cpu(), got_dpsum.cpu()
    assert torch.equal(got_dpsum, ref_dpsum)
    assert torch.equal(got_lse.isposinf(), ref_lse.isposinf())
    assert not got_lse.isnan().any()
    finite = ref_lse.isfinite()
    assert finite.sum() > 0.5 * finite.numel()
    torch.testing.assert_close(got_lse[finite], ref_lse[finite], rtol=2e-7, atol=2e-6)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("kv_block", [64, 128])
def test_list_layout_kernels_equal_their_torch_ops(kv_block):
    """kernels/sm90/list_layout.py against the torch ops they replace, on NSA-like varlen lists
    with an empty and a one-token sequence: the transpose's sort keys bit for bit (and the CSR
    built from them equals the checked transpose), the split-list work units bit for bit where
    real, all zero (empty) after."""
    from kernels.interface import transpose_block_sparse_trusted
    from kernels.sm90 import list_layout
    from sparsity.csr import _column_offsets, _sort_keys, _tile_geometry

    lengths = [1000, 0, 1, 300, 2100]
    bs, cu = _nsa_like_lists(lengths, heads=2, kv_block=kv_block, seed=kv_block)
    bs, cu = bs.to("cuda"), cu.cuda()
    offsets, total = _column_offsets(bs, None, cu, None, True, "bs")
    geometry = _tile_geometry(bs, offsets)
    span = bs.num_rows
    unlisted = 2 * total * bs.num_heads * span
    # The call's own bound (int32 keys), and one past 2**31 (int64 keys, `sort_key_dtype`).
    for bound, dtype in ((unlisted, torch.int32), (unlisted + 2**31, torch.int64)):
        expected = _sort_keys(bs, geometry, span, bound, False, "bs")
        got = list_layout.transpose_keys(bs, geometry, span, bound)
        assert got.dtype == expected.dtype == dtype
        assert torch.equal(got, expected)
        assert (expected < bound).sum() > 0.2 * expected.numel()  # not vacuous
    host = tuple(cu.tolist())
    csr = transpose_block_sparse_trusted(bs, cu_seqlens_k=cu, host_cu_seqlens_k=host,
                                         host_cu_seqlens_q=host)
    assert csr.equals(transpose_block_sparse_csr(bs, cu_seqlens_k=cu))
    for chunk, head_major in ((1, False), (3, False), (16, False), (3, True), (16, True)):
        units = work_units(csr, chunk, head_major)
        reference = work_units_torch(csr, chunk, head_major)
        assert units.shape == reference.shape
        real = reference[:, 3] < reference[:, 4]
        assert real.sum() > 10
        assert torch.equal(units[real], reference[real])
        assert torch.equal(units[~real], torch.zeros_like(units[~real]))


@pytest.mark.gpu
@requires_sm90
def test_backward_adds_dk_dv_into_given_accumulators():
    """dkv_accumulators (nsa()'s float32 dk, dv sums): the returned dk, dv are those tensors,
    holding what they held plus this call's dk, dv. For NSA-like lists the kernel sums partials
    in float32 (partial_dkv) and adds them there itself; dense causal on few KV tiles too
    (split rows); a window call, one CTA per KV tile, adds its float32 dK, dV into them as it
    stores (add_dkv). Given as UnwrittenDkvSums (holding garbage: nothing yet), the returned
    dk, dv are this call's alone: stored (store_dkv_sums) or zeroed before the partials."""
    from kernels.dkv_sums import UnwrittenDkvSums
    from kernels import attention_forward
    from kernels.sm90 import backward

    lengths = [1500, 700]
    cu_cpu = torch.tensor([0, 1500, 2200], dtype=torch.int32)
    bs, _ = _nsa_like_lists(lengths, heads=2, kv_block=64, seed=3)
    bs = bs.to("cuda")
    cu = cu_cpu.cuda()
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v, dout = _random_bf16_problem(2200, gen)
    common = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500,
                  causal=True)
    for options, partial in ((dict(block_sparse=bs), True), (dict(), None),
                             (dict(window_size=(255, 0)), False)):
        options = dict(common, **options)
        spec = backward._spec_for(q, k, True, options.get("window_size", (-1, -1)),
                                  options.get("block_sparse"), 1, False)
        if partial is not None:
            assert spec.partial_dkv is partial
        out, lse = attention_forward(q, k, v, **options)
        _, dk_ref, dv_ref = backward.run(dout, q, k, v, out, lse, **options)
        starts = [torch.randn(x.shape, device="cuda", generator=gen) for x in (k, v)]
        sums = [t.clone() for t in starts]
        _, dk, dv = backward.run(dout, q, k, v, out, lse, dkv_accumulators=sums, **options)
        assert dk is sums[0] and dv is sums[1]
        for total, start, ref in ((dk, starts[0], dk_ref), (dv, starts[1], dv_ref)):
            added = total - start
            assert ref.abs().sum() > 0
            assert (added - ref.float()).norm() <= 1e-2 * ref.float().norm()
        unwritten = UnwrittenDkvSums(torch.full_like(t, float("nan")) for t in starts)
        _, dk, dv = backward.run(dout, q, k, v, out, lse, dkv_accumulators=unwritten,
                                 **options)
        assert dk is unwritten[0] and dv is unwritten[1]
        for total, ref in ((dk, dk_ref), (dv, dv_ref)):
            assert torch.isfinite(total).all()
            assert (total - ref.float()).norm() <= 1e-2 * ref.float().norm()


@pytest.mark.gpu
@requires_sm90
def test_backward_from_given_row_dots_equals_the_one_from_out():
    """kernels.sm90.backward.run with dout_dot_out (out not read) against the same call with
    out: the row dots come from torch instead of the preprocess kernel, so the gradients agree
    to float32 summation order, not bit for bit."""
    from kernels import attention_forward
    from kernels.sm90 import backward

    cu = torch.tensor([0, 300, 1000], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = _random_bf16_problem(1000, gen)
    options = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700,
                   causal=True)
    out, lse = attention_forward(q, k, v, **options)
    reference = backward.run(dout, q, k, v, out, lse, **options)
    row_dots = (dout.float() * out.float()).sum(-1)
    given = backward.run(dout, q, k, v, None, lse, dout_dot_out=row_dots, **options)
    for a, b in zip(given, reference):
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("layout", ["varlen", "padded", "strided"])
def test_dq_kernel_adds_into_a_given_dq(layout):
    """dq_accumulator (nsa()'s running dq): the dQ kernel adds the values the tensor holds as it
    writes (`DqSpec.accumulate`): the returned dq is that tensor, holding its old values plus
    this call's dq, rounded once. Every row, also rows that see no key (compressed keys) and
    rows of a short sequence; a tensor the kernel cannot write (odd strides) gets dq added
    after."""
    from kernels import attention_forward
    from kernels.sm90 import backward

    gen = torch.Generator(device="cuda").manual_seed(11)
    cases = []
    if layout == "varlen":
        cu = torch.tensor([0, 1500, 1530, 2200], dtype=torch.int32, device="cuda")
        q, k, v, dout = _random_bf16_problem(2200, gen)
        common = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
        bs, _ = _nsa_like_lists([1500, 30, 670], heads=2, kv_block=64, seed=4)
        cases = [dict(causal=True), dict(causal=True, window_size=(127, 0)),
                 dict(causal=True, block_sparse=bs.to("cuda"))]
        cases = [(q, k, v, dout, dict(common, **c)) for c in cases]
        # The compressed branch: keys are N/16 compressed tokens, the first 15 rows see none.
        k_cmp, v_cmp = k[:137], v[:137]
        cu_cmp = torch.tensor([0, 93, 94, 137], dtype=torch.int32, device="cuda")
        cases.append((q, k_cmp, v_cmp, dout, dict(cu_seqlens_q=cu, cu_seqlens_k=cu_cmp,
                                                  max_seqlen_q=1500, max_seqlen_k=93,
                                                  causal=True, compress_factor=16)))
    else:
        q, k, v, dout = (t.view(2, 700, *t.shape[1:]) for t in _random_bf16_problem(1400, gen))
        cases = [(q, k, v, dout, dict(causal=True))]
    for q, k, v, dout, options in cases:
        out, lse = attention_forward(q, k, v, **options)
        dq_ref, _, _ = backward.run(dout, q, k, v, out, lse, **options)
        start = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
        held = start.clone()
        if layout == "strided":  # every other head of a wider tensor: not writable in place
            wide = torch.zeros(*q.shape[:-2], 2 * q.shape[-2], q.shape[-1] + 8, device="cuda",
                               dtype=q.dtype)
            held = wide[..., ::2, 1:q.shape[-1] + 1]  # 2 bytes off 16-byte alignment
            held.copy_(start)
            assert backward._kernel_rows(held, (q.shape[0] * q.shape[1], *q.shape[2:])) is None
        dq, _, _ = backward.run(dout, q, k, v, out, lse, dq_accumulator=held, **options)
        assert dq is held
        exact = start.float() + dq_ref.float()
        assert dq_ref.abs().sum() > 0
        # One rounding of the float32 sum (the reference dq was rounded once more).
        assert (dq.float() - exact).norm() <= 1e-2 * exact.norm()
        bound = (start.float().abs() + dq_ref.float().abs()) * 2 ** -7 + 1e-3
        assert ((dq.float() - exact).abs() <= bound).all()
