"""kernels/call_cache.py: what a signature tells apart, and the bounded store."""
from __future__ import annotations

import torch

from kernels import call_cache
from sparsity import build_selected_block_sparse


def test_signatures_tell_apart_what_the_checks_read():
    x = torch.zeros(64, 4, 8)
    base = call_cache.tensor_signature(x)
    assert call_cache.tensor_signature(torch.zeros(64, 4, 8)) == base  # values do not count
    assert call_cache.tensor_signature(x.transpose(0, 1)) != base  # strides
    assert call_cache.tensor_signature(x.double()) != base  # dtype
    flat = torch.zeros(64 * 32 + 1)
    misaligned = flat[1:].view(64, 4, 8)  # 4 bytes past a 16-byte boundary
    assert call_cache.tensor_signature(misaligned)[:4] == base[:4]
    assert call_cache.tensor_signature(misaligned) != base


def test_lists_are_signed_field_by_field_and_host_bounds_by_value():
    cu = torch.tensor([0, 40, 72], dtype=torch.int32)
    selected = torch.zeros(3, 1, 2, dtype=torch.int32)  # 2 + 1 tiles of 32 rows
    lists = build_selected_block_sparse(selected, cu_seqlens_q=cu, cu_seqlens_k=cu, q_tile=32,
                                        selected_block_size=16, kv_block=16, causal=True)
    again = build_selected_block_sparse(selected.clone(), cu_seqlens_q=cu.clone(),
                                        cu_seqlens_k=cu.clone(), q_tile=32,
                                        selected_block_size=16, kv_block=16, causal=True)
    sign = lambda bounds, bs: call_cache.call_signature(  # noqa: E731
        "forward", (), bounds, dict(block_sparse=bs, causal=True))
    assert sign(((0, 40, 72), (0, 40, 72)), lists) == sign(([0, 40, 72], [0, 40, 72]), again)
    assert sign(((0, 40, 72), (0, 40, 72)), lists) != sign(((0, 30, 72), (0, 30, 72)), lists)


def test_the_store_keeps_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(call_cache, "MAX_ENTRIES", 2)
    call_cache.clear()
    call_cache.store(("a",), 1)
    call_cache.store(("b",), 2)
    assert call_cache.lookup(("a",)) == 1  # now the most recent
    call_cache.store(("c",), 3)
    assert call_cache.lookup(("b",)) is None and call_cache.lookup(("a",)) == 1
    call_cache.clear()
    assert call_cache.lookup(("a",)) is None
