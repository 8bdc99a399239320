"""Sequence mode: each rank keeps its query rows and reads the keys they need from the others.

For groups whose size does not divide Hkv (heads mode's condition), or on request. Rank r holds
tokens of the sequence (packed: the contiguous rows [r T/W, (r+1) T/W); padded: positions
[r N/W, (r+1) N/W) of every batch entry). Per document (segment) it holds positions [a, b):

- keys: K and V of the whole sequence, all-gathered (each rank holds (T, Hkv, D) of each: the
  simple form; reading only the blocks a rank's queries need is the frugal one, not built), of
  which the segment's document prefix up to the end of b's selection tile is the rank's key
  sequence (the rule's forced blocks and its compressed-block counts read the tile's whole
  extent, so a tile cut by the shard bound must see the keys of its other part too, which its
  rows never attend);
- queries: its own rows [a, b), and before them a halo of the rows [p, a) that the rule of one
  GPU reads: p is a's selection tile start, one tile further back (a selection tile's scoring
  query averages the q_tile rows ending at its first row), or 0. The halo comes from the
  previous rank's last rows (one all-gather of each rank's last 2 q_tile rows: sequence mode
  needs at least that many tokens per rank);
- nsa()'s internals on those query rows (`sparsity.QueryRows`: every rule at the rows' positions
  in their document, the kernels' q_start_positions), then the rows it owns are kept. The first
  tile of a halo scores only the rows it has, so its selection differs from one GPU's: its rows
  are halo rows, dropped.

Backward: dO is zero on the halo rows, so they add exactly nothing to any gradient and get none
(their q is taken detached). dK and dV of the gathered keys are summed over the ranks into
their owners (a reduce-scatter); W_k, W_v and W_gate get each rank's partial (its queries'
share), which the data x context gradient reduction completes, as in heads mode. Outputs equal
one process's up to the order of float sums (the dK/dV reduction over ranks adds in another
order than one process's kernels), with the same selected blocks.

The kernels take q_start_positions on the fallback only (`kernels.dispatch` says so): on a GPU
sequence mode runs the branches' attention in torch until the sm90 kernels take them.
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
from sparsity import QueryRows


@dataclass(frozen=True)
class _Segment:
    """The positions [a, b) of one sequence that this rank holds, at `local_row` of its shard;
    the sequence starts at packed row `start` of the whole sequence."""

    start: int
    a: int
    b: int
    local_row: int
    halo_from: int  # p: the first position of the query rows (the halo is [p, a))
    keys_end: int  # the keys the rule reads: to the end of the last row's selection tile


@dataclass(frozen=True)
class _Layout:
    """Where this rank's rows sit in the whole packed sequence, and its local problem."""

    segments: tuple[_Segment, ...]
    bounds: tuple[int, ...]  # the whole packed sequence's cu_seqlens (host)
    shard_rows: int  # this rank's rows (packed), or N / W (padded, per batch entry)
    padded: tuple[int, int] | None  # (B, N) of a padded batch, else None

    def owner(self, row: int) -> tuple[int, int]:
        """(rank, row in that rank's shard, flattened) of global packed row `row`."""
        if self.padded is None:
            return row // self.shard_rows, row % self.shard_rows
        n = self.padded[1]
        entry, position = divmod(row, n)
        return position // self.shard_rows, entry * self.shard_rows + position % self.shard_rows


def tail_rows(q_tile: int) -> int:
    """Rows of each rank's end that it sends for the next rank's halo (which is at most
    2 q_tile - 1 rows)."""
    return 2 * q_tile


def sequence_mode(context: ContextParallelGroup, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                  host_cu_seqlens, nsa_options: dict) -> Tensor:
    """This rank's shard of nsa() (module docstring). q, k, v: the rank's shard, packed
    (T/W, ., D) with the whole sequence's cu_seqlens, or padded (B, N/W, ., D)."""
    options = {name: nsa_options.get(name, default) for name, default in _nsa_defaults().items()}
    unknown = sorted(set(nsa_options) - set(options))
    if unknown:
        raise TypeError(f"mode='sequence': unexpected nsa() options {unknown}")
    q_tile = options["_q_tile"]
    if options["causal"] is not True:
        raise ValueError("mode='sequence': causal attention only (causal=False rows see the "
                         "whole sequence; use heads mode)")
    layout = _layout(context, q, cu_seqlens, host_cu_seqlens, q_tile)
    heads, dim = q.shape[-2:]
    q_rows = q.reshape(-1, heads, dim)
    k_all, v_all = (_GatherSequence.apply(context, x, layout) for x in (k, v))
    halo = _halo_rows(context, q_rows, layout, q_tile)

    key_ranges, query_parts, key_bounds, query_bounds, starts, owned = [], [], [0], [0], [], []
    for segment in layout.segments:
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
    k_local, v_local = (_rows(x, key_ranges) for x in (k_all, v_all))
    q_local = torch.cat(query_parts)
    cu_keys = torch.tensor(key_bounds, dtype=torch.int32, device=device)
    queries = QueryRows(torch.tensor(query_bounds, dtype=torch.int32, device=device),
                        tuple(query_bounds), tuple(starts))
    # One GPU clips num_selected_blocks by the longest sequence: the same bound here.
    whole = layout.bounds
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
    return _rows(out_local, owned).reshape(q.shape)


def _rows(x: Tensor, ranges: list[tuple[int, int]]) -> Tensor:
    """Rows [a, b) of x for each range, in order: a view where they follow each other (packed
    shards: a rank's documents are consecutive), else a gather."""
    if all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
        return x[ranges[0][0]:ranges[-1][1]]
    index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(x.device)
    return x[index]


@functools.cache
def _nsa_defaults() -> dict:
    """nsa()'s keyword options and their defaults (the one place that states them); read from
    its signature once, not per layer call."""
    import inspect

    from nsa.api import nsa

    skipped = {"q", "k", "v", "cu_seqlens", "host_cu_seqlens", "W_k", "W_v", "W_gate",
               "context_parallel_group", "context_parallel_mode"}
    return {name: parameter.default
            for name, parameter in inspect.signature(nsa).parameters.items()
            if name not in skipped}


def _layout(context: ContextParallelGroup, q: Tensor, cu_seqlens, host_cu_seqlens,
            q_tile: int) -> _Layout:
    """This rank's segments (module docstring), from host values only."""
    rank, world = context.rank, context.world_size
    if cu_seqlens is not None:
        shard = q.shape[0]
        bounds, padded = list(host_cu_seqlens), None
    else:
        batch, shard = q.shape[0], q.shape[1]
        n = shard * world
        bounds, padded = [i * n for i in range(batch + 1)], (batch, n)
    if shard < tail_rows(q_tile):
        raise ValueError(f"mode='sequence': every rank must hold at least {tail_rows(q_tile)} "
                         f"tokens (two selection tiles: a rank's halo comes from its "
                         f"neighbour's last rows), got {shard}")
    segments = []
    for s, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if padded is None:
            first, last = rank * shard, (rank + 1) * shard  # this rank's packed rows
            lo, hi = max(first, start), min(last, end)
            if lo >= hi:
                continue
            a, b, local_row = lo - start, hi - start, lo - first
        else:
            a, b, local_row = rank * shard, (rank + 1) * shard, s * shard
        halo_from = 0 if a == 0 else max(0, (a // q_tile) * q_tile - q_tile)
        keys_end = min(end - start, -(-b // q_tile) * q_tile)
        segments.append(_Segment(start, a, b, local_row, halo_from, keys_end))
    return _Layout(tuple(segments), tuple(bounds), shard, padded)


def _halo_rows(context: ContextParallelGroup, q_rows: Tensor, layout: _Layout,
               q_tile: int) -> dict:
    """Segment -> its halo's q rows [p, a) (rows of earlier ranks), from one all-gather of every
    rank's last tail_rows (per batch entry for a padded batch)."""
    tail = tail_rows(q_tile)
    if layout.padded is None:
        tails = q_rows[-tail:]
    else:
        batch = layout.padded[0]
        tails = q_rows.view(batch, layout.shard_rows, *q_rows.shape[1:])[:, -tail:]
    gathered = [torch.empty_like(tails) for _ in range(context.world_size)]
    dist.all_gather(gathered, tails.detach().contiguous(), group=context.process_group)
    halos = {}
    for segment in layout.segments:
        if segment.halo_from == segment.a:
            continue
        rows = []
        for position in range(segment.halo_from, segment.a):
            owner, local = layout.owner(segment.start + position)
            if layout.padded is None:
                rows.append(gathered[owner][local - (layout.shard_rows - tail)])
            else:
                entry, offset = divmod(local, layout.shard_rows)
                rows.append(gathered[owner][entry, offset - (layout.shard_rows - tail)])
        halos[segment] = torch.stack(rows)
    return halos


class _GatherSequence(torch.autograd.Function):
    """The whole packed sequence from every rank's shard (all-gather); backward: each rank's
    rows of the summed gradient (a reduce-scatter: every rank adds its keys' gradients)."""

    @staticmethod
    def forward(ctx, context: ContextParallelGroup, x: Tensor, layout: _Layout) -> Tensor:
        ctx.context, ctx.layout, ctx.shape = context, layout, x.shape
        parts = [torch.empty_like(x) for _ in range(context.world_size)]
        dist.all_gather(parts, x.contiguous(), group=context.process_group)
        return _packed_whole(parts, layout)

    @staticmethod
    def backward(ctx, grad: Tensor):
        context, layout = ctx.context, ctx.layout
        total = grad.contiguous()
        dist.all_reduce(total, group=context.process_group)
        if layout.padded is None:
            rows = slice(context.rank * layout.shard_rows, (context.rank + 1) * layout.shard_rows)
            return None, total[rows], None
        batch, n = layout.padded
        whole = total.view(batch, n, *total.shape[1:])
        mine = whole[:, context.rank * layout.shard_rows:(context.rank + 1) * layout.shard_rows]
        return None, mine.reshape(ctx.shape), None


def _packed_whole(parts: list[Tensor], layout: _Layout) -> Tensor:
    """Rank-ordered shards -> the whole sequence's packed rows."""
    if layout.padded is None:
        return torch.cat(parts)
    batch, n = layout.padded
    return torch.cat(parts, dim=1).reshape(batch * n, *parts[0].shape[2:])
