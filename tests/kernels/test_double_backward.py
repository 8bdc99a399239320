"""flash_attn_func / flash_attn_varlen_func refuse second-order gradients clearly.

The attention backward runs without an autograd graph (a kernel, or the fallback's chunked
math treating out and lse as constants), so a gradient of its gradients would be silently wrong
or fail obscurely ("appears to not have been used in the graph", as with plain
once_differentiable). First-order gradients with create_graph=True still work; only
differentiating them again raises, and the message says double backward is not supported.
"""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_func, flash_attn_varlen_func

DOUBLE_BACKWARD = "double backward"


def _inputs(shape_q, shape_kv, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()
                 for shape in (shape_q, shape_kv, shape_kv))


def _calls():
    def padded():
        q, k, v = _inputs((1, 9, 4, 8), (1, 9, 2, 8))
        return (q, k, v), flash_attn_func(q, k, v, causal=True)

    def varlen():
        q, k, v = _inputs((11, 4, 8), (11, 2, 8))
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        return (q, k, v), flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True,
                                                 window_size=(3, 0))
    return {"padded": padded, "varlen": varlen}


@pytest.mark.parametrize("call", ["padded", "varlen"])
def test_second_order_gradient_is_refused(call):
    (q, k, v), out = _calls()[call]()
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(dq.sum(), k)
    # Also when the second gradient is taken with respect to q itself.
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        dq.square().sum().backward()


@pytest.mark.parametrize("call", ["padded", "varlen"])
def test_first_order_gradients_with_create_graph_are_unchanged(call):
    (q, k, v), out = _calls()[call]()
    loss = out.square().sum()
    expected = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
    actual = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    for a, e in zip(actual, expected):
        assert torch.equal(a.detach(), e)
