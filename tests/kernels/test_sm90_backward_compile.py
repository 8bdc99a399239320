"""Every sm90 backward variant the library dispatches compiles for sm_90a, without a GPU.

The specs come from the dispatcher's `choose_backward_spec` for the calls NSA's branches and
kernels.flash_attn_func make (the forward's compile tests list them), in both dtypes, both head
dims and both modes (fast, deterministic); numerics run on the GPU (test_sm90_backward.py).
"""
import dataclasses
import itertools

import pytest
import torch

import cutlass  # noqa: F401  (a broken CuTe DSL install must fail here, not skip)

from kernels.sm90.backward import with_dkv_destination
from kernels.sm90.compile import (compile_backward_kernel_on_fake_tensors,
                                  compile_backward_on_fake_tensors, compile_dq_on_fake_tensors)
from kernels.sm90.spec import (FUSED_DQ_MIN_KEYS, BwdSpec, ListShape, choose_backward_spec,
                               dq_spec_for)
from test_sm90_compile import CALLS


# KV tiles x KV heads x sequences of a call: few (compressed keys at 16K: 2 x 8) picks split
# rows in the dispatcher, many keeps one CTA per KV tile.
GRID_SIZES = {"few-kv-tiles": 16, "many-kv-tiles": 1024}


def _backward_spec(dtype, head_dim, call, deterministic=False, grid="many-kv-tiles") -> BwdSpec:
    causal, window, cf, sparse, _, max_seqlen = CALLS[call]
    return choose_backward_spec(dtype=dtype, head_dim=head_dim, causal=causal,
                                window_size=window, compress_factor=cf,
                                sparse_block_size=sparse, deterministic=deterministic,
                                kv_tile_ctas=GRID_SIZES[grid],
                                max_seqlen_k=max_seqlen)


def _distinct_calls():
    """One (call, grid size) per distinct backward spec (several calls differ only in forward
    schedules; block-sparse and deterministic calls do not depend on the grid size)."""
    seen, calls = set(), []
    for call in CALLS:
        for grid in GRID_SIZES:
            spec = _backward_spec("bfloat16", 128, call, grid=grid)
            if spec not in seen:
                seen.add(spec)
                calls.append(f"{call}/{grid}")
    return calls


def _spec_of(dtype, head_dim, call_and_grid, deterministic=False) -> BwdSpec:
    call, grid = call_and_grid.split("/")
    return _backward_spec(dtype, head_dim, call, deterministic, grid)


@pytest.mark.parametrize("call", _distinct_calls())
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_variant_compiles_for_sm90a(dtype, head_dim, call):
    spec = _spec_of(dtype, head_dim, call)
    assert spec.fits_in_smem()
    # dK, dV into given float32 sums (nsa()'s dk, dv), into sums that hold nothing yet (stored,
    # where one CTA owns each KV tile) and as a direct call's outputs (the split-list units that
    # own their tile storing them: `owned_dkv_stores`)
    for into_caller_sums, unwritten in ((True, False), (True, True), (False, False)):
        launched = with_dkv_destination(spec, into_caller_sums, unwritten)
        assert launched.owned_dkv_stores == (spec.split_lists and not into_caller_sums)
        owns_tiles = into_caller_sums and not spec.partial_dkv
        assert launched.add_dkv == (owns_tiles and not unwritten)
        assert launched.store_dkv_sums == (owns_tiles and unwritten)
        assert callable(compile_backward_on_fake_tensors(launched))
    if spec.dq_separate:  # and the query-centric dQ kernel that runs beside it, both ways
        for accumulate in (False, True):  # (nsa() adds its branches' dq as the kernel writes)
            assert callable(compile_dq_on_fake_tensors(dq_spec_for(spec, accumulate)))


@pytest.mark.parametrize("call", [c for c in _distinct_calls() if c.endswith("many-kv-tiles")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_backward_variant_compiles_for_sm90a(head_dim, call):
    spec = _spec_of("bfloat16", head_dim, call, deterministic=True)
    assert spec.deterministic and not spec.partial_dkv
    assert callable(compile_backward_on_fake_tensors(spec))
    if spec.dq_separate:
        assert callable(compile_dq_on_fake_tensors(dq_spec_for(spec)))


@pytest.mark.parametrize("head_dim, cols", [(128, 64), (64, 32), (64, 64)])
def test_dq_kernel_taking_fused_sums_compiles_for_sm90a(head_dim, cols):
    """The dQ kernel that adds a fused-dQ accumulator of `cols`-column blocks into its dQ
    (`DqSpec.sums_block_cols`: nsa()'s selected branch taking the `DqSums`), on 64-key lists
    (the selected branch's), adding into a running dq and not."""
    from kernels.sm90.spec import DqSpec

    for accumulate in (False, True):
        spec = DqSpec("bfloat16", head_dim, causal=False, has_window_left=False,
                      has_window_right=False, block_sparse=True, accumulate=accumulate,
                      sums_block_cols=cols)
        assert callable(compile_dq_on_fake_tensors(spec))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_kernel_storing_fused_sums_compiles_for_sm90a(head_dim):
    """The dQ kernel that stores its dQ as the first values of the fused-dQ sums instead of
    writing dq (`DqSpec.stores_sums`: nsa()'s compressed branch opening the `DqSums`), in the
    layout of dense keys' fused dQ, on compressed causal keys (that branch's call); a spec
    that would also write or add dq is refused."""
    from kernels.sm90.spec import DqSpec, fused_dq_block_cols

    cols = fused_dq_block_cols(head_dim)
    assert cols == _backward_spec("bfloat16", head_dim, "window-causal").dq_cols_per_warpgroup
    spec = DqSpec("bfloat16", head_dim, causal=True, has_window_left=False,
                  has_window_right=False, block_sparse=False, compressed=True,
                  sums_block_cols=cols, stores_sums=True)
    assert callable(compile_dq_on_fake_tensors(spec))
    for refused in (dict(sums_block_cols=0), dict(accumulate=True), dict(reads_ds=True)):
        with pytest.raises(ValueError, match="stores_sums"):
            DqSpec("bfloat16", head_dim, causal=True, has_window_left=False,
                   has_window_right=False, block_sparse=False,
                   **dict(dict(sums_block_cols=cols, stores_sums=True), **refused))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ds_tile_variants_compile_for_sm90a(dtype, head_dim):
    """64-key lists with the dS tiles (kernels.sm90.backward.DS_TILES, chosen per call by
    memory): the KV-centric kernel storing them (split units into nsa()'s float32 sums, and
    the deterministic whole walk) and the dQ kernel reading them (kernels/sm90/bwd_dq_from_ds.py),
    adding into a running dq or not, taking fused sums or not; its shared storage is what
    `DqSpec.smem_bytes` says."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from kernels.sm90.bwd_dq_from_ds import DqFromDsSm90
    from kernels.sm90.compile import fake_dq_arguments

    for deterministic in (False, True):
        spec = dataclasses.replace(_spec_of(dtype, head_dim, "selected-sparse64/many-kv-tiles",
                                            deterministic), stores_ds=True)
        spec = with_dkv_destination(spec, into_caller_sums=not deterministic)
        assert spec.fits_in_smem() and spec.split_lists != deterministic
        assert callable(compile_backward_on_fake_tensors(spec))
    cols = 64 if head_dim == 128 else 32
    for accumulate, cols, ctas, heads in ((False, 0, 2, 1), (True, cols, 2, 1), (True, 0, 1, 1),
                                          (False, cols, 1, 2), (True, 0, 1, 2)):
        # Two 64-row CTAs per SM of one head, one 128-row CTA (DS_CTAS_PER_SM = 1), or two
        # heads of a list in one 128-row CTA (dispatched where they divide the list's heads).
        dq_spec = dataclasses.replace(dq_spec_for(spec, accumulate, sums_block_cols=cols),
                                      ctas_per_sm=ctas, tile_m=128 // ctas, heads_per_cta=heads)
        assert dq_spec.reads_ds and dq_spec.fits_in_smem()
        kernel = DqFromDsSm90(dq_spec)
        tensors, optional = fake_dq_arguments(dq_spec)
        cute.compile(kernel, *tensors, cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1),
                     cutlass.Int32(0), cutlass.Int32(0), *optional, make_fake_stream())
        assert kernel.shared_storage.size_in_bytes() == dq_spec.smem_bytes


def test_consumer_registers_take_only_what_the_producers_free():
    """`consumer_registers`, the one rule of the warp-specialized kernels: what the launch
    gives every thread, plus what the producer warpgroup frees down to its 24, shared by the
    consumers (setmaxnreg.inc asking for more waits for ever). The kernels' figures: 240 at
    one 384-thread CTA per SM, 232 at two 256-thread CTAs, 160 at 512 threads, and 112 for
    the dQ kernel's two heads a CTA (640 threads start at 96: b90a76e's hang asked for 120)."""
    from kernels.sm90.spec import REGISTERS_PER_SM, consumer_registers

    assert consumer_registers(384, 256, 1, 24) == 240
    assert consumer_registers(256, 128, 2, 24) == 232
    assert consumer_registers(512, 384, 1, 24) == 160
    assert consumer_registers(640, 512, 1, 24) == 112
    for warpgroups, ctas in itertools.product((1, 2, 3, 4), (1, 2)):
        threads, consumers = 128 * (1 + warpgroups), 128 * warpgroups
        regs = consumer_registers(threads, consumers, ctas, 24)
        launch = REGISTERS_PER_SM // ctas // threads // 8 * 8
        assert regs % 8 == 0 and regs <= 240
        assert regs * consumers + 24 * (threads - consumers) <= launch * threads
        assert regs == 240 or (regs + 8) * consumers + 24 * (threads - consumers) > \
            launch * threads  # every register the producers free is taken, to a multiple of 8


def test_query_positions_variant_compiles_for_sm90a():
    """`BwdSpec.q_positions` and the dQ kernel's (q_start_positions), on the window rule: the
    KV-centric walk's query-tile range and keys-as-rows mask, with the fused dQ (windows from
    FUSED_DQ_MIN_KEYS keys on) and beside the dQ kernel, and the dQ kernel's range."""
    spec = dataclasses.replace(_spec_of("bfloat16", 128, "window-causal/many-kv-tiles"),
                               q_positions=True)
    assert spec.fuses_dq
    assert callable(compile_backward_on_fake_tensors(spec))
    beside = dataclasses.replace(spec, dq_separate=True)
    assert callable(compile_backward_on_fake_tensors(beside))
    assert callable(compile_dq_on_fake_tensors(dq_spec_for(beside, accumulate=True)))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_dq_conversion_compiles_for_sm90a(dtype, head_dim, accumulate):
    """The fused backward's float32 dQ accumulator to dq (kernels/sm90/dq_convert.py), for the
    blocks of every fused variant the dispatcher picks."""
    from kernels.sm90.compile import compile_dq_convert_on_fake_tensors
    from kernels.sm90.dq_convert import DqConvertSpec

    spec = _backward_spec(dtype, head_dim, "causal")
    assert spec.fuses_dq
    assert callable(compile_dq_convert_on_fake_tensors(DqConvertSpec(
        dtype, head_dim, spec.dq_cols_per_warpgroup, accumulate)))


@pytest.mark.parametrize("call", ["selected-sparse64", "compressed-causal", "window-causal"])
def test_dq_kernel_smem_footprint_matches_the_kernel(call):
    """`DqSpec.smem_bytes` is the DSL's shared storage size."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from kernels.sm90.bwd_dq_sm90 import DqBackwardSm90
    from kernels.sm90.compile import fake_dq_arguments

    spec = dq_spec_for(dataclasses.replace(_spec_of("bfloat16", 128, call + "/many-kv-tiles"),
                                           dq_separate=True))
    kernel = DqBackwardSm90(spec)
    tensors, lists = fake_dq_arguments(spec)
    cute.compile(kernel, *tensors, cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1),
                 cutlass.Int32(0), cutlass.Int32(0), *lists, make_fake_stream())
    assert kernel.shared_storage.size_in_bytes() == spec.smem_bytes


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sparse_block", [64, 128, None])
def test_backward_smem_footprint_matches_the_kernel(sparse_block, head_dim):
    """`BwdSpec.smem_bytes` (what the dispatcher checks) is the DSL's shared storage size:
    64- and 128-key lists, and the fused dQ's staging (no lists), with 64- and 128-row
    steps."""
    from kernels.sm90.bwd_sm90 import FlashAttentionBackwardSm90

    spec = choose_backward_spec(dtype="bfloat16", head_dim=head_dim, causal=True,
                                window_size=(-1, -1), sparse_block_size=sparse_block)
    assert spec.fuses_dq == (sparse_block is None)
    kernel = FlashAttentionBackwardSm90(spec)
    compile_backward_kernel_on_fake_tensors(kernel)  # uncached: this object's storage
    assert kernel.shared_storage.size_in_bytes() == spec.smem_bytes


def test_backward_dispatch_takes_the_list_block_as_the_key_tile():
    assert _backward_spec("bfloat16", 128, "selected-sparse64").tile_n == 64
    assert _backward_spec("bfloat16", 128, "sparse128").tile_n == 128
    assert _backward_spec("bfloat16", 128, "causal").tile_n == 128
    assert _backward_spec("bfloat16", 128, "selected-sparse64").ctas_per_sm == 2
    with pytest.raises(ValueError, match="head_dim 256"):
        choose_backward_spec(dtype="bfloat16", head_dim=256, causal=True, window_size=(-1, -1))


def test_backward_dispatch_steps_128_rows_at_head_dim_64_with_128_key_tiles():
    """FA3/FA4's tile at head dim 64: 128 query rows per step, each consumer warpgroup's 64
    rows of the fused dQ one accumulator tile; 64-key tiles (one warpgroup) and head dim 128
    step 64 rows."""
    for call in _distinct_calls():
        for head_dim in (64, 128):
            spec = _spec_of("bfloat16", head_dim, call)
            wide = head_dim == 64 and spec.tile_n == 128
            assert spec.tile_m == (128 if wide else 64), (call, head_dim)
            assert spec.dq_rows_per_warpgroup == wide
            assert spec.dq_cols_per_warpgroup == 64 and spec.fits_in_smem()
    assert _backward_spec("bfloat16", 64, "selected-sparse64").tile_m == 64


def test_backward_dispatch_fuses_dq_only_for_dense_keys():
    """dQ fused into the KV-centric kernel with the writer warp (2026-11-24, H100: faster on
    dense causal from 4096-key sequences on; sliding windows since 2026-11-29, H200) where no
    compress factor or list applies, in the fast mode; every other call of these (packed short
    sequences too, NSA's lists per KV group), and the deterministic mode, keeps the
    query-centric dQ kernel (the KV-centric kernel then needs no dQ staging and keeps two CTAs
    per SM at 64-key tiles). Lists per query head: the test below."""
    for call in _distinct_calls():
        causal, window, cf, sparse, _, _ = CALLS[call.split("/")[0]]
        max_seqlen_k = CALLS[call.split("/")[0]][5]
        long_keys = max_seqlen_k is None or max_seqlen_k >= FUSED_DQ_MIN_KEYS
        plain = sparse is None and cf == 1 and long_keys
        for head_dim in (64, 128):
            for deterministic in (False, True):
                spec = _spec_of("bfloat16", head_dim, call, deterministic)
                fused = plain and not deterministic
                assert spec.dq_separate == (not fused), (call, head_dim, deterministic)
                assert spec.fuses_dq == fused and spec.q_stages == 2
                if fused:
                    assert spec.can_fuse_dq and spec.ds_stages == 2 and spec.fits_in_smem()
                else:
                    assert dq_spec_for(spec).list_block == (spec.tile_n if spec.block_sparse
                                                            else 64)
    selected = _backward_spec("bfloat16", 128, "selected-sparse64")
    assert selected.ctas_per_sm == 2 and selected.fits_in_smem()


@pytest.mark.parametrize("window_size", [(-1, 0), (511, 0), (-1, -1)])
def test_dense_keys_fuse_dq_only_while_the_accumulator_fits(window_size):
    """Dense keys (causal, a sliding window: nsa()'s window branch, full) fuse dQ while its
    float32 accumulator is within FUSED_DQ_MAX_ACCUMULATOR_BYTES or unknown (a compile-only
    caller); a larger one (nsa() at 1M tokens, H=32, D=128: 16 GiB) keeps the dQ kernel, which
    needs none."""
    from kernels.sm90.spec import FUSED_DQ_MAX_ACCUMULATOR_BYTES

    def spec_for(accumulator):
        return choose_backward_spec(dtype="bfloat16", head_dim=128, causal=window_size[1] == 0,
                                    window_size=window_size, max_seqlen_k=1 << 20,
                                    kv_tile_ctas=GRID_SIZES["many-kv-tiles"],
                                    dq_accumulator_bytes=accumulator)

    for fits in (None, 1 << 30, FUSED_DQ_MAX_ACCUMULATOR_BYTES):
        assert spec_for(fits).fuses_dq, fits
    past = spec_for(FUSED_DQ_MAX_ACCUMULATOR_BYTES + 1)
    assert past.dq_separate and not past.fuses_dq and past.fits_in_smem()
    assert spec_for(4 * (1 << 20) * 32 * 128).dq_separate  # nsa() at 1M tokens


def test_backward_issues_dv_before_ds_except_where_the_wgmmas_are_serialised():
    """Two 64-key CTAs per SM at head dim 128 leave 232 registers per consumer thread: ptxas
    serialises every wgmma there, and the early dV issue measured slower (H100, 2026-11-24);
    128-row steps keep dV after dS too; everywhere else dV goes to the tensor cores before dS
    is computed. The one-CTA-per-SM
    variant (a tuner switch) has the registers and takes the early issue; it compiles."""
    selected = _backward_spec("bfloat16", 128, "selected-sparse64")
    assert selected.ctas_per_sm == 2 and not selected.dv_before_ds
    assert _backward_spec("bfloat16", 64, "selected-sparse64").dv_before_ds
    assert _backward_spec("bfloat16", 128, "causal").dv_before_ds
    # 128-row steps (head dim 64): the early issue made ptxas serialise every wgmma (SASS).
    wide = _backward_spec("bfloat16", 64, "causal")
    assert wide.tile_m == 128 and not wide.dv_before_ds
    single = dataclasses.replace(selected, one_cta_per_sm=True)
    assert single.ctas_per_sm == 1 and single.dv_before_ds and single.fits_in_smem()
    assert callable(compile_backward_on_fake_tensors(single))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_alternate_steps_backward_variants_compile_for_sm90a(head_dim):
    """Two consumer warpgroups on alternate query steps of one 64-key tile
    (`BwdSpec.alternate_steps`; a tuner and GPU-test switch, dispatched only when
    `ALTERNATE_STEPS_AT_64_KEYS` is set): split lists, lists walking the whole group, adding
    dK/dV into given float32 sums, and the deterministic mode all compile, one CTA per SM."""
    from kernels.sm90.spec import ALTERNATE_STEPS_AT_64_KEYS

    base = _backward_spec("bfloat16", head_dim, "selected-sparse64")
    assert base.tile_n == 64 and base.alternate_steps == ALTERNATE_STEPS_AT_64_KEYS
    deterministic = _backward_spec("bfloat16", head_dim, "selected-sparse64", deterministic=True)
    variants = [dataclasses.replace(base, alternate_steps=True),
                dataclasses.replace(base, alternate_steps=True, split_lists=False),
                dataclasses.replace(base, alternate_steps=True, split_lists=False, add_dkv=True),
                dataclasses.replace(deterministic, alternate_steps=True)]
    for spec in variants:
        assert spec.ctas_per_sm == 1 and spec.num_consumer_warpgroups == 2
        assert spec.warpgroups_per_step == 1 and spec.key_warpgroups == 1
        assert not spec.can_fuse_dq and spec.fits_in_smem()
        assert callable(compile_backward_on_fake_tensors(spec))


def test_heavy_first_backward_variants_compile_for_sm90a(monkeypatch):
    """CTAs launched heaviest first (`BwdSpec.heavy_first`, KV heads folded into the grid's
    first extent): dispatched for causal compressed keys only (while
    `HEAVY_FIRST_COMPRESSED_CAUSAL` is set, as it is by default); with split rows, adding into
    float32 sums and the deterministic mode it compiles."""
    from kernels.sm90 import spec as sm90_spec

    assert sm90_spec.HEAVY_FIRST_COMPRESSED_CAUSAL
    monkeypatch.setattr(sm90_spec, "HEAVY_FIRST_COMPRESSED_CAUSAL", False)
    assert not _backward_spec("bfloat16", 128, "compressed-causal").heavy_first
    monkeypatch.setattr(sm90_spec, "HEAVY_FIRST_COMPRESSED_CAUSAL", True)
    for call in _distinct_calls():
        causal, _, cf, sparse, _, _ = CALLS[call.split("/")[0]]
        spec = _spec_of("bfloat16", 128, call)
        assert spec.heavy_first == (causal and cf != 1 and sparse is None), call
    variants = [_backward_spec("bfloat16", 128, "compressed-causal", grid="few-kv-tiles"),
                _backward_spec("bfloat16", 64, "compressed-causal"),
                _backward_spec("bfloat16", 128, "compressed-causal", deterministic=True)]
    variants.append(dataclasses.replace(variants[1], add_dkv=True))
    assert variants[0].split_rows
    for spec in variants:
        assert spec.heavy_first
        assert callable(compile_backward_on_fake_tensors(spec))


def test_backward_dispatch_splits_rows_only_for_grids_smaller_than_the_gpu():
    assert _backward_spec("bfloat16", 128, "compressed-causal", grid="few-kv-tiles").split_rows
    assert not _backward_spec("bfloat16", 128, "compressed-causal").split_rows
    assert not _backward_spec("bfloat16", 128, "compressed-causal", deterministic=True,
                              grid="few-kv-tiles").split_rows
    assert not _backward_spec("bfloat16", 128, "sparse128", grid="few-kv-tiles").split_rows


def test_balanced_kv_tiles_counts_tiles_as_heavy_as_the_heaviest():
    """Sequences alike count their KV tiles (the CTA count split rows compared before); one
    long sequence among short ones counts about one tile, which `_row_splits` then splits;
    a sliding window caps a tile's query steps; empty sequences count nothing."""
    from kernels.sm90.backward import _row_splits, balanced_kv_tiles

    def bounds(lengths):
        return tuple(itertools.accumulate(lengths, initial=0))

    alike = bounds([8192] * 8)
    assert balanced_kv_tiles(alike, bounds([128] * 8)) == 8
    assert balanced_kv_tiles(alike, bounds([256] * 8)) == 16
    unequal = [8031] + [300] * 24
    count = balanced_kv_tiles(bounds(unequal), bounds([n // 64 for n in unequal]))
    assert count == 2  # 126 + 24 x 5 query steps over 126
    assert _row_splits(count * 8, 126, torch.device("cpu")) > 1
    windowed = balanced_kv_tiles(bounds(unequal), bounds(unequal), 511)
    assert windowed == -(-(11 * 63 + 24 * 5 * 3) // 11)  # steps capped at ceil(639 / 64) + 1
    assert balanced_kv_tiles(bounds([0, 0]), bounds([0, 0])) == 0
    assert balanced_kv_tiles(bounds([64, 0]), bounds([1, 0])) == 1


PER_HEAD_LISTS = ListShape(spans_kv_groups=False, per_query_head=True, width=64)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_64_key_lists_per_query_head_walk_the_group_unsplit_and_compile(head_dim):
    """64-key lists per query head inside a KV group are not split into work units (a unit
    would walk one head and add float32 partials per head: 1.9x slower on the H100,
    2026-11-24)."""
    spec = choose_backward_spec(dtype="bfloat16", head_dim=head_dim, causal=False,
                                window_size=(-1, -1), sparse_block_size=64,
                                lists=PER_HEAD_LISTS)
    assert not spec.split_lists and not spec.partial_dkv and not spec.deterministic
    assert spec.dq_separate
    assert callable(compile_backward_on_fake_tensors(spec))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_wide_128_key_lists_per_query_head_take_the_fused_dq(head_dim):
    """128-key lists per query head at least FUSED_DQ_MIN_LIST_WIDTH wide run as work units
    with the fused dQ (the units head by head, `kernels.sm90.backward.work_units`), MHA lists
    (per query head and per KV head) too; narrower lists walk the group unsplit with the dQ
    kernel, and so do deterministic calls and calls with a window or compressed keys; lists per
    KV group keep split units with the dQ kernel (2026-11-27, H100: the fused path lost
    there), as do compile-only calls (no lists given: NSA's)."""
    from kernels.sm90.spec import FUSED_DQ_MIN_LIST_WIDTH

    def spec_for(lists, **kwargs):
        kwargs = dict(dict(causal=False, window_size=(-1, -1)), **kwargs)
        return choose_backward_spec(dtype="bfloat16", head_dim=head_dim, sparse_block_size=128,
                                    lists=lists, **kwargs)

    width = FUSED_DQ_MIN_LIST_WIDTH[head_dim]
    wide = ListShape(spans_kv_groups=False, per_query_head=True, width=width)
    spec = spec_for(wide)
    assert spec.split_lists and spec.fuses_dq and spec.partial_dkv
    assert callable(compile_backward_on_fake_tensors(spec))
    assert spec_for(wide, causal=True) == dataclasses.replace(spec, causal=True)
    assert spec_for(dataclasses.replace(wide, spans_kv_groups=True)) == spec  # MHA
    narrow = spec_for(dataclasses.replace(wide, width=width - 1))
    assert narrow.dq_separate and not narrow.split_lists
    for other in (dict(deterministic=True), dict(compress_factor=64, causal=True),
                  dict(window_size=(256, 0), causal=True)):
        assert spec_for(wide, **other).dq_separate, other
    assert not spec_for(wide, deterministic=True).split_lists
    per_group = ListShape(spans_kv_groups=True, per_query_head=False, width=4 * width)
    for lists in (per_group, None):
        assert spec_for(lists).split_lists and spec_for(lists).dq_separate


@pytest.mark.parametrize("call", ["compressed-causal", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_band_backward_variants_compile_for_sm90a(head_dim, call, monkeypatch):
    """Split rows by bands launched band by band (`BwdSpec.row_bands`, behind
    ROW_BANDS_FOR_SPLIT_ROWS): with the dQ kernel (compressed keys) and the fused dQ (dense
    causal), as the switch dispatches them where split rows are."""
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "ROW_BANDS_FOR_SPLIT_ROWS", True)
    spec = _spec_of("bfloat16", head_dim, f"{call}/few-kv-tiles")
    assert spec.row_bands and spec.split_rows and not spec.heavy_first
    assert spec.fuses_dq == (call == "causal")
    assert callable(compile_backward_on_fake_tensors(spec))
    assert not _spec_of("bfloat16", head_dim, f"{call}/many-kv-tiles").row_bands


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compressed_fused_row_band_variant_compiles_for_sm90a(dtype, head_dim):
    """Long compressed causal keys take split rows by bands with the fused dQ while its float32
    accumulator stays within FUSED_DQ_MAX_ACCUMULATOR_BYTES; shorter keys, a larger
    accumulator, an unknown one, a window or the deterministic mode keep the dQ kernel."""
    from kernels.sm90.spec import FUSED_DQ_MAX_ACCUMULATOR_BYTES, ROW_BANDS_FUSED_MIN_KEYS

    def spec_for(keys=ROW_BANDS_FUSED_MIN_KEYS, accumulator=1 << 30, **options):
        call = dict(dtype=dtype, head_dim=head_dim, causal=True, window_size=(-1, -1),
                    compress_factor=64, kv_tile_ctas=GRID_SIZES["many-kv-tiles"],
                    max_seqlen_k=keys, dq_accumulator_bytes=accumulator) | options
        return choose_backward_spec(**call)

    spec = spec_for()
    assert spec.row_bands and spec.split_rows and spec.fuses_dq and not spec.heavy_first
    assert spec.partial_dkv and spec.fits_in_smem()  # nsa()'s float32 dk, dv take its partials
    assert callable(compile_backward_on_fake_tensors(spec))
    for other in (dict(keys=ROW_BANDS_FUSED_MIN_KEYS - 1),
                  dict(accumulator=FUSED_DQ_MAX_ACCUMULATOR_BYTES + 1),
                  dict(accumulator=None), dict(window_size=(1023, 0)),
                  dict(deterministic=True), dict(causal=False)):
        other_spec = spec_for(**other)
        assert other_spec.dq_separate and not other_spec.row_bands, other


@pytest.mark.parametrize("grid", list(GRID_SIZES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compressed_dq_store_variant_compiles_for_sm90a(head_dim, grid):
    """Compressed causal keys of at most one KV tile a sequence (nsa()'s compressed branch on
    documents up to 8K tokens) may store their fused dQ as the first values of the shared sums
    (`dq_store_opens_sums`, `BwdSpec.dq_stores`): every query tile meets that one tile. Not
    where a sequence has no key or more than a tile of them, a compress factor beyond the
    step, a window, lists, query positions, the deterministic mode, or no host bounds."""
    from kernels.sm90.backward import dq_store_opens_sums

    def spec_for(**options):
        call = dict(dtype="bfloat16", head_dim=head_dim, causal=True, window_size=(-1, -1),
                    compress_factor=64, kv_tile_ctas=GRID_SIZES[grid], max_seqlen_k=128)
        return choose_backward_spec(**(call | options))

    spec = spec_for()
    assert spec.dq_separate and spec.split_rows == (grid == "few-kv-tiles")
    rows, keys = (0, 8192, 8192, 8256, 9000), (0, 128, 128, 129, 139)  # a sequence of no rows
    assert dq_store_opens_sums(spec, rows, keys, 64, False)
    assert not dq_store_opens_sums(spec, rows, (0, 129, 129, 130, 140), 64, False)  # 129 keys
    assert not dq_store_opens_sums(spec, rows, (0, 128, 128, 128, 138), 64, False)  # 64 rows, 0
    assert not dq_store_opens_sums(spec, rows, keys, spec.tile_m + 1, False)
    assert not dq_store_opens_sums(spec, rows, keys, 64, True)
    assert not dq_store_opens_sums(spec, None, keys, 64, False)
    assert not dq_store_opens_sums(spec, rows, None, 64, False)
    for other in (dict(window_size=(1023, 0)), dict(deterministic=True), dict(causal=False),
                  dict(sparse_block_size=64)):
        assert not dq_store_opens_sums(spec_for(**other), rows, keys, 64, False), other
    stored = dataclasses.replace(spec, dq_separate=False, dq_stores=True, heavy_first=False)
    assert stored.fuses_dq and stored.fits_in_smem()
    assert callable(compile_backward_on_fake_tensors(stored))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_row_statistics_kernel_compiles_for_sm90a(dtype, head_dim):
    from kernels.sm90.bwd_preprocess import PreprocessSpec
    from kernels.sm90.compile import compile_preprocess_on_fake_tensors

    assert callable(compile_preprocess_on_fake_tensors(PreprocessSpec(dtype, head_dim)))


def test_gate_folded_row_statistics_compile_for_sm90a():
    """The row statistics that fold nsa()'s gate into lse (`GateFoldedStatistics`)."""
    from kernels.sm90.bwd_preprocess import GateFoldSpec
    from kernels.sm90.compile import compile_gate_fold_on_fake_tensors

    assert callable(compile_gate_fold_on_fake_tensors(GateFoldSpec()))


@pytest.mark.parametrize("kernel, key_bits", [("transpose_keys", 32), ("transpose_keys", 64),
                                              ("work_units", 64)])
def test_list_layout_kernels_compile_for_sm90a(kernel, key_bits):
    """The backward's list layout kernels (kernels/sm90/list_layout.py), the transpose's keys
    in both widths."""
    from kernels.sm90.list_layout import compile_on_fake_tensors

    assert callable(compile_on_fake_tensors(kernel, key_bits))


# A user mask and bias on the 128 x 128 lists of kernels/masked.py (lists per KV group, split
# into units, and per query head): the fused-dQ spec `score_mod_spec` makes, each bias dtype.
# The 16-bit bias's tiles staged in smem where its rows start 16 bytes apart (`staged`); dbias
# summed into float32 sums of every cell or of the visited tiles alone (`tiles`) or, a slab
# per batch entry and query head, stored (`stores`).
@pytest.mark.parametrize("head_dim, list_heads, mask, bias, grad, staged, stores, tiles", [
    (128, "kv", True, "bfloat16", True, True, False, False),
    (128, "kv", True, "bfloat16", True, True, False, True),
    (64, "kv", False, "float16", True, False, False, True),
    (128, "kv", True, "bfloat16", True, False, True, False),
    (64, "query", False, "float32", True, False, True, False),
    (128, "query", False, "float16", False, True, False, False),
    (128, "query", True, "", False, False, False, False)])
def test_score_mod_backward_variants_compile_for_sm90a(head_dim, list_heads, mask, bias, grad,
                                                       staged, stores, tiles):
    import torch

    from kernels.sm90.backward import score_mod_spec
    from kernels.sm90.forward import ScoreModTensors

    lists = ListShape(spans_kv_groups=list_heads == "kv", per_query_head=list_heads == "query",
                      width=256)
    base = choose_backward_spec(dtype="bfloat16", head_dim=head_dim, causal=False,
                                window_size=(-1, -1), sparse_block_size=128,
                                max_seqlen_k=16384, lists=lists)
    cells = torch.zeros(1, 8, 8) if staged else torch.zeros(1, 3, 3)
    mods = ScoreModTensors(mask=cells.to(torch.uint8) if mask else None,
                           bias=cells.to(getattr(torch, bias)) if bias else None,
                           slabs=torch.zeros(1, 1, 2, dtype=torch.int32))
    spec = score_mod_spec(base, mods, grad, stores, tiles)
    assert spec is not None and spec.fuses_dq and spec.score_bias_grad == grad
    assert spec.score_dbias_stores == stores and spec.score_dbias_tiles == tiles
    assert spec.score_stage_bias == staged
    compile_backward_on_fake_tensors(with_dkv_destination(spec, into_caller_sums=False))


def test_score_mod_backward_of_a_column_chunk_compiles_for_sm90a():
    """A chunk of keys of a shared bias's backward under a rule (kernels/masked.py
    `_backward_by_columns`): causal rows placed by `q_positions`, dK/dV stored by the units
    that own their KV tile."""
    import torch

    from kernels.sm90.backward import score_mod_spec
    from kernels.sm90.forward import ScoreModTensors

    lists = ListShape(spans_kv_groups=True, per_query_head=True, width=256)
    base = choose_backward_spec(dtype="bfloat16", head_dim=128, causal=True,
                                window_size=(-1, -1), sparse_block_size=128,
                                max_seqlen_k=16384, lists=lists)
    cells = torch.zeros(1, 8, 8)
    mods = ScoreModTensors(mask=None, bias=cells.to(torch.bfloat16),
                           slabs=torch.zeros(1, 1, 2, dtype=torch.int32), bias_shared=True)
    spec = dataclasses.replace(score_mod_spec(base, mods, True), q_positions=True)
    launched = with_dkv_destination(spec, into_caller_sums=False)
    assert launched.owned_dkv_stores and launched.split_lists and launched.score_bias_grad
    compile_backward_on_fake_tensors(launched)
