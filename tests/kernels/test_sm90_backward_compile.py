"""Every sm90 backward variant the library dispatches compiles for sm_90a, without a GPU.

The specs come from the dispatcher's `choose_backward_spec` for the calls NSA's branches and
kernels.flash_attn_func make (the forward's compile tests list them), in both dtypes, both head
dims and both modes (fast, deterministic); numerics run on the GPU (test_sm90_backward.py).
"""
import pytest

import cutlass  # noqa: F401  (a broken CuTe DSL install must fail here, not skip)

from kernels.sm90.compile import (compile_backward_kernel_on_fake_tensors,
                                  compile_backward_on_fake_tensors)
from kernels.sm90.spec import BwdSpec, choose_backward_spec
from test_sm90_compile import CALLS


def _backward_spec(dtype, head_dim, call, deterministic=False) -> BwdSpec:
    causal, window, cf, sparse, _, _ = CALLS[call]
    return choose_backward_spec(dtype=dtype, head_dim=head_dim, causal=causal,
                                window_size=window, compress_factor=cf,
                                sparse_block_size=sparse, deterministic=deterministic)


def _distinct_calls():
    """One call per distinct backward spec (several calls differ only in forward schedules)."""
    seen, calls = set(), []
    for call in CALLS:
        spec = _backward_spec("bfloat16", 128, call)
        if spec not in seen:
            seen.add(spec)
            calls.append(call)
    return calls


@pytest.mark.parametrize("call", _distinct_calls())
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_variant_compiles_for_sm90a(dtype, head_dim, call):
    spec = _backward_spec(dtype, head_dim, call)
    assert spec.fits_in_smem()
    assert callable(compile_backward_on_fake_tensors(spec))


@pytest.mark.parametrize("call", _distinct_calls())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_backward_variant_compiles_for_sm90a(head_dim, call):
    spec = _backward_spec("bfloat16", head_dim, call, deterministic=True)
    assert spec.deterministic
    assert callable(compile_backward_on_fake_tensors(spec))


@pytest.mark.parametrize("tile_n", [64, 128])
def test_backward_smem_footprint_matches_the_kernel(tile_n):
    """`BwdSpec.smem_bytes` (what the dispatcher checks) is the DSL's shared storage size."""
    from kernels.sm90.bwd_sm90 import FlashAttentionBackwardSm90

    spec = choose_backward_spec(dtype="bfloat16", head_dim=128, causal=True,
                                window_size=(-1, -1), sparse_block_size=tile_n)
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


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_tma_reduce_dq_variant_compiles_for_sm90a(head_dim, deterministic):
    """`dq_tma_reduce` (not dispatched yet: it waits for a GPU run, FINDINGS session 10)."""
    import dataclasses

    spec = dataclasses.replace(
        _backward_spec("bfloat16", head_dim, "causal", deterministic=deterministic),
        dq_tma_reduce=True)
    assert spec.fits_in_smem()
    assert callable(compile_backward_on_fake_tensors(spec))


@pytest.mark.parametrize("call", ["compressed-causal", "window-causal", "dense"])
def test_backward_split_rows_variant_compiles_for_sm90a(call):
    """`split_rows` (not dispatched yet: it waits for a GPU run, FINDINGS session 10)."""
    import dataclasses

    spec = dataclasses.replace(_backward_spec("bfloat16", 128, call), split_rows=True)
    assert spec.partial_dkv
    assert callable(compile_backward_on_fake_tensors(spec))
