"""Sequence mode: each rank keeps its query rows and reads the keys they need from the others.

For groups whose size does not divide Hkv (heads mode's condition), or on request. Rank r holds
one or two chunks of the sequence (nsa.distributed.sharding's layout: packed, rows of the whole
packed sequence; padded, positions of every batch entry). Per document and chunk (a segment) it
holds positions [a, b):

- keys: K and V of the whole sequence, all-gathered (each rank holds (T, Hkv, D) of each: the
  simple form; reading only the blocks a rank's queries need is the frugal one, not built), of
  which the segment's document prefix up to the end of b's selection tile is the rank's key
  sequence (the rule's forced blocks and its compressed-block counts read the tile's whole
  extent, so a tile cut by the shard bound must see the keys of its other part too, which its
  rows never attend);
- queries: its own rows [a, b), and before them a halo of the rows [p, a) that the rule of one
  GPU reads: p is a's selection tile start, one tile further back (a selection tile's scoring
  query averages the q_tile rows ending at its first row), or 0. The halo is the end of the
  chunk before a's (owned by the previous rank, or by any rank with the zigzag layout): one
  all-gather of the last 2 q_tile rows of every rank's chunks, so sequence mode needs at least
  that many tokens per chunk;
- nsa()'s internals on those query rows (`sparsity.QueryRows`: every rule at the rows' positions
  in their document, the kernels' q_start_positions), then the rows it owns are kept. The first
  tile of a halo scores only the rows it has, so its selection differs from one GPU's: its rows
  are halo rows, dropped.

Backward: dO is zero on the halo rows, so they add exactly nothing to any gradient and get none
(their q is taken detached). dK and dV of the gathered keys are summed over the ranks into
their owners (a reduce-scatter: each rank receives only its rows); W_k, W_v and W_gate get each
rank's partial (its queries' share), which the data x context gradient reduction completes, as
in heads mode. Outputs equal one process's up to the order of float sums (the dK/dV reduction
over ranks adds in another order than one process's kernels), with the same selected blocks.
On a GPU every branch runs on the sm90 kernels, which read each row at its position
(q_start_positions).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nsa.function import NSAFunction
from nsa.memory_policy import keeps_branch_outputs
from nsa.validation import PackedSequences, validate_nsa_call
from nsa.distributed.groups import ContextParallelGroup
from nsa.distributed.sharding import (chunks_per_rank, shard_ranges, take_ranges,
                                      to_natural_order, to_rank_order)
from sparsity import QueryRows


@dataclass(frozen=True)
class _Segment:
    """The positions [a, b) of one sequence that this rank holds in one chunk, at `local_row`
    of its shard; the sequence starts at packed row `start` of the whole sequence."""

    start: int
    a: int
    b: int
    local_row: int
    halo_from: int  # p: the first position of the query rows (the halo is [p, a))
    keys_end: int  # the keys the rule reads: to the end of the last row's selection tile
    # Where the halo's rows are: the end of chunk `slot` of rank `rank`, in batch entry `entry`
    # (0 when packed); None without a halo.
    halo_source: tuple[int, int, int] | None


@dataclass(frozen=True)
class _RankRows:
    """Where this rank's rows sit in the whole sequence, and its local problem. The sequence
    axis is seen as (entries, length): a padded batch (B, N), or packed rows (1, T)."""

    segments: tuple[_Segment, ...]
    bounds: tuple[int, ...]  # the whole packed sequence's cu_seqlens (host)
    entries: int
    length: int
    layout: str  # nsa.distributed.sharding's: which chunks of `length` each rank holds


def tail_rows(q_tile: int) -> int:
    """Rows of each chunk's end that its rank sends for the next chunk's halo (which is at most
    2 q_tile - 1 rows)."""
    return 2 * q_tile


def sequence_mode(context: ContextParallelGroup, layout: str, q, k, v, W_k, W_v, W_gate,
                  cu_seqlens, host_cu_seqlens, nsa_options: dict) -> Tensor:
    """This rank's shard of nsa() (module docstring). q, k, v: the rank's shard in `layout`,
    packed (T/W, ., D) with the whole sequence's cu_seqlens, or padded (B, N/W, ., D)."""
    options = {name: nsa_options.get(name, default) for name, default in _nsa_defaults().items()}
    unknown = sorted(set(nsa_options) - set(options))
    if unknown:
        raise TypeError(f"mode='sequence': unexpected nsa() options {unknown}")
    q_tile = options["_q_tile"]
    if options["causal"] is not True:
        raise ValueError("mode='sequence': causal attention only (causal=False rows see the "
                         "whole sequence; use heads mode)")
    rows = _rank_rows(context, layout, q, cu_seqlens, host_cu_seqlens, q_tile)
    heads, dim = q.shape[-2:]
    q_rows = q.reshape(-1, heads, dim)
    k_all, v_all = (_GatherSequence.apply(context, x, rows) for x in (k, v))
    halo = _halo_rows(context, q_rows, rows, q_tile)

    key_ranges, query_parts, key_bounds, query_bounds, starts, owned = [], [], [0], [0], [], []
    for segment in rows.segments:
        key_ranges.append((segment.start, segment.start + segment.keys_end))
        key_bounds.append(key_bounds[-1] + segment.keys_end)
        halo_rows = halo.get(segment, q_rows[:0])
        query_parts += [halo_rows.detach(), q_rows[segment.local_row:
                                                   segment.local_row + segment.b - segment.a]]
        owned.append((query_bounds[-1] + segment.a - segment.halo_from,
                      query_bounds[-1] + segment.b - segment.halo_from))
        query_bounds.append(query_bounds[-1] + segment.b - segment.halo_from)
        starts.append(segment.halo_from)
    device = q.device
    k_local, v_local = (take_ranges(x, 0, key_ranges) for x in (k_all, v_all))
    q_local = torch.cat(query_parts)
    cu_keys = torch.tensor(key_bounds, dtype=torch.int32, device=device)
    queries = QueryRows(torch.tensor(query_bounds, dtype=torch.int32, device=device),
                        tuple(query_bounds), tuple(starts))
    # One GPU clips num_selected_blocks by the longest sequence: the same bound here.
    whole = rows.bounds
    longest = max(b - a for a, b in zip(whole, whole[1:]))
    recompute = options["recompute"]
    # validate_nsa_call reads q's shape, dtype and device only: a stand-in with the keys' rows.
    stand_in = q_local[:1].expand(k_local.shape[0], heads, dim)
    config, _ = validate_nsa_call(
        stand_in, k_local, v_local, cu_seqlens=cu_keys,
        max_seqlen=longest if options["max_seqlen"] is None else options["max_seqlen"],
        host_cu_seqlens=key_bounds, W_k=W_k, W_v=W_v, W_gate=W_gate, causal=True,
        softmax_scale=options["softmax_scale"],
        num_cmp_selected_blocks=options["num_cmp_selected_blocks"], q_tile=q_tile,
        cmp_kv_block=options["_cmp_kv_block"],
        compress_block_size=options["compress_block_size"],
        selected_block_size=options["selected_block_size"],
        num_selected_blocks=options["num_selected_blocks"], window_size=options["window_size"],
        deterministic=options["deterministic"], recompute=recompute, capture=options["capture"])
    # (capture is checked, not used: captured plans do not cover query rows.)
    sequences = PackedSequences(tuple(key_bounds), max(
        (b - a for a, b in zip(key_bounds, key_bounds[1:])), default=0))
    differentiable = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, W_k, W_v, W_gate))
    keep = differentiable and keeps_branch_outputs(q_local, sum(config.branches), recompute)
    out_local = NSAFunction.apply(q_local, k_local, v_local, W_k, W_v, W_gate, cu_keys,
                                  sequences.max_seqlen, config, sequences.cu_seqlens, keep,
                                  queries)
    return take_ranges(out_local, 0, owned).reshape(q.shape)


@functools.cache
def _nsa_defaults() -> dict:
    """nsa()'s keyword options and their defaults (the one place that states them); read from
    its signature once, not per layer call."""
    import inspect

    from nsa.api import nsa

    skipped = {"q", "k", "v", "cu_seqlens", "host_cu_seqlens", "W_k", "W_v", "W_gate",
               "context_parallel_group", "context_parallel_mode", "context_parallel_layout"}
    return {name: parameter.default
            for name, parameter in inspect.signature(nsa).parameters.items()
            if name not in skipped}


def _rank_rows(context: ContextParallelGroup, layout: str, q: Tensor, cu_seqlens,
               host_cu_seqlens, q_tile: int) -> _RankRows:
    """This rank's segments (module docstring), from host values only."""
    rank, world = context.rank, context.world_size
    if cu_seqlens is not None:
        entries, shard = 1, q.shape[0]
        bounds = tuple(host_cu_seqlens)
        documents = tuple(zip(bounds, bounds[1:]))  # (start, end) in the one entry
    else:
        entries, shard = q.shape[0], q.shape[1]
        bounds = tuple(i * shard * world for i in range(entries + 1))
        documents = ((0, shard * world),)  # each entry is one sequence
    length = shard * world
    ranges_of = [shard_ranges(length, rank=r, world_size=world, layout=layout)
                 for r in range(world)]
    chunk = shard // chunks_per_rank(layout)
    if chunk < tail_rows(q_tile):
        raise ValueError(f"mode='sequence': every rank must hold at least {tail_rows(q_tile)} "
                         f"tokens per chunk of the layout (two selection tiles: a chunk's halo "
                         f"comes from the end of the chunk before it), got {chunk} "
                         f"(layout={layout!r}, {shard} tokens a rank)")
    # The chunk that ends where another starts: the source of a halo at that chunk's start.
    chunk_ending_at = {stop: (r, slot) for r, ranges in enumerate(ranges_of)
                       for slot, (_, stop) in enumerate(ranges)}
    segments = []
    for entry in range(entries):
        for slot, (first, last) in enumerate(ranges_of[rank]):
            for doc_start, doc_end in documents:
                lo, hi = max(first, doc_start), min(last, doc_end)
                if lo >= hi:
                    continue
                a, b = lo - doc_start, hi - doc_start
                halo_from = 0 if a == 0 else max(0, (a // q_tile) * q_tile - q_tile)
                halo_source = None if halo_from == a else (*chunk_ending_at[lo], entry)
                segments.append(_Segment(
                    start=entry * length + doc_start, a=a, b=b,
                    local_row=entry * shard + slot * chunk + lo - first, halo_from=halo_from,
                    keys_end=min(doc_end - doc_start, -(-b // q_tile) * q_tile),
                    halo_source=halo_source))
    return _RankRows(tuple(segments), bounds, entries, length, layout)


def _halo_rows(context: ContextParallelGroup, q_rows: Tensor, rows: _RankRows,
               q_tile: int) -> dict:
    """Segment -> its halo's q rows [p, a): the end of the chunk before the segment's (rows of
    another chunk, of this or another rank), from one all-gather of the last tail_rows rows of
    every rank's chunks (per batch entry for a padded batch)."""
    tail = tail_rows(q_tile)
    chunks = chunks_per_rank(rows.layout)
    # (entries, chunks, tail, H, D): each chunk's last rows
    tails = q_rows.view(rows.entries, chunks, -1, *q_rows.shape[1:])[:, :, -tail:]
    gathered = [torch.empty_like(tails, memory_format=torch.contiguous_format)
                for _ in range(context.world_size)]
    dist.all_gather(gathered, tails.detach().contiguous(), group=context.process_group)
    halos = {}
    for segment in rows.segments:
        if segment.halo_source is not None:
            rank, slot, entry = segment.halo_source
            halos[segment] = gathered[rank][entry, slot, tail - (segment.a - segment.halo_from):]
    return halos


class _GatherSequence(torch.autograd.Function):
    """The whole sequence's packed rows in natural order from every rank's shard (an all-gather);
    backward: each rank's rows of the gradient summed over the ranks (every rank adds its keys'
    gradients), as a reduce-scatter where the backend has one."""

    @staticmethod
    def forward(ctx, context: ContextParallelGroup, x: Tensor, rows: _RankRows) -> Tensor:
        ctx.context, ctx.rows, ctx.shape = context, rows, x.shape
        parts = [torch.empty_like(x) for _ in range(context.world_size)]
        dist.all_gather(parts, x.contiguous(), group=context.process_group)
        by_rank = torch.cat([part.view(rows.entries, -1, *x.shape[-2:]) for part in parts], 1)
        whole = to_natural_order(by_rank, 1, context.world_size, rows.layout)
        return whole.reshape(rows.entries * rows.length, *x.shape[-2:])

    @staticmethod
    def backward(ctx, grad: Tensor):
        context, rows = ctx.context, ctx.rows
        world = context.world_size
        # (entries, T or N, ...) in rank order: rank r's shard at [r*T/W, (r+1)*T/W)
        by_rank = to_rank_order(grad.reshape(rows.entries, rows.length, *grad.shape[1:]), 1,
                                world, rows.layout)
        # (W, entries, T/W, ...): [r] is rank r's shard of this rank's partial gradient (no
        # copy for packed contiguous shards: entries = 1)
        stacked = by_rank.unflatten(1, (world, -1)).transpose(0, 1).contiguous()
        return None, context.sum_scattered(stacked).reshape(ctx.shape), None
