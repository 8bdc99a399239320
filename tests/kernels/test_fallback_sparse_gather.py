"""The fallback's block-sparse path, which gathers only the keys each (tile, head) lists, against
the dense float64 reference: outputs, lse and gradients with many tiles and long lists, lists
per query head and per KV group, varlen (empty sequences, sequences without keys), rows that see
nothing, batching of tiles, unlisted keys never read, and memory that follows the lists."""
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
from sparsity import BlockSparseTensors, build_selected_block_sparse

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    name: str
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    heads: int
    kv_heads: int
    lists_per: str  # "query" (Hs = H) or "kv" (Hs = Hkv)
    q_tile: int
    kv_block: int
    causal: bool = False
    compress_factor: int = 1
    window_size: tuple[int, int] = (-1, -1)
    builder: str = "random"  # "random" lists, or "selected": NSA-like, build_selected_block_sparse
    head_dim: int = 8

    def __str__(self) -> str:
        return self.name


CASES = [
    # 40 tiles, ~25 of 50 blocks listed per (tile, head) at random, full or mask.
    Case("many-tiles-long-lists-kv", (160,), (200,), heads=4, kv_heads=2, lists_per="kv",
         q_tile=4, kv_block=4),
    Case("many-tiles-causal-query", (150,), (150,), heads=4, kv_heads=2, lists_per="query",
         q_tile=8, kv_block=4, causal=True),
    Case("varlen-query-heads-window", (0, 13, 40, 1, 27), (0, 13, 40, 1, 27), heads=6,
         kv_heads=2, lists_per="query", q_tile=8, kv_block=4, causal=True, window_size=(9, 0)),
    Case("varlen-no-keys-gqa4", (9, 12, 30), (0, 7, 22), heads=8, kv_heads=2, lists_per="kv",
         q_tile=4, kv_block=8),
    Case("two-sided-window-partial-blocks", (37, 22), (37, 22), heads=2, kv_heads=2,
         lists_per="kv", q_tile=5, kv_block=3, window_size=(4, 6)),
    Case("compressed-cf4-gqa16", (70, 45), (17, 11), heads=16, kv_heads=1, lists_per="kv",
         q_tile=16, kv_block=2, causal=True, compress_factor=4),
    Case("nsa-selected-causal", (300, 77), (300, 77), heads=8, kv_heads=2, lists_per="kv",
         q_tile=32, kv_block=8, causal=True, builder="selected"),
    Case("nsa-selected-query-heads", (130,), (130,), heads=4, kv_heads=1, lists_per="query",
         q_tile=16, kv_block=8, causal=True, builder="selected"),
]
CASE = {case.name: case for case in CASES}


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def nsa_like_lists(generator, case: Case, list_heads: int, picks: int = 6) -> BlockSparseTensors:
    """Lists from random selections plus block 0 and each tile's diagonal, as NSA builds them:
    full blocks in the past, mask blocks on the diagonal, future picks dropped."""
    cu_q, cu_k = _cu(case.seqlens_q), _cu(case.seqlens_k)
    rows = []
    for nq, nk in zip(case.seqlens_q, case.seqlens_k):
        num_blocks = max(1, -(-nk // case.kv_block))
        for tile in range(-(-nq // case.q_tile)):
            diagonal = torch.arange(tile * case.q_tile // case.kv_block,
                                    ((tile + 1) * case.q_tile - 1) // case.kv_block + 1)
            random = torch.randint(-1, num_blocks, (list_heads, picks), generator=generator)
            forced = torch.cat([torch.zeros(1, dtype=torch.long), diagonal])
            rows.append(torch.cat([forced.expand(list_heads, -1), random], dim=-1))
    selected = torch.nn.utils.rnn.pad_sequence(
        [row.T for row in rows], batch_first=True, padding_value=-1).transpose(1, 2)
    return build_selected_block_sparse(selected, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                       q_tile=case.q_tile, selected_block_size=case.kv_block,
                                       kv_block=case.kv_block, causal=case.causal)


def make_inputs(case: Case, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    q = randn(sum(case.seqlens_q), case.heads, case.head_dim)
    k = randn(sum(case.seqlens_k), case.kv_heads, case.head_dim)
    v = randn(sum(case.seqlens_k), case.kv_heads, case.head_dim)
    list_heads = case.heads if case.lists_per == "query" else case.kv_heads
    if case.builder == "selected":
        block_sparse = nsa_like_lists(generator, case, list_heads)
    else:
        block_sparse = random_block_sparse(generator, case.seqlens_q, case.seqlens_k,
                                           heads=list_heads, q_tile=case.q_tile,
                                           kv_block=case.kv_block)
    kwargs = dict(cu_seqlens_q=_cu(case.seqlens_q), cu_seqlens_k=_cu(case.seqlens_k),
                  causal=case.causal, compress_factor=case.compress_factor,
                  window_size=case.window_size, block_sparse=block_sparse)
    return q, k, v, kwargs


def reference_with_grads(q, k, v, dout, kwargs):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, **kwargs)
    out.backward(dout.double())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def blind_rows(case: Case, kwargs) -> torch.Tensor:
    """(H, Tq) bool: rows that see no key, from the reference's literal visibility."""
    cu_q, cu_k = kwargs["cu_seqlens_q"].tolist(), kwargs["cu_seqlens_k"].tolist()
    return torch.cat([
        ~visibility(cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s], heads=case.heads,
                    kv_heads=case.kv_heads, causal=case.causal,
                    compress_factor=case.compress_factor, window_size=case.window_size,
                    block_sparse=kwargs["block_sparse"], seq=s).any(-1)
        for s in range(len(cu_q) - 1)], dim=1)


def max_rel_err(actual, expected) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def tiles_budget(q, k, v, kwargs, tiles: int) -> int:
    """A chunk budget that fits exactly `tiles` tiles per batch."""
    problem = validate_attention_forward(q, k, v, **kwargs)
    return tiles * fallback._bytes_per_tile(problem, kwargs["block_sparse"], torch.float64)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float64_matches_reference(case):
    """The gather path computes the reference's function: fp64 agrees to rounding."""
    q, k, v, kwargs = make_inputs(case)
    bs = kwargs["block_sparse"]
    assert int(bs.full_count.sum()) > 0, "the case must list full blocks"
    assert case.builder == "selected" or int(bs.mask_count.sum()) > 0
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, kwargs)

    assert out.dtype == lse.dtype == torch.float64
    assert max_rel_err(out, ref_out) < 1e-12
    blind = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), blind)
    assert max_rel_err(lse[~blind], ref_lse[~blind]) < 1e-12
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert grad.shape == ref.shape and grad.dtype == torch.float64, name
        assert torch.isfinite(grad).all(), name
        assert max_rel_err(grad, ref) < 1e-12, name


@pytest.mark.parametrize("name", ["many-tiles-causal-query", "varlen-no-keys-gqa4",
                                  "nsa-selected-causal"])
def test_float32_and_bfloat16_match_reference(name):
    case = CASE[name]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q, k, v, kwargs = make_inputs(case, dtype=dtype, seed=2)
        out, lse = attention_forward_fallback(q, k, v, **kwargs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        grads = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
        ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, kwargs)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert max_rel_err(out, ref_out) < tol
        for grad, ref in zip(grads, ref_grads):
            assert grad.dtype == dtype and max_rel_err(grad, ref) < tol


@pytest.mark.parametrize("name", ["many-tiles-long-lists-kv", "varlen-query-heads-window",
                                  "compressed-cf4-gqa16"])
def test_batches_of_tiles_give_the_same_numbers(name):
    """One tile per batch, three (batches cut across a sequence's tiles), or all at once."""
    case = CASE[name]
    q, k, v, kwargs = make_inputs(case, seed=4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    results = []
    for budget in (tiles_budget(q, k, v, kwargs, 1), tiles_budget(q, k, v, kwargs, 3),
                   fallback.CHUNK_BUDGET_BYTES):
        out, lse = attention_forward_fallback(q, k, v, chunk_budget_bytes=budget, **kwargs)
        grads = attention_backward_fallback(dout, q, k, v, out, lse, chunk_budget_bytes=budget,
                                            **kwargs)
        results.append((out, lse, *grads))
    for one_tile, three_tiles, everything in zip(*results):
        torch.testing.assert_close(one_tile, everything, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(three_tiles, everything, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("lists_per", ["query", "kv"])
def test_rows_that_see_nothing(lists_per):
    """Tiles with empty lists, sequences without keys, causal rows before their only mask
    block: out 0 and lse -inf exactly, zero dq, no NaN, and their dout moves no gradient."""
    case = Case(f"blind-{lists_per}", (9, 16, 0, 21), (0, 16, 3, 21), heads=4, kv_heads=2,
                lists_per=lists_per, q_tile=4, kv_block=4, causal=True)
    q, k, v, kwargs = make_inputs(case, seed=6)
    blind = blind_rows(case, kwargs)
    assert blind.any() and (~blind).any(), "the case must have blind and seeing rows"
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    assert torch.equal(lse == float("-inf"), blind)
    assert (out.transpose(0, 1)[blind] == 0).all()

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    dq, dk, dv = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq.transpose(0, 1)[blind] == 0).all()
    noisy = dout.clone()
    noisy.transpose(0, 1)[blind] = 1e3 * torch.randn(int(blind.sum()), case.head_dim,
                                                      dtype=dout.dtype)
    _, dk_noisy, dv_noisy = attention_backward_fallback(noisy, q, k, v, out, lse, **kwargs)
    assert torch.equal(dk, dk_noisy) and torch.equal(dv, dv_noisy)


def test_no_lists_at_all():
    """Lists of width 0 (nothing listed anywhere): every row sees nothing."""
    case = CASE["varlen-no-keys-gqa4"]
    q, k, v, kwargs = make_inputs(case, seed=8)
    bs = kwargs["block_sparse"]
    empty_index = torch.empty(bs.num_rows, bs.num_heads, 0, dtype=torch.int32)
    kwargs["block_sparse"] = BlockSparseTensors(
        full_count=torch.zeros_like(bs.full_count), full_index=empty_index,
        mask_count=torch.zeros_like(bs.mask_count), mask_index=empty_index.clone(),
        row_block_size=bs.row_block_size, col_block_size=bs.col_block_size,
        row_block_offsets=bs.row_block_offsets)
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    assert (out == 0).all() and (lse == float("-inf")).all()
    grads = attention_backward_fallback(torch.randn_like(out), q, k, v, out, lse, **kwargs)
    assert all((g == 0).all() for g in grads)


def without_blocks(bs: BlockSparseTensors, dropped: int, every: int) -> BlockSparseTensors:
    """The same lists without the blocks b with b % every == dropped: keys nobody lists."""
    def drop(count, index):
        keep = (torch.arange(index.shape[-1]) < count.unsqueeze(-1)) & (index % every != dropped)
        kept = index.masked_fill(~keep, torch.iinfo(index.dtype).max).sort(dim=-1).values
        kept = kept.masked_fill(kept == torch.iinfo(index.dtype).max, -1)
        return keep.sum(-1, dtype=torch.int32), kept.contiguous()

    full_count, full_index = drop(bs.full_count, bs.full_index)
    mask_count, mask_index = drop(bs.mask_count, bs.mask_index)
    return BlockSparseTensors(full_count=full_count, full_index=full_index,
                              mask_count=mask_count, mask_index=mask_index,
                              row_block_size=bs.row_block_size, col_block_size=bs.col_block_size,
                              row_block_offsets=bs.row_block_offsets)


@pytest.mark.parametrize("name", ["many-tiles-long-lists-kv", "varlen-query-heads-window"])
def test_unlisted_keys_are_never_read(name):
    """NaN in every key and value of blocks no (tile, head) lists changes nothing: the path
    reads only listed blocks (and the sentinel of padded slots reads as zero)."""
    case = CASE[name]
    q, k, v, kwargs = make_inputs(case, seed=9)
    bs = kwargs["block_sparse"] = without_blocks(kwargs["block_sparse"], dropped=0, every=3)
    assert int(bs.full_count.sum()) > 0 and int(bs.mask_count.sum()) > 0
    cu_k = kwargs["cu_seqlens_k"]
    sequence_of_key = torch.repeat_interleave(torch.arange(cu_k.numel() - 1), cu_k.diff())
    block_of_key = (torch.arange(k.shape[0]) - cu_k[sequence_of_key]) // bs.col_block_size
    unlisted = block_of_key % 3 == 0
    assert unlisted.any()
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[unlisted] = float("nan")
    poisoned_v[unlisted] = float("nan")

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10), dtype=q.dtype)
    out, lse = attention_forward_fallback(q, k, v, **kwargs)
    expected = (out, lse, *attention_backward_fallback(dout, q, k, v, out, lse, **kwargs))
    out_p, lse_p = attention_forward_fallback(q, poisoned_k, poisoned_v, **kwargs)
    dq_p, dk_p, dv_p = attention_backward_fallback(dout, q, poisoned_k, poisoned_v, out_p, lse_p,
                                                   **kwargs)
    assert (dk_p[unlisted] == 0).all() and (dv_p[unlisted] == 0).all()
    for actual, wanted in zip((out_p, lse_p, dq_p, dk_p, dv_p), expected):
        assert torch.equal(actual, wanted)


def test_batches_follow_the_lists_not_the_sequence_length():
    """NSA's selected branch (tiles of 128, 16 blocks of 64): every batch of tiles stays under
    the budget, the batches cover every tile once, and tiles per batch do not shrink as the
    sequence grows (the work per tile is the listed keys, not N)."""
    heads, kv_heads, head_dim, q_tile, kv_block, selected = 8, 2, 64, 128, 64, 16
    budget = fallback.CHUNK_BUDGET_BYTES
    largest_batch = []
    for seqlen in (8 * 1024, 64 * 1024):
        q = torch.empty(1, seqlen, heads, head_dim, device="meta")
        k = torch.empty(1, seqlen, kv_heads, head_dim, device="meta")
        problem = validate_attention_forward(q, k, k, causal=True)
        num_tiles = seqlen // q_tile
        index = torch.zeros(num_tiles, kv_heads, selected // 2, dtype=torch.int32)
        count = torch.zeros(num_tiles, kv_heads, dtype=torch.int32)
        bs = BlockSparseTensors(full_count=count, full_index=index, mask_count=count,
                                mask_index=index, row_block_size=q_tile, col_block_size=kv_block,
                                row_block_offsets=torch.tensor([0, num_tiles], dtype=torch.int32))
        covered, largest = 0, 0
        for batch in fallback._tile_batches(problem, bs, torch.float32, budget):
            assert batch.first_tile == batch.first_local_tile == covered
            scores_bytes = heads * q_tile * selected * kv_block * (4 * 4 + 4)
            assert batch.num_tiles * scores_bytes <= budget
            assert batch.row_start == covered * q_tile
            assert batch.row_end == min(seqlen, (covered + batch.num_tiles) * q_tile)
            covered += batch.num_tiles
            largest = max(largest, batch.num_tiles)
        assert covered == num_tiles
        largest_batch.append(largest)
    assert largest_batch[0] == largest_batch[1] > 1
