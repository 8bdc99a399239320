"""flash_attn_func / flash_attn_varlen_func on the fallback: float64 gradcheck at tiny sizes,
agreement with attention_forward/backward, and the lse output."""
from __future__ import annotations

import pytest
import torch

from kernels import attention_backward, attention_forward, flash_attn_func, flash_attn_varlen_func
from reference_attention import one_thread, random_block_sparse  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("options", [
    dict(),
    dict(causal=True, compress_factor=2, window_size=(3, -1)),
    dict(window_size=(1, 2), softmax_scale=0.7),
], ids=["dense", "causal-cf2-window", "two-sided-window"])
def test_gradcheck_padded(options):
    generator = torch.Generator().manual_seed(0)
    cf = options.get("compress_factor", 1)
    q = _randn(generator, 2, 7, 4, 3)
    k = _randn(generator, 2, 7 // cf, 2, 3)
    v = _randn(generator, 2, 7 // cf, 2, 3)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, **options),
                                    (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gradcheck_varlen_block_sparse(causal):
    generator = torch.Generator().manual_seed(1)
    seqlens = (3, 0, 6)
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    block_sparse = random_block_sparse(generator, seqlens, seqlens, heads=2, q_tile=2, kv_block=2)
    assert int(block_sparse.full_count.sum()) > 0 and int(block_sparse.mask_count.sum()) > 0
    q, k, v = _randn(generator, 9, 4, 3), _randn(generator, 9, 2, 3), _randn(generator, 9, 2, 3)

    def attention(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=causal,
                                      block_sparse=block_sparse)

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_autograd_matches_the_explicit_entry_points():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 11, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, 11, 1, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, 11, 1, 8, generator=generator, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dout = torch.randn(out.shape, generator=generator)
    out.backward(dout)

    expected_out, expected_lse = attention_forward(q.detach(), k.detach(), v.detach(), causal=True)
    expected = attention_backward(dout, q.detach(), k.detach(), v.detach(), expected_out,
                                  expected_lse, causal=True)
    assert torch.equal(out.detach(), expected_out) and torch.equal(lse, expected_lse)
    for leaf, grad in zip((q, k, v), expected):
        assert torch.equal(leaf.grad, grad)
    assert lse.shape == (2, 4, 11) and not lse.requires_grad


def test_varlen_lse_layout_and_noncontiguous_dout():
    generator = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = torch.randn(12, 2, 8, generator=generator, requires_grad=True)
    k = torch.randn(12, 2, 8, generator=generator, requires_grad=True)
    v = torch.randn(12, 2, 8, generator=generator, requires_grad=True)
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, return_lse=True)
    assert lse.shape == (2, 12) and lse.dtype == torch.float32

    weight = torch.randn(8, generator=generator)
    # Broadcasting makes autograd hand back a dout whose last dim has stride 0.
    (out * weight.expand_as(out)).sum().backward()
    q_grad = q.grad.clone()
    q.grad = None
    out2 = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    out2.backward(weight.expand_as(out2).contiguous())
    assert torch.equal(q.grad, q_grad)
