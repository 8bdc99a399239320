"""Every sm90 forward variant the library dispatches compiles for sm_90a, without a GPU.

CuTe DSL compiles for a target architecture on any machine (CUTE_DSL_ARCH=sm_90a, set in
tests/conftest.py) from fake tensors with symbolic extents. This catches DSL errors in every
compile-time branch in CI; numerics and speed are checked on the GPU (test_sm90_forward.py).
The specs come from the dispatcher's own `choose_spec`, so a new dispatch choice is compiled
here as soon as it exists.
"""
import dataclasses

import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest

from kernels.sm90.compile import compile_forward_on_fake_tensors
from kernels.sm90.spec import choose_spec

# Calls as NSA's branches and kernels.flash_attn_func make them: (causal, window_size,
# compress_factor, block-sparse column block size, list capacity, max_seqlen_k).
CALLS = {
    "compressed-causal": (True, (-1, -1), 64, None, None, 256),
    "window-causal": (True, (511, 0), 1, None, None, 16384),
    "selected-sparse64": (True, (-1, -1), 1, 64, 200, 16384),
    "selected-sparse64-short": (True, (-1, -1), 1, 64, 20, 16384),
    "causal": (True, (-1, -1), 1, None, None, 16384),
    "causal-short-sequences": (True, (-1, 0), 1, None, None, 512),
    "sparse128": (False, (-1, -1), 1, 128, 200, 16384),
    "dense": (False, (-1, -1), 1, None, None, None),
    "dense-short-sequences": (False, (-1, -1), 1, None, None, 4096),
    "window-both-sides-compressed": (False, (300, 100), 16, None, None, 1024),
}


def _spec(dtype, head_dim, call):
    causal, window, cf, sparse, capacity, max_seqlen_k = CALLS[call]
    return choose_spec(dtype=dtype, head_dim=head_dim, causal=causal, window_size=window,
                       compress_factor=cf, sparse_block_size=sparse,
                       sparse_list_capacity=capacity, max_seqlen_k=max_seqlen_k)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dispatched_variant_compiles_for_sm90a(dtype, head_dim, call):
    if head_dim > 128 and CALLS[call][3] == 128:
        # 128-key tiles of a 192/256 head dim take more shared memory than an SM has: the
        # dispatcher refuses them (and can_run sends such calls to the fallback).
        with pytest.raises(ValueError, match="fits shared memory"):
            _spec(dtype, head_dim, call)
        return
    spec = _spec(dtype, head_dim, call)
    assert spec.fits_in_smem()
    compiled = compile_forward_on_fake_tensors(spec)
    assert callable(compiled)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("call", ["compressed-causal", "causal", "selected-sparse64-short"])
def test_smem_footprint_matches_the_kernel(call, head_dim):
    """`FwdSpec.smem_bytes`, which the dispatcher checks against the SM's capacity, is the
    size of the kernel's shared storage as the DSL lays it out."""
    from kernels.sm90.compile import compile_kernel_on_fake_tensors
    from kernels.sm90.fwd_sm90 import FlashAttentionForwardSm90

    spec = _spec("bfloat16", head_dim, call)
    kernel = FlashAttentionForwardSm90(spec)
    compile_kernel_on_fake_tensors(kernel)
    assert kernel.shared_storage.size_in_bytes() == spec.smem_bytes


# Schedules that tools/tune_sm90_forward.py times against the dispatched one.
SCHEDULES = [
    dict(persistent=False, q_stages=1),
    dict(persistent=True, q_stages=1, heads_fastest=True),
    dict(pingpong=True, tile_m=128, tile_n=128),
    dict(pingpong=True, tile_m=192, tile_n=64, persistent=True, q_stages=2, store_warp=True),
    dict(tile_m=64, tile_n=64, persistent=False, pingpong=False),
    dict(persistent=True, q_stages=2, store_warp=True, defer_store=True),
    dict(persistent=False, q_stages=1, store_warp=True, defer_store=False),
    dict(persistent=True, q_stages=2, overlap_tiles=True, pingpong=True),
    dict(persistent=True, q_stages=2, pingpong=True, store_warp=True, tile_m=128, tile_n=128,
         narrow_first_tile=True),
    dict(persistent=False, q_stages=1, pingpong=False, store_warp=False, o_in_q=True,
         num_stages=3),
]


@pytest.mark.parametrize("schedule", SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("call", ["window-causal", "selected-sparse64"])
def test_schedule_variants_compile_for_sm90a(call, schedule):
    if (schedule.get("overlap_tiles") or schedule.get("narrow_first_tile")) \
            and call == "selected-sparse64":
        pytest.skip("overlap_tiles and narrow_first_tile walk a KV range, not block-sparse lists")
    spec = dataclasses.replace(_spec("bfloat16", 128, call), **schedule)
    assert callable(compile_forward_on_fake_tensors(spec))


@pytest.mark.parametrize("call", ["compressed-causal", "selected-sparse64"])
def test_traced_build_compiles_for_sm90a(call):
    """The diagnostic build (tools/trace_sm90_forward.py): every stamp names a known event."""
    spec = dataclasses.replace(_spec("bfloat16", 128, call), trace=True)
    assert callable(compile_forward_on_fake_tensors(spec))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("call", ["causal", "window-causal", "causal-short-sequences",
                                  "compressed-causal", "selected-sparse64", "sparse128"])
def test_masked_value_screen_compiles_for_sm90a(call, dtype):
    """The diagnostic build that reads masked tiles' V for non-finite values (issue 16's cost
    measurement, kernels/sm90/screen.py) compiles on each schedule it is timed on."""
    spec = dataclasses.replace(_spec(dtype, 128, call), screen_masked_v=True)
    assert callable(compile_forward_on_fake_tensors(spec))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("call", ["compressed-causal", "window-causal", "selected-sparse64",
                                  "selected-sparse64-short"])
def test_row_dot_build_compiles_for_nsa_branches(call, head_dim):
    """The forward that writes rowsum(dO * O) instead of O (nsa()'s backward recomputes each
    branch so, kernels.sm90.forward.run's row_dot_into), as run() derives it from the dispatch."""
    spec = _spec("bfloat16", head_dim, call).writing_row_dots()
    assert callable(compile_forward_on_fake_tensors(spec))


@pytest.mark.parametrize("call", ["causal", "window-causal", "compressed-causal"])
def test_row_dot_build_fits_where_its_dispatch_fits(call):
    """The row-dot build stages no output, so it needs no output buffer: it fits wherever the
    dispatched build does (head dim 256 dispatches O in the Q buffer, which it turns off)."""
    spec = _spec("bfloat16", 256, call)
    row_dots = spec.writing_row_dots()
    assert row_dots.fits_in_smem() and row_dots.smem_bytes <= spec.smem_bytes
    assert callable(compile_forward_on_fake_tensors(row_dots))


def test_dispatch_picks_persistent_tiles_for_short_kv_ranges():
    window = _spec("bfloat16", 128, "window-causal")
    assert window.persistent and (window.tile_m, window.tile_n) == (128, 128)
    assert window.store_warp and window.pingpong and window.heads_fastest
    compressed = _spec("bfloat16", 128, "compressed-causal")
    assert compressed.persistent and compressed.pingpong and compressed.store_warp
    assert compressed.narrow_first_tile and not window.narrow_first_tile
    assert not compressed.heads_fastest
    assert not _spec("bfloat16", 128, "causal").persistent
    long_window = choose_spec(dtype="bfloat16", head_dim=128, causal=True, window_size=(8191, 0))
    assert not long_window.persistent and long_window.tile_m == 128
    assert not _spec("bfloat16", 128, "selected-sparse64").persistent
    short_lists = _spec("bfloat16", 128, "selected-sparse64-short")
    assert short_lists.persistent and short_lists.store_warp and not short_lists.pingpong
    assert not short_lists.narrow_first_tile


def test_dispatch_picks_the_window_schedule_for_packed_short_sequences():
    for call in ("causal-short-sequences", "dense-short-sequences"):
        for head_dim in (64, 128, 192):
            spec = _spec("bfloat16", head_dim, call)
            assert spec.persistent and spec.pingpong and spec.store_warp and spec.heads_fastest
            assert spec.q_stages == (1 if head_dim > 128 else 2)
            assert not spec.narrow_first_tile and not spec.o_in_q
        # Head dim 256 measured slower persistent (one K/V stage): one tile per CTA.
        assert not _spec("bfloat16", 256, call).persistent

    def causal_spec(max_seqlen_k):
        return choose_spec(dtype="bfloat16", head_dim=128, causal=True, window_size=(-1, 0),
                           max_seqlen_k=max_seqlen_k)
    assert causal_spec(4096).persistent
    assert not causal_spec(4097).persistent and not causal_spec(None).persistent
    # A list window (flash-attn callers pass them) picks what the tuple does, and key lengths
    # on one side of the bound share one cached spec.
    assert choose_spec(dtype="bfloat16", head_dim=128, causal=True, window_size=[-1, 0],
                       max_seqlen_k=1000) is causal_spec(4096)
    # The compressed branch keeps its own schedule whatever its (short) key length.
    compressed = _spec("bfloat16", 128, "compressed-causal")
    assert compressed.narrow_first_tile and not compressed.heads_fastest


def test_dispatch_gives_head_dim_64_192_row_tiles_over_long_ranges():
    for call in ("causal", "dense"):
        spec = _spec("bfloat16", 64, call)
        assert (spec.tile_m, spec.tile_n) == (192, 128) and not spec.persistent
        assert spec.pingpong  # three warpgroups, round robin
    for call in ("causal-short-sequences", "window-causal", "compressed-causal",
                 "selected-sparse64"):
        assert _spec("bfloat16", 64, call).tile_m == 128
    assert _spec("bfloat16", 128, "causal").tile_m == 128


def test_dispatch_sizes_wide_heads_to_shared_memory():
    for head_dim in (192, 256):
        dense = _spec("bfloat16", head_dim, "causal")
        assert dense.tile_n == (80 if head_dim == 256 else 64)
        assert dense.o_in_q and not dense.persistent
        assert dense.num_stages == 2 and dense.q_stages == 1
        compressed = _spec("bfloat16", head_dim, "compressed-causal")
        assert compressed.persistent and not compressed.o_in_q and compressed.q_stages == 1
        assert compressed.num_stages == (1 if head_dim == 256 else 2)
    # Head dim 256 windows: one tile per CTA, whose output shares the Q buffer, keeps two K/V
    # stages (measured faster than the persistent schedule with one).
    window = _spec("bfloat16", 256, "window-causal")
    assert not window.persistent and window.o_in_q and window.num_stages == 2
    assert _spec("bfloat16", 192, "window-causal").persistent
    for head_dim in (64, 128, 192, 256):
        for call in CALLS:
            if head_dim <= 128 or CALLS[call][3] != 128:
                assert _spec("bfloat16", head_dim, call).fits_in_smem()


def test_compile_cache_returns_the_same_kernel():
    spec = _spec("bfloat16", 128, "compressed-causal")
    assert compile_forward_on_fake_tensors(spec) is compile_forward_on_fake_tensors(spec)


def test_launcher_built_arguments_compile_for_sm90a():
    """The fake tensors above must be no more specific than what the launcher passes: build
    the arguments exactly as kernels/sm90/forward.py does (`launch.as_cute` of torch tensors, here
    small CPU ones: compiling reads only their dtype and layout) and compile from them. A build
    that leaned on a static head-dim stride passed with fakes and failed on the device."""
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import make_fake_stream

    from kernels.sm90.forward import _typed_scalars
    from kernels.sm90.launch import as_cute
    from kernels.sm90.fwd_sm90 import FlashAttentionForwardSm90

    from kernels.sm90.compile import fake_arguments

    spec = _spec("bfloat16", 128, "compressed-causal")
    _, optional = fake_arguments(spec)  # this spec's optional tensors: all None
    assert optional == (None,) * len(optional)
    q = torch.randn(300, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(4, 2, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(4, 300)
    cu_q = torch.tensor([0, 300], dtype=torch.int32)
    cu_k = torch.tensor([0, 4], dtype=torch.int32)
    args = (*(as_cute(t) for t in (q, k, k.clone(), out, lse, cu_q, cu_k)),
            *_typed_scalars((300, 0.088, 64, 0, 0, 132)), *(None,) * len(optional),
            make_fake_stream())
    assert callable(cute.compile(FlashAttentionForwardSm90(spec), *args))


@pytest.mark.parametrize("dtype, dim, match", [
    ("float32", 128, "dtype torch.float32"), ("bfloat16", 96, "head dim 96")])
def test_direct_kernel_call_rejects_unsupported_input_before_compiling(dtype, dim, match):
    """kernels.sm90.forward.run (the tools' and tests' way in) refuses what the public entry
    points would send to the fallback, before building a spec or touching the device."""
    import torch

    from kernels.sm90.forward import run

    q = torch.randn(4, 2, dim).to(getattr(torch, dtype))
    with pytest.raises(ValueError, match=match):
        run(q, q, q, causal=True)


@pytest.mark.parametrize("call", ["compressed-causal", "window-causal"])
def test_query_positions_variant_compiles_for_sm90a(call):
    """`FwdSpec.q_positions` (q_start_positions: context parallelism's sequence mode) on the
    dense rules of NSA's branches: the persistent, narrowed-first-tile and windowed variants;
    the block-sparse walk reads the same per-tile range (GPU tests cover it)."""
    spec = dataclasses.replace(_spec("bfloat16", 128, call), q_positions=True)
    assert callable(compile_forward_on_fake_tensors(spec))


# A user mask and bias (kernels/sm90/score_mod.py) on the block-sparse lists of 128 x 128 tiles
# that kernels/masked.py builds (capacity 2 x Tk): long keys (one CTA per tile) and short ones
# (the persistent schedule), with and without a rule; each bias dtype the kernel reads.
SCORE_MOD_CALLS = {
    "long": (False, (-1, -1), 16384),
    "long-causal-window": (True, (300, 0), 16384),
    "short-causal": (True, (-1, -1), 1024),
}
SCORE_MODS = {"mask": (True, None), "bias-bf16": (False, "bfloat16"),
              "mask-bias-fp16": (True, "float16"), "mask-bias-fp32": (True, "float32")}


# Each call and each mod at least once (compiles cost ~9 s each on CI's cores); the cells'
# rows an even number of elements apart (read in key pairs) except for the last two, or 16
# bytes apart (`tma`: a 16-bit bias comes by TMA with K, one CTA per tile); a bias shared by
# query heads (heads side by side in the tile order) in both schedules.
@pytest.mark.parametrize("call, mods, pairs, shared, tma", [
    ("long", "mask", True, False, False),
    ("long", "bias-bf16", True, True, True),
    ("long-causal-window", "mask-bias-fp16", True, False, False),
    ("short-causal", "bias-bf16", True, True, True),
    ("short-causal", "mask-bias-fp32", False, True, False),
    ("short-causal", "mask", False, False, False)])
def test_score_mod_variants_compile_for_sm90a(call, mods, pairs, shared, tma):
    import torch

    from kernels.sm90.forward import ScoreModTensors

    causal, window, max_seqlen_k = SCORE_MOD_CALLS[call]
    with_mask, bias_dtype = SCORE_MODS[mods]
    blocks = -(-max_seqlen_k // 128)
    base = choose_spec(dtype="bfloat16", head_dim=128 if call != "short-causal" else 64,
                       causal=causal, window_size=window, sparse_block_size=128,
                       sparse_list_capacity=2 * blocks, max_seqlen_k=max_seqlen_k)
    cells = torch.zeros(1, 8, 8) if tma else torch.zeros(1, 2, 2) if pairs else torch.zeros(
        1, 3, 3)
    spec = ScoreModTensors(
        mask=cells.to(torch.uint8) if with_mask else None,
        bias=None if bias_dtype is None else cells.to(getattr(torch, bias_dtype)),
        slabs=torch.zeros(1, 1, 2, dtype=torch.int32), bias_shared=shared).spec(base)
    assert spec.score_mask == with_mask and spec.score_bias == (bias_dtype or "")
    assert spec.score_pairs == pairs
    assert spec.heads_fastest == shared  # kernels.sm90.forward.SHARED_BIAS_HEADS_TOGETHER
    assert spec.pingpong  # the warpgroups take turns (kernels.sm90.forward.PINGPONG)
    assert spec.score_bias_tma == tma  # kernels.sm90.forward.BIAS_TMA
    assert not tma or (spec.o_in_q and not spec.persistent)
    assert callable(compile_forward_on_fake_tensors(spec))
