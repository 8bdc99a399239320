"""flash_attn_func / flash_attn_varlen_func on the fallback: float64 gradcheck at tiny sizes,
agreement with attention_forward/backward, the lse output, and the deterministic mode."""
from __future__ import annotations

import pytest
import torch

from kernels import (attention_backward, attention_forward, flash_attn_func,
                     flash_attn_varlen_func)
from kernels.device import DISABLE_ENV
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


# --- deterministic: a backward mode, not a different function ------------------------------------

def _varlen_sparse_inputs(dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(4)
    seqlens = (5, 0, 11)
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device=device)
    block_sparse = random_block_sparse(generator, seqlens, seqlens, heads=2, q_tile=4,
                                       kv_block=2).to(device)
    q, k, v = (torch.randn(16, heads, 8, generator=generator).to(device, dtype).requires_grad_()
               for heads in (4, 2, 2))
    return q, k, v, cu, block_sparse


def _grads(function, inputs, dout):
    for x in inputs:
        x.grad = None
    function(*inputs).backward(dout)
    return [x.grad.clone() for x in inputs]


@pytest.mark.parametrize("layout", ["padded-dense", "varlen-sparse"])
def test_deterministic_gradients_equal_the_default_ones(layout):
    if layout == "padded-dense":
        generator = torch.Generator().manual_seed(5)
        inputs = [torch.randn(2, 9, heads, 8, generator=generator, requires_grad=True)
                  for heads in (4, 1, 1)]

        def attention(q, k, v, deterministic):
            return flash_attn_func(q, k, v, causal=True, window_size=(4, 0),
                                   deterministic=deterministic)
    else:
        *inputs, cu, block_sparse = _varlen_sparse_inputs()

        def attention(q, k, v, deterministic):
            return flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True,
                                          block_sparse=block_sparse, deterministic=deterministic)

    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6))
    default = _grads(lambda *x: attention(*x, False), inputs, dout)
    deterministic = _grads(lambda *x: attention(*x, True), inputs, dout)
    again = _grads(lambda *x: attention(*x, True), inputs, dout)
    for a, b, c in zip(default, deterministic, again):
        assert a.abs().sum() > 0
        assert torch.equal(a, b) and torch.equal(b, c)


def test_attention_backward_takes_deterministic():
    q, k, v, cu, block_sparse = (x.detach() if isinstance(x, torch.Tensor) else x
                                 for x in _varlen_sparse_inputs())
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, block_sparse=block_sparse)
    out, lse = attention_forward(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    default = attention_backward(dout, q, k, v, out, lse, **kwargs)
    deterministic = attention_backward(dout, q, k, v, out, lse, **kwargs, deterministic=True)
    for a, b in zip(default, deterministic):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value, error", [(1, TypeError), ("true", TypeError), (None, TypeError)])
def test_deterministic_must_be_a_bool_and_is_checked_before_the_forward(value, error,
                                                                        monkeypatch):
    q, k, v, cu, block_sparse = _varlen_sparse_inputs()
    ran = []
    monkeypatch.setattr("kernels.autograd.attention_forward", lambda *a, **kw: ran.append(1))
    with pytest.raises(error, match="^deterministic must be a bool"):
        flash_attn_func(q[None], k[None], v[None], deterministic=value)
    with pytest.raises(error, match="^deterministic must be a bool"):
        flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, deterministic=value)
    assert not ran
    out, lse = attention_forward(q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu,
                                 cu_seqlens_k=cu)
    with pytest.raises(error, match="^deterministic must be a bool"):
        attention_backward(out, q.detach(), k.detach(), v.detach(), out, lse, cu_seqlens_q=cu,
                           cu_seqlens_k=cu, deterministic=value)


@pytest.mark.gpu
def test_deterministic_sparse_fallback_is_bitwise_repeatable_on_cuda(monkeypatch):
    """On CUDA the sparse path's scatter of dK/dV is the one sum whose order is not fixed
    (index_add_ adds atomically); deterministic=True sorts it. Many tiles list the same blocks
    here, so atomic adds would collide."""
    monkeypatch.setenv(DISABLE_ENV, "1")  # the fallback, also on sm_90
    generator = torch.Generator().manual_seed(7)
    seqlens = (300, 257)
    cu = torch.tensor([0, 300, 557], dtype=torch.int32, device="cuda")
    block_sparse = random_block_sparse(generator, seqlens, seqlens, heads=1, q_tile=4,
                                       kv_block=8).to("cuda")
    q, k, v = (torch.randn(557, heads, 32, generator=generator).cuda() for heads in (8, 1, 1))
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, block_sparse=block_sparse)
    out, lse = attention_forward(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    runs = [attention_backward(dout, q, k, v, out, lse, **kwargs, deterministic=True)
            for _ in range(5)]
    default = attention_backward(dout, q, k, v, out, lse, **kwargs)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    for a, b in zip(runs[0], default):
        torch.testing.assert_close(a, b)


def test_varlen_host_bounds_give_the_same_result_without_reading_the_bounds(monkeypatch):
    """flash_attn_varlen_func(host_cu_seqlens=...) computes what the plain call computes,
    forward and backward, and its checks read no tensor value (cu_seqlens' tolist would be the
    device read); bad host bounds and block_sparse with them are refused by name."""
    generator = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, heads, 16, generator=generator, requires_grad=True)
               for heads in (4, 2, 2))
    plain = flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)
    plain_grads = torch.autograd.grad(plain.sum(), (q, k, v))

    def no_read(*_):
        raise AssertionError("cu_seqlens was read")
    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    hosted = flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True,
                                    host_cu_seqlens=[0, 5, 12, 20])
    hosted_grads = torch.autograd.grad(hosted.sum(), (q, k, v))
    monkeypatch.undo()
    assert torch.equal(plain, hosted)
    for a, b in zip(plain_grads, hosted_grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="must end at the number of rows"):
        flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, host_cu_seqlens=[0, 5, 12, 21])
    with pytest.raises(TypeError, match="host_cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, host_cu_seqlens="0, 5, 12, 20")
    with pytest.raises(ValueError, match="host_cu_seqlens: not taken with block_sparse"):
        flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, host_cu_seqlens=(0, 5, 12, 20),
                               block_sparse=object())
