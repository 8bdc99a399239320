"""Query start positions (`q_start_positions`): a sequence's queries from position p on, against
all of its keys, compute exactly rows [p, p + n) of the whole sequence's attention, forward and
backward, under every rule (causal, window, compressed keys, block-sparse lists with mask
blocks); the building block of context parallelism's sequence mode (a rank holds a later shard
of a document's queries) and of chunked prefill."""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_varlen_func
from kernels.fallback import attention_backward_fallback, attention_forward_fallback
from reference_attention import one_thread, random_block_sparse  # noqa: F401 (fixture)
from sparsity import BlockSparseTensors

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, KV_HEADS, DIM = 4, 2, 16


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(total_q: int, total_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total_k, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total_k, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    dout = torch.randn(total_q, HEADS, DIM, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _suffix_rows(lengths, starts) -> torch.Tensor:
    """Packed rows of the whole sequences that the shifted call holds: [p, n) of each."""
    cu = _cu(lengths).tolist()
    return torch.cat([torch.arange(cu[s] + p, cu[s + 1]) for s, p in enumerate(starts)])


def _compare(lengths, key_lengths, starts, options, block_sparse=None, shifted_lists=None):
    """The whole sequences' attention (queries from 0), with dout zero on rows before each
    sequence's start, against the call on rows [p, n) with q_start_positions = p."""
    q, k, v, dout = _inputs(sum(lengths), sum(key_lengths), seed=len(lengths) + sum(starts))
    rows = _suffix_rows(lengths, starts)
    dout_whole = torch.zeros_like(dout)
    dout_whole[rows] = dout[rows]
    whole = dict(cu_seqlens_q=_cu(lengths), cu_seqlens_k=_cu(key_lengths), **options)
    out, lse = attention_forward_fallback(q, k, v, block_sparse=block_sparse, **whole)
    dq, dk, dv = attention_backward_fallback(dout_whole, q, k, v, out, lse,
                                             block_sparse=block_sparse, **whole)

    shifted = dict(cu_seqlens_q=_cu([n - p for n, p in zip(lengths, starts)]),
                   cu_seqlens_k=_cu(key_lengths), q_start_positions=list(starts), **options)
    out_s, lse_s = attention_forward_fallback(q[rows], k, v, block_sparse=shifted_lists,
                                              **shifted)
    dq_s, dk_s, dv_s = attention_backward_fallback(dout[rows], q[rows], k, v, out_s, lse_s,
                                                   block_sparse=shifted_lists, **shifted)
    torch.testing.assert_close(out_s, out[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_s, lse[:, rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dq_s, dq[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dk_s, dk, rtol=0, atol=1e-12)
    torch.testing.assert_close(dv_s, dv, rtol=0, atol=1e-12)
    return out_s


@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(causal=True, window_size=(37, 0)),
    dict(causal=False, window_size=(20, 9)),
    dict(causal=False),
], ids=["causal", "causal-window", "two-sided-window", "no-rule"])
def test_queries_from_a_position_are_those_rows_of_the_whole_sequence(options):
    lengths = [300, 90, 170]
    out = _compare(lengths, lengths, [128, 0, 77], options)
    assert out.abs().sum() > 0


def test_compressed_keys_are_seen_by_position():
    """Row at position i sees compressed token j iff (j + 1) l <= i + 1, from any start."""
    l, lengths = 8, [400, 131]
    _compare(lengths, [n // l for n in lengths], [200, 64], dict(causal=True, compress_factor=l))


def test_block_sparse_mask_blocks_use_the_positions():
    """Lists of the tiles from the start on (tile-aligned starts): mask blocks apply the causal
    rule at the rows' positions."""
    q_tile, kv_block, lengths, starts = 16, 8, [96, 64], [48, 32]
    gen = torch.Generator().manual_seed(3)
    whole = random_block_sparse(gen, lengths, lengths, heads=KV_HEADS, q_tile=q_tile,
                                kv_block=kv_block, causal_full=True)
    offsets = whole.row_block_offsets.tolist()
    tiles = torch.cat([torch.arange(offsets[s] + p // q_tile, offsets[s + 1])
                       for s, p in enumerate(starts)])
    shifted = BlockSparseTensors(
        full_count=whole.full_count[tiles], full_index=whole.full_index[tiles],
        mask_count=whole.mask_count[tiles], mask_index=whole.mask_index[tiles],
        row_block_size=q_tile, col_block_size=kv_block,
        row_block_offsets=_cu([(n - p) // q_tile for n, p in zip(lengths, starts)]))
    _compare(lengths, lengths, starts, dict(causal=True), block_sparse=whole,
             shifted_lists=shifted)


def test_all_zero_starts_are_the_plain_call():
    lengths = [50, 20]
    q, k, v, _ = _inputs(70, 70, seed=0)
    options = dict(cu_seqlens_q=_cu(lengths), cu_seqlens_k=_cu(lengths), max_seqlen_q=50,
                   max_seqlen_k=50, causal=True)
    plain = flash_attn_varlen_func(q, k, v, **options)
    assert torch.equal(flash_attn_varlen_func(q, k, v, q_start_positions=(0, 0), **options),
                       plain)


def test_autograd_entry_takes_them():
    lengths, starts = [60, 40], [20, 5]
    q, k, v, dout = _inputs(100, 100, seed=1)
    rows = _suffix_rows(lengths, starts)
    leaves = [x.clone().requires_grad_() for x in (q[rows], k, v)]
    out = flash_attn_varlen_func(*leaves, _cu([40, 35]), _cu(lengths), 40, 60, causal=True,
                                 q_start_positions=starts)
    out.backward(dout[rows])
    expected_out, _ = attention_forward_fallback(
        q[rows], k, v, cu_seqlens_q=_cu([40, 35]), cu_seqlens_k=_cu(lengths), causal=True,
        q_start_positions=starts)
    torch.testing.assert_close(out.detach(), expected_out, rtol=0, atol=0)
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)


@pytest.mark.parametrize("value,error,match", [
    ((1,), ValueError, r"one int per sequence \(2\)"),
    ((1, -1), ValueError, r"q_start_positions\[1\] must be an int"),
    ((1, 2.0), ValueError, r"q_start_positions\[1\] must be an int"),
    (torch.tensor([1, 2]), TypeError, "tuple or list of 2 ints on the host"),
    ((0, 2**31 - 1), ValueError, r"q_start_positions\[1\]"),
])
def test_bad_starts_are_refused_before_any_compute(value, error, match):
    q, k, v, _ = _inputs(20, 20, seed=4)
    with pytest.raises(error, match=match):
        attention_forward_fallback(q, k, v, cu_seqlens_q=_cu([10, 10]),
                                   cu_seqlens_k=_cu([10, 10]), causal=True,
                                   q_start_positions=value)


def test_padded_calls_do_not_take_them():
    q = torch.randn(1, 8, HEADS, DIM)
    k = torch.randn(1, 8, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="packed varlen calls only"):
        attention_forward_fallback(q, k, k, causal=True, q_start_positions=(2,))
