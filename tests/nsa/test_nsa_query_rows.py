"""NSA on query rows (`sparsity.QueryRows`): q holding each sequence's rows from a tile-aligned
position on, against all of its keys (what a rank of context parallelism's sequence mode
computes), equals the whole sequence's nsa() on those rows, forward and backward, once the
first tile after each start (whose selection scores only the rows q holds) is left out."""
from __future__ import annotations

import pytest
import torch

from nsa import nsa
from nsa.function import NSAFunction
from nsa.validation import validate_nsa_call
from nsa_testing import SMALL, cu_seqlens_of, random_inputs
from sparsity import QueryRows

Q_TILE = SMALL["_q_tile"]


def _nsa_options(**extra) -> dict:
    options = {key: value for key, value in SMALL.items() if not key.startswith("_")}
    return dict(options, **extra)


@pytest.mark.parametrize("extra", [{}, dict(num_cmp_selected_blocks=1), dict(window_size=0)],
                         ids=["defaults", "sparse-compressed", "no-window"])
def test_query_rows_equal_the_whole_sequences_rows(extra):
    lengths, starts = [300, 200, 70], [64, 32, 0]
    x = random_inputs(lengths, heads=4, kv_heads=2, head_dim=16, seed=5)
    cu = cu_seqlens_of(lengths)
    options = _nsa_options(**extra)
    leaves = {n: x[n].clone().requires_grad_() for n in x if n != "cu_seqlens"}
    whole = nsa(**leaves, cu_seqlens=cu, max_seqlen=max(lengths), _q_tile=Q_TILE,
                _cmp_kv_block=SMALL["_cmp_kv_block"], **options)

    # q: each sequence's rows from its start on; kept: all but the first tile after a start.
    bounds = cu.tolist()
    q_rows = torch.cat([torch.arange(a + p, b) for a, b, p in zip(bounds, bounds[1:], starts)])
    kept = torch.cat([torch.arange(a + p + (Q_TILE if p else 0), b)
                      for a, b, p in zip(bounds, bounds[1:], starts)])
    rows_lengths = [n - p for n, p in zip(lengths, starts)]
    queries = QueryRows(cu_seqlens_of(rows_lengths), tuple(cu_seqlens_of(rows_lengths).tolist()),
                        tuple(starts))
    config, sequences = validate_nsa_call(
        x["q"], x["k"], x["v"], cu_seqlens=cu, max_seqlen=max(lengths), W_k=x["W_k"],
        W_v=x["W_v"], W_gate=x["W_gate"], causal=True, softmax_scale=None, q_tile=Q_TILE,
        cmp_kv_block=SMALL["_cmp_kv_block"], num_cmp_selected_blocks=extra.get(
            "num_cmp_selected_blocks"),
        **{k: v for k, v in options.items() if k != "num_cmp_selected_blocks"})
    part_leaves = {n: x[n].clone().requires_grad_() for n in ("k", "v", "W_k", "W_v", "W_gate")}
    part_q = x["q"][q_rows].clone().requires_grad_()
    part = NSAFunction.apply(part_q, part_leaves["k"], part_leaves["v"], part_leaves["W_k"],
                             part_leaves["W_v"], part_leaves["W_gate"], cu, max(lengths), config,
                             sequences.cu_seqlens, False, queries)
    position_of = {int(r): i for i, r in enumerate(q_rows)}
    local_kept = torch.tensor([position_of[int(r)] for r in kept])
    torch.testing.assert_close(part[local_kept], whole[kept], rtol=0, atol=1e-12)

    # Backward with dO on the kept rows only: every gradient equals the whole sequence's.
    dout = torch.randn(whole.shape, generator=torch.Generator().manual_seed(1),
                       dtype=whole.dtype)
    dout_whole = torch.zeros_like(dout)
    dout_whole[kept] = dout[kept]
    dout_part = torch.zeros_like(part)
    dout_part[local_kept] = dout[kept]
    whole.backward(dout_whole)
    part.backward(dout_part)
    torch.testing.assert_close(part_q.grad[local_kept], leaves["q"].grad[kept], rtol=0,
                               atol=1e-12)
    assert torch.equal(part_q.grad[~torch.isin(torch.arange(len(q_rows)), local_kept)],
                       torch.zeros_like(part_q.grad[:len(q_rows) - len(kept)]))
    for name in ("k", "v", "W_k", "W_v", "W_gate"):
        torch.testing.assert_close(part_leaves[name].grad, leaves[name].grad, rtol=0,
                                   atol=1e-12, msg=name)
