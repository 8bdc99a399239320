"""nsa/fused.py: the model's elementwise chains compiled on the GPU, eager on the CPU."""
from __future__ import annotations

import pytest
import torch

from nsa import fused
from nsa.layer import rotary_tables, rotate
from nsa.models.lm import rms_norm, silu_product


def test_cpu_tensors_run_the_function_itself(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile must not be asked for CPU tensors")

    monkeypatch.setattr(torch, "compile", no_compile)
    x = torch.randn(5, 4, 8)
    positions = torch.arange(5)
    cos, sin = rotary_tables(positions, 8, 10000.0, x.dtype)
    assert torch.equal(rotate(x, cos, sin), rotate.eager(x, cos, sin))
    weight = torch.randn(8)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm.eager(x, weight, 1e-6))


def test_a_failed_compile_warns_once_and_stays_eager(monkeypatch):
    compiles = []

    def failing_compile(fn, **kwargs):
        compiles.append(fn)

        def run(*args, **kw):
            raise RuntimeError("no triton here")
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))

    @fused.fused_on_gpu
    def double(x):
        return x * 2

    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="double: torch.compile failed.*no triton"):
        assert torch.equal(double(x), x * 2)
    assert torch.equal(double(x), x * 2)  # no second attempt, no second warning
    assert len(compiles) == 1


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (got.double() - exact).abs().max().item()


@pytest.mark.gpu
def test_compiled_chains_are_as_accurate_as_eager_on_the_gpu():
    """Output and gradients of each compiled chain against the same function in float64: within
    one bfloat16 step of the result's largest magnitude, or no farther than eager is. (Not
    against eager itself: eager rounds its intermediates to bfloat16 where the compiled kernel
    keeps float32, so the two differ by a step wherever a sum cancels.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 8, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    positions = torch.randint(0, 32768, (4096,), device="cuda", generator=g)
    weight = torch.randn(128, device="cuda", generator=g).requires_grad_()
    up = torch.randn(4096, 8, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    cases = [
        (rotate, (x, *rotary_tables(positions, 128, 10000.0, x.dtype)), (x,)),
        (rms_norm, (x, weight, 1e-6), (x, weight)),
        (silu_product, (x, up), (x, up)),
    ]
    for fn, args, inputs in cases:
        exact_inputs = {id(t): t.detach().double().requires_grad_() for t in inputs}
        exact_args = tuple(exact_inputs.get(id(a), a) if isinstance(a, torch.Tensor) else a
                           for a in args)
        exact = fn.eager(*exact_args)
        out, expected = fn(*args), fn.eager(*args)
        step = 2 ** -8 * exact.abs().max().item()
        name = fn.__name__
        assert _error(out, exact) <= max(step, _error(expected, exact)), name
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dout)
        expected_grads = torch.autograd.grad(expected, inputs, dout)
        exact_grads = torch.autograd.grad(exact, list(exact_inputs.values()), dout.double())
        for got, want, exact_grad in zip(grads, expected_grads, exact_grads):
            step = 2 ** -8 * exact_grad.abs().max().item()
            assert _error(got, exact_grad) <= max(step, _error(want, exact_grad)), name
