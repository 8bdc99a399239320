"""Every sm90 forward variant the library dispatches compiles for sm_90a, without a GPU.

CuTe DSL compiles for a target architecture on any machine (CUTE_DSL_ARCH=sm_90a, set in
tests/conftest.py) from fake tensors with symbolic extents. This catches DSL errors in every
compile-time branch in CI; numerics and speed are checked on the GPU (test_sm90_forward.py).
"""
import pytest

pytest.importorskip("cutlass")

from kernels.sm90.compile import compile_forward_on_fake_tensors  # noqa: E402
from kernels.sm90.spec import FwdSpec  # noqa: E402

# (causal, window left, window right, block-sparse, compressed, tile_n): NSA's branches first.
MASK_VARIANTS = {
    "compressed-causal": (True, False, False, False, True, 128),
    "window-causal": (True, True, False, False, False, 128),
    "selected-sparse64": (True, False, False, True, False, 64),
    "causal": (True, False, False, False, False, 128),
    "sparse128": (False, False, False, True, False, 128),
    "dense": (False, False, False, False, False, 128),
    "window-both-sides-compressed": (False, True, True, False, True, 128),
}


def _spec(dtype, head_dim, variant):
    causal, left, right, sparse, compressed, tile_n = MASK_VARIANTS[variant]
    return FwdSpec(dtype=dtype, head_dim=head_dim, causal=causal, has_window_left=left,
                   has_window_right=right, block_sparse=sparse, compressed=compressed,
                   tile_n=tile_n)


@pytest.mark.parametrize("variant", list(MASK_VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_variant_compiles_for_sm90a(dtype, head_dim, variant):
    compiled = compile_forward_on_fake_tensors(_spec(dtype, head_dim, variant))
    assert callable(compiled)


def test_compile_cache_returns_the_same_kernel():
    spec = _spec("bfloat16", 128, "compressed-causal")
    assert compile_forward_on_fake_tensors(spec) is compile_forward_on_fake_tensors(spec)
