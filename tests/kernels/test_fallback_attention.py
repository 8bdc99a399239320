"""The torch fallback against the dense float64 reference: outputs, lse and gradients, over
causal x compress_factor, windows, block sparsity, varlen and GQA; rows that see nothing;
causality; chunking."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from kernels import fallback
from kernels.fallback import attention_backward_fallback, attention_forward_fallback
from kernels.validate import validate_attention_forward
from reference_attention import (one_thread, random_block_sparse,  # noqa: F401 (fixture)
                                 reference_attention, visibility)

TINY_BUDGET = 1  # one row per chunk

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    name: str
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...] | None = None  # default: seqlens_q // compress_factor
    varlen: bool = True
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    causal: bool = False
    compress_factor: int = 1
    window_size: tuple[int, int] = (-1, -1)
    sparse_heads: str | None = None  # "query" (Hs = H) or "kv" (Hs = Hkv)
    q_tile: int = 8
    kv_block: int = 4

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("padded-dense", (37, 37), varlen=False),
    Case("padded-causal-gqa4", (37, 37), varlen=False, heads=8, kv_heads=2, causal=True),
    Case("padded-causal-cf4", (37, 37), varlen=False, heads=4, kv_heads=1, causal=True,
         compress_factor=4),
    Case("padded-causal-cf16-gqa16", (70,), varlen=False, heads=16, kv_heads=1, head_dim=8,
         causal=True, compress_factor=16),
    Case("padded-causal-nq20-nk33", (20, 20), (33, 33), varlen=False, heads=2, kv_heads=2,
         causal=True),
    Case("padded-window-left-only", (29, 29), varlen=False, kv_heads=2, window_size=(5, -1)),
    Case("padded-window-two-sided", (29,), varlen=False, window_size=(3, 2)),
    Case("padded-causal-window", (33, 33), varlen=False, heads=8, kv_heads=2, causal=True,
         window_size=(7, 0)),
    Case("varlen-causal-8seqs", (0, 1, 17, 5, 33, 2, 1, 9), heads=8, kv_heads=2, causal=True),
    Case("varlen-causal-cf4-window", (0, 1, 17, 5, 33), heads=4, kv_heads=2, causal=True,
         compress_factor=4, window_size=(12, -1)),
    Case("varlen-dense-gqa16", (3, 0, 11), heads=16, kv_heads=1, head_dim=8),
    Case("varlen-single-rows", (1, 1, 6), causal=True),
    Case("varlen-one-sequence", (45,), heads=2, kv_heads=1, causal=True, compress_factor=4),
    Case("varlen-causal-nq-ne-nk", (5, 12, 0), (9, 3, 4), heads=4, kv_heads=1, causal=True),
    Case("varlen-window-cf4-noncausal", (13, 27), kv_heads=1, compress_factor=4,
         window_size=(6, 9)),
    Case("sparse-per-query-head-causal", (0, 1, 17, 5, 33), heads=4, kv_heads=2, causal=True,
         sparse_heads="query"),
    Case("sparse-per-kv-head-padded-window", (30, 30), varlen=False, heads=8, kv_heads=2,
         window_size=(6, 3), sparse_heads="kv"),
    Case("sparse-per-kv-head-causal-cf4", (19, 40, 3), heads=4, kv_heads=1, causal=True,
         compress_factor=4, sparse_heads="kv", q_tile=16, kv_block=2),
    Case("sparse-gqa16-noncausal", (21, 9), heads=16, kv_heads=1, head_dim=8,
         sparse_heads="kv", q_tile=4, kv_block=8),
]
CASE = {case.name: case for case in CASES}
LOW_PRECISION_CASES = [CASE[name] for name in (
    "padded-causal-gqa4", "varlen-causal-8seqs", "sparse-per-query-head-causal",
    "sparse-per-kv-head-causal-cf4")]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def make_inputs(case: Case, dtype=torch.float32, seed=0):
    """Random q, k, v and the keyword arguments of attention_forward for `case`."""
    generator = torch.Generator().manual_seed(seed)
    seqlens_k = case.seqlens_k or tuple(n // case.compress_factor for n in case.seqlens_q)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    if case.varlen:
        q = randn(sum(case.seqlens_q), case.heads, case.head_dim)
        k = randn(sum(seqlens_k), case.kv_heads, case.head_dim)
        v = randn(sum(seqlens_k), case.kv_heads, case.head_dim)
        kwargs = dict(cu_seqlens_q=_cu(case.seqlens_q), cu_seqlens_k=_cu(seqlens_k))
    else:
        batch = len(case.seqlens_q)
        q = randn(batch, case.seqlens_q[0], case.heads, case.head_dim)
        k = randn(batch, seqlens_k[0], case.kv_heads, case.head_dim)
        v = randn(batch, seqlens_k[0], case.kv_heads, case.head_dim)
        kwargs = {}
    kwargs.update(causal=case.causal, compress_factor=case.compress_factor,
                  window_size=case.window_size)
    if case.sparse_heads is not None:
        heads = case.heads if case.sparse_heads == "query" else case.kv_heads
        kwargs["block_sparse"] = random_block_sparse(
            generator, case.seqlens_q, seqlens_k, heads=heads, q_tile=case.q_tile,
            kv_block=case.kv_block)
    return q, k, v, kwargs


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def reference_with_grads(q, k, v, dout, kwargs):
    """Reference (out, lse) and (dq, dk, dv) through torch autograd, in float64."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, **kwargs)
    out.backward(dout.double())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def check_lse(lse: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    blind = expected == float("-inf")
    assert torch.equal(lse == float("-inf"), blind), "lse is -inf exactly where rows see nothing"
    assert rel_err(lse[~blind], expected[~blind]) < tol


@pytest.mark.parametrize("budget", [fallback.CHUNK_BUDGET_BYTES, TINY_BUDGET],
                         ids=["one-chunk", "row-chunks"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp32_matches_reference(case, budget):
    q, k, v, kwargs = make_inputs(case)
    out, lse = attention_forward_fallback(q, k, v, chunk_budget_bytes=budget, **kwargs)
    dout = torch.randn_like(out)
    dq, dk, dv = attention_backward_fallback(dout, q, k, v, out, lse, chunk_budget_bytes=budget,
                                             **kwargs)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, kwargs)

    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse, 1e-5)
    for name, grad, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert grad.shape == ref.shape and grad.dtype == torch.float32, name
        assert rel_err(grad, ref) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=str)
def test_low_precision_matches_reference(case, dtype):
    q, k, v, kwargs = make_inputs(case, dtype=dtype, seed=1)
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    dout = torch.randn(out.shape).to(dtype)
    grads = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, kwargs)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse, 1e-2)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert grad.dtype == dtype, name
        assert rel_err(grad, ref) < 1e-2, name


@pytest.mark.parametrize("case", [
    Case("cf16-first-15-rows", (40,), causal=True, compress_factor=16),
    Case("window-right-only-cf8", (30,), compress_factor=8, window_size=(-1, 2), kv_heads=2),
    Case("sparse-empty-tiles", (24, 0, 17), heads=4, kv_heads=2, causal=True,
         sparse_heads="query", q_tile=4, kv_block=4),
], ids=str)
def test_rows_that_see_nothing(case):
    """Blind rows: out 0 and lse -inf exactly, zero dq, and their dout moves no gradient."""
    q, k, v, kwargs = make_inputs(case, seed=2)
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    cu_q, cu_k = kwargs["cu_seqlens_q"].tolist(), kwargs["cu_seqlens_k"].tolist()
    blind = torch.cat([
        ~visibility(cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s], heads=case.heads,
                    kv_heads=case.kv_heads, causal=case.causal,
                    compress_factor=case.compress_factor, window_size=case.window_size,
                    block_sparse=kwargs.get("block_sparse"), seq=s).any(-1)
        for s in range(len(cu_q) - 1)], dim=1)  # (H, Tq)
    assert blind.any() and (~blind).any(), "the case must have blind and seeing rows"

    assert torch.equal(lse == float("-inf"), blind)
    assert (out.transpose(0, 1)[blind] == 0).all()
    dout = torch.randn_like(out)
    dq, dk, dv = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq.transpose(0, 1)[blind] == 0).all()

    noisy_dout = dout.clone()
    noisy_dout.transpose(0, 1)[blind] = 1e3 * torch.randn(int(blind.sum()), case.head_dim)
    _, dk_noisy, dv_noisy = attention_backward_fallback(noisy_dout, q, k, v, out, lse, **kwargs)
    assert torch.equal(dk, dk_noisy) and torch.equal(dv, dv_noisy)


CAUSAL_CASES = [
    Case("causal", (23, 40), heads=4, kv_heads=2, causal=True),
    Case("causal-cf4", (23, 40), heads=4, kv_heads=1, causal=True, compress_factor=4),
    Case("causal-window", (23, 40), heads=2, kv_heads=2, causal=True, window_size=(5, 0)),
    Case("causal-sparse", (23, 40), heads=4, kv_heads=2, causal=True, sparse_heads="kv"),
]


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=str)
def test_causality(case):
    """Row i of a sequence, and every gradient it produces, depends on nothing after row i."""
    q, k, v, kwargs = make_inputs(case, seed=3)
    if case.sparse_heads is not None:  # lists whose full blocks are truly in the past
        kwargs["block_sparse"] = random_block_sparse(
            torch.Generator().manual_seed(3), case.seqlens_q, case.seqlens_q, heads=case.kv_heads,
            q_tile=case.q_tile, kv_block=case.kv_block, causal_full=True)
    from kernels import flash_attn_varlen_func

    cu_q, cu_k = kwargs["cu_seqlens_q"].tolist(), kwargs["cu_seqlens_k"].tolist()
    options = {key: value for key, value in kwargs.items() if not key.startswith("cu_")}
    seq, cut = 1, 17  # rows <= 17 of the second sequence are "the past"
    q_future = torch.arange(q.shape[0]) > cu_q[seq] + cut
    key_position = (torch.arange(k.shape[0]) - cu_k[seq] + 1) * case.compress_factor - 1
    k_future = key_position > cut  # keys of later sequences count as future too
    past_rows = slice(cu_q[seq], cu_q[seq] + cut + 1)

    def run(q, k, v):
        return flash_attn_varlen_func(q, k, v, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"],
                                      max(cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)),
                                      max(cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)),
                                      **options)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = run(*leaves)
    (out[past_rows] * torch.randn_like(out[past_rows])).sum().backward()
    assert leaves[0].grad[q_future].abs().max() == 0
    assert leaves[1].grad[k_future].abs().max() == 0
    assert leaves[2].grad[k_future].abs().max() == 0
    assert leaves[1].grad[~k_future].abs().max() > 0  # the past does get gradients

    perturbed = [x.clone() for x in (q, k, v)]
    perturbed[0][q_future] += torch.randn_like(perturbed[0][q_future])
    perturbed[1][k_future] += torch.randn_like(perturbed[1][k_future])
    perturbed[2][k_future] += torch.randn_like(perturbed[2][k_future])
    with torch.no_grad():
        out_perturbed = run(*perturbed)
    assert torch.equal(out_perturbed[past_rows], out.detach()[past_rows])
    assert not torch.equal(out_perturbed, out.detach())


@pytest.mark.parametrize("name", ["varlen-causal-cf4-window", "sparse-per-kv-head-causal-cf4",
                                  "padded-window-two-sided"])
def test_chunked_equals_unchunked(name):
    """Chunks of 3 rows (not aligned to q tiles) give the numbers of one chunk per sequence."""
    case = CASE[name]
    q, k, v, kwargs = make_inputs(case, seed=4)
    longest_k = max(case.seqlens_k or [n // case.compress_factor for n in case.seqlens_q])
    three_rows = 3 * case.heads * longest_k * (4 * 4 + 4)
    results = []
    for budget in (fallback.CHUNK_BUDGET_BYTES, three_rows):
        out, lse = attention_forward_fallback(q, k, v, chunk_budget_bytes=budget, **kwargs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        grads = attention_backward_fallback(dout, q, k, v, out, lse, chunk_budget_bytes=budget,
                                            **kwargs)
        results.append((out, lse, *grads))
    for one_chunk, chunked in zip(*results):
        torch.testing.assert_close(chunked, one_chunk, rtol=1e-5, atol=1e-5)


def test_chunks_bound_memory_at_32k():
    """At N = 32K the fallback never holds more than the budget of scores at once."""
    seqlen, heads = 32 * 1024, 8
    q = torch.empty(1, seqlen, heads, 64, device="meta")
    k = torch.empty(1, seqlen, 2, 64, device="meta")
    budget = fallback.CHUNK_BUDGET_BYTES
    for causal in (False, True):
        problem = validate_attention_forward(q, k, k, causal=causal)
        rows_covered = 0
        for r0, r1, c0, c1 in fallback._chunks(problem, seqlen, seqlen, torch.float32,
                                               budget):
            assert r0 == rows_covered and r1 > r0
            assert heads * (r1 - r0) * (c1 - c0) * (4 * 4 + 4) <= budget  # fp32 temps + masks
            assert (c0, c1) == (0, r1 if causal else seqlen)
            rows_covered = r1
        assert rows_covered == seqlen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_padded_equals_varlen(dtype):
    """A padded batch is B equal-length sequences: same numbers, both layouts."""
    case = CASE["padded-causal-cf4"]
    q, k, v, kwargs = make_inputs(case, dtype=dtype)
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    packed_out, packed_lse = attention_forward_fallback(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
        cu_seqlens_q=_cu([seqlen_q] * batch), cu_seqlens_k=_cu([seqlen_k] * batch), **kwargs)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(packed_out, out.flatten(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(packed_lse, lse.transpose(0, 1).flatten(1), rtol=0, atol=0)
