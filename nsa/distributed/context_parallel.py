"""nsa_context_parallel: nsa() on a sequence sharded across the ranks of a process group.

Heads mode (built): NSA is separable by KV group (compression, selection and gating are per KV
group or per head), so one all-to-all turns "my tokens, all heads" into "all tokens, my KV
groups" (Hkv/W KV heads and their H/W query heads on each rank), each rank runs nsa() unchanged
on the whole sequence, and a second all-to-all brings the output back to the token shards.
Every number is computed by exactly the code one process runs on those heads, so outputs and
gradients equal one process's bitwise. It needs the world size W to divide Hkv.

Sequence mode (for W > Hkv; not built yet): query shards stay put, compressed K/V all-gathered,
a window halo from the previous shard, remote selected blocks read from their owners. The API
takes `mode` now so that it slots in without a change to the callers.
"""
from __future__ import annotations

from torch import Tensor

from nsa.api import nsa
from nsa.distributed.agreement import MODES, agree_on_call
from nsa.distributed.exchange import HeadsToSequence, SequenceToHeads
from nsa.distributed.groups import ContextParallelGroup, resolve_group


def nsa_context_parallel(q: Tensor, k: Tensor, v: Tensor, *, group,
                         cu_seqlens: Tensor | None = None,
                         host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
                         mode: str = "auto", W_k: Tensor | None = None, W_v: Tensor | None = None,
                         W_gate: Tensor | None = None, **nsa_options) -> Tensor:
    """This rank's shard of nsa(q, k, v, ...) computed over the whole sharded sequence.

    q, k, v: this rank's contiguous token shard (nsa.distributed.shard_sequence makes it):
        packed (T/W, H, D), (T/W, Hkv, D) with the GLOBAL cu_seqlens (the whole packed
        sequence's bounds, the same on every rank; documents may cross shard boundaries), or
        padded (B, N/W, H, D), (B, N/W, Hkv, D). Every rank holds the same number of tokens.
    group: the context-parallel group: a ProcessGroup, a 1-D DeviceMesh, or (mesh, dim name)
        for one dimension of a 2-D (data x context) mesh.
    host_cu_seqlens: cu_seqlens's values on the host, as for nsa() (spares a device read).
    mode: "heads" (all-to-all to KV-head shards; needs W to divide Hkv), "sequence" (not
        available yet: raises), or "auto" (heads when W divides Hkv).
    W_k, W_v (Hkv, D, D), W_gate (H, 3, D): replicated weights, the same on every rank. Each
        rank's gradient is its partial: nonzero only in the heads it computed, so the sum over
        the group (what DDP/FSDP's gradient reduction over the data x context ranks adds) is the
        one-process gradient.
    nsa_options: nsa()'s other options (block sizes, window_size, max_seqlen of the whole
        sequence, softmax_scale, deterministic, ...), the same on every rank.

    Returns this rank's shard of the output, q's shape. Collective: every rank of the group
    calls it with agreeing arguments (checked first, with one small all-gather: disagreeing
    shapes, cu_seqlens, options or devices raise the same error on every rank instead of
    hanging), and every rank runs the backward.
    """
    context = resolve_group(group)
    agreed = agree_on_call(context, q, k, v, W_k, W_v, W_gate, cu_seqlens, host_cu_seqlens, mode,
                           nsa_options)
    chosen = choose_mode(mode, context.world_size, k.shape[-2])
    assert chosen == "heads"
    if context.world_size == 1:
        return nsa(q, k, v, cu_seqlens=cu_seqlens, host_cu_seqlens=agreed.host_cu_seqlens,
                   W_k=W_k, W_v=W_v, W_gate=W_gate, **nsa_options)
    return _heads_mode(context, q, k, v, W_k, W_v, W_gate, cu_seqlens, agreed.host_cu_seqlens,
                       nsa_options)


def choose_mode(mode: str, world_size: int, kv_heads: int) -> str:
    """The mode a call runs in, or a ValueError naming `mode` (the same on every rank: it
    depends only on values the ranks agreed on)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    heads_fit = kv_heads % world_size == 0
    if mode in ("heads", "auto") and heads_fit:
        return "heads"
    need = (f"heads mode needs the context-parallel world size to divide Hkv (got world size "
            f"{world_size}, Hkv {kv_heads})")
    if mode == "heads":
        raise ValueError(f"mode='heads': {need}; use a group of a size that divides Hkv")
    raise ValueError(f"mode={mode!r}: {need}, and sequence mode (for more ranks than KV heads) "
                     "is not available yet; use a context-parallel group of a size that "
                     "divides Hkv")


def _heads_mode(context: ContextParallelGroup, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                host_cu_seqlens, nsa_options) -> Tensor:
    packed = cu_seqlens is not None
    # The exchange works on (L, n, h, D); packed tokens are one row of L.
    as_4d = (lambda x: x.unsqueeze(0)) if packed else (lambda x: x)
    q_heads, k_heads, v_heads = SequenceToHeads.apply(context, as_4d(q), as_4d(k), as_4d(v))
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
    (out,) = HeadsToSequence.apply(context, as_4d(out_heads))
    return out.squeeze(0) if packed else out
