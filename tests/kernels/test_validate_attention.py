"""kernels.validate: every bad input raises a ValueError/TypeError whose message starts with the
argument's name, before any compute; good input is described and normalised."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kernels import attention_backward, attention_forward
from kernels.interface import attention_backward_trusted
from kernels.validate import validate_attention_forward, validate_trusted_attention_backward
from op_counting import OpCounter
from reference_attention import random_block_sparse
from sparsity import (BlockSparseTensors, transpose_block_sparse, transpose_block_sparse_csr,
                      validate_block_sparse_csr)

H, HKV, D = 4, 2, 8
CU = [0, 3, 3, 10]  # sequences of 3, 0 and 7 rows


def cu(values=CU, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def padded(batch=2, seqlen=6):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, seqlen, H, D, generator=generator),
            torch.randn(batch, seqlen, HKV, D, generator=generator),
            torch.randn(batch, seqlen, HKV, D, generator=generator))


def packed(rows=10):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, H, D, generator=generator),
            torch.randn(rows, HKV, D, generator=generator),
            torch.randn(rows, HKV, D, generator=generator))


def varlen_kwargs(**overrides):
    return {"cu_seqlens_q": cu(), "cu_seqlens_k": cu(), **overrides}


def sparse(heads=HKV, q_tile=2, kv_block=2, seqlens=(3, 0, 7)):
    return random_block_sparse(torch.Generator().manual_seed(1), seqlens, seqlens, heads=heads,
                               q_tile=q_tile, kv_block=kv_block)


def one_mask_block(block):
    """Lists for sequences (3, 0, 7), tiles and blocks of 2: only the last tile lists `block`
    (as mask, for KV head 0). The last sequence has ceil(7 / 2) = 4 blocks: 0..3."""
    mask_count = torch.zeros(6, HKV, dtype=torch.int32)
    mask_count[5, 0] = 1
    mask_index = torch.full((6, HKV, 1), -1, dtype=torch.int32)
    mask_index[5, 0, 0] = block
    return BlockSparseTensors(
        full_count=torch.zeros(6, HKV, dtype=torch.int32),
        full_index=torch.zeros(6, HKV, 0, dtype=torch.int32), mask_count=mask_count,
        mask_index=mask_index, row_block_size=2, col_block_size=2,
        row_block_offsets=cu([0, 2, 2, 6]))


def replace(bs, **fields):
    values = {name: getattr(bs, name) for name in (
        "full_count", "full_index", "mask_count", "mask_index", "row_block_size",
        "col_block_size", "row_block_offsets")}
    values.update(fields)
    return BlockSparseTensors(**values)


def raises(error, name):
    """Expect `error` with a message that starts with the argument's name."""
    return pytest.raises(error, match=rf"^{re.escape(name)}\b")


def noncontiguous_last_dim(x):
    return torch.cat([x, x], dim=-1)[..., ::2]


def _bad_forward_inputs():
    """(case id, error, name, q, k, v, kwargs) for attention_forward."""
    q, k, v = padded()
    pq, pk, pv = packed()
    meta = torch.device("meta")
    bs = sparse()
    offsets = bs.row_block_offsets.clone()
    offsets[1] += 1
    return [
        ("q-not-tensor", TypeError, "q", q.tolist(), k, v, {}),
        ("v-not-tensor", TypeError, "v", q, k, None, {}),
        ("q-rank-padded", ValueError, "q", pq, k, v, {}),
        ("k-rank-padded", ValueError, "k", q, pk, v, {}),
        ("q-rank-varlen", ValueError, "q", q, pk, pv, varlen_kwargs()),
        ("v-rank-varlen", ValueError, "v", pq, pk, v, varlen_kwargs()),
        ("q-dtype-int", TypeError, "q", q.long(), k.long(), v.long(), {}),
        ("k-dtype-mismatch", TypeError, "k", q, k.half(), v, {}),
        ("v-dtype-mismatch", TypeError, "v", q, k, v.double(), {}),
        ("k-device", ValueError, "k", q, k.to(meta), v, {}),
        ("v-device", ValueError, "v", q, k, v.to(meta), {}),
        ("v-shape", ValueError, "v", q, k, v[:, :5], {}),
        ("k-batch", ValueError, "k", q, k[:1], v[:1], {}),
        ("k-heads-not-dividing", ValueError, "k", q, k[:, :, :1].expand(-1, -1, 3, -1),
         v[:, :, :1].expand(-1, -1, 3, -1), {}),
        ("k-head-dim", ValueError, "k", q, k[..., :4], v[..., :4], {}),
        ("v-head-dim", ValueError, "v", q, k, v[..., :4], {}),
        ("q-no-heads", ValueError, "q", q[:, :, :0], k, v, {}),
        ("q-head-dim-0", ValueError, "q", q[..., :0], k[..., :0], v[..., :0], {}),
        ("q-stride", ValueError, "q", noncontiguous_last_dim(q), k, v, {}),
        ("k-stride", ValueError, "k", q, noncontiguous_last_dim(k), v, {}),
        ("v-stride", ValueError, "v", q, k, noncontiguous_last_dim(v), {}),
        ("cu-q-without-k", ValueError, "cu_seqlens_q", pq, pk, pv, dict(cu_seqlens_q=cu())),
        ("cu-k-without-q", ValueError, "cu_seqlens_k", pq, pk, pv, dict(cu_seqlens_k=cu())),
        ("cu-q-not-tensor", TypeError, "cu_seqlens_q", pq, pk, pv,
         varlen_kwargs(cu_seqlens_q=CU)),
        ("cu-q-int64", TypeError, "cu_seqlens_q", pq, pk, pv,
         varlen_kwargs(cu_seqlens_q=cu(dtype=torch.int64))),
        ("cu-k-2d", ValueError, "cu_seqlens_k", pq, pk, pv,
         varlen_kwargs(cu_seqlens_k=cu().view(2, 2))),
        ("cu-q-too-short", ValueError, "cu_seqlens_q", pq, pk, pv,
         varlen_kwargs(cu_seqlens_q=cu([10]))),
        ("cu-k-device", ValueError, "cu_seqlens_k", pq, pk, pv,
         varlen_kwargs(cu_seqlens_k=cu().to(meta))),
        ("cu-k-length", ValueError, "cu_seqlens_k", pq, pk, pv,
         varlen_kwargs(cu_seqlens_k=cu([0, 10]))),
        ("cu-q-start", ValueError, "cu_seqlens_q", pq, pk, pv,
         varlen_kwargs(cu_seqlens_q=cu([1, 3, 3, 10]))),
        ("cu-k-decreasing", ValueError, "cu_seqlens_k", pq, pk, pv,
         varlen_kwargs(cu_seqlens_k=cu([0, 5, 3, 10]))),
        ("cu-q-end", ValueError, "cu_seqlens_q", pq, pk, pv,
         varlen_kwargs(cu_seqlens_q=cu([0, 3, 3, 9]))),
        ("max-seqlen-q-short", ValueError, "max_seqlen_q", pq, pk, pv,
         varlen_kwargs(max_seqlen_q=6)),
        ("max-seqlen-k-float", TypeError, "max_seqlen_k", pq, pk, pv,
         varlen_kwargs(max_seqlen_k=7.0)),
        ("max-seqlen-q-padded", ValueError, "max_seqlen_q", q, k, v, dict(max_seqlen_q=7)),
        # Above int32 (cu_seqlens' type, the kernels' Int32 arithmetic): it describes nothing.
        ("max-seqlen-q-beyond-int32", ValueError, "max_seqlen_q", pq, pk, pv,
         varlen_kwargs(max_seqlen_q=2**31)),
        ("max-seqlen-k-2**40", ValueError, "max_seqlen_k", pq, pk, pv,
         varlen_kwargs(max_seqlen_k=2**40)),
        ("max-seqlen-q-padded-2**40", ValueError, "max_seqlen_q", q, k, v,
         dict(max_seqlen_q=2**40)),
        # Meta tensors have shapes but no values: refused by name at the entry points.
        ("q-meta", ValueError, "q", q.to(meta), k.to(meta), v.to(meta), {}),
        ("q-meta-varlen", ValueError, "q", pq.to(meta), pk.to(meta), pv.to(meta),
         varlen_kwargs(cu_seqlens_q=cu().to(meta), cu_seqlens_k=cu().to(meta))),
        ("q-meta-only", ValueError, "q", q.to(meta), k, v, {}),
        ("window-low", ValueError, "window_size", q, k, v, dict(window_size=(-2, 0))),
        ("window-float", TypeError, "window_size", q, k, v, dict(window_size=(1.5, 0))),
        ("window-length", TypeError, "window_size", q, k, v, dict(window_size=(3,))),
        ("window-int", TypeError, "window_size", q, k, v, dict(window_size=3)),
        ("compress-factor-0", ValueError, "compress_factor", q, k, v, dict(compress_factor=0)),
        ("compress-factor-float", TypeError, "compress_factor", q, k, v,
         dict(compress_factor=2.0)),
        ("compress-factor-bool", TypeError, "compress_factor", q, k, v,
         dict(compress_factor=True)),
        ("scale-zero", ValueError, "softmax_scale", q, k, v, dict(softmax_scale=0.0)),
        ("scale-negative", ValueError, "softmax_scale", q, k, v, dict(softmax_scale=-1.0)),
        ("scale-inf", ValueError, "softmax_scale", q, k, v, dict(softmax_scale=float("inf"))),
        ("scale-nan", ValueError, "softmax_scale", q, k, v, dict(softmax_scale=float("nan"))),
        ("scale-string", TypeError, "softmax_scale", q, k, v, dict(softmax_scale="0.1")),
        ("scale-inf-in-float32", ValueError, "softmax_scale", q, k, v,
         dict(softmax_scale=1e39)),
        ("causal-int", TypeError, "causal", q, k, v, dict(causal=1)),
        ("sparse-not-dataclass", TypeError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=object())),
        ("sparse-heads", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=sparse(heads=3))),
        ("sparse-tiles", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=sparse(seqlens=(3, 0, 9)))),
        ("sparse-offsets", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=replace(bs, row_block_offsets=offsets))),
        ("sparse-block-past-end", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=one_mask_block(4))),
        ("sparse-index-dtype", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=replace(bs, full_index=bs.full_index.long()))),
        ("sparse-device", ValueError, "block_sparse", pq, pk, pv,
         varlen_kwargs(block_sparse=sparse().to(meta))),
        ("sparse-padded-sequences", ValueError, "block_sparse", q, k, v,
         dict(block_sparse=sparse())),
    ]


BAD_FORWARD = _bad_forward_inputs()


@pytest.mark.parametrize("error, name, q, k, v, kwargs", [case[1:] for case in BAD_FORWARD],
                         ids=[case[0] for case in BAD_FORWARD])
def test_forward_rejects(error, name, q, k, v, kwargs):
    with raises(error, name):
        attention_forward(q, k, v, **kwargs)


def csr(bs, col_block_offsets=(0, 3, 6), check=True):
    """The backward's transposed lists of `bs` over sequences of 3 KV blocks (6 keys, blocks of
    2) each, as the padded backward tests use them (or over other `col_block_offsets`)."""
    return transpose_block_sparse_csr(bs, col_block_offsets=cu(list(col_block_offsets)),
                                      num_col_blocks=col_block_offsets[-1], check=check)


def padded_lists(heads=HKV, seed=1):
    """Lists for `padded()`: 2 sequences of 6 rows, tiles of 4 rows, blocks of 2 keys."""
    return random_block_sparse(torch.Generator().manual_seed(seed), (6, 6), (6, 6), heads=heads,
                               q_tile=4, kv_block=2)


def _bad_backward_inputs():
    """(case id, error, name, dout, out, lse, kwargs) for attention_backward on `padded()`."""
    q, k, v = padded()
    out, lse = attention_forward(q, k, v)
    bs = padded_lists()
    transposed = csr(bs)
    other_entries = csr(padded_lists(seed=2))
    assert not other_entries.equals(transposed)
    return [
        ("dout-not-tensor", TypeError, "dout", None, out, lse, {}),
        ("dout-shape", ValueError, "dout", out[:, :5], out, lse, {}),
        ("dout-heads", ValueError, "dout", out[:, :, :2], out, lse, {}),
        ("dout-dtype", TypeError, "dout", out.double(), out, lse, {}),
        ("dout-stride", ValueError, "dout", noncontiguous_last_dim(out), out, lse, {}),
        ("dout-stride-0", ValueError, "dout", out[..., :1].expand(out.shape), out, lse, {}),
        ("dout-device", ValueError, "dout", out.to("meta"), out, lse, {}),
        ("q-meta", ValueError, "q", out.to("meta"), out.to("meta"), lse.to("meta"),
         dict(q=q.to("meta"), k=k.to("meta"), v=v.to("meta"))),
        ("out-shape", ValueError, "out", out, out[..., :4], lse, {}),
        ("out-dtype", TypeError, "out", out, out.half(), lse, {}),
        ("lse-varlen-layout", ValueError, "lse", out, out, lse.transpose(0, 1).flatten(1), {}),
        ("lse-dtype", TypeError, "lse", out, out, lse.double(), {}),
        ("lse-device", ValueError, "lse", out, out, lse.to("meta"), {}),
        ("deterministic-int", TypeError, "deterministic", out, out, lse,
         dict(deterministic=1)),
        ("deterministic-str", TypeError, "deterministic", out, out, lse,
         dict(deterministic="false")),
        ("transposed-without-lists", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse_transposed=transposed)),
        ("transposed-not-csr", TypeError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=object())),
        # The padded transpose (BlockSparseTensors) is the sparsity package's too, but the
        # backward takes the CSR only.
        ("transposed-padded-layout", TypeError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=transpose_block_sparse(
             bs, col_block_offsets=cu([0, 3, 6])))),
        ("transposed-block-sizes", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=dataclasses.replace(
             transposed, col_block_size=2))),
        ("transposed-heads", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=csr(padded_lists(heads=H)))),
        ("transposed-kv-blocks", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=csr(bs, (0, 3, 7)))),
        ("transposed-sequences", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=dataclasses.replace(
             transposed, row_block_offsets=cu([0, 6])))),
        ("transposed-offsets-dtype", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=dataclasses.replace(
             transposed, offsets=transposed.offsets.long()))),
        ("transposed-device", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=transposed.to("meta"))),
        # Contents (the public path reads them): the right shapes, but not these sequences' KV
        # blocks, or not the transpose of block_sparse.
        ("transposed-row-offsets", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=csr(bs, (0, 4, 6), check=False))),
        ("transposed-entries", ValueError, "block_sparse_transposed", out, out, lse,
         dict(block_sparse=bs, block_sparse_transposed=other_entries)),
    ]


BAD_BACKWARD = _bad_backward_inputs()
# Cases the trusted path (no device reads) must still reject, with the same message.
# (The trusted path is internal: nsa() refuses meta tensors before it.)
BAD_BACKWARD_WITHOUT_READS = [c for c in BAD_BACKWARD if c[0] not in (
    "transposed-row-offsets", "transposed-entries", "q-meta")]


@pytest.mark.parametrize("error, name, dout, out, lse, kwargs", [c[1:] for c in BAD_BACKWARD],
                         ids=[c[0] for c in BAD_BACKWARD])
def test_backward_rejects(error, name, dout, out, lse, kwargs):
    q, k, v = padded()
    kwargs = dict(kwargs)
    q, k, v = (kwargs.pop(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    with raises(error, name):
        attention_backward(dout, q, k, v, out, lse, **kwargs)


@pytest.mark.parametrize("error, name, dout, out, lse, kwargs",
                         [c[1:] for c in BAD_BACKWARD_WITHOUT_READS],
                         ids=[c[0] for c in BAD_BACKWARD_WITHOUT_READS])
def test_trusted_backward_rejects_what_needs_no_read(error, name, dout, out, lse, kwargs):
    q, k, v = padded()
    kwargs = dict(kwargs)
    q, k, v = (kwargs.pop(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    with raises(error, name) as public:
        attention_backward(dout, q, k, v, out, lse, **kwargs)
    with raises(error, name) as trusted:
        attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=None, **kwargs)
    assert str(trusted.value) == str(public.value)


def test_trusted_backward_takes_transposed_lists_without_reads(monkeypatch):
    q, k, v = padded()
    bs = padded_lists()
    transposed = csr(bs)
    out, lse = attention_forward(q, k, v, block_sparse=bs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    public = attention_backward(dout, q, k, v, out, lse, block_sparse=bs,
                                block_sparse_transposed=transposed)
    counter = OpCounter(monkeypatch)
    with counter:
        validate_trusted_attention_backward(dout, q, k, v, out, lse, host_cu_seqlens=None,
                                            block_sparse=bs, block_sparse_transposed=transposed)
    assert counter.reads == 0
    trusted = attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=None,
                                         block_sparse=bs, block_sparse_transposed=transposed)
    for a, b in zip(public, trusted):
        assert torch.equal(a, b)


def test_backward_accepts_matching_transposed_lists():
    q, k, v = padded()
    bs = padded_lists()
    transposed = csr(bs)
    validate_block_sparse_csr(transposed, num_heads=HKV)
    out, lse = attention_forward(q, k, v, block_sparse=bs)
    dout = torch.randn_like(out)
    grads = attention_backward(dout, q, k, v, out, lse, block_sparse=bs,
                               block_sparse_transposed=transposed)
    assert all(torch.isfinite(g).all() for g in grads)
    # The fallback reads the forward lists: the transpose changes nothing.
    without = attention_backward(dout, q, k, v, out, lse, block_sparse=bs)
    for a, b in zip(grads, without):
        assert torch.equal(a, b)


def test_varlen_backward_accepts_transposed_lists_of_empty_sequences():
    q, k, v = packed()
    bs = sparse(q_tile=2, kv_block=2)  # sequences of 3, 0 and 7 rows
    transposed = transpose_block_sparse_csr(bs, cu_seqlens_k=cu())
    out, lse = attention_forward(q, k, v, **varlen_kwargs(block_sparse=bs))
    grads = attention_backward(torch.randn_like(out), q, k, v, out, lse,
                               **varlen_kwargs(block_sparse=bs,
                                               block_sparse_transposed=transposed))
    assert all(torch.isfinite(g).all() for g in grads)


def test_last_block_of_a_sequence_is_valid():
    q, k, v = packed()
    out, lse = attention_forward(q, k, v, **varlen_kwargs(block_sparse=one_mask_block(3)))
    # Only the last row (packed row 9) and the query heads of KV head 0 see anything.
    assert torch.isfinite(lse[:2, 9]).all() and (lse[2:, 9] == float("-inf")).all()
    assert (lse[:, :9] == float("-inf")).all()
    assert (out[9, :2] != 0).all() and (out[9, 2:] == 0).all() and (out[:9] == 0).all()


def test_padded_problem_is_normalised():
    q, k, v = padded(batch=3, seqlen=6)
    problem = validate_attention_forward(q, k[:, :3], v[:, :3], causal=True, compress_factor=2,
                                         window_size=[4, 0])
    assert not problem.varlen and problem.num_seqs == 3
    assert problem.cu_seqlens_q == (0, 6, 12, 18) and problem.cu_seqlens_k == (0, 3, 6, 9)
    assert (problem.max_seqlen_q, problem.max_seqlen_k) == (6, 3)
    assert problem.softmax_scale == pytest.approx(D ** -0.5)
    assert problem.window_size == (4, 0) and problem.group_size == H // HKV
    assert problem.block_sparse_heads is None
    hash(problem)  # frozen, host values only


def test_varlen_problem_is_normalised():
    q, k, v = packed()
    bs = sparse(heads=H)
    problem = validate_attention_forward(q, k, v, cu_seqlens_q=cu(), cu_seqlens_k=cu(),
                                         softmax_scale=2, block_sparse=bs)
    assert problem.varlen and problem.num_seqs == 3
    assert problem.cu_seqlens_q == tuple(CU) and problem.max_seqlen_q == 7
    assert problem.softmax_scale == 2.0 and isinstance(problem.softmax_scale, float)
    assert problem.block_sparse_heads == H
    assert list(problem.sequences()) == [(0, 0, 3, 0, 3), (1, 3, 3, 3, 3), (2, 3, 10, 3, 10)]
    # A larger max_seqlen is allowed (kernels may round it up); normalisation keeps it.
    again = validate_attention_forward(q, k, v, cu_seqlens_q=cu(), cu_seqlens_k=cu(),
                                       max_seqlen_q=64, max_seqlen_k=7)
    assert again.max_seqlen_q == 64


def test_empty_inputs_are_valid():
    q, k, v = padded(batch=0)
    out, lse = attention_forward(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == (0, H, 6)
    q, k, v = packed(rows=0)
    zero = cu([0, 0])
    out, lse = attention_forward(q, k, v, cu_seqlens_q=zero, cu_seqlens_k=zero)
    assert out.shape == (0, H, D) and lse.shape == (H, 0)


def test_trusted_backward_adds_into_accumulators_and_checks_its_internal_arguments():
    """nsa()'s internal arguments of attention_backward_trusted: dkv_accumulators receive dk, dv
    (and are returned); wrong ones are refused by name; the row dots in place of out are the
    plan's alone (tests/nsa/test_nsa_backward_lists.py checks them there)."""
    q, k, v = padded()
    out, lse = attention_forward(q, k, v, causal=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True)
    starts = [torch.randn(x.shape, generator=torch.Generator().manual_seed(5)) for x in (k, v)]
    sums = [t.clone() for t in starts]
    got = attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=None, causal=True,
                                     dkv_accumulators=sums)
    assert torch.equal(got[0], dq) and got[1] is sums[0] and got[2] is sums[1]
    torch.testing.assert_close(sums[0], starts[0] + dk)
    torch.testing.assert_close(sums[1], starts[1] + dv)
    with pytest.raises(ValueError, match="dkv_accumulators: dk expected"):
        attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=None, causal=True,
                                   dkv_accumulators=(starts[0].double(), starts[1]))
    with pytest.raises(ValueError, match="dkv_accumulators: dv expected"):
        attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=None, causal=True,
                                   dkv_accumulators=(starts[0], starts[1][:, :3]))
    with pytest.raises(TypeError, match="dout_dot_out"):  # only the plan takes it
        attention_backward_trusted(dout, q, k, v, None, lse, host_cu_seqlens=None, causal=True,
                                   dout_dot_out=(dout * out).sum(-1))
