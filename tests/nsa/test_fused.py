"""nsa/fused.py: the model's elementwise chains compiled on the GPU, eager on the CPU."""
from __future__ import annotations

import pytest
import torch

from nsa import fused
from nsa.layer import apply_rotary
from nsa.models.lm import rms_norm, silu_product


def test_cpu_tensors_run_the_function_itself(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile must not be asked for CPU tensors")

    monkeypatch.setattr(torch, "compile", no_compile)
    x = torch.randn(5, 4, 8)
    positions = torch.arange(5)
    assert torch.equal(apply_rotary(x, positions, 10000.0),
                       apply_rotary.eager(x, positions, 10000.0))
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


@pytest.mark.gpu
def test_compiled_chains_match_eager_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 8, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    positions = torch.randint(0, 32768, (4096,), device="cuda", generator=g)
    weight = torch.randn(128, device="cuda", generator=g).requires_grad_()
    up = torch.randn(4096, 8, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    cases = [
        (apply_rotary, (x, positions, 10000.0), (x,)),
        (rms_norm, (x, weight, 1e-6), (x, weight)),
        (silu_product, (x, up), (x, up)),
    ]
    for fn, args, inputs in cases:
        out = fn(*args)
        expected = fn.eager(*args)
        # bf16 outputs: the fused kernel rounds once, as eager does; float32 math in another
        # order may flip the last bit.
        torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=1e-5)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dout)
        expected_grads = torch.autograd.grad(expected, inputs, dout)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6,
                                       atol=1e-3 * want.float().abs().max().item())
