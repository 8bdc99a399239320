"""nsa() forward at 2M tokens (H=32, Hkv=8, D=128, bf16, learned gates) on the kernels, compared
on slices with the same call on the fallback (issue 15: the forward at 2M must be right).

q alone is 16 GiB there and the fallback's float32 gated sum 32 GiB: the test needs a GPU of
about 110 GB (an H200) and skips on smaller ones (an 80 GB H100 holds 1.5M tokens forward).
Two packed sequences: rows of the second lie past 2**32 elements of q."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import device as kernels_device
from nsa import nsa
from nsa_testing import cu_seqlens_of, rel_err

NEEDED_BYTES = 110 * 2 ** 30


def _sm90_with_memory() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and torch.cuda.get_device_properties(0).total_memory >= NEEDED_BYTES)


@pytest.mark.gpu
@pytest.mark.whole_gpu
@pytest.mark.skipif(not _sm90_with_memory(), reason="needs an sm_90 GPU with ~110 GB (H200)")
def test_nsa_forward_at_two_million_tokens_matches_the_fallback_on_slices(monkeypatch):
    heads, kv_heads, dim = 32, 8, 128
    total = 2 ** 21
    lengths = [total - 5000, 5000]
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=generator) * scale).bfloat16()

    q, k, v = randn(total, heads, dim), randn(total, kv_heads, dim), randn(total, kv_heads, dim)
    W_gate = randn(heads, 3, dim, scale=dim ** -0.5)
    cu = cu_seqlens_of(lengths).to(device)
    call = dict(cu_seqlens=cu, max_seqlen=max(lengths), W_gate=W_gate)
    attention = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                     max_seqlen_k=max(lengths), causal=True)
    assert kernels.which_backend(q, k, v, **attention) == "sm90"
    # Slices: the first rows, the last rows of the long sequence (the largest offsets inside
    # it, the most compressed and selectable keys) and the whole short sequence.
    end = lengths[0]
    rows = torch.cat([torch.arange(0, 2048), torch.arange(end - 4096, end),
                      torch.arange(end, total)]).to(device)
    with torch.no_grad():
        out = nsa(q, k, v, **call)
        on_kernels = out[rows].float()
        assert torch.isfinite(out).all()
        del out
        monkeypatch.setattr(kernels_device, "_device_unsupported", lambda _: "the test's fallback run")
        assert kernels.which_backend(q, k, v, **attention).startswith("fallback")
        on_fallback = nsa(q, k, v, **call)[rows].float()
    for name, part in (("first rows", slice(0, 2048)), ("last rows", slice(2048, 2048 + 4096)),
                       ("second sequence", slice(2048 + 4096, None))):
        error = rel_err(on_kernels[part], on_fallback[part])
        assert error < 1e-2, f"{name}: relative error {error:.3e}"
