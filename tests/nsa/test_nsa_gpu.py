"""nsa() on an sm_90 GPU, with its branches on the CuTe DSL forward kernel, against the float64
reference: outputs and every gradient, packed varlen and padded, GQA, default NSA geometry
(compressed blocks of 64, selected blocks of 64, 128-row selection tiles, window 512)."""
import pytest
import torch

import kernels
from nsa import nsa, nsa_reference
from nsa_testing import cu_seqlens_of, differentiable, grads_of, random_inputs, rel_err

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")

CASES = [
    # lengths, H, Hkv, D, options
    ([1500, 77, 700], 8, 2, 128, dict()),
    ([2100], 16, 1, 64, dict(num_selected_blocks=8, window_size=256)),
    ([1000, 1030], 4, 4, 128, dict(num_cmp_selected_blocks=2)),
    ([900, 300], 8, 2, 192, dict()),
    ([700], 4, 1, 256, dict(window_size=256)),
]


@requires_sm90
@pytest.mark.parametrize("case", CASES, ids=["gqa4-varlen", "gqa16-d64", "sparse-compressed",
                                             "d192", "d256"])
def test_nsa_on_kernels_matches_reference(case):
    lengths, heads, heads_kv, dim, options = case
    x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t)
         for n, t in random_inputs(lengths, heads, heads_kv, dim, seed=7).items()}
    cu = x["cu_seqlens"]
    backend = kernels.which_backend(
        x["q"].bfloat16(), x["k"].bfloat16(), x["v"].bfloat16(), cu_seqlens_q=cu,
        cu_seqlens_k=cu, causal=True, window_size=(511, 0))
    assert backend == "sm90", backend
    fast_in = differentiable(x, torch.bfloat16)
    ref_in = differentiable({n: (t.detach().bfloat16() if isinstance(t, torch.Tensor)
                                 and t.is_floating_point() else t) for n, t in x.items()},
                            torch.float64)
    out = nsa(**fast_in, max_seqlen=max(lengths), **options)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths), **options)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    dout = torch.randn(out.shape, device="cuda", dtype=torch.float64)
    grads, ref_grads = grads_of(out, fast_in, dout), grads_of(ref, ref_in, dout)
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-2, name


@requires_sm90
def test_nsa_padded_equals_packed_on_kernels():
    torch.manual_seed(3)
    q = torch.randn(2, 1100, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1100, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    padded = nsa(q, k, v)
    packed = nsa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                 cu_seqlens=cu_seqlens_of([1100, 1100]).cuda(), max_seqlen=1100)
    assert rel_err(padded.flatten(0, 1), packed) < 1e-3


@requires_sm90
def test_nsa_empty_inputs_on_the_gpu():
    """No rows at all: every stage, the gated sum included, must take its empty path."""
    q = torch.randn(0, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(0, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = nsa(q, k, k, cu_seqlens=cu_seqlens_of([0, 0]).cuda())
    out.sum().backward()
    assert out.shape == (0, 4, 128) and q.grad.shape == q.shape
    padded = nsa(*(torch.randn(0, 5, h, 128, device="cuda", dtype=torch.bfloat16)
                   for h in (4, 2, 2)))
    assert padded.shape == (0, 5, 4, 128)
