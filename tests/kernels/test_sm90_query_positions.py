"""`q_start_positions` on the sm90 kernels: each sequence's queries from a position on (any
position, not only tile multiples), forward and backward, against the torch fallback of the
same call in float32 (the fallback of such a call is checked against the whole sequence's rows
in test_query_start_positions.py). One case per rule NSA's branches use: the compressed keys
(causal, compress factor 64), the sliding window, block-sparse lists with mask blocks, plain
causal; GQA, several sequences of odd lengths.

    python -m pytest -q tests/kernels/test_sm90_query_positions.py     # on an sm_90 GPU
"""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_varlen_func
from kernels.fallback import attention_backward_fallback, attention_forward_fallback
from kernels.interface import which_backend
from gpu_marks import requires_sm90
from reference_attention import random_block_sparse
from sparsity import BlockSparseTensors

pytestmark = [pytest.mark.gpu, requires_sm90]

HEADS, KV_HEADS, DIM = 8, 2, 128
TOLERANCE = 2e-2


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def _check(query_lengths, key_lengths, starts, options, block_sparse=None):
    """sm90 against the fallback on the same shifted call: out, lse, dq, dk, dv."""
    gen = torch.Generator(device="cuda").manual_seed(sum(starts) + len(query_lengths))
    total_q, total_k = sum(query_lengths), sum(key_lengths)
    q = torch.randn(total_q, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total_k, KV_HEADS, DIM, generator=gen, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    call = dict(cu_seqlens_q=_cu(query_lengths), cu_seqlens_k=_cu(key_lengths),
                max_seqlen_q=max(query_lengths), max_seqlen_k=max(key_lengths),
                q_start_positions=tuple(starts), block_sparse=block_sparse, **options)
    for backward in (False, True):
        assert which_backend(q, k, v, backward=backward, **call) == "sm90"

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, return_lse=True, **call)
    out.backward(dout)
    ref_q, ref_k, ref_v, ref_dout = (x.float() for x in (q, k, v, dout))
    ref_out, ref_lse = attention_forward_fallback(ref_q, ref_k, ref_v, **call)
    ref_grads = attention_backward_fallback(ref_dout, ref_q, ref_k, ref_v, ref_out, ref_lse,
                                            **call)
    assert _rel_err(out, ref_out) < TOLERANCE
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=0, atol=2e-2)
    for name, leaf, ref in zip("qkv", leaves, ref_grads):
        assert torch.isfinite(leaf.grad).all(), name
        assert _rel_err(leaf.grad, ref) < TOLERANCE, (name, _rel_err(leaf.grad, ref))
    assert out.abs().sum() > 0


# Query rows per sequence and where they start: positions off every tile boundary, one at 0,
# one short sequence, one longer than a few tiles.
LENGTHS = (1000, 77, 300, 2500)
STARTS = (333, 0, 1791, 4097)


@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(causal=True, window_size=(511, 0)),
], ids=["causal", "window-511"])
def test_positions_on_dense_rules(options):
    keys = [p + n for n, p in zip(LENGTHS, STARTS)]  # every key up to the last row
    _check(LENGTHS, keys, STARTS, options)


def test_positions_on_compressed_keys():
    """NSA's compressed branch: key j of sequence s stands for tokens [64 j, 64 j + 64)."""
    keys = [(p + n) // 64 for n, p in zip(LENGTHS, STARTS)]
    _check(LENGTHS, keys, STARTS, dict(causal=True, compress_factor=64))


def test_positions_on_block_sparse_lists():
    """The selected branch: 128-row tiles of lists over 64-key blocks, mask blocks masked at
    the rows' positions (tile-aligned starts: the rows of the whole sequence's tiles)."""
    whole_lengths, starts = (1280, 900, 640), (512, 128, 0)
    gen = torch.Generator().manual_seed(7)
    whole = random_block_sparse(gen, whole_lengths, whole_lengths, heads=KV_HEADS, q_tile=128,
                                kv_block=64, causal_full=True)
    offsets = whole.row_block_offsets.tolist()
    tiles = torch.cat([torch.arange(offsets[s] + p // 128, offsets[s + 1])
                       for s, p in enumerate(starts)])
    rows = [n - p for n, p in zip(whole_lengths, starts)]
    shifted = BlockSparseTensors(
        full_count=whole.full_count[tiles], full_index=whole.full_index[tiles],
        mask_count=whole.mask_count[tiles], mask_index=whole.mask_index[tiles],
        row_block_size=128, col_block_size=64,
        row_block_offsets=torch.tensor([0, *torch.tensor([-(-n // 128) for n in rows]).cumsum(0)
                                        .tolist()], dtype=torch.int32)).to("cuda")
    _check(rows, whole_lengths, starts, dict(causal=True), block_sparse=shifted)
