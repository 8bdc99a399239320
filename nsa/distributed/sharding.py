"""Split tokens into equal contiguous shards, one per rank, and gather them back.

The layout nsa_context_parallel expects: rank r of W holds tokens [r*T/W, (r+1)*T/W) of every
per-token tensor (q, k, v, gate inputs, labels, positions), along the sequence dimension (0 for
packed (T, ...), 1 for padded (B, N, ...)). Packed documents may cross shard boundaries:
cu_seqlens is not sharded, every rank passes the global cu_seqlens of the whole packed sequence.
A length that W does not divide is refused rather than padded: a pad row would be a token of
some document, and silently changing the documents is worse than asking the caller to pack to a
multiple (a data loader packs to a fixed T anyway).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nsa.distributed.groups import resolve_group


def shard_bounds(total: int, group=None, *, rank: int | None = None,
                 world_size: int | None = None, name: str = "x") -> tuple[int, int]:
    """(start, stop) of this rank's tokens among `total`: the same split shard_sequence makes.

    Pass `group` (a ProcessGroup, a 1-D DeviceMesh or (mesh, dim)), or `rank` and `world_size`
    (a data loader that knows them without a process group).
    """
    rank, world_size = _rank_and_world(group, rank, world_size)
    if total % world_size:
        raise ValueError(f"{name} has {total} tokens, not a multiple of the context-parallel "
                         f"world size {world_size}: pack or pad the data to a multiple of "
                         f"{world_size} tokens before sharding (shards must be equal)")
    size = total // world_size
    return rank * size, (rank + 1) * size


def shard_sequence(x: Tensor, group=None, *, rank: int | None = None,
                   world_size: int | None = None, seq_dim: int = 0, name: str = "x") -> Tensor:
    """This rank's contiguous shard of x along seq_dim (0: packed (T, ...); 1: padded (B, N, ...)).

    Returns a view of x (call .contiguous() or .clone() to own the memory). A length that the
    world size does not divide raises a ValueError naming `name` and the multiple needed.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for {name} of shape "
                         f"{tuple(x.shape)}")
    start, stop = shard_bounds(x.shape[seq_dim], group, rank=rank, world_size=world_size,
                               name=name)
    return x.narrow(seq_dim, start, stop - start)


def unshard_sequence(x: Tensor, group, *, seq_dim: int = 0) -> Tensor:
    """All ranks' shards of x concatenated along seq_dim in rank order (an all-gather).

    Every rank must pass a shard of the same shape. The result carries no autograd history:
    it is for checks, logging and evaluation, not for a loss (compute the loss on the shards).
    """
    context = resolve_group(group)
    shards = [torch.empty_like(x, memory_format=torch.contiguous_format)
              for _ in range(context.world_size)]
    dist.all_gather(shards, x.detach().contiguous(), group=context.process_group)
    return torch.cat(shards, dim=seq_dim)


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
