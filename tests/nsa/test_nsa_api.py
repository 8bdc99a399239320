"""nsa() end to end: forward and gradients against nsa_reference, layouts, causality, gradcheck."""
import pytest
import torch

from nsa import SELECTION_Q_TILE, nsa, nsa_reference
from nsa.reference import window_attention_reference
from nsa_testing import (SMALL, cu_seqlens_of, differentiable, grads_of, random_inputs,
                         rel_err)


def _nsa_and_reference(x: dict, dtype, deterministic: bool = False, **options):
    """nsa() on x cast to dtype, and the float64 reference on the same (rounded) values; both
    with their gradients for one random dout."""
    kwargs = {**SMALL, **options}
    fast_in = differentiable(x, dtype)
    ref_in = differentiable({n: t.detach().to(dtype) if t is not None and t.is_floating_point()
                             else t for n, t in x.items()}, torch.float64)
    out = nsa(**fast_in, **kwargs, deterministic=deterministic)
    ref = nsa_reference(**ref_in, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return out, ref, grads_of(out, fast_in, dout), grads_of(ref, ref_in, dout)


def _assert_close_to_reference(x, dtype, tolerance, **options):
    """The checks of nsa() against the reference; returns nsa()'s output and gradients."""
    out, ref, grads, ref_grads = _nsa_and_reference(x, dtype, **options)
    assert out.dtype == dtype and out.shape == x["q"].shape
    assert rel_err(out, ref) < tolerance
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert grads[name].dtype == dtype
        assert rel_err(grads[name], ref_grads[name]) < tolerance, name
    return out, grads


CASES = {
    # name: (lengths, heads, kv_heads, options)
    "group1-varlen": ([70, 5, 33, 100], 2, 2, {}),
    "group4-odd": ([131], 4, 1, {}),
    "group16": ([64, 29], 16, 1, {}),
    "8seqs-short": ([1, 2, 3, 4, 7, 13, 40, 75], 8, 2, {}),
    "noncausal": ([70, 3, 45], 4, 2, dict(causal=False)),
    "sparse-compressed": ([150, 20], 4, 2, dict(num_cmp_selected_blocks=1)),
    "sparse-compressed-noncausal": ([90, 37], 4, 1,
                                    dict(num_cmp_selected_blocks=2, causal=False)),
    "window-off": ([60, 51], 4, 2, dict(window_size=0)),
    "scale-and-blocks": ([77, 20], 4, 2, dict(compress_block_size=2, selected_block_size=6,
                                              num_selected_blocks=5, softmax_scale=0.2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_reference(case):
    lengths, heads, kv_heads, options = CASES[case]
    x = random_inputs(lengths, heads, kv_heads, 8, seed=len(case))
    _assert_close_to_reference(x, torch.float32, 1e-4, **options)


@pytest.mark.parametrize("case", ["group4-odd", "8seqs-short", "sparse-compressed"])
def test_bfloat16_matches_reference(case):
    lengths, heads, kv_heads, options = CASES[case]
    x = random_inputs(lengths, heads, kv_heads, 16, seed=len(case) + 1)
    _assert_close_to_reference(x, torch.bfloat16, 1e-2, **options)


@pytest.mark.parametrize("case", ["group4-odd", "sparse-compressed", "window-off"])
def test_deterministic_matches_reference_and_the_default_mode(case):
    """deterministic=True is a mode of the backward, not another function: the same gradients
    as the reference, and on the CPU (the fallback, deterministic anyway) the same bits as the
    default mode."""
    lengths, heads, kv_heads, options = CASES[case]
    x = random_inputs(lengths, heads, kv_heads, 8, seed=len(case) + 2)
    out, grads = _assert_close_to_reference(x, torch.float32, 1e-4, deterministic=True,
                                            **options)
    default_out, _, default_grads, _ = _nsa_and_reference(x, torch.float32, **options)
    assert torch.equal(out, default_out)
    for name, grad in grads.items():
        assert torch.equal(grad, default_grads[name]), name


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_without_projections_and_gates(gated):
    x = random_inputs([50, 81], 4, 2, 8, seed=11)
    x.pop("W_k"), x.pop("W_v")
    if not gated:
        x.pop("W_gate")
    _assert_close_to_reference(x, torch.float32, 1e-4)


def test_window_size_zero_switches_the_window_branch_off():
    x = random_inputs([60], 4, 2, 8, seed=12)
    fast_in = differentiable(x, torch.float64)
    out = nsa(**fast_in, **{**SMALL, "window_size": 0})
    grads = grads_of(out, fast_in, torch.randn_like(out))
    assert torch.all(grads["W_gate"][:, 2] == 0)  # the window's gate has nothing to weigh
    assert torch.all(grads["W_gate"][:, :2] != 0)
    with_window = nsa(**differentiable(x, torch.float64), **SMALL)
    assert rel_err(out, with_window) > 1e-2
    # Ungated, the running branches are averaged: 3 * (all three) - 2 * (window off) = o_window.
    x.pop("W_gate")
    two = nsa(**x, **{**SMALL, "window_size": 0})
    three = nsa(**x, **SMALL)
    window = window_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], window_size=12,
                                        softmax_scale=8 ** -0.5)
    torch.testing.assert_close(3 * three - 2 * two, window)


def test_padded_batch_equals_packed_varlen():
    batch, seqlen = 3, 53
    x = random_inputs([seqlen] * batch, 4, 2, 8, seed=13, dtype=torch.float32)
    packed = nsa(**x, **SMALL)
    padded = nsa(*(x[n].view(batch, seqlen, *x[n].shape[1:]) for n in "qkv"),
                 W_k=x["W_k"], W_v=x["W_v"], W_gate=x["W_gate"], **SMALL)
    assert padded.shape == (batch, seqlen, 4, 8)
    torch.testing.assert_close(padded.flatten(0, 1), packed, rtol=0, atol=1e-6)


def test_packed_sequences_equal_each_sequence_alone():
    lengths = [40, 3, 0, 77, 16]
    x = random_inputs(lengths, 4, 2, 8, seed=14, dtype=torch.float32)
    packed = nsa(**x, **SMALL)
    start = 0
    for n in lengths:
        alone = dict(x, cu_seqlens=cu_seqlens_of([n]),
                     **{name: x[name][start:start + n] for name in "qkv"})
        torch.testing.assert_close(packed[start:start + n], nsa(**alone, **SMALL), rtol=0,
                                   atol=1e-6)
        start += n


@pytest.mark.parametrize("options", [{}, dict(num_cmp_selected_blocks=1)],
                         ids=["dense-compressed", "sparse-compressed"])
@pytest.mark.parametrize("row", [0, 15, 33, 70])
def test_outputs_and_gradients_never_depend_on_later_rows(row, options):
    # Perturb q, k, v after `row` in the second sequence: rows <= row keep their outputs and the
    # gradients they send to every input; later rows receive none of their gradient.
    lengths = [30, 90]
    x = random_inputs(lengths, 4, 2, 8, seed=15)
    start = lengths[0]
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    dout[start + row + 1:] = 0

    def run(inputs):
        inputs = differentiable(inputs, torch.float64)
        out = nsa(**inputs, **SMALL, **options)
        return out.detach(), grads_of(out, inputs, dout)

    out, grads = run(x)
    perturbed = dict(x)
    gen = torch.Generator().manual_seed(16)
    for name in "qkv":
        perturbed[name] = x[name].clone()
        perturbed[name][start + row + 1:] += torch.randn(
            perturbed[name][start + row + 1:].shape, generator=gen, dtype=torch.float64) * 2
    out2, grads2 = run(perturbed)

    keep = slice(0, start + row + 1)
    torch.testing.assert_close(out2[keep], out[keep], rtol=0, atol=1e-12)
    assert not torch.allclose(out2[keep.stop:], out[keep.stop:])
    for name in ("q", "k", "v"):
        torch.testing.assert_close(grads2[name][keep], grads[name][keep], rtol=0, atol=1e-12)
        assert torch.all(grads[name][keep.stop:] == 0), name
    for name in ("W_k", "W_v", "W_gate"):
        torch.testing.assert_close(grads2[name], grads[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [dict(), dict(num_cmp_selected_blocks=1, causal=False)],
                         ids=["causal", "noncausal-sparse-compressed"])
def test_gradcheck_float64(options):
    tiny = dict(compress_block_size=4, selected_block_size=4, num_selected_blocks=4,
                window_size=8, _q_tile=8, _cmp_kv_block=2)
    x = random_inputs([23, 6], 2, 1, 4, seed=17)
    names = ["q", "k", "v", "W_k", "W_v", "W_gate"]

    def f(*tensors):
        inputs = dict(zip(names, tensors))
        return nsa(**inputs, cu_seqlens=x["cu_seqlens"], **tiny, **options)

    tensors = [x[n].clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, tensors, fast_mode=True)


def test_empty_inputs():
    q = torch.randn(0, 2, 8, requires_grad=True)
    k = torch.randn(0, 1, 8, requires_grad=True)
    out = nsa(q, k, k, cu_seqlens=cu_seqlens_of([0, 0]), **SMALL)
    out.sum().backward()
    assert out.shape == (0, 2, 8) and q.grad.shape == q.shape
    padded = nsa(torch.randn(0, 5, 2, 8), torch.randn(0, 5, 1, 8), torch.randn(0, 5, 1, 8),
                 **SMALL)
    assert padded.shape == (0, 5, 2, 8)


def test_defaults_run_at_full_tile_size():
    # The real geometry (128-row tiles, l = l' = 64, 16 blocks) on one short float32 sequence.
    assert SELECTION_Q_TILE == 128
    x = random_inputs([300], 2, 1, 8, seed=18, dtype=torch.float32, weights=False)
    out = nsa(**x, window_size=100)
    ref = nsa_reference(**{n: t.double() if t.is_floating_point() else t for n, t in x.items()},
                        window_size=100)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(reentrant):
    """nsa() inside torch.utils.checkpoint (recomputed in the backward): the same output and
    gradients as a plain call. The non-reentrant form lets the backward unpack each saved
    tensor once, so NSAFunction reads them once."""
    from torch.utils.checkpoint import checkpoint

    x = random_inputs([150, 37, 90], heads=4, kv_heads=2, head_dim=16, seed=3)
    names = ("q", "k", "v", "W_k", "W_v", "W_gate")
    options = dict(cu_seqlens=x["cu_seqlens"], **SMALL)

    def run(checkpointed: bool):
        leaves = {n: x[n].detach().clone().requires_grad_() for n in names}

        def call(*tensors):
            return nsa(**dict(zip(names, tensors)), **options)
        tensors = [leaves[n] for n in names]
        out = checkpoint(call, *tensors, use_reentrant=reentrant) if checkpointed \
            else call(*tensors)
        out.backward(torch.ones_like(out))
        return out.detach(), [leaves[n].grad for n in names]

    (out, grads), (plain_out, plain_grads) = run(True), run(False)
    assert torch.equal(out, plain_out)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads))


@pytest.mark.parametrize("num_cmp_selected_blocks", [None, 2])
def test_the_window_is_launched_before_the_compression(num_cmp_selected_blocks, monkeypatch):
    """nsa()'s forward launches the window branch first (it reads q, k and v alone), then
    compresses, runs the compressed branch (dense: before the selection) and the selected one;
    the output equals that of every branch after the selection (UNSELECTED_FIRST off) up to
    the gated sum's order of terms, and the gradients bitwise (the backward runs as before)."""
    import nsa.branches as branches
    import nsa.function as function

    order = []
    forward, compress = branches.Branch.forward, function.compress_pair

    names = {branches.COMPRESSED: "compressed", branches.SELECTED: "selected",
             branches.WINDOW: "window"}

    def recorded_forward(self, *args, **kwargs):
        order.append(names[self.index])
        return forward(self, *args, **kwargs)

    def recorded_compress(*args, **kwargs):
        order.append("compress")
        return compress(*args, **kwargs)
    monkeypatch.setattr(branches.Branch, "forward", recorded_forward)
    monkeypatch.setattr(function, "compress_pair", recorded_compress)
    x = random_inputs([70, 5, 33], heads=4, kv_heads=2, head_dim=16, seed=11,
                      dtype=torch.float32)
    options = dict(SMALL, num_cmp_selected_blocks=num_cmp_selected_blocks)
    results = {}
    for first in (True, False):
        monkeypatch.setattr(function, "UNSELECTED_FIRST", first)
        order.clear()
        inputs = differentiable(x, torch.float32)
        out = nsa(**inputs, **options)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results[first] = (out.detach(), grads_of(out, inputs, dout), list(order))
    # The sparse compressed branch waits for the selection: after it either way.
    assert results[True][2] == ["window", "compress", "compressed", "selected"]
    assert results[False][2] == ["compress", "compressed", "selected", "window"]
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[True][1].items():
        assert torch.equal(grad, results[False][1][name]), name
