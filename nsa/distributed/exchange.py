"""The all-to-all between sequence shards and head shards, differentiable both ways.

Tensors here are 4-D (L, n, h, D): L = B for a padded batch, L = 1 for packed tokens, n the
tokens along the sequence, h the heads. With W ranks:

  sequence_to_heads: (L, n, h, D) on every rank, its n tokens of all h heads
                  -> (L, W*n, h/W, D): all tokens of head slice r (heads [r*h/W, (r+1)*h/W))
  heads_to_sequence: the inverse.

Several tensors (q, k, v; or dq, dk, dv) travel in one all-to-all: each rank's message to rank j
is the concatenation of every tensor's head slice j, so one collective pays the latency once.
They must share the dtype, L, n and D. The backward of one direction is the other direction
(an all-to-all is a permutation of the data: its adjoint is the inverse permutation), which moves
every gradient element to where its input came from without adding anything: bitwise exact.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nsa.distributed.groups import ContextParallelGroup


def sequence_to_heads(tensors: tuple[Tensor, ...], group: ContextParallelGroup
                      ) -> tuple[Tensor, ...]:
    return start_sequence_to_heads(tensors, group).finish()


def heads_to_sequence(tensors: tuple[Tensor, ...], group: ContextParallelGroup
                      ) -> tuple[Tensor, ...]:
    return start_heads_to_sequence(tensors, group).finish()


class Exchange:
    """An all-to-all under way (`start_sequence_to_heads`, `start_heads_to_sequence`):
    `finish()` waits for it (on NCCL: the current stream waits, the host does not) and returns
    the received tensors. Until then, work queued on the current stream overlaps the transfer."""

    def __init__(self, send: Tensor, received: Tensor, work, unpack):
        self._send, self._received, self._work, self._unpack = send, received, work, unpack

    def finish(self) -> tuple[Tensor, ...]:
        if self._work is not None:
            self._work.wait()
        self._send = None  # kept alive until the transfer has read it
        return self._unpack(self._received)


def start_sequence_to_heads(tensors: tuple[Tensor, ...], group: ContextParallelGroup,
                            chunk: tuple[int, int] = (0, 1)) -> Exchange:
    """chunk = (c, count): send only chunk c of `count` equal chunks of each destination's h/W
    heads (the pipelined heads mode); the result then holds h/W/count heads."""
    world = group.world_size
    heads = [x.shape[2] // world // chunk[1] for x in tensors]
    # (L, n, h, D) -> (L, n, W, h/W, D): the W axis picks the destination rank.
    by_destination = torch.cat([chunk_heads(x, world, chunk) for x in tensors], dim=3)
    send = by_destination.permute(2, 0, 1, 3, 4).contiguous()  # (W, L, n, sum h/W, D)
    batch, tokens = send.shape[1], send.shape[2]

    def unpack(received: Tensor) -> tuple[Tensor, ...]:
        # [i] = rank i's tokens of this rank's heads. Rank order is token order (rank i holds
        # shard i), so stacking along n restores the sequence.
        return tuple(part.permute(1, 0, 2, 3, 4).reshape(batch, world * tokens, h,
                                                         part.shape[-1])
                     for part, h in zip(received.split(heads, dim=3), heads))

    return _start_all_to_all(send, group, unpack)


def start_heads_to_sequence(tensors: tuple[Tensor, ...], group: ContextParallelGroup
                            ) -> Exchange:
    world = group.world_size
    heads = [x.shape[2] for x in tensors]
    # (L, W*n, h, D) -> (L, W, n, h, D): the W axis picks the rank that holds those tokens.
    by_destination = torch.cat([x.unflatten(1, (world, x.shape[1] // world)) for x in tensors],
                               dim=3)
    send = by_destination.transpose(0, 1).contiguous()  # (W, L, n, sum h, D)
    batch, tokens = send.shape[1], send.shape[2]

    def unpack(received: Tensor) -> tuple[Tensor, ...]:
        # [j] = this rank's tokens of rank j's heads. Rank j computed heads [j*h, (j+1)*h):
        # putting W before h restores the global head order.
        return tuple(part.permute(1, 2, 0, 3, 4).reshape(batch, tokens, world * h,
                                                         part.shape[-1])
                     for part, h in zip(received.split(heads, dim=3), heads))

    return _start_all_to_all(send, group, unpack)


def chunk_heads(x: Tensor, world: int, chunk: tuple[int, int] = (0, 1)) -> Tensor:
    """The (L, n, W, h/W/count, D) view of x (L, n, h, D) at chunk c of `count` equal chunks of
    every rank's h/W heads, chunk = (c, count)."""
    index, count = chunk
    per_rank = x.shape[2] // world
    width = per_rank // count
    return x.unflatten(2, (world, per_rank))[:, :, :, index * width:(index + 1) * width]


def _start_all_to_all(send: Tensor, group: ContextParallelGroup, unpack) -> Exchange:
    if group.world_size == 1:
        return Exchange(send, send, None, unpack)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group.process_group, async_op=True)
    return Exchange(send, received, work, unpack)


class SequenceToHeads(torch.autograd.Function):
    """sequence_to_heads forward, heads_to_sequence backward."""

    @staticmethod
    def forward(ctx, group: ContextParallelGroup, *tensors: Tensor):
        ctx.group = group
        return sequence_to_heads(tensors, group)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        # Unused outputs arrive as zeros (autograd materializes them), so every rank joins the
        # same collective whatever its own graph used.
        return (None, *heads_to_sequence(grads, ctx.group))


class HeadsToSequence(torch.autograd.Function):
    """heads_to_sequence forward, sequence_to_heads backward."""

    @staticmethod
    def forward(ctx, group: ContextParallelGroup, *tensors: Tensor):
        ctx.group = group
        return heads_to_sequence(tensors, group)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, *sequence_to_heads(grads, ctx.group))
