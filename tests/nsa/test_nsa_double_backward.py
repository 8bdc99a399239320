"""nsa() refuses second-order gradients clearly, with and without gate weights.

Its backward runs the attention backward without an autograd graph, so before this check a
gradient of its gradients was silently wrong (with W_gate only the gate and compression terms
reached the second order: -40.5 where finite differences give -467.9) or failed with "element 0
of tensors does not require grad". First-order gradients with create_graph=True are unchanged.
"""
from __future__ import annotations

import pytest
import torch

from nsa import nsa
from nsa_testing import SMALL, TENSOR_INPUTS, differentiable, random_inputs

DOUBLE_BACKWARD = "double backward"


def _call(weights: bool, padded: bool = False):
    inputs = random_inputs([24, 24] if padded else [40, 23], 4, 2, 8, seed=3, weights=weights)
    if padded:
        del inputs["cu_seqlens"]
        for name in "qkv":
            inputs[name] = inputs[name].view(2, 24, *inputs[name].shape[1:])
    inputs = differentiable(inputs, torch.float64)
    return inputs, nsa(**inputs, **SMALL)


@pytest.mark.parametrize("weights", [True, False], ids=["W_gate", "no-weights"])
@pytest.mark.parametrize("padded", [False, True], ids=["varlen", "padded"])
def test_second_order_gradient_is_refused(weights, padded):
    inputs, out = _call(weights, padded)
    (dq,) = torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(dq.sum(), inputs["k"])


@pytest.mark.parametrize("weights", [True, False], ids=["W_gate", "no-weights"])
def test_first_order_gradients_with_create_graph_are_unchanged(weights):
    inputs, out = _call(weights)
    sources = [inputs[n] for n in TENSOR_INPUTS if inputs.get(n) is not None]
    loss = out.square().sum()
    expected = torch.autograd.grad(loss, sources, retain_graph=True)
    actual = torch.autograd.grad(loss, sources, create_graph=True)
    for a, e in zip(actual, expected):
        assert torch.equal(a.detach(), e)
