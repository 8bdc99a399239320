"""The split-list backward's dK/dV tile passes (kernels/sm90/dkv_tiles.py, run by
kernels/sm90/backward.py beside `BwdSpec.owned_dkv_stores`): the float32 partials zeroed only in
the tiles several work units share, and dK/dV finished tile by tile (those tiles converted,
unlisted tiles zeroed, the tiles an owning unit stored left alone).

CPU: the sm_90a builds and the refused specs. GPU (sm_90): both passes against the states
computed in torch, over packed sequences with an empty one and lengths that are no multiple of
the tile, lists per KV head and per query head, and more list rows than KV blocks (the host's
bound).
"""
from __future__ import annotations

from types import SimpleNamespace

import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from gpu_marks import requires_sm90

UNLISTED, OWNED, SUMMED = 0, 1, 2


@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode, dtype", [("zero", "bfloat16"), ("finish", "bfloat16"),
                                         ("finish", "float16")])
def test_kernel_builds_for_sm90(mode, dtype, head_dim, tile_n):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.dkv_tiles import DkvTilesSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(DkvTilesSpec(mode, dtype, head_dim, tile_n))


def test_the_spec_refuses_what_the_kernel_does_not_build():
    from kernels.sm90.dkv_tiles import DkvTilesSpec

    with pytest.raises(ValueError, match="mode 'sum'"):
        DkvTilesSpec("sum", "bfloat16", 128, 128)
    with pytest.raises(ValueError, match="dtype 'float32'"):
        DkvTilesSpec("finish", "float32", 128, 128)
    with pytest.raises(ValueError, match="head_dim 66"):
        DkvTilesSpec("finish", "bfloat16", 66, 128)
    with pytest.raises(ValueError, match="tile_n 32"):
        DkvTilesSpec("zero", "bfloat16", 128, 32)


def _lists(key_lengths, tile_n, list_heads, chunk, spare_rows, gen):
    """A stand-in for the transposed lists' CSR (what the passes read: offsets, the KV blocks'
    sequence offsets, the list heads) with list lengths of every kind: empty, one unit (at most
    `chunk`), several units; `spare_rows` empty rows past the real KV blocks."""
    blocks = torch.tensor([-(-n // tile_n) for n in key_lengths])
    row_block_offsets = torch.cat([torch.zeros(1, dtype=torch.long), blocks.cumsum(0)])
    rows = int(blocks.sum()) + spare_rows
    lengths = torch.randint(0, 3 * chunk, (rows, list_heads), generator=gen)
    lengths[::3] = torch.randint(1, chunk + 1, lengths[::3].shape, generator=gen)
    lengths[1::5] = 0
    lengths[rows - spare_rows:] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
    cu_seqlens_k = torch.cat([torch.zeros(1, dtype=torch.long),
                              torch.tensor(key_lengths).cumsum(0)])
    csr = SimpleNamespace(offsets=offsets.int().cuda(), num_heads=list_heads,
                          row_block_offsets=row_block_offsets.int().cuda())
    return csr, lengths, row_block_offsets, cu_seqlens_k.int().cuda()


def _row_states(lengths, row_block_offsets, key_lengths, tile_n, kv_heads, chunk):
    """(Tk, Hkv) state of every key row, from the list lengths (the module's rule)."""
    rows, list_heads = lengths.shape
    per_kv = lengths.view(rows, kv_heads, list_heads // kv_heads)
    entries = per_kv.sum(-1)
    state = torch.full((rows, kv_heads), SUMMED)
    state[entries == 0] = UNLISTED
    if list_heads == kv_heads:
        state[(entries > 0) & (entries <= chunk)] = OWNED
    per_row = []
    for s, n in enumerate(key_lengths):
        first = int(row_block_offsets[s])
        per_row.append(state[first + torch.arange(n) // tile_n])
    return torch.cat(per_row)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("lists_per", ["kv", "query"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, tile_n", [(128, 64), (64, 128), (128, 128)])
def test_zero_and_finish_touch_each_tile_by_its_state(head_dim, tile_n, dtype, lists_per):
    from kernels.sm90 import dkv_tiles

    gen = torch.Generator().manual_seed(head_dim + tile_n)
    key_lengths, kv_heads, group, chunk = [300, 0, 1000, 64, 129], 2, 2, 4
    list_heads = kv_heads if lists_per == "kv" else kv_heads * group
    csr, lengths, row_block_offsets, cu_seqlens_k = _lists(key_lengths, tile_n, list_heads,
                                                           chunk, spare_rows=3, gen=gen)
    state = _row_states(lengths, row_block_offsets, key_lengths, tile_n, kv_heads, chunk).cuda()
    assert {UNLISTED, SUMMED} <= set(state.unique().tolist())
    assert (OWNED in state.unique().tolist()) == (lists_per == "kv")
    shape = (sum(key_lengths), kv_heads, head_dim)
    sums = tuple(torch.randn(shape, device="cuda") for _ in range(2))
    out = tuple(torch.randn(shape, device="cuda").to(dtype) for _ in range(2))
    sums_before, out_before = tuple(t.clone() for t in sums), tuple(t.clone() for t in out)

    run = dict(csr=csr, chunk=chunk, cu_seqlens_k=cu_seqlens_k, tile_n=tile_n, sums=sums,
               out=out)
    dkv_tiles.run("zero", **run)
    torch.cuda.synchronize()
    summed = (state == SUMMED)[..., None].expand(shape)
    for after, before in zip(sums, sums_before):
        assert (after[summed] == 0).all()
        assert torch.equal(after[~summed], before[~summed])
    for after, before in zip(out, out_before):
        assert torch.equal(after, before)

    for t in sums:
        t.copy_(torch.randn(shape, device="cuda"))
    dkv_tiles.run("finish", **run)
    torch.cuda.synchronize()
    owned = (state == OWNED)[..., None].expand(shape)
    unlisted = (state == UNLISTED)[..., None].expand(shape)
    for after, before, partial in zip(out, out_before, sums):
        assert torch.equal(after[summed], partial[summed].to(dtype))
        assert (after[unlisted] == 0).all()
        assert torch.equal(after[owned], before[owned])
