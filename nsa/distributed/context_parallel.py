"""nsa_context_parallel: nsa() on a sequence sharded across the ranks of a process group.

Heads mode (built): NSA is separable by KV group (compression, selection and gating are per KV
group or per head), so one all-to-all turns "my tokens, all heads" into "all tokens, my KV
groups" (Hkv/W KV heads and their H/W query heads on each rank), each rank runs nsa() unchanged
on the whole sequence, and a second all-to-all brings the output back to the token shards.
Every number is computed by exactly the code one process runs on those heads, so outputs and
gradients equal one process's bitwise. It needs the world size W to divide Hkv.

Sequence mode (nsa/distributed/sequence_mode.py; for W not dividing Hkv, or on request): query
shards stay put, K and V are all-gathered, the rows the rule reads before a rank's first row
come from the previous rank, each rank runs nsa()'s internals on its query rows at their
positions, and dK/dV go home summed over the ranks (equal to one process up to the order of
float sums).
"""
from __future__ import annotations

import torch
from torch import Tensor

from nsa.api import nsa
from nsa.distributed.agreement import MODES, agree_on_call
from nsa.distributed.exchange import (HeadsToSequence, SequenceToHeads, chunk_heads,
                                      start_heads_to_sequence, start_sequence_to_heads)
from nsa.distributed.groups import ContextParallelGroup, resolve_group
from nsa.distributed.sequence_mode import sequence_mode
from nsa.distributed.sharding import to_natural_order, to_rank_order


def nsa_context_parallel(q: Tensor, k: Tensor, v: Tensor, *, group,
                         cu_seqlens: Tensor | None = None,
                         host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
                         mode: str = "auto", W_k: Tensor | None = None, W_v: Tensor | None = None,
                         W_gate: Tensor | None = None, overlap_chunks: int = 1,
                         layout: str = "contiguous", **nsa_options) -> Tensor:
    """This rank's shard of nsa(q, k, v, ...) computed over the whole sharded sequence.

    q, k, v: this rank's token shard in `layout` (nsa.distributed.shard_sequence makes it):
        packed (T/W, H, D), (T/W, Hkv, D) with the GLOBAL cu_seqlens (the whole packed
        sequence's bounds, the same on every rank; documents may cross shard boundaries), or
        padded (B, N/W, H, D), (B, N/W, Hkv, D). Every rank holds the same number of tokens.
    group: the context-parallel group: a ProcessGroup, a 1-D DeviceMesh, or (mesh, dim name)
        for one dimension of a 2-D (data x context) mesh.
    host_cu_seqlens: cu_seqlens's values on the host, as for nsa() (spares a device read).
    mode: "heads" (all-to-all to KV-head shards; needs W to divide Hkv), "sequence" (each rank
        keeps its queries; causal only, at least 256 tokens a chunk of the layout), or "auto" (heads when W
        divides Hkv, else sequence).
    W_k, W_v (Hkv, D, D), W_gate (H, 3, D): replicated weights, the same on every rank. Each
        rank's gradient is its partial: nonzero only in the heads it computed, so the sum over
        the group (what DDP/FSDP's gradient reduction over the data x context ranks adds) is the
        one-process gradient.
    overlap_chunks: heads mode in this many chunks of a rank's KV heads (a divisor of
        Hkv / W), pipelined: the all-to-all of chunk c+1 (and of chunk c's output) runs while
        nsa() computes chunk c, forward and backward. 1 (default): one all-to-all each way,
        nothing overlapped. The same numbers either way on the GPU (nsa() is per KV head).
        Not yet timed on GPUs: the default stays 1 until it is.
    layout: how the tokens are sharded (nsa.distributed.sharding): "contiguous" (default:
        rank r holds tokens [r*T/W, (r+1)*T/W)) or "zigzag" (rank r holds chunks r and 2W-1-r
        of 2W equal chunks: the same causal work on every rank, which sequence mode needs to
        be balanced). The output and gradients come back in the same layout.
    nsa_options: nsa()'s other options (block sizes, window_size, max_seqlen of the whole
        sequence, softmax_scale, deterministic, ...), the same on every rank.

    Returns this rank's shard of the output, q's shape. Collective: every rank of the group
    calls it with agreeing arguments (checked first, with one small all-gather: disagreeing
    shapes, cu_seqlens, options or devices raise the same error on every rank instead of
    hanging), and every rank runs the backward.
    """
    context = resolve_group(group)
    agreed = agree_on_call(context, q, k, v, W_k, W_v, W_gate, cu_seqlens, host_cu_seqlens, mode,
                           {**nsa_options, "overlap_chunks": overlap_chunks, "layout": layout})
    chosen = choose_mode(mode, context.world_size, k.shape[-2])
    if chosen == "sequence":
        if overlap_chunks != 1:
            raise ValueError("overlap_chunks: heads mode only (mode='sequence' was chosen)")
        return sequence_mode(context, layout, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                             agreed.host_cu_seqlens, nsa_options)
    if context.world_size == 1:
        return nsa(q, k, v, cu_seqlens=cu_seqlens, host_cu_seqlens=agreed.host_cu_seqlens,
                   W_k=W_k, W_v=W_v, W_gate=W_gate, **nsa_options)
    if overlap_chunks > 1:
        return _pipelined_heads_mode(context, layout, overlap_chunks, q, k, v, W_k, W_v,
                                     W_gate, cu_seqlens, agreed.host_cu_seqlens, nsa_options)
    return _heads_mode(context, layout, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                       agreed.host_cu_seqlens, nsa_options)


def choose_mode(mode: str, world_size: int, kv_heads: int) -> str:
    """The mode a call runs in, or a ValueError naming `mode` (the same on every rank: it
    depends only on values the ranks agreed on)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    heads_fit = kv_heads % world_size == 0
    if mode == "sequence" or (mode == "auto" and not heads_fit):
        return "sequence"
    if heads_fit:
        return "heads"
    raise ValueError(f"mode='heads': heads mode needs the context-parallel world size to "
                     f"divide Hkv (got world size {world_size}, Hkv {kv_heads}); use a group "
                     f"of a size that divides Hkv, or mode='sequence'")


def _heads_mode(context: ContextParallelGroup, layout: str, q, k, v, W_k, W_v, W_gate,
                cu_seqlens, host_cu_seqlens, nsa_options) -> Tensor:
    packed = cu_seqlens is not None
    # The exchange works on (L, n, h, D); packed tokens are one row of L.
    as_4d = (lambda x: x.unsqueeze(0)) if packed else (lambda x: x)
    natural, by_rank = _orders(context, layout)
    q_heads, k_heads, v_heads = (
        natural(x) for x in SequenceToHeads.apply(context, as_4d(q), as_4d(k), as_4d(v)))
    if packed:
        q_heads, k_heads, v_heads = (x.squeeze(0) for x in (q_heads, k_heads, v_heads))
    # Rank r computes KV heads [r*Hkv/W, (r+1)*Hkv/W) and their query heads: q head h belongs
    # to KV head h // (H/Hkv), so they are the contiguous q heads [r*H/W, (r+1)*H/W).
    rank, world = context.rank, context.world_size
    kv_slice = slice(rank * k.shape[-2] // world, (rank + 1) * k.shape[-2] // world)
    q_slice = slice(rank * q.shape[-2] // world, (rank + 1) * q.shape[-2] // world)
    # Slicing a replicated weight makes its gradient here zero outside the slice: the partial
    # that the gradient reduction over the group completes.
    out_heads = nsa(q_heads, k_heads, v_heads, cu_seqlens=cu_seqlens,
                    host_cu_seqlens=host_cu_seqlens,
                    W_k=None if W_k is None else W_k[kv_slice],
                    W_v=None if W_v is None else W_v[kv_slice],
                    W_gate=None if W_gate is None else W_gate[q_slice], **nsa_options)
    (out,) = HeadsToSequence.apply(context, by_rank(as_4d(out_heads)))
    return out.squeeze(0) if packed else out


def _orders(context: ContextParallelGroup, layout: str):
    """(natural, by_rank): (L, n, h, D) tensors of the whole sequence from the rank order the
    all-to-all delivers to the natural order nsa() reads, and back. Identities (no copy) for
    the contiguous layout, whose rank order is the natural order."""
    world = context.world_size
    return (lambda x: to_natural_order(x, 1, world, layout),
            lambda x: to_rank_order(x, 1, world, layout))


def _pipelined_heads_mode(context: ContextParallelGroup, layout: str, chunks: int, q, k, v, W_k,
                          W_v, W_gate, cu_seqlens, host_cu_seqlens, nsa_options) -> Tensor:
    packed = cu_seqlens is not None
    as_4d = (lambda x: x.unsqueeze(0)) if packed else (lambda x: x)
    as_given = (lambda x: x.squeeze(0)) if packed else (lambda x: x)
    natural, by_rank = _orders(context, layout)

    def run(q_c, k_c, v_c, W_k_c, W_v_c, W_gate_c):
        out_c = nsa(*(as_given(natural(x)) for x in (q_c, k_c, v_c)), cu_seqlens=cu_seqlens,
                    host_cu_seqlens=host_cu_seqlens, W_k=W_k_c, W_v=W_v_c, W_gate=W_gate_c,
                    **nsa_options)
        return by_rank(as_4d(out_c))

    out = PipelinedHeads.apply(context, chunks, run, as_4d(q), as_4d(k), as_4d(v), W_k, W_v,
                               W_gate)
    return as_given(out)


class PipelinedHeads(torch.autograd.Function):
    """Heads mode in `chunks` chunks of each rank's KV heads, the exchanges of one chunk
    overlapping the computation of its neighbour (`_pipeline`): the forward sends chunk c+1's
    q, k, v (and chunk c's output) while nsa() runs on chunk c; the backward does the same with
    dO and with dq, dk, dv. Chunk c of rank r: its KV heads [c*g, (c+1)*g) within the rank's
    Hkv/W (g = Hkv/W/chunks) and their query heads; nsa() runs on each chunk as on any head
    subset.

    Each chunk's nsa() is differentiated on its own (its graph kept from the forward, as a
    checkpoint keeps its inputs): a backward that runs chunk by chunk is what lets its
    exchanges overlap too. Tensors are (L, n, h, D) as in nsa.distributed.exchange."""

    @staticmethod
    def forward(ctx, context, chunks, run, q, k, v, W_k, W_v, W_gate):
        differentiable = any(ctx.needs_input_grad[3:])
        graphs = []

        def compute(c, received):
            q_c, k_c, v_c = (x.detach().requires_grad_(differentiable) for x in received)
            weights_c = tuple(
                None if W is None else W.detach()[rows].requires_grad_(differentiable)
                for W, rows in zip((W_k, W_v, W_gate),
                                   _weight_rows(context, c, chunks, k.shape[2], q.shape[2])))
            with torch.set_grad_enabled(differentiable):
                out_c = run(q_c, k_c, v_c, *weights_c)
            if differentiable:
                graphs.append((out_c, (q_c, k_c, v_c), weights_c))
            return (out_c.detach(),)

        out = torch.empty_like(q)
        _pipeline(context, chunks, (q, k, v), compute, (out,))
        ctx.context, ctx.chunks, ctx.graphs = context, chunks, graphs
        ctx.shapes = (q.shape, k.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        context, chunks = ctx.context, ctx.chunks
        q_shape, k_shape = ctx.shapes
        graphs, ctx.graphs = ctx.graphs, None
        weight_grads = [None, None, None]

        def compute(c, received):
            (dout_c,) = received
            out_c, inputs_c, weights_c = graphs[c]
            graphs[c] = None  # this chunk's graph goes as soon as it is differentiated
            present = [W for W in weights_c if W is not None]
            grads = torch.autograd.grad(out_c, [*inputs_c, *present], dout_c)
            present_grads = iter(grads[3:])
            for i, (W, rows) in enumerate(zip(weights_c, _weight_rows(
                    context, c, chunks, k_shape[2], q_shape[2]))):
                if W is None:
                    continue
                if weight_grads[i] is None:  # the full weight's shape: zero outside our rows
                    weight_grads[i] = W.new_zeros((W.shape[0] * chunks * context.world_size,
                                                   *W.shape[1:]))
                weight_grads[i][rows] = next(present_grads)
            return grads[:3]

        dq = dout.new_empty(q_shape)
        dk, dv = dout.new_empty(k_shape), dout.new_empty(k_shape)
        _pipeline(context, chunks, (dout,), compute, (dq, dk, dv))
        needs = ctx.needs_input_grad
        return (None, None, None, dq if needs[3] else None, dk if needs[4] else None,
                dv if needs[5] else None,
                *(grad if need else None for grad, need in zip(weight_grads, needs[6:])))


def _pipeline(context: ContextParallelGroup, chunks: int, inputs: tuple[Tensor, ...], compute,
              results: tuple[Tensor, ...]) -> None:
    """Chunk by chunk: chunk c of `inputs` (sequence shards, all heads) arrives as head shards,
    `compute(c, received)` turns them into head-shard tensors, and those go back as sequence
    shards into chunk c of `results`. Chunk c+1's exchange starts before chunk c's compute is
    queued and chunk c's results leave right after it, so each transfer runs beside a
    neighbouring chunk's compute; only the first arrival and the last departure are exposed."""
    world = context.world_size
    pending = start_sequence_to_heads(inputs, context, (0, chunks))
    outgoing = []
    for c in range(chunks):
        following = (start_sequence_to_heads(inputs, context, (c + 1, chunks))
                     if c + 1 < chunks else None)
        outgoing.append(start_heads_to_sequence(compute(c, pending.finish()), context))
        pending = following
    for c, exchange in enumerate(outgoing):
        # (L, n, W*h_c, D): rank j's chunk-c heads at j
        for full, part in zip(results, exchange.finish()):
            chunk_heads(full, world, (c, chunks)).copy_(part.unflatten(2, (world, -1)))


def _weight_rows(context: ContextParallelGroup, chunk: int, chunks: int, kv_heads: int,
                 heads: int) -> tuple[slice, slice, slice]:
    """Rows of W_k, W_v (KV heads) and W_gate (q heads) that this rank's chunk computes."""
    def rows(total: int) -> slice:
        width = total // context.world_size // chunks
        start = context.rank * total // context.world_size + chunk * width
        return slice(start, start + width)

    return rows(kv_heads), rows(kv_heads), rows(heads)
