"""The attention function of docs/interfaces.md in plain torch, on any device.

This is the path for CPUs, GPUs the CuTe kernels do not support, and cases they do not cover.
It computes exactly what the kernels compute (causal with ``compress_factor``, window, block
sparsity, varlen, GQA), in fp32 (fp64 for fp64 inputs), with memory bounded by
``CHUNK_BUDGET_BYTES`` of temporaries, never an (N x N) tensor. Two ways to walk a call:

- Dense (no ``block_sparse``): one sequence at a time, one chunk of query rows at a time,
  against the keys the chunk can see under the causal and window rules; chunks are sized by
  those keys, not by the sequence, so the work follows the attended pairs (:func:`_chunks`).
- Block sparse: a batch of query tiles (``row_block_size`` rows) at a time, against only the
  keys its listed blocks hold, gathered per (tile, list head) into a short dense array. The
  work is O(tiles x listed keys), not O(N^2): NSA's selected branch lists ~16 blocks per tile
  whatever the sequence length. Full blocks are masked only where a sequence's last block ends
  early; mask blocks also get the causal/window rule.

The backward is the analytic one flash attention uses: recompute ``P = exp(S - lse)`` from the
forward's ``lse``, ``delta = rowsum(dO * O)``, ``dS = P * (dP - delta)``; dK and dV are summed
over the query heads of each KV group (scattered back with ``index_add_`` on the sparse path).
Every sum runs in a fixed order except that scatter on CUDA, whose atomic adds land in any
order: with ``deterministic=True`` it becomes a sorted accumulation there (``index_put_`` with
``accumulate=True``), so the fallback's gradients are bit-identical from run to run.

GQA is a reshape of q, never a copy of k and v: the dense path groups query heads by KV head,
``(Hkv, G * rows, D)``; the sparse path by list head, ``(tiles, Hs, H / Hs * tile rows, D)``.

Non-finite inputs (NaN, +-inf) reach only the rows that see them. A masked probability of exactly
0 times a NaN is still NaN, and a matmul cannot skip the product, so no NaN or inf enters a
product summed over keys or rows: the forward's values (P V) and the backward's q, k, v, dO and O
have theirs replaced by zeros, and what the changed rows legitimately reach is set to NaN
afterwards, from the visibility alone: forward rows that see a non-finite value; in the backward,
every row that contributes a gradient (dO not zero) and sees a non-finite key or value, or holds
a non-finite q, dO, O or lse, gets NaN dq, and each key it sees NaN dk and dv (a little more than
IEEE arithmetic would mark, and NaN where it might give +-inf: the reach is the contract, not
the non-finite values). The forward's scores use q and k as they are (a masked score is replaced
by -inf, never multiplied), so a row that sees a non-finite key is NaN through its own softmax.
The backward is linear in dO: a row whose dO is zero contributes exactly zero, whatever its O and
lse hold, so a loss on the first rows of a sequence has finite gradients when later rows are
NaN. All of it is elementwise work and small (rows x keys) mask products: no host read.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    q_start_positions=None, chunk_budget_bytes=CHUNK_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, then compute ``(out, lse)`` in torch; arguments as ``attention_forward``."""
    problem = validate_attention_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        compress_factor=compress_factor, window_size=window_size, block_sparse=block_sparse,
        q_start_positions=q_start_positions,
    )
    return forward(problem, q, k, v, block_sparse, chunk_budget_bytes)


def attention_backward_fallback(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, deterministic=False, q_start_positions=None,
    chunk_budget_bytes=CHUNK_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, then compute ``(dq, dk, dv)`` in torch; arguments as ``attention_backward``.

    ``block_sparse_transposed`` is checked but not needed: the fallback walks query tiles and
    reads the forward layout.
    """
    problem = validate_attention_backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, compress_factor=compress_factor, window_size=window_size,
        block_sparse=block_sparse, block_sparse_transposed=block_sparse_transposed,
        deterministic=deterministic, q_start_positions=q_start_positions,
    )
    return backward(problem, dout, q, k, v, out, lse, block_sparse, chunk_budget_bytes,
                    deterministic=deterministic)


@torch.no_grad()
def forward(problem: AttentionProblem, q, k, v, block_sparse=None,
            chunk_budget_bytes: int = CHUNK_BUDGET_BYTES):
    """``(out, lse)`` for an already validated call."""
    acc = accumulation_dtype(q.dtype)
    q_rows, k_rows, v_rows = _packed(q), _packed(k), _packed(v)
    out = torch.zeros_like(q_rows)  # rows that see nothing keep 0 and lse -inf
    lse = torch.full((problem.num_heads, q_rows.shape[0]), float("-inf"),
                     dtype=lse_dtype(q.dtype), device=q.device)
    if block_sparse is None:
        _dense_forward(problem, q_rows, k_rows, v_rows, out, lse, acc, chunk_budget_bytes)
    else:
        _sparse_forward(problem, block_sparse, q_rows, k_rows, v_rows, out, lse, acc,
                        chunk_budget_bytes)
    if problem.varlen:
        return out, lse
    batch, seqlen = q.shape[0], q.shape[1]
    lse = lse.view(problem.num_heads, batch, seqlen).permute(1, 0, 2).contiguous()
    return out.view(q.shape), lse


@torch.no_grad()
def backward(problem: AttentionProblem, dout, q, k, v, out, lse, block_sparse=None,
             chunk_budget_bytes: int = CHUNK_BUDGET_BYTES, *, deterministic: bool = False):
    """``(dq, dk, dv)`` for an already validated call; dk, dv summed over each KV group."""
    acc = accumulation_dtype(q.dtype)
    rows = _BackwardRows(
        q=_packed(q), k=_packed(k), v=_packed(v), dout=_packed(dout), out=_packed(out),
        lse=lse if problem.varlen else lse.permute(1, 0, 2).reshape(lse.shape[1], -1))
    dq = torch.zeros(rows.q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(rows.k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(rows.v.shape, dtype=acc, device=q.device)
    if block_sparse is None:
        _dense_backward(problem, rows, dq, dk, dv, acc, chunk_budget_bytes)
    else:
        _sparse_backward(problem, block_sparse, rows, dq, dk, dv, acc, chunk_budget_bytes,
                         deterministic)
    return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype))


@dataclass(frozen=True)
class _BackwardRows:
    """The backward's inputs as packed rows ``(T, heads, D)``; lse as ``(H, Tq)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


# --- softmax, shared by both paths ---------------------------------------------------------------
# Scores are (..., rows, keys) with invisible entries at -inf; values and keys (..., keys, D).
# A `sight` (_DenseSight, _ListedSight) says which rows see which keys, for the NaN marking.

def _softmax_forward(scores: torch.Tensor, values: torch.Tensor, bad_values: torch.Tensor,
                     sight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of masked scores, consuming them; rows that see nothing give 0 and -inf.

    ``values`` holds zeros where a value row is non-finite (``bad_values (..., keys)``): rows that
    see such a row get NaN, the others never meet it (a masked P of 0 times a NaN is NaN).
    A row with a non-finite score gets NaN from the softmax itself.
    """
    row_max = scores.amax(dim=-1, keepdim=True)
    blind = row_max == float("-inf")  # sees nothing (a NaN row_max is not blind: it is NaN)
    unnormalised = scores.sub_(row_max.masked_fill(blind, 0)).exp_()
    row_sum = unnormalised.sum(dim=-1, keepdim=True)
    # Normalise the (rows x D) output, not the (rows x keys) probabilities.
    out = (unnormalised @ values).div_(row_sum.masked_fill(blind, 1))
    lse = torch.where(blind, float("-inf"), row_max + row_sum.log())
    return _mark_nan_(out, sight.rows_seeing(bad_values)), lse


def _softmax_backward(scores, lse, q, k, v, dout, out, scale: float, *, sight, live, bad_rows,
                      bad_keys):
    """``(dq, dk, dv)`` of one block of rows against its keys, consuming the scores.

    ``q, k, v, dout, out`` hold finite values only (callers zero the non-finite rows), so every
    masked pair multiplies finite numbers by an exact 0. ``lse``, ``live`` (dO not zero) and
    ``bad_rows`` (a non-finite q, dO or O row) are ``(..., rows, 1)``; ``bad_keys (..., keys)``
    flags non-finite k or v rows. Rows that saw nothing (lse -inf) or have a zero dO add nothing;
    rows that add something and see or hold a non-finite value get NaN dq, and NaN dk and dv
    for every key they see.
    """
    blind = lse == float("-inf")
    bad_lse = torch.isnan(lse) | (lse == float("inf"))
    # P = exp(S - lse): blind rows have only -inf scores (any finite lse keeps them 0); a
    # non-finite lse becomes +inf so that its row's P is exactly 0 here, and NaN below if live.
    probs = scores.sub_(lse.masked_fill(blind, 0).masked_fill_(bad_lse, float("inf"))).exp_()
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = (dout @ v.transpose(-1, -2)).sub_(delta).mul_(probs)
    dq = (dscores @ k).mul_(scale)
    dk = (dscores.transpose(-1, -2) @ q).mul_(scale)
    dv = probs.transpose(-1, -2) @ dout
    poisoned = live & ~blind & (bad_rows | bad_lse | sight.rows_seeing(bad_keys))
    reached = sight.keys_seen_by(poisoned)
    return _mark_nan_(dq, poisoned), _mark_nan_(dk, reached), _mark_nan_(dv, reached)


def _row_magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``(...)``: the largest ``|x|`` of each row (last dim); NaN or inf where the row holds one.
    (One pass and a float reduction: several times faster than ``isfinite(x).all(-1)``.)"""
    return x.abs().amax(dim=-1)


def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """``(...)`` bool: rows (last dim) of ``x`` holding a NaN or an inf."""
    return ~torch.isfinite(_row_magnitudes(x))


def _zeroed_nonfinite(x: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``acc`` with NaN and inf replaced by 0 (never in place on the caller's tensor),
    and its :func:`_row_magnitudes`: rows whose magnitude is not finite were changed."""
    magnitudes = _row_magnitudes(x)
    converted = x.to(acc)
    if converted is x:
        return x.nan_to_num(0.0, 0.0, 0.0), magnitudes
    return converted.nan_to_num_(0.0, 0.0, 0.0), magnitudes


def _mark_nan_(x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """Set the rows of ``x (..., n, D)`` flagged in ``flags (..., n, 1)`` to NaN, in place.
    (Adding a 0/NaN column is one broadcast pass; a broadcast masked_fill_ is several times
    slower on CPU.)"""
    return x.add_(torch.where(flags, float("nan"), 0.0).to(x.dtype))


def _as_counts(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as float32 0/1 for the mask products below: sums of non-negative terms are
    > 0 exactly when one term is 1."""
    return mask.to(torch.float32)


# --- dense path: chunks of rows against the keys they can see ------------------------------------

class _DenseSight:
    """Which keys ``[c0, c1)`` the rows of a dense chunk see: ``visible (rows, keys)`` shared by
    every head, or None (no rule: all of them). Rows are grouped as ``(Hkv, G * rows)``."""

    def __init__(self, visible: torch.Tensor | None, group: int, num_rows: int, num_keys: int):
        self.visible, self.group = visible, group
        self.num_rows, self.num_keys = num_rows, num_keys
        self._counts = None if visible is None else _as_counts(visible)

    def rows_seeing(self, bad_keys: torch.Tensor) -> torch.Tensor:
        """``bad_keys (Hkv, keys)`` -> ``(Hkv, G * rows, 1)``: rows that see a flagged key."""
        kv_heads = bad_keys.shape[0]
        if self._counts is None:
            seen = bad_keys.any(dim=-1, keepdim=True).expand(kv_heads, self.num_rows)
        else:
            seen = (_as_counts(bad_keys) @ self._counts.T) > 0
        return seen.unsqueeze(1).expand(kv_heads, self.group, self.num_rows).reshape(
            kv_heads, -1, 1)

    def keys_seen_by(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows (Hkv, G * rows, 1)`` -> ``(Hkv, keys, 1)``: keys a flagged row sees."""
        kv_heads = rows.shape[0]
        per_row = rows.view(kv_heads, self.group, self.num_rows).any(dim=1)
        if self._counts is None:
            seen = per_row.any(dim=-1, keepdim=True).expand(kv_heads, self.num_keys)
        else:
            seen = (_as_counts(per_row) @ self._counts) > 0
        return seen.unsqueeze(-1)


def _dense_forward(problem, q_rows, k_rows, v_rows, out, lse, acc, budget) -> None:
    kv_heads, group = problem.num_kv_heads, problem.group_size
    for s, q0, q1, k0, k1 in problem.sequences():
        k_seq = k_rows[k0:k1].to(acc).transpose(0, 1)  # (Hkv, Nk, D)
        v_seq, v_magnitudes = _zeroed_nonfinite(v_rows[k0:k1], acc)
        v_seq, bad_v = v_seq.transpose(0, 1), ~torch.isfinite(v_magnitudes.T)  # (Hkv, Nk, ...)
        start = problem.q_start(s)  # chunks are in positions: row r is q row q0 + r - start
        for r0, r1, c0, c1 in _chunks(problem, q1 - q0, k1 - k0, acc, budget, start):
            rows = slice(q0 + r0 - start, q0 + r1 - start)
            q_chunk = _group_by_kv_head(q_rows[rows].to(acc), kv_heads)
            sight = _DenseSight(_visibility(problem, r0, r1, c0, c1, q_rows.device), group,
                                r1 - r0, c1 - c0)
            scores = _masked_scores(problem, q_chunk, k_seq[:, c0:c1], sight.visible)
            chunk_out, chunk_lse = _softmax_forward(scores, v_seq[:, c0:c1], bad_v[:, c0:c1],
                                                    sight)
            out[rows] = _ungroup(chunk_out, r1 - r0).to(out.dtype)
            lse[:, rows] = chunk_lse.view(-1, r1 - r0).to(lse.dtype)


def _dense_backward(problem, rows: _BackwardRows, dq, dk, dv, acc, budget) -> None:
    kv_heads, group = problem.num_kv_heads, problem.group_size
    for s, q0, q1, k0, k1 in problem.sequences():
        start = problem.q_start(s)  # as in _dense_forward
        (k_seq, k_magnitudes), (v_seq, v_magnitudes) = (
            _zeroed_nonfinite(x[k0:k1], acc) for x in (rows.k, rows.v))
        k_seq, v_seq = k_seq.transpose(0, 1), v_seq.transpose(0, 1)  # (Hkv, Nk, D)
        bad_kv = ~torch.isfinite(k_magnitudes + v_magnitudes).T  # (Hkv, Nk)
        dk_seq = torch.zeros_like(k_seq)
        dv_seq = torch.zeros_like(v_seq)
        for r0, r1, c0, c1 in _chunks(problem, q1 - q0, k1 - k0, acc, budget, start):
            chunk, keys = slice(q0 + r0 - start, q0 + r1 - start), slice(c0, c1)
            (q_chunk, dout_chunk, out_chunk), magnitudes = zip(*(
                _zeroed_nonfinite(x[chunk], acc) for x in (rows.q, rows.dout, rows.out)))
            q_chunk, dout_chunk, out_chunk = (_group_by_kv_head(x, kv_heads)
                                              for x in (q_chunk, dout_chunk, out_chunk))
            bad_rows = _group_flags(~torch.isfinite(sum(magnitudes)), kv_heads)
            live = _group_flags(magnitudes[1] != 0, kv_heads)  # NaN counts as live
            sight = _DenseSight(_visibility(problem, r0, r1, c0, c1, q_chunk.device), group,
                                r1 - r0, c1 - c0)
            scores = _masked_scores(problem, q_chunk, k_seq[:, keys], sight.visible)
            chunk_dq, chunk_dk, chunk_dv = _softmax_backward(
                scores, rows.lse[:, chunk].to(acc).reshape(kv_heads, -1, 1), q_chunk,
                k_seq[:, keys], v_seq[:, keys], dout_chunk, out_chunk, problem.softmax_scale,
                sight=sight, live=live, bad_rows=bad_rows, bad_keys=bad_kv[:, keys])
            dq[chunk] = _ungroup(chunk_dq, r1 - r0)
            dk_seq[:, keys] += chunk_dk
            dv_seq[:, keys] += chunk_dv
        dk[k0:k1] = dk_seq.transpose(0, 1)
        dv[k0:k1] = dv_seq.transpose(0, 1)


def _group_flags(flags: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per-row flags ``(rows, H)`` -> ``(Hkv, G * rows, 1)``, as :func:`_group_by_kv_head`."""
    return _group_by_kv_head(flags.unsqueeze(-1), kv_heads)


# A chunk's key span may exceed its first row's by 1 / SPAN_GROWTH: the pairs a chunk computes but
# no row attends (the triangle past the diagonal, the one before a window's left edge) stay under
# an eighth. Below MIN_CHUNK_ROWS rows that bound is not applied: each chunk costs a few dozen
# small ops, about as much as a few thousand (row, key) pairs of work on a CPU. (On a CPU with a
# 512-key window, quarters ran 3-4% slower than eighths and halves 20-35% slower.)
MIN_CHUNK_ROWS = 64
SPAN_GROWTH = 8


def _chunks(problem: AttentionProblem, num_rows: int, num_keys: int, acc: torch.dtype,
            budget: int, first_row: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(row_start, row_end, key_start, key_end)``, local to a sequence, rows as
    positions: ``num_rows`` rows from position ``first_row`` (the sequence's q_start).

    Rows ``[r0, r1)`` see keys ``[lo(r0), hi(r1))`` (:func:`_visible_key_range`), so a chunk's
    work and temporaries are rows x that span, which the causal and window rules tie to the rows,
    not to the sequence. Each chunk takes the most rows that (a) keep the (heads x rows x keys)
    temporaries under ``budget`` and (b) widen the span by at most 1 / SPAN_GROWTH of what the
    chunk's first row sees, or are at most MIN_CHUNK_ROWS. A w-key window thus runs
    max(w / 8, 64) rows per chunk at any sequence length; causal chunks grow with the row until
    the budget holds them.
    """
    if num_rows == 0 or num_keys == 0:
        return
    bytes_per_pair = _bytes_per_pair(problem, acc)
    r0, row_end = first_row, first_row + num_rows
    while r0 < row_end:
        c0, first_end = _visible_key_range(problem, r0, r0 + 1, num_keys)
        widest = max(0, first_end - c0) * (SPAN_GROWTH + 1) // SPAN_GROWTH

        def fits(rows: int) -> bool:
            span = max(0, _visible_key_range(problem, r0, r0 + rows, num_keys)[1] - c0)
            return (rows * span * bytes_per_pair <= budget
                    and (rows <= MIN_CHUNK_ROWS or span <= widest))

        # fits() is true for 1 row by decree and, as rows grow, false from some point on.
        lo, hi = 1, row_end - r0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        r1 = r0 + lo
        c0, c1 = _visible_key_range(problem, r0, r1, num_keys)
        if c0 < c1:
            yield r0, r1, c0, c1
        r0 = r1


def _bytes_per_pair(problem: AttentionProblem, acc: torch.dtype) -> int:
    """Temporaries per (row, key) of a dense chunk, in the backward (the worst case): per head,
    scores/probabilities, dP/dS and a matmul's transposed copy in ``acc`` and the boolean mask;
    per pair, the visibility as float32 counts and a transposed copy of it."""
    return problem.num_heads * (4 * torch.finfo(acc).bits // 8 + 4) + 8


def _visible_key_range(problem, r0: int, r1: int, num_keys: int) -> tuple[int, int]:
    """Keys ``[c0, c1)`` that rows ``[r0, r1)`` may see under the causal and window rules."""
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


def _visibility(problem: AttentionProblem, r0: int, r1: int, c0: int, c1: int,
                device) -> torch.Tensor | None:
    """Which keys ``[c0, c1)`` rows ``[r0, r1)`` see: bool ``(rows, keys)``; None when every
    key is visible (no rule applies)."""
    if not has_rule(problem):
        return None
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    keys = torch.arange(c0, c1, device=device)
    return visible_under_rule(problem, rows, keys)


def _masked_scores(problem: AttentionProblem, q_chunk, k_chunk, visible) -> torch.Tensor:
    """``scale * q k^T`` with invisible entries at -inf: ``(Hkv, G * rows, keys)``."""
    scores = torch.matmul(q_chunk, k_chunk.transpose(1, 2)).mul_(problem.softmax_scale)
    if visible is None:
        return scores
    per_head = scores.view(problem.num_kv_heads, problem.group_size, *visible.shape)
    per_head.masked_fill_(~visible, float("-inf"))  # the rule is the same for every head
    return scores


# --- block-sparse path: tiles against the keys their lists hold ----------------------------------

@dataclass(frozen=True)
class _TileBatch:
    """Consecutive query tiles of one sequence, processed together."""

    first_tile: int  # global row block (row of the compact lists)
    first_local_tile: int  # the same tile, counted from the sequence's first
    num_tiles: int
    row_start: int  # packed rows [row_start, row_end) of q; the last tile may be partial
    row_end: int
    key_start: int  # packed row of the sequence's first key in k and v
    num_keys: int
    q_start: int = 0  # the position of the sequence's first query row (the rule reads it)

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_end)


@dataclass(frozen=True)
class _ListedKeys:
    """The keys each (tile, list head) of a batch lists, full blocks' keys then mask blocks'.

    Every list has the same length L = (Kf + Km) x col_block_size; slots past a list's count,
    and keys past the sequence's end, hold a sentinel (the sequence's first key) and are masked.
    """

    kv_rows: torch.Tensor  # (tiles, Hs, L) int64: rows of k, v viewed as (Tk * Hkv, D)
    listed: torch.Tensor  # (tiles, Hs, L) bool: a listed block's key that exists
    mask_start: int  # keys [mask_start, L) belong to mask blocks
    by_rule: torch.Tensor | None  # (tiles, Hs, tile rows, L - mask_start) bool; None: no rule


class _ListedSight:
    """Which listed keys the rows of a batch of tiles see: every row of a tile sees its listed
    full-block keys, its mask-block keys where the rule allows. Rows are laid out as
    :func:`_to_tiles` lays them, ``(tiles, Hs, H / Hs * tile rows)``."""

    def __init__(self, keys: _ListedKeys, group: int, tile_rows: int):
        self.keys, self.group, self.tile_rows = keys, group, tile_rows
        self._rule_counts = None if keys.by_rule is None else _as_counts(keys.by_rule)

    def rows_seeing(self, bad_keys: torch.Tensor) -> torch.Tensor:
        """``bad_keys (tiles, Hs, L)`` -> ``(tiles, Hs, H / Hs * tile rows, 1)``."""
        split = self.keys.mask_start
        hit = bad_keys & self.keys.listed
        seen = hit[..., :split].any(dim=-1, keepdim=True)  # (tiles, Hs, 1): the whole tile
        if self._rule_counts is None:
            seen = seen | hit[..., split:].any(dim=-1, keepdim=True)
        else:  # (tiles, Hs, tile rows, Lm) @ (tiles, Hs, Lm, 1)
            seen = seen | ((self._rule_counts @ _as_counts(hit[..., split:]).unsqueeze(-1))
                           .squeeze(-1) > 0)
        num_tiles, list_heads = seen.shape[:2]
        return seen.unsqueeze(2).expand(num_tiles, list_heads, self.group,
                                        self.tile_rows).reshape(num_tiles, list_heads, -1, 1)

    def keys_seen_by(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows (tiles, Hs, H / Hs * tile rows, 1)`` -> ``(tiles, Hs, L, 1)``."""
        num_tiles, list_heads = rows.shape[:2]
        per_row = rows.view(num_tiles, list_heads, self.group, self.tile_rows).any(dim=2)
        any_row = per_row.any(dim=-1, keepdim=True)
        split = self.keys.mask_start
        full = any_row & self.keys.listed[..., :split]
        if self._rule_counts is None:
            masked = any_row
        else:  # (tiles, Hs, 1, tile rows) @ (tiles, Hs, tile rows, Lm)
            masked = (_as_counts(per_row).unsqueeze(-2) @ self._rule_counts).squeeze(-2) > 0
        masked = masked & self.keys.listed[..., split:]
        return torch.cat([full, masked], dim=-1).unsqueeze(-1)


def _sparse_forward(problem, bs, q_rows, k_rows, v_rows, out, lse, acc, budget) -> None:
    head_dim = problem.head_dim
    k_flat, v_flat = k_rows.reshape(-1, head_dim), v_rows.reshape(-1, head_dim)
    bad_v_rows = _nonfinite_rows(v_flat)  # (Tk * Hkv,): one pass over v per call
    for batch in _tile_batches(problem, bs, acc, budget):
        keys = _listed_keys(problem, bs, batch, q_rows.device)
        sight = _ListedSight(keys, problem.num_heads // bs.num_heads, bs.row_block_size)
        q_tiles = _to_tiles(q_rows[batch.rows], batch, bs, acc)
        # Keys as they are: a row that sees a non-finite key gets NaN from its own scores.
        scores = _listed_scores(problem, q_tiles, _gather(k_flat, keys, acc), keys)
        bad_v = bad_v_rows[keys.kv_rows]
        tile_out, tile_lse = _softmax_forward(scores, _gather(v_flat, keys, acc, bad_v), bad_v,
                                              sight)
        num_rows = batch.row_end - batch.row_start
        out[batch.rows] = _from_tiles(tile_out, bs.row_block_size, num_rows).to(out.dtype)
        tile_lse = _from_tiles(tile_lse, bs.row_block_size, num_rows)  # (rows, H, 1)
        lse[:, batch.rows] = tile_lse.squeeze(-1).T.to(lse.dtype)


def _sparse_backward(problem, bs, rows: _BackwardRows, dq, dk, dv, acc, budget,
                     deterministic: bool) -> None:
    head_dim = problem.head_dim
    k_flat, v_flat = rows.k.reshape(-1, head_dim), rows.v.reshape(-1, head_dim)
    dk_flat, dv_flat = dk.view(-1, head_dim), dv.view(-1, head_dim)
    bad_kv_rows = _nonfinite_rows(k_flat) | _nonfinite_rows(v_flat)
    for batch in _tile_batches(problem, bs, acc, budget):
        keys = _listed_keys(problem, bs, batch, dq.device)
        sight = _ListedSight(keys, problem.num_heads // bs.num_heads, bs.row_block_size)
        # The last tile's missing rows are zeros in q, dout, out and lse: their scores are 0,
        # P = 1 on visible keys (finite), dP = delta = 0, so they add exactly 0 to dk and dv.
        q_tiles, dout_tiles, out_tiles, lse_tiles = (
            _to_tiles(x[batch.rows], batch, bs, acc)
            for x in (rows.q, rows.dout, rows.out, rows.lse.T.unsqueeze(-1)))
        (q_tiles, dout_tiles, out_tiles), magnitudes = zip(*(
            _zeroed_nonfinite(x, acc) for x in (q_tiles, dout_tiles, out_tiles)))
        bad_rows = ~torch.isfinite(sum(magnitudes)).unsqueeze(-1)
        live = (magnitudes[1] != 0).unsqueeze(-1)  # NaN counts as live
        bad_keys = bad_kv_rows[keys.kv_rows]  # zeroed in both k and v: either poisons the key
        k_listed, v_listed = (_gather(x, keys, acc, bad_keys) for x in (k_flat, v_flat))
        scores = _listed_scores(problem, q_tiles, k_listed, keys)
        tile_dq, listed_dk, listed_dv = _softmax_backward(
            scores, lse_tiles, q_tiles, k_listed, v_listed, dout_tiles, out_tiles,
            problem.softmax_scale, sight=sight, live=live, bad_rows=bad_rows,
            bad_keys=bad_keys)
        dq[batch.rows] = _from_tiles(tile_dq, bs.row_block_size, batch.row_end - batch.row_start)
        # Sentinel slots scatter exact zeros (their P and dS are 0) onto the sentinel key.
        destination = keys.kv_rows.view(-1)
        _add_rows(dk_flat, destination, listed_dk.reshape(-1, head_dim), deterministic)
        _add_rows(dv_flat, destination, listed_dv.reshape(-1, head_dim), deterministic)


def _add_rows(target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
              deterministic: bool) -> None:
    """``target[rows[i]] += values[i]``, duplicates summed. index_add_ adds atomically on CUDA, in
    no fixed order; index_put_ with accumulate=True sorts the rows there and sums each one in
    order (slower), which is what deterministic=True asks for. On the CPU index_add_ already
    sums in order."""
    if deterministic and target.is_cuda:
        target.index_put_((rows,), values, accumulate=True)
    else:
        target.index_add_(0, rows, values)


def _tile_batches(problem: AttentionProblem, bs, acc: torch.dtype,
                  budget: int) -> Iterator[_TileBatch]:
    """Yield batches of consecutive tiles of one sequence whose temporaries fit ``budget``.

    Sequences without keys or lists are skipped: their rows see nothing.
    """
    if _listed_key_width(bs) == 0:
        return
    tiles_per_batch = max(1, budget // _bytes_per_tile(problem, bs, acc))
    tile_rows = bs.row_block_size
    first_tile = 0  # the validation checked bs.row_block_offsets equals these
    for s, q0, q1, k0, k1 in problem.sequences():
        num_tiles = -(-(q1 - q0) // tile_rows)
        for t0 in range(0, num_tiles if k1 > k0 else 0, tiles_per_batch):
            t1 = min(num_tiles, t0 + tiles_per_batch)
            yield _TileBatch(first_tile=first_tile + t0, first_local_tile=t0, num_tiles=t1 - t0,
                             row_start=q0 + t0 * tile_rows, row_end=min(q1, q0 + t1 * tile_rows),
                             key_start=k0, num_keys=k1 - k0, q_start=problem.q_start(s))
        first_tile += num_tiles


def _listed_key_width(bs) -> int:
    """L: keys per (tile, list head) after gathering, the longest lists' blocks."""
    return (bs.full_index.shape[-1] + bs.mask_index.shape[-1]) * bs.col_block_size


def _bytes_per_tile(problem: AttentionProblem, bs, acc: torch.dtype) -> int:
    """Temporaries one query tile adds to a batch, in the backward (the worst case)."""
    element = torch.finfo(acc).bits // 8
    listed_keys, tile_rows = _listed_key_width(bs), bs.row_block_size
    # (H x tile rows x L): scores, P, dP/dS, a matmul's transposed copy, and the masks (as the
    # dense chunks); (Hs x tile rows x L): the rule as float32 counts and a copy; (Hs x L): the
    # gathered k and v, their gradients, and the index tensors; q, dout, out and dq of the
    # tile's rows, and their zeroed copies.
    return (problem.num_heads * tile_rows * listed_keys * (4 * element + 4)
            + bs.num_heads * tile_rows * listed_keys * 8
            + bs.num_heads * listed_keys * (4 * problem.head_dim * element + 3 * 8)
            + 7 * problem.num_heads * tile_rows * problem.head_dim * element)


def _listed_keys(problem: AttentionProblem, bs, batch: _TileBatch, device) -> _ListedKeys:
    """Expand the compact lists of ``batch``'s tiles to key positions (no host sync)."""
    tiles = slice(batch.first_tile, batch.first_tile + batch.num_tiles)
    key_in_block = torch.arange(bs.col_block_size, device=device)

    def expand(count, index):
        count, index = count[tiles], index[tiles]  # (tiles, Hs), (tiles, Hs, K)
        in_list = torch.arange(index.shape[-1], device=device) < count.unsqueeze(-1)
        keys = (index.long().unsqueeze(-1) * bs.col_block_size + key_in_block).flatten(-2)
        listed = in_list.repeat_interleave(bs.col_block_size, dim=-1) & (keys < batch.num_keys)
        return keys, listed

    full_keys, full_listed = expand(bs.full_count, bs.full_index)
    mask_keys, mask_listed = expand(bs.mask_count, bs.mask_index)
    keys = torch.cat([full_keys, mask_keys], dim=-1)
    listed = torch.cat([full_listed, mask_listed], dim=-1)
    kv_head = torch.arange(bs.num_heads, device=device) // (bs.num_heads // problem.num_kv_heads)
    kv_rows = (keys.masked_fill(~listed, 0) + batch.key_start) * problem.num_kv_heads
    kv_rows += kv_head.unsqueeze(-1)

    by_rule = None
    if has_rule(problem) and mask_keys.shape[-1]:
        first_row = batch.q_start + (batch.first_local_tile
                                     + torch.arange(batch.num_tiles, device=device)
                                     ) * bs.row_block_size
        rows = first_row.unsqueeze(-1) + torch.arange(bs.row_block_size, device=device)
        by_rule = visible_under_rule(problem, rows[:, None, :, None], mask_keys.unsqueeze(-2))
    return _ListedKeys(kv_rows=kv_rows, listed=listed, mask_start=full_keys.shape[-1],
                       by_rule=by_rule)


def _gather(x_flat: torch.Tensor, keys: _ListedKeys, acc: torch.dtype,
            bad: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x_flat (Tk * Hkv, D)`` at the listed keys: ``(tiles, Hs, L, D)`` in ``acc``.

    Sentinel slots read as zeros, so what an unlisted key holds (even inf or NaN) never reaches
    a result: the masked score's P is 0, and 0 times a zero value is 0. Slots flagged in
    ``bad (tiles, Hs, L)`` (non-finite rows) read as zeros too; the caller marks what sees them.
    """
    gathered = x_flat.index_select(0, keys.kv_rows.view(-1)).to(acc)
    gathered = gathered.view(*keys.kv_rows.shape, x_flat.shape[-1])
    dropped = ~keys.listed if bad is None else ~keys.listed | bad
    return gathered.masked_fill_(dropped.unsqueeze(-1), 0)


def _listed_scores(problem: AttentionProblem, q_tiles, k_listed, keys: _ListedKeys):
    """``scale * q k^T`` per (tile, list head) with invisible entries at -inf:
    ``(tiles, Hs, H / Hs * tile rows, L)``."""
    # Scale q (rows x D), not the scores (rows x L): L is many times D.
    scores = torch.matmul(q_tiles * problem.softmax_scale, k_listed.transpose(-1, -2))
    num_tiles, list_heads, _, num_keys = scores.shape
    tile_rows = 1 if keys.by_rule is None else keys.by_rule.shape[-2]
    per_row = scores.view(num_tiles, list_heads, -1, tile_rows, num_keys)  # (.., H / Hs, ..)
    per_row.masked_fill_(~keys.listed[:, :, None, None, :], float("-inf"))
    if keys.by_rule is not None:
        per_row[..., keys.mask_start:].masked_fill_(~keys.by_rule.unsqueeze(2), float("-inf"))
    return scores


def _to_tiles(x: torch.Tensor, batch: _TileBatch, bs, acc: torch.dtype) -> torch.Tensor:
    """Rows ``(rows, H, D)`` of a batch to ``(tiles, Hs, H / Hs * tile rows, D)`` in ``acc``;
    a partial last tile is padded with zero rows. Query head h = list head * H / Hs + g."""
    padded_rows = batch.num_tiles * bs.row_block_size
    x = x.to(acc)
    if x.shape[0] < padded_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - x.shape[0], *x.shape[1:])])
    heads, dim = x.shape[1], x.shape[2]
    list_heads = bs.num_heads
    return (x.reshape(batch.num_tiles, bs.row_block_size, list_heads, heads // list_heads, dim)
            .permute(0, 2, 3, 1, 4).reshape(batch.num_tiles, list_heads, -1, dim))


def _from_tiles(x: torch.Tensor, tile_rows: int, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`_to_tiles`: ``(rows, H, D)``, padding rows dropped."""
    num_tiles, list_heads, _, dim = x.shape
    return (x.view(num_tiles, list_heads, -1, tile_rows, dim).permute(0, 3, 1, 2, 4)
            .reshape(num_tiles * tile_rows, -1, dim)[:num_rows])


# --- the causal/window rule ----------------------------------------------------------------------

def has_rule(problem: AttentionProblem) -> bool:
    left, right = problem.window_size
    return problem.causal or left >= 0 or right >= 0


def visible_under_rule(problem: AttentionProblem, rows: torch.Tensor,
                       keys: torch.Tensor) -> torch.Tensor:
    """Whether row ``rows`` sees key ``keys`` under causal and window (broadcast shapes); the
    one statement of the rule on the torch paths (this module and ``kernels.masked``)."""
    positions = (keys + 1) * problem.compress_factor - 1  # the key's last token
    left, right = problem.window_size
    visible = torch.ones(torch.broadcast_shapes(rows.shape, positions.shape), dtype=torch.bool,
                         device=keys.device)
    if problem.causal:
        visible &= positions <= rows
    if left >= 0:
        visible &= positions >= rows - left
    if right >= 0:
        visible &= positions <= rows + right
    return visible


# --- layout helpers ------------------------------------------------------------------------------

def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
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
