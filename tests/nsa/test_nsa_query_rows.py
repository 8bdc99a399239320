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
from gpu_marks import requires_sm90
from nsa_testing import SMALL, cu_seqlens_of, random_inputs
from sparsity import QueryRows

Q_TILE = SMALL["_q_tile"]


def _nsa_options(**extra) -> dict:
    options = {key: value for key, value in SMALL.items() if not key.startswith("_")}
    return dict(options, **extra)


def _query_rows_against_whole(x: dict, lengths, starts, options: dict, q_tile: int,
                              cmp_kv_block: int) -> dict:
    """nsa() of the whole sequences and NSAFunction on each sequence's rows from its start on;
    per name (out, q, k, v, W_k, W_v, W_gate): (query rows' value, whole's value) on the rows
    kept (all but the first tile after a start), gradients from dO on those rows only. Also
    "q (halo)": the query rows' dq on the rows left out (must be 0)."""
    cu = x["cu_seqlens"]
    names = ("q", "k", "v", "W_k", "W_v", "W_gate")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    whole = nsa(**leaves, cu_seqlens=cu, max_seqlen=max(lengths), _q_tile=q_tile,
                _cmp_kv_block=cmp_kv_block, **options)

    # q: each sequence's rows from its start on; kept: all but the first tile after a start.
    bounds = cu.tolist()
    q_rows = torch.cat([torch.arange(a + p, b) for a, b, p in zip(bounds, bounds[1:], starts)])
    kept = torch.cat([torch.arange(a + p + (q_tile if p else 0), b)
                      for a, b, p in zip(bounds, bounds[1:], starts)])
    rows_lengths = [n - p for n, p in zip(lengths, starts)]
    rows_cu = cu_seqlens_of(rows_lengths).to(cu.device)
    queries = QueryRows(rows_cu, tuple(rows_cu.tolist()), tuple(starts))
    config, sequences = validate_nsa_call(
        x["q"], x["k"], x["v"], cu_seqlens=cu, max_seqlen=max(lengths), W_k=x["W_k"],
        W_v=x["W_v"], W_gate=x["W_gate"], causal=True, softmax_scale=None, q_tile=q_tile,
        cmp_kv_block=cmp_kv_block, num_cmp_selected_blocks=options.get(
            "num_cmp_selected_blocks"),
        **{k: v for k, v in options.items() if k != "num_cmp_selected_blocks"})
    part_leaves = {n: x[n].clone().requires_grad_() for n in names}
    part_q = part_leaves["q"][q_rows].detach().requires_grad_()
    part = NSAFunction.apply(part_q, part_leaves["k"], part_leaves["v"], part_leaves["W_k"],
                             part_leaves["W_v"], part_leaves["W_gate"], cu, max(lengths), config,
                             sequences.cu_seqlens, False, queries)
    position_of = {int(r): i for i, r in enumerate(q_rows)}
    local_kept = torch.tensor([position_of[int(r)] for r in kept], device=cu.device)
    kept = kept.to(cu.device)

    dout = torch.randn(whole.shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64).to(whole)
    dout_whole = torch.zeros_like(dout)
    dout_whole[kept] = dout[kept]
    dout_part = torch.zeros_like(part)
    dout_part[local_kept] = dout[kept]
    whole.backward(dout_whole)
    part.backward(dout_part)
    halo = ~torch.isin(torch.arange(len(q_rows), device=cu.device), local_kept)
    pairs = {"out": (part.detach()[local_kept], whole.detach()[kept]),
             "q": (part_q.grad[local_kept], leaves["q"].grad[kept]),
             "q (halo)": (part_q.grad[halo], torch.zeros_like(part_q.grad[halo]))}
    pairs.update({n: (part_leaves[n].grad, leaves[n].grad) for n in names[1:]})
    return pairs


@pytest.mark.parametrize("extra", [{}, dict(num_cmp_selected_blocks=1), dict(window_size=0)],
                         ids=["defaults", "sparse-compressed", "no-window"])
def test_query_rows_equal_the_whole_sequences_rows(extra):
    lengths, starts = [300, 200, 70], [64, 32, 0]
    x = random_inputs(lengths, heads=4, kv_heads=2, head_dim=16, seed=5)
    pairs = _query_rows_against_whole(x, lengths, starts, _nsa_options(**extra), Q_TILE,
                                      SMALL["_cmp_kv_block"])
    for name, (part, whole) in pairs.items():
        torch.testing.assert_close(part, whole, rtol=0, atol=1e-12, msg=name)


@pytest.mark.gpu
@requires_sm90
def test_query_rows_on_the_sm90_kernels():
    """The same on the GPU at nsa()'s defaults (bf16, D=128): every branch's kernels take the
    rows' positions (q_start_positions); within bf16 rounding of the whole sequences' rows."""
    from nsa.api import CMP_KV_BLOCK, SELECTION_Q_TILE

    lengths, starts = [5000, 700, 3000], [2048, 0, 1152]
    x = random_inputs(lengths, heads=8, kv_heads=2, head_dim=128, seed=6)
    x = {n: t.cuda().bfloat16() if t.is_floating_point() else t.cuda() for n, t in x.items()}
    defaults = dict(compress_block_size=64, selected_block_size=64, num_selected_blocks=16,
                    window_size=512)
    pairs = _query_rows_against_whole(x, lengths, starts, defaults, SELECTION_Q_TILE,
                                      CMP_KV_BLOCK)
    assert torch.equal(*pairs.pop("q (halo)"))
    for name, (part, whole) in pairs.items():
        error = ((part.float() - whole.float()).norm() / whole.float().norm()).item()
        assert error < 1e-2, (name, error)
