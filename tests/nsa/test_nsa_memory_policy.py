"""nsa()'s backward with the branch outputs kept or recomputed (nsa/memory_policy.py): the rule,
the argument, and the same gradients either way."""
from __future__ import annotations

import pytest
import torch

from nsa import nsa
from nsa import memory_policy
from nsa.branches import Branch
from nsa_testing import SMALL, differentiable, grads_of, random_inputs, rel_err

LENGTHS = [40, 17, 29, 64]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _run(inputs: dict, recompute, device="cpu", dtype=torch.float32, options=SMALL):
    leaves = differentiable({n: (x.to(device) if x is not None else None)
                             for n, x in inputs.items()}, dtype)
    out = nsa(leaves["q"], leaves["k"], leaves["v"], cu_seqlens=leaves["cu_seqlens"],
              W_k=leaves["W_k"], W_v=leaves["W_v"], W_gate=leaves["W_gate"],
              recompute=recompute, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(device=device, dtype=dtype)
    return out, grads_of(out, leaves, dout)


@pytest.mark.parametrize("options", [dict(SMALL), dict(SMALL, window_size=0),
                                     dict(SMALL, num_cmp_selected_blocks=1)])
def test_kept_and_recomputed_outputs_give_the_same_gradients_bitwise(options):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=3)
    out_kept, kept = _run(inputs, recompute=False, options=options)
    out_recomputed, recomputed = _run(inputs, recompute=True, options=options)
    assert torch.equal(out_kept, out_recomputed)
    assert kept.keys() == recomputed.keys() == {"q", "k", "v", "W_k", "W_v", "W_gate"}
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), name


def _branch_forwards_in_backward(monkeypatch, recompute) -> int:
    """How many branch forwards nsa()'s backward runs."""
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=4)
    leaves = differentiable(inputs, torch.float32)
    out = nsa(leaves["q"], leaves["k"], leaves["v"], cu_seqlens=leaves["cu_seqlens"],
              W_gate=leaves["W_gate"], recompute=recompute, **SMALL)
    calls = []
    original = Branch.forward

    def counted(self, *args):
        calls.append(self.index)
        return original(self, *args)

    monkeypatch.setattr(Branch, "forward", counted)
    out.backward(torch.randn_like(out))
    return len(calls)


def test_recompute_false_runs_no_branch_forward_in_the_backward(monkeypatch):
    assert _branch_forwards_in_backward(monkeypatch, recompute=False) == 0


def test_recompute_true_recomputes_every_branch(monkeypatch):
    assert _branch_forwards_in_backward(monkeypatch, recompute=True) == 3


def test_the_default_keeps_small_outputs_and_recomputes_past_the_budget(monkeypatch):
    q = torch.empty(1000, 4, 16)  # 3 branches x 64,000 floats = 768,000 bytes
    assert memory_policy.kept_output_bytes(q, 3) == 768_000
    monkeypatch.setattr(memory_policy, "HOST_KEEP_BUDGET", 768_000)
    assert memory_policy.keeps_branch_outputs(q, 3, None)
    monkeypatch.setattr(memory_policy, "HOST_KEEP_BUDGET", 767_999)
    assert not memory_policy.keeps_branch_outputs(q, 3, None)
    assert memory_policy.keeps_branch_outputs(q, 3, False)
    assert not memory_policy.keeps_branch_outputs(q, 2, True)


def test_the_default_follows_the_rule(monkeypatch):
    """recompute=None: recomputes exactly when the rule says the outputs do not fit."""
    monkeypatch.setattr(memory_policy, "HOST_KEEP_BUDGET", 0)
    assert _branch_forwards_in_backward(monkeypatch, recompute=None) == 3


@pytest.mark.parametrize("bad", ["false", 0, 1.0])
def test_recompute_must_be_none_or_a_bool(bad):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=5, dtype=torch.float32)
    with pytest.raises(TypeError, match="recompute must be None or a bool"):
        nsa(inputs["q"], inputs["k"], inputs["v"], cu_seqlens=inputs["cu_seqlens"],
            recompute=bad, **SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("window_size", [512, 0])
def test_kept_and_recomputed_outputs_agree_on_the_gpu(window_size):
    """On the sm90 kernels the recomputing forward takes <dO, o_b> from its float32 accumulator,
    the kept path from the rounded o_b that the gated sum used: equal up to that rounding, and
    both match the reference as closely."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    options = dict(window_size=window_size)
    inputs = random_inputs([1500, 2048, 700], 8, 2, 128, seed=6, dtype=torch.float32)
    out_kept, kept = _run(inputs, False, "cuda", torch.bfloat16, options)
    out_recomputed, recomputed = _run(inputs, True, "cuda", torch.bfloat16, options)
    assert torch.equal(out_kept, out_recomputed)
    for name in kept:
        assert rel_err(kept[name], recomputed[name]) < 5e-3, name
