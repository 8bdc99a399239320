"""Compression, gating and the three branches, each against its nsa.reference counterpart."""
import contextlib
import pytest
import torch

from nsa.branches import compressed_attention, selected_attention, window_attention
from nsa.compression import (compress, compress_backward, compress_kv, compressed_block_starts,
                             compressed_cu_seqlens)
from nsa import gating
from nsa.gating import gate_backward, gate_weights
from nsa.reference import (compress_kv_reference, compressed_attention_reference,
                           gates_reference, select_blocks_reference,
                           selected_attention_reference, window_attention_reference)
from nsa.selection import select_blocks
from nsa_testing import cu_seqlens_of, random_inputs, rel_err

LENGTHS = [45, 3, 0, 70, 9]  # varlen, one shorter than a compression block, one empty


# --- compression ---------------------------------------------------------------------------------

def test_compressed_cu_seqlens_count_complete_blocks_only():
    cu = cu_seqlens_of([45, 3, 0, 70, 8])
    assert compressed_cu_seqlens(cu, 4).tolist() == [0, 11, 11, 11, 28, 30]


@pytest.mark.parametrize("projected", [False, True], ids=["mean", "projected"])
def test_compress_kv_matches_reference(projected):
    x = random_inputs(LENGTHS, 4, 2, 8, seed=1, dtype=torch.float32, weights=projected)
    W_k, W_v = x.get("W_k"), x.get("W_v")
    k_cmp, v_cmp, cu_cmp = compress_kv(x["k"], x["v"], x["cu_seqlens"], 4, W_k, W_v)
    k_ref, v_ref, cu_ref = compress_kv_reference(
        x["k"].double(), x["v"].double(), x["cu_seqlens"], 4,
        None if W_k is None else W_k.double(), None if W_v is None else W_v.double())
    assert torch.equal(cu_cmp, cu_ref)
    assert k_cmp.dtype == torch.float32 and k_cmp.shape == (30, 2, 8)
    assert rel_err(k_cmp, k_ref) < 1e-6 and rel_err(v_cmp, v_ref) < 1e-6


def test_first_compressed_token_is_the_mean_of_its_rows():
    k = torch.randn(10, 1, 3)
    k_cmp, _, _ = compress_kv(k, k, cu_seqlens_of([10]), 4)
    torch.testing.assert_close(k_cmp[1], k[4:8].mean(0))


@pytest.mark.parametrize("projected", [False, True], ids=["mean", "projected"])
def test_compress_backward_matches_autograd(projected):
    x = random_inputs(LENGTHS, 4, 2, 8, seed=2, weights=projected)
    cu = x["cu_seqlens"]
    k = x["k"].clone().requires_grad_()
    W = x["W_k"].clone().requires_grad_() if projected else None
    k_ref, _, cu_cmp = compress_kv_reference(k, k, cu, 4, W, W)
    d_cmp = torch.randn_like(k_ref)
    expected = torch.autograd.grad(k_ref, [k] + ([W] if projected else []), d_cmp)
    starts = compressed_block_starts(cu, cu_cmp, 4, k_ref.shape[0])
    dk, dW = compress_backward(d_cmp, x["k"], starts, 4, x.get("W_k"))
    torch.testing.assert_close(dk, expected[0])
    if projected:
        torch.testing.assert_close(dW, expected[1])
    else:
        assert dW is None
    # Rows of incomplete tail blocks feed no compressed token.
    assert torch.all(dk[44] == 0) and torch.all(dk[45:48] == 0)
    torch.testing.assert_close(compress(x["k"], starts, 4, x.get("W_k")), k_ref.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_key_value_gradients_finish_each_way(dtype):
    """nsa()'s dk, dv before their conversion (`KeyValueGradients`): no branch -> zeros; the
    attention branches' sums alone -> converted (a copy when asked, even where no conversion
    is needed); the compressed rows alone -> expanded; both -> summed, rounded once; the
    compressed rows equal compress_backward's expansion."""
    from nsa.compression import compressed_row_gradients, compressed_row_tokens
    from nsa.function import KeyValueGradients

    x = random_inputs(LENGTHS, 4, 2, 8, seed=3)
    cu = x["cu_seqlens"]
    k, v = x["k"].to(dtype), x["v"].to(dtype)
    k_cmp, _, cu_cmp = compress_kv_reference(x["k"], x["v"], cu, 4)
    starts = compressed_block_starts(cu, cu_cmp, 4, k_cmp.shape[0])
    tokens = compressed_row_tokens(starts, 4, k.shape[0])
    d_cmp = [torch.randn_like(k_cmp) for _ in range(2)]
    rows = [compressed_row_gradients(d, x["k"], starts, 4)[0] for d in d_cmp]
    expanded = [compress_backward(d, x["k"], starts, 4, row_tokens=tokens)[0] for d in d_cmp]
    sums = tuple(torch.randn(k.shape) for _ in range(2))

    zeros = KeyValueGradients(None).finish(k, v)
    assert all(torch.equal(z, torch.zeros_like(k)) for z in zeros)
    converted = KeyValueGradients(sums).finish(k, v, copy=True)
    assert all(c.dtype == dtype and torch.equal(c, s.to(dtype)) for c, s in zip(converted, sums))
    assert all(c.data_ptr() != s.data_ptr() for c, s in zip(converted, sums))
    only_rows = KeyValueGradients(None, (*rows, tokens)).finish(k, v)
    assert all(torch.equal(o, e.to(dtype)) for o, e in zip(only_rows, expanded))
    both = KeyValueGradients(sums, (*rows, tokens)).finish(k, v)
    assert all(torch.equal(b, (s + e).to(dtype)) for b, s, e in zip(both, sums, expanded))
    assert expanded[0].abs().sum() > 0  # not vacuous


# --- gating --------------------------------------------------------------------------------------

@pytest.mark.parametrize("branches", [(True, True, True), (True, True, False)],
                         ids=["three", "window-off"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "mean"])
@pytest.mark.parametrize("chunk_rows", [None, 7], ids=["one-step", "7-row-steps"])
def test_gate_weights_and_backward_match_reference(branches, gated, chunk_rows, monkeypatch):
    x = random_inputs([30], 4, 2, 8, seed=3)
    if chunk_rows:  # gate_backward's row steps, uneven against the 30 rows
        monkeypatch.setattr(gating, "GATE_BACKWARD_CHUNK_ELEMENTS", chunk_rows * 4 * 8)
    W_gate = x["W_gate"] if gated else None
    weights = gate_weights(x["q"], W_gate, branches)
    expected = gates_reference(x["q"], W_gate, branches)
    torch.testing.assert_close(weights, expected)
    if not gated:
        assert torch.allclose(weights.sum(-1), torch.ones(()).double())
        return
    q = x["q"].clone().requires_grad_()
    W = W_gate.clone().requires_grad_()
    d_weights = torch.randn(30, 4, 3, dtype=torch.float64)
    dq_ref, dW_ref = torch.autograd.grad(gates_reference(q, W, branches), [q, W], d_weights)
    start = torch.randn(x["q"].shape, dtype=torch.float64)
    dq = start.clone()
    dW = gate_backward(x["q"], W_gate, weights, d_weights, dq)  # adds into dq
    torch.testing.assert_close(dq, start + dq_ref)
    torch.testing.assert_close(dW, dW_ref)
    if not branches[2]:
        assert torch.all(weights[..., 2] == 0) and torch.all(dW[:, 2] == 0)


def _bfloat16_gate_inputs(device, tokens=300, heads=4, dim=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g).bfloat16().to(device)
    W = (torch.randn(heads, 3, dim, generator=g) * dim ** -0.5).bfloat16().to(device)
    d_weights = torch.randn(tokens, heads, 3, generator=g).to(device)
    dq = torch.randn(tokens, heads, dim, generator=g).bfloat16().to(device)
    return q, W, d_weights, dq


def _check_gate_in_input_dtype_matches_generic(q, W, d_weights, dq, branches, force):
    """The bfloat16 products (`products_in_input_dtype`) against the float32 generic path on
    the same inputs: float32 summation order apart, the same numbers."""
    with force(False):
        weights_ref = gate_weights(q, W, branches)
        dq_ref = dq.clone()
        dW_ref = gate_backward(q, W, weights_ref, d_weights, dq_ref)
    with force(True):
        weights = gate_weights(q, W, branches)
        assert weights.is_contiguous() and weights.dtype == torch.float32
        dq_new = dq.clone()
        dW = gate_backward(q, W, weights, d_weights, dq_new)
    torch.testing.assert_close(weights, weights_ref, rtol=1e-6, atol=1e-6)
    # d_logits as bfloat16 hi + lo carries 16 of float32's 24 mantissa bits (dW_gate is
    # returned to W_gate's bfloat16 after: 8 bits).
    torch.testing.assert_close(dW, dW_ref, rtol=0, atol=2e-5 * dW_ref.abs().max().item())
    # One rounding of the same float32 sum into bfloat16: at most one ulp apart.
    torch.testing.assert_close(dq_new.float(), dq_ref.float(), rtol=2 ** -7, atol=1e-6)
    assert (dq_new != dq).any()
    if not branches[2]:
        assert torch.all(weights[..., 2] == 0) and torch.all(dW[:, 2] == 0)


@contextlib.contextmanager
def _force_input_dtype_products(monkeypatch, on: bool):
    with monkeypatch.context() as patch:
        patch.setattr(gating, "products_in_input_dtype", lambda q, W: on)
        yield


@pytest.mark.parametrize("branches", [(True, True, True), (True, True, False)],
                         ids=["three", "window-off"])
def test_gate_in_input_dtype_matches_generic_cpu(branches, monkeypatch):
    """The bfloat16 path's arithmetic (hi/lo split, in-place product into dq) on the CPU, with
    float32 products standing in for cuBLAS's out_dtype ones."""
    _check_gate_in_input_dtype_matches_generic(
        *_bfloat16_gate_inputs("cpu"), branches,
        lambda on: _force_input_dtype_products(monkeypatch, on))


@pytest.mark.gpu
@pytest.mark.parametrize("branches", [(True, True, True), (True, True, False)],
                         ids=["three", "window-off"])
def test_gate_in_input_dtype_matches_generic_gpu(branches, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, W, d_weights, dq = _bfloat16_gate_inputs("cuda", tokens=4096, heads=8, dim=128)
    assert gating.products_in_input_dtype(q, W)
    assert not gating.products_in_input_dtype(q.float(), W.float())
    _check_gate_in_input_dtype_matches_generic(
        q, W, d_weights, dq, branches,
        lambda on: _force_input_dtype_products(monkeypatch, on))


def test_gate_folded_lse_scales_probabilities_by_the_gate():
    """nsa()'s backward on the kernels reads lse - log g (folded by the backward's row
    statistics): exp(s - folded) = g * exp(s - lse).
    A gate of 0 (sigmoid underflow) and a row that sees nothing (lse = -inf) both give -inf,
    the mark of a row that adds nothing: never NaN, never +inf."""
    from kernels.sm90.backward import gate_folded_lse

    lse = torch.tensor([[1.5, float("-inf"), 0.25, float("-inf"), 2.0]])  # (H=1, T=5)
    gate = torch.tensor([[0.3], [0.7], [0.0], [0.0], [1.0]])  # (T, H) column
    folded = gate_folded_lse(lse, gate)
    assert folded.shape == lse.shape
    score = torch.tensor(0.9)
    for t in (0, 4):
        torch.testing.assert_close(torch.exp(score - folded[0, t]),
                                   gate[t, 0] * torch.exp(score - lse[0, t]))
    assert torch.isneginf(folded[0, 1:4]).all() and not torch.isnan(folded).any()


# --- branches ------------------------------------------------------------------------------------

def _branch_outputs(x: dict, causal: bool, fast: bool) -> dict:
    """All three branch outputs through the fast pieces (float32) or the reference (float64)."""
    cu, scale = x["cu_seqlens"], x["q"].shape[-1] ** -0.5
    rule = dict(compress_block_size=4, selected_block_size=8, num_selected_blocks=5,
                softmax_scale=scale, causal=causal, num_cmp_selected_blocks=1, q_tile=16,
                cmp_kv_block=4)
    if fast:
        q, k, v = (x[n].float() for n in "qkv")
        k_cmp, v_cmp, cu_cmp = compress_kv(k, v, cu, 4)
        sel = select_blocks(q, k_cmp, cu, cu_cmp, **rule)
        k_cmp, v_cmp = k_cmp.float(), v_cmp.float()
        attend = dict(compressed=compressed_attention, selected=selected_attention,
                      window=window_attention)
    else:
        q, k, v = (x[n].double() for n in "qkv")
        k_cmp, v_cmp, cu_cmp = compress_kv_reference(k, v, cu, 4)
        sel = select_blocks_reference(q, k_cmp, cu, cu_cmp, **rule)
        attend = dict(compressed=compressed_attention_reference,
                      selected=selected_attention_reference, window=window_attention_reference)
    out = {}
    for cmp_selected, name in ((None, "compressed"), (sel.cmp_selected, "compressed-sparse")):
        out[name] = attend["compressed"](
            q, k_cmp, v_cmp, cu, cu_cmp, compress_block_size=4, softmax_scale=scale,
            causal=causal, cmp_selected=cmp_selected, q_tile=16, cmp_kv_block=4)
    out["selected"] = attend["selected"](q, k, v, cu, sel.selected, selected_block_size=8,
                                         softmax_scale=scale, causal=causal, q_tile=16)
    out["window"] = attend["window"](q, k, v, cu, window_size=12, softmax_scale=scale)
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (16, 1)],
                         ids=["group1", "group4", "group16"])
def test_branches_match_reference(causal, heads, kv_heads):
    x = random_inputs(LENGTHS, heads, kv_heads, 8, seed=heads + causal)
    fast, ref = _branch_outputs(x, causal, fast=True), _branch_outputs(x, causal, fast=False)
    for name in ref:
        assert rel_err(fast[name], ref[name]) < 1e-5, name
    if causal:  # rows 0..2 of a sequence see no compressed token: exactly zero, not NaN
        assert torch.all(fast["compressed"][:3] == 0)
    # With 1 ranked block of 4 compressed tokens the sparse branch sees less than the dense one.
    assert rel_err(fast["compressed-sparse"], fast["compressed"]) > 1e-2


@pytest.mark.parametrize("row", [5, 16, 40])
def test_every_branch_is_causal(row):
    # Changing q, k, v after `row` (in the selection too) leaves every branch's rows <= row.
    x = random_inputs([64], 4, 2, 8, seed=7)
    before = _branch_outputs(x, True, fast=True)
    gen = torch.Generator().manual_seed(8)
    for name in "qkv":
        x[name] = x[name].clone()
        x[name][row + 1:] = torch.randn(x[name][row + 1:].shape, generator=gen,
                                        dtype=x[name].dtype) * 3
    after = _branch_outputs(x, True, fast=True)
    for name in before:
        torch.testing.assert_close(after[name][:row + 1], before[name][:row + 1], rtol=0,
                                   atol=1e-6, msg=name)
        assert not torch.allclose(after[name][row + 1:], before[name][row + 1:]), name
