"""The attention function of docs/interfaces.md, written the obvious way: the tests' oracle.

Dense float64, one sequence at a time, with the (H, Nq, Nk) visibility mask built literally from
the rules. Differentiable through torch autograd, so gradients come from torch, not from an
analytic backward. Small inputs only.

Also here: `random_block_sparse`, random compact lists for the tests to feed both sides, and the
`one_thread` fixture.
"""
from __future__ import annotations

import pytest
import torch

from sparsity import BlockSparseTensors


def reference_attention(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None,
                        causal=False, compress_factor=1, window_size=(-1, -1),
                        block_sparse=None):
    """``(out, lse)`` in float64, in the layouts of ``attention_forward``."""
    varlen = cu_seqlens_q is not None
    if varlen:
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        q_rows, k_rows, v_rows = q, k, v
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = [s * seqlen_q for s in range(batch + 1)]
        cu_k = [s * seqlen_k for s in range(batch + 1)]
        q_rows, k_rows, v_rows = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    q_rows, k_rows, v_rows = q_rows.double(), k_rows.double(), v_rows.double()
    heads, kv_heads, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    group = heads // kv_heads
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale

    outs, lses = [], []
    for seq in range(len(cu_q) - 1):
        qs = q_rows[cu_q[seq]:cu_q[seq + 1]]
        ks = k_rows[cu_k[seq]:cu_k[seq + 1]].repeat_interleave(group, dim=1)  # head h -> h // G
        vs = v_rows[cu_k[seq]:cu_k[seq + 1]].repeat_interleave(group, dim=1)
        visible = visibility(qs.shape[0], ks.shape[0], heads=heads, kv_heads=kv_heads,
                             causal=causal, compress_factor=compress_factor,
                             window_size=window_size, block_sparse=block_sparse, seq=seq)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing
        sees_any = visible.any(dim=-1, keepdim=True)
        # Softmax of an all -inf row is NaN; give those rows zeros instead (and zero gradients).
        probs = torch.softmax(scores.masked_fill(~sees_any, 0.0), dim=-1) * sees_any
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
        lses.append(lse)

    out = torch.cat(outs) if outs else q_rows.new_zeros(q_rows.shape)
    lse = torch.cat(lses, dim=1) if lses else q_rows.new_zeros(heads, 0)
    if varlen:
        return out, lse
    return out.view(q.shape), lse.view(heads, q.shape[0], q.shape[1]).permute(1, 0, 2)


def visibility(num_rows, num_keys, *, heads, kv_heads, causal, compress_factor, window_size,
               block_sparse=None, seq=0) -> torch.Tensor:
    """(H, Nq, Nk) bool: which keys each row of sequence `seq` sees, the rules taken literally."""
    rows = torch.arange(num_rows).view(-1, 1)
    position = (torch.arange(num_keys).view(1, -1) + 1) * compress_factor - 1
    left, right = window_size
    by_rule = torch.ones(num_rows, num_keys, dtype=torch.bool)
    if causal:
        by_rule &= position <= rows
    if left >= 0:
        by_rule &= rows - left <= position
    if right >= 0:
        by_rule &= position <= rows + right
    if block_sparse is None:
        return by_rule.expand(heads, num_rows, num_keys)

    bs = block_sparse
    out = torch.zeros(heads, num_rows, num_keys, dtype=torch.bool)
    first_tile = int(bs.row_block_offsets[seq])
    lists_per_query_head = bs.full_count.shape[1] == heads
    for head in range(heads):
        list_head = head if lists_per_query_head else head // (heads // kv_heads)
        full = torch.zeros(num_rows, num_keys, dtype=torch.bool)
        mask = torch.zeros(num_rows, num_keys, dtype=torch.bool)
        for tile in range((num_rows + bs.row_block_size - 1) // bs.row_block_size):
            tile_rows = slice(tile * bs.row_block_size, (tile + 1) * bs.row_block_size)
            for kind, table in (("full", full), ("mask", mask)):
                count = int(getattr(bs, f"{kind}_count")[first_tile + tile, list_head])
                for block in getattr(bs, f"{kind}_index")[first_tile + tile, list_head, :count]:
                    block_keys = slice(int(block) * bs.col_block_size,
                                       (int(block) + 1) * bs.col_block_size)
                    table[tile_rows, block_keys] = True
        out[head] = full | (mask & by_rule)
    return out


def random_block_sparse(generator: torch.Generator, seqlens_q, seqlens_k, *, heads: int,
                        q_tile: int, kv_block: int, causal_full: bool = False,
                        compress_factor: int = 1) -> BlockSparseTensors:
    """Random compact lists: per tile and head a random subset of the sequence's KV blocks
    (often empty), each block randomly full or mask.

    With ``causal_full`` a block is full only when all of its keys are at or before the tile's
    first row (what a causal builder guarantees), so the lists keep causality.
    """
    full_lists, mask_lists, offsets = [], [], [0]
    for nq, nk in zip(seqlens_q, seqlens_k):
        num_tiles = -(-nq // q_tile)
        num_blocks = -(-nk // kv_block)
        offsets.append(offsets[-1] + num_tiles)
        for tile in range(num_tiles):
            full_row, mask_row = [], []
            for _ in range(heads):
                chosen = (torch.rand(num_blocks, generator=generator) < 0.5).nonzero().view(-1)
                as_full = torch.rand(len(chosen), generator=generator) < 0.5
                if causal_full:
                    last_position = ((chosen + 1) * kv_block) * compress_factor - 1
                    as_full &= last_position <= tile * q_tile
                full_row.append(chosen[as_full].tolist())
                mask_row.append(chosen[~as_full].tolist())
            full_lists.append(full_row)
            mask_lists.append(mask_row)

    def pack(lists):
        width = max((len(entries) for row in lists for entries in row), default=0)
        count = torch.tensor([[len(e) for e in row] for row in lists],
                             dtype=torch.int32).view(len(lists), heads)
        index = torch.full((len(lists), heads, width), -1, dtype=torch.int32)
        for r, row in enumerate(lists):
            for h, entries in enumerate(row):
                index[r, h, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
        return count, index

    full_count, full_index = pack(full_lists)
    mask_count, mask_index = pack(mask_lists)
    return BlockSparseTensors(
        full_count=full_count, full_index=full_index, mask_count=mask_count,
        mask_index=mask_index, row_block_size=q_tile, col_block_size=kv_block,
        row_block_offsets=torch.tensor(offsets, dtype=torch.int32),
    )


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread. The fallback tests issue many small ops; on a loaded
    2-core machine extra threads only spin (measured: 5 s instead of 0.06 s for one test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
