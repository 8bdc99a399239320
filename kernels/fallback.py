"""The attention function of docs/interfaces.md in plain torch, on any device.

This is the path for CPUs, GPUs the CuTe kernels do not support, and cases they do not cover.
It computes exactly what the kernels compute (causal with ``compress_factor``, window, block
sparsity, varlen, GQA), in fp32 (fp64 for fp64 inputs), one sequence at a time and one chunk of
query rows at a time, so memory stays bounded: no (N x N) tensor ever exists, only
(chunk rows x keys x heads) under ``CHUNK_BUDGET_BYTES``.

The backward is the analytic one flash attention uses: recompute ``P = exp(S - lse)`` from the
forward's ``lse``, ``delta = rowsum(dO * O)``, ``dS = P * (dP - delta)``; dK and dV are summed
over the query heads of each KV group.

Query heads are processed grouped by KV head, ``(Hkv, G * rows, D)``, so GQA is a reshape of q,
never a copy of k and v.
"""
from __future__ import annotations

from typing import Iterator

import torch

from .validate import (
    AttentionProblem,
    lse_dtype,
    validate_attention_backward,
    validate_attention_forward,
)

# Scores, probabilities and their gradients for one chunk of rows stay under this many bytes.
CHUNK_BUDGET_BYTES = 256 << 20


def attention_forward_fallback(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1), block_sparse=None,
    chunk_budget_bytes=CHUNK_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, then compute ``(out, lse)`` in torch; arguments as ``attention_forward``."""
    problem = validate_attention_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        compress_factor=compress_factor, window_size=window_size, block_sparse=block_sparse,
    )
    return forward(problem, q, k, v, block_sparse, chunk_budget_bytes)


def attention_backward_fallback(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, chunk_budget_bytes=CHUNK_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, then compute ``(dq, dk, dv)`` in torch; arguments as ``attention_backward``.

    ``block_sparse_transposed`` is checked but not needed: the fallback walks query rows and
    reads the forward layout.
    """
    problem = validate_attention_backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, compress_factor=compress_factor, window_size=window_size,
        block_sparse=block_sparse, block_sparse_transposed=block_sparse_transposed,
    )
    return backward(problem, dout, q, k, v, out, lse, block_sparse, chunk_budget_bytes)


@torch.no_grad()
def forward(problem: AttentionProblem, q, k, v, block_sparse=None,
            chunk_budget_bytes: int = CHUNK_BUDGET_BYTES):
    """``(out, lse)`` for an already validated call."""
    acc = _accumulation_dtype(q.dtype)
    q_rows, k_rows, v_rows = _packed(q), _packed(k), _packed(v)
    heads, kv_heads = problem.num_heads, problem.num_kv_heads
    out = torch.zeros_like(q_rows)
    lse = torch.full((heads, q_rows.shape[0]), float("-inf"), dtype=lse_dtype(q.dtype),
                     device=q.device)

    first_tiles = _first_tile_of_sequences(problem, block_sparse)
    for seq, q0, q1, k0, k1 in problem.sequences():
        k_seq = k_rows[k0:k1].to(acc).transpose(0, 1)  # (Hkv, Nk, D)
        v_seq = v_rows[k0:k1].to(acc).transpose(0, 1)
        for r0, r1, c0, c1 in _chunks(problem, block_sparse, q1 - q0, k1 - k0, acc,
                                      chunk_budget_bytes):
            rows = slice(q0 + r0, q0 + r1)
            q_chunk = _group_by_kv_head(q_rows[rows].to(acc), kv_heads)
            visible = _visibility(problem, block_sparse, first_tiles[seq], r0, r1, c0, c1,
                                  q.device)
            scores = _masked_scores(problem, q_chunk, k_seq[:, c0:c1], visible)
            row_max = scores.amax(dim=-1, keepdim=True)  # -inf for rows that see nothing
            unnormalised = scores.sub_(_finite(row_max)).exp_()
            row_sum = unnormalised.sum(dim=-1, keepdim=True)
            sees_any = row_sum > 0
            # Normalise the (rows x D) output, not the (rows x keys) probabilities.
            chunk_out = (unnormalised @ v_seq[:, c0:c1]).div_(row_sum.masked_fill(~sees_any, 1))
            chunk_lse = torch.where(sees_any, row_max + row_sum.log(), float("-inf"))
            out[rows] = _ungroup(chunk_out, r1 - r0).to(out.dtype)
            lse[:, rows] = chunk_lse.view(heads, r1 - r0).to(lse.dtype)

    if problem.varlen:
        return out, lse
    batch, seqlen = q.shape[0], q.shape[1]
    return out.view(q.shape), lse.view(heads, batch, seqlen).permute(1, 0, 2).contiguous()


@torch.no_grad()
def backward(problem: AttentionProblem, dout, q, k, v, out, lse, block_sparse=None,
             chunk_budget_bytes: int = CHUNK_BUDGET_BYTES):
    """``(dq, dk, dv)`` for an already validated call; dk, dv summed over each KV group."""
    acc = _accumulation_dtype(q.dtype)
    q_rows, k_rows, v_rows = _packed(q), _packed(k), _packed(v)
    dout_rows, out_rows = _packed(dout), _packed(out)
    lse_rows = lse if problem.varlen else lse.permute(1, 0, 2).reshape(lse.shape[1], -1)
    heads, kv_heads = problem.num_heads, problem.num_kv_heads
    scale = problem.softmax_scale
    dq = torch.zeros(q_rows.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k_rows.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v_rows.shape, dtype=acc, device=q.device)

    first_tiles = _first_tile_of_sequences(problem, block_sparse)
    for seq, q0, q1, k0, k1 in problem.sequences():
        k_seq = k_rows[k0:k1].to(acc).transpose(0, 1)  # (Hkv, Nk, D)
        v_seq = v_rows[k0:k1].to(acc).transpose(0, 1)
        dk_seq = torch.zeros_like(k_seq)
        dv_seq = torch.zeros_like(v_seq)
        for r0, r1, c0, c1 in _chunks(problem, block_sparse, q1 - q0, k1 - k0, acc,
                                      chunk_budget_bytes):
            rows, keys = slice(q0 + r0, q0 + r1), slice(c0, c1)
            q_chunk = _group_by_kv_head(q_rows[rows].to(acc), kv_heads)
            dout_chunk = _group_by_kv_head(dout_rows[rows].to(acc), kv_heads)
            out_chunk = _group_by_kv_head(out_rows[rows].to(acc), kv_heads)
            chunk_lse = lse_rows[:, rows].to(acc).reshape(kv_heads, -1, 1)  # (Hkv, G*C, 1)

            visible = _visibility(problem, block_sparse, first_tiles[seq], r0, r1, c0, c1,
                                  q.device)
            scores = _masked_scores(problem, q_chunk, k_seq[:, keys], visible)
            probs = scores.sub_(_finite(chunk_lse)).exp_()  # masked and empty rows give 0
            delta = (dout_chunk * out_chunk).sum(dim=-1, keepdim=True)
            dscores = (dout_chunk @ v_seq[:, keys].transpose(1, 2)).sub_(delta).mul_(probs)

            dq[rows] = _ungroup(dscores @ k_seq[:, keys], r1 - r0).mul_(scale)
            dk_seq[:, keys] += (dscores.transpose(1, 2) @ q_chunk).mul_(scale)
            dv_seq[:, keys] += probs.transpose(1, 2) @ dout_chunk
        dk[k0:k1] = dk_seq.transpose(0, 1)
        dv[k0:k1] = dv_seq.transpose(0, 1)

    return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype))


# --- chunks --------------------------------------------------------------------------------------

def _chunks(problem: AttentionProblem, block_sparse, num_rows: int, num_keys: int,
            acc: torch.dtype, budget: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(row_start, row_end, key_start, key_end)``, local to a sequence.

    Rows per chunk keep the (heads x rows x keys) temporaries under ``budget``; keys are cut to
    the range the rows can see, so causal and windowed calls skip the invisible part.
    """
    if num_rows == 0 or num_keys == 0:
        return
    # Per (head, row, key): scores/probabilities, dP/dS and a matmul's transposed copy in `acc`
    # (the backward's worst case), and the boolean masks (the rule and, when block sparse, the
    # expanded full and mask lists).
    bytes_per_row = problem.num_heads * num_keys * (4 * torch.finfo(acc).bits // 8 + 4)
    rows_per_chunk = max(1, min(num_rows, budget // bytes_per_row))
    for r0 in range(0, num_rows, rows_per_chunk):
        r1 = min(num_rows, r0 + rows_per_chunk)
        c0, c1 = _visible_key_range(problem, block_sparse, r0, r1, num_keys)
        if c0 < c1:
            yield r0, r1, c0, c1


def _visible_key_range(problem, block_sparse, r0: int, r1: int, num_keys: int) -> tuple[int, int]:
    """Keys ``[c0, c1)`` that rows ``[r0, r1)`` may see under the causal and window rules."""
    if block_sparse is not None:
        return 0, num_keys  # a full block ignores causal and window, so no range can be cut
    cf = problem.compress_factor
    left, right = problem.window_size
    c0, c1 = 0, num_keys
    # pos(j) = (j + 1) * cf - 1; the bounds below are that rule solved for j at the extreme rows.
    if problem.causal:
        c1 = min(c1, r1 // cf)  # pos(j) <= r1 - 1
    if right >= 0:
        c1 = min(c1, (r1 + right) // cf)  # pos(j) <= r1 - 1 + right
    if left >= 0:
        c0 = max(c0, -(-(r0 - left + 1) // cf) - 1)  # pos(j) >= r0 - left
    return c0, c1


# --- masks ---------------------------------------------------------------------------------------

def _first_tile_of_sequences(problem: AttentionProblem, block_sparse) -> list[int]:
    """``row_block_offsets`` on the host, from the sequence lengths it was validated against."""
    if block_sparse is None:
        return [0] * problem.num_seqs
    offsets, tile = [], 0
    for _, q0, q1, _, _ in problem.sequences():
        offsets.append(tile)
        tile += -(-(q1 - q0) // block_sparse.row_block_size)
    return offsets


def _visibility(problem: AttentionProblem, block_sparse, first_tile: int, r0: int, r1: int,
                c0: int, c1: int, device) -> torch.Tensor:
    """Which keys ``[c0, c1)`` rows ``[r0, r1)`` see: bool ``(Hm, rows, keys)``, Hm in {1, Hs};
    None when every key is visible (no rule applies).

    ``first_tile`` is the sequence's first row block in ``block_sparse`` (unused without it).
    """
    left, right = problem.window_size
    if block_sparse is None and not problem.causal and left < 0 and right < 0:
        return None
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    keys = torch.arange(c0, c1, device=device)
    positions = (keys + 1) * problem.compress_factor - 1
    by_rule = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if problem.causal:
        by_rule &= positions <= rows
    if left >= 0:
        by_rule &= positions >= rows - left
    if right >= 0:
        by_rule &= positions <= rows + right
    if block_sparse is None:
        return by_rule.unsqueeze(0)
    full, masked = _listed_blocks(block_sparse, first_tile, r0, r1, c1, keys)
    return full | (masked & by_rule)


def _listed_blocks(bs, first_tile: int, r0: int, r1: int, c1: int, keys: torch.Tensor):
    """Expand the compact lists of the tiles holding rows ``[r0, r1)`` to ``(Hs, rows, keys)``.

    Returns (listed as full, listed as mask). Column indices are local to the sequence.
    """
    tile0 = r0 // bs.row_block_size
    tile1 = (r1 - 1) // bs.row_block_size + 1
    global_tiles = slice(first_tile + tile0, first_tile + tile1)
    tile_of_row = torch.arange(r0, r1, device=keys.device) // bs.row_block_size - tile0
    block_of_key = keys // bs.col_block_size
    num_blocks = (c1 - 1) // bs.col_block_size + 1  # blocks past the last key cannot matter

    def expand(count, index):
        count, index = count[global_tiles], index[global_tiles]  # (tiles, Hs), (tiles, Hs, K)
        in_list = torch.arange(index.shape[-1], device=keys.device) < count.unsqueeze(-1)
        # Unlisted slots (and blocks beyond this key range) go to a spill column, dropped below.
        columns = torch.where(in_list & (index < num_blocks), index, num_blocks).long()
        table = torch.zeros(*index.shape[:2], num_blocks + 1, dtype=torch.bool, device=keys.device)
        table.scatter_(-1, columns, True)
        table = table[..., :num_blocks].transpose(0, 1)  # (Hs, tiles, blocks)
        return table[:, tile_of_row][:, :, block_of_key]

    return expand(bs.full_count, bs.full_index), expand(bs.mask_count, bs.mask_index)


def _masked_scores(problem: AttentionProblem, q_chunk, k_chunk, visible) -> torch.Tensor:
    """``scale * q k^T`` with invisible entries at -inf: ``(Hkv, G * rows, keys)``."""
    kv_heads, group = problem.num_kv_heads, problem.group_size
    scores = torch.matmul(q_chunk, k_chunk.transpose(1, 2)).mul_(problem.softmax_scale)
    if visible is None:
        return scores
    grouped = scores.view(kv_heads, group, -1, scores.shape[-1])
    mask_heads = visible.shape[0]
    # Mask heads are 1 (rule only), Hkv (lists shared by a KV group) or H (lists per query head).
    if mask_heads == problem.num_heads:
        visible = visible.view(kv_heads, group, *visible.shape[1:])
    else:
        visible = visible.view(mask_heads, 1, *visible.shape[1:])
    grouped.masked_fill_(~visible, float("-inf"))
    return scores


# --- layout helpers ------------------------------------------------------------------------------

def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``(rows, heads, D)``: padded batches become B sequences of equal length."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _group_by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(rows, H, D) -> (Hkv, G * rows, D)``; query head h = kv_head * G + g."""
    rows, heads, dim = x.shape
    return x.view(rows, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3).reshape(
        kv_heads, -1, dim)


def _ungroup(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`_group_by_kv_head`."""
    kv_heads, _, dim = x.shape
    return x.view(kv_heads, -1, rows, dim).permute(2, 0, 1, 3).reshape(rows, -1, dim)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see nothing) as 0, so exp(-inf - lse) is 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)
