"""How a sequence's tokens are split over the ranks (the layout), and gathered back.

Every per-token tensor (q, k, v, gate inputs, labels, positions) is split along the sequence
dimension (0 for packed (T, ...), 1 for padded (B, N, ...)) into W equal shards, one per rank,
by one of two layouts:

- "contiguous": rank r holds tokens [r*T/W, (r+1)*T/W).
- "zigzag": the sequence is cut into 2W equal chunks and rank r holds chunk r followed by chunk
  2W-1-r. Causal attention's work grows with the row's position, so under the contiguous
  layout the last rank does the most (NSA's compressed branch: about 1.75x the average on 4
  ranks); pairing an early chunk with its mirror gives every rank the same causal work
  (docs/context_parallel.md has the arithmetic).

`shard_ranges` is the one place that says which tokens a rank holds; everything else here (and
nsa_context_parallel's exchanges) derives from it. Packed documents may cross shard and chunk
boundaries: cu_seqlens is not sharded, every rank passes the global cu_seqlens of the whole
packed sequence. A length that the layout cannot split equally is refused rather than padded: a
pad row would be a token of some document, and silently changing the documents is worse than
asking the caller to pack to a multiple (a data loader packs to a fixed T anyway).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nsa.distributed.groups import resolve_group

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout, name: str = "layout") -> None:
    """A ValueError naming the argument (`name`: the caller's, e.g. a model's
    context_parallel_layout) and the allowed values, unless layout is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    """How many separate pieces of the sequence a rank holds under `layout`."""
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def shard_ranges(total: int, group=None, *, rank: int | None = None,
                 world_size: int | None = None, layout: str = "contiguous",
                 name: str = "x") -> tuple[tuple[int, int], ...]:
    """The (start, stop) ranges of this rank's tokens among `total`, in the order its shard
    holds them: one range (contiguous) or two (zigzag: chunk r, then chunk 2W-1-r).

    Pass `group` (a ProcessGroup, a 1-D DeviceMesh or (mesh, dim)), or `rank` and `world_size`
    (a data loader that knows them without a process group). A `total` the layout cannot split
    equally (W chunks contiguous, 2W zigzag) raises a ValueError naming `name` and the multiple.
    """
    rank, world_size = _rank_and_world(group, rank, world_size)
    pieces = chunks_per_rank(layout) * world_size
    if total % pieces:
        raise ValueError(f"{name} has {total} tokens, not a multiple of {pieces} (layout="
                         f"{layout!r} over {world_size} ranks: {pieces} equal chunks): pack or "
                         f"pad the data to a multiple of {pieces} tokens before sharding")
    size = total // pieces
    chunks = (rank,) if layout == "contiguous" else (rank, pieces - 1 - rank)
    return tuple((c * size, (c + 1) * size) for c in chunks)


def shard_bounds(total: int, group=None, *, rank: int | None = None,
                 world_size: int | None = None, name: str = "x") -> tuple[int, int]:
    """(start, stop) of this rank's tokens among `total` in the contiguous layout (for zigzag,
    whose shard is two ranges, see shard_ranges)."""
    (bounds,) = shard_ranges(total, group, rank=rank, world_size=world_size, name=name)
    return bounds


def shard_indices(total: int, group=None, *, rank: int | None = None,
                  world_size: int | None = None, layout: str = "contiguous",
                  device=None) -> Tensor:
    """(total / W,) int64: the index in the whole sequence of each of this rank's tokens, in
    shard order. The positions for a rotary embedding of one padded sequence, or the rows to
    pick from per-token tensors (labels, document positions: nsa.layer.positions_in_sequences
    of the whole packed batch, indexed by these)."""
    ranges = shard_ranges(total, group, rank=rank, world_size=world_size, layout=layout,
                          name="the sequence")
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])


def shard_sequence(x: Tensor, group=None, *, rank: int | None = None,
                   world_size: int | None = None, seq_dim: int = 0, layout: str = "contiguous",
                   name: str = "x") -> Tensor:
    """This rank's shard of x along seq_dim (0: packed (T, ...); 1: padded (B, N, ...)).

    contiguous: a view of x (call .contiguous() or .clone() to own the memory); zigzag: a new
    tensor, the rank's two chunks concatenated. A length the layout cannot split equally raises
    a ValueError naming `name` and the multiple needed.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for {name} of shape "
                         f"{tuple(x.shape)}")
    ranges = shard_ranges(x.shape[seq_dim], group, rank=rank, world_size=world_size,
                          layout=layout, name=name)
    return take_ranges(x, seq_dim, ranges)


def unshard_sequence(x: Tensor, group, *, seq_dim: int = 0,
                     layout: str = "contiguous") -> Tensor:
    """The whole sequence in its natural order from every rank's shard x (an all-gather).

    Every rank must pass a shard of the same shape. The result carries no autograd history:
    it is for checks, logging and evaluation, not for a loss (compute the loss on the shards).
    """
    check_layout(layout)
    context = resolve_group(group)
    shards = [torch.empty_like(x, memory_format=torch.contiguous_format)
              for _ in range(context.world_size)]
    dist.all_gather(shards, x.detach().contiguous(), group=context.process_group)
    return to_natural_order(torch.cat(shards, dim=seq_dim), seq_dim, context.world_size, layout)


def to_natural_order(x: Tensor, seq_dim: int, world_size: int, layout: str) -> Tensor:
    """Every rank's shard concatenated in rank order (what an all-gather or an all-to-all
    delivers) -> the sequence in its natural order. x itself where the two orders agree
    (contiguous): no copy."""
    ranges = _ranges_in_rank_order(x.shape[seq_dim], world_size, layout)
    if _follow_each_other(ranges):
        return x
    pieces = x.split([stop - start for start, stop in ranges], dim=seq_dim)
    return torch.cat([piece for _, piece in sorted(zip(ranges, pieces),
                                                   key=lambda pair: pair[0])], dim=seq_dim)


def to_rank_order(x: Tensor, seq_dim: int, world_size: int, layout: str) -> Tensor:
    """The inverse of to_natural_order: the whole sequence -> every rank's shard concatenated
    in rank order (rank r's at [r*T/W, (r+1)*T/W)). x itself for contiguous."""
    return take_ranges(x, seq_dim, _ranges_in_rank_order(x.shape[seq_dim], world_size, layout))


def _ranges_in_rank_order(total: int, world_size: int, layout: str) -> list[tuple[int, int]]:
    return [bounds for rank in range(world_size)
            for bounds in shard_ranges(total, rank=rank, world_size=world_size, layout=layout)]


def take_ranges(x: Tensor, dim: int, ranges) -> Tensor:
    """x's [start, stop) ranges along dim, concatenated in order: a view when they follow each
    other."""
    if _follow_each_other(ranges):
        return x.narrow(dim, ranges[0][0], ranges[-1][1] - ranges[0][0])
    return torch.cat([x.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def _follow_each_other(ranges) -> bool:
    return all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))


def _rank_and_world(group, rank, world_size) -> tuple[int, int]:
    if group is not None:
        if rank is not None or world_size is not None:
            raise ValueError("pass either group or rank and world_size, not both")
        context = resolve_group(group)
        return context.rank, context.world_size
    if rank is None or world_size is None:
        raise ValueError("pass group, or both rank and world_size")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size
