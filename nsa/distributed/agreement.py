"""One collective that checks every rank of the group called nsa_context_parallel alike.

A rank that raises while the others enter a collective leaves them waiting forever, and ranks
whose calls disagree (unequal shards, different cu_seqlens, a grad on one rank and not another)
would exchange garbage or hang in the backward. So each rank first checks its own arguments
without raising, then all ranks all-gather a small int64 record of the call (its "fingerprint":
the shapes, dtype, device type, which tensors require grad, cu_seqlens's length and a checksum of
its values, the mode and the options, and the local error if there was one, message included).
Every rank then reaches the same verdict from the same gathered records and raises the same
error, or none. This gather is the first collective of the call; nothing else runs before it.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nsa.distributed.groups import ContextParallelGroup
from nsa.distributed.sharding import chunks_per_rank

# nsa() options passed through unchanged; each is compared across ranks by name.
NSA_OPTIONS = ("max_seqlen", "compress_block_size", "selected_block_size", "num_selected_blocks",
               "window_size", "causal", "softmax_scale", "num_cmp_selected_blocks",
               "deterministic", "recompute", "capture", "_q_tile", "_cmp_kv_block")
# nsa_context_parallel's own options, compared across ranks like nsa()'s.
CONTEXT_PARALLEL_OPTIONS = ("overlap_chunks", "layout")
MODES = ("auto", "heads", "sequence")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE_TYPES = ("cpu", "cuda", "meta")
_WEIGHTS = ("W_k", "W_v", "W_gate")
_MESSAGE_BYTES = 480  # a local error's message, carried in the record (longer ones are cut)
_ERROR_CLASSES = (None, ValueError, TypeError)
_MOD = (1 << 61) - 1  # checksums stay in int64


@dataclass(frozen=True)
class AgreedCall:
    """What every rank agreed on: the host values of cu_seqlens (None when padded)."""

    host_cu_seqlens: tuple[int, ...] | None


# Fields of the record after the error code, in order; each names what a mismatch blames.
_FIELDS = (
    ("packed", "cu_seqlens", "must be given on every rank or on none (packed on some ranks, "
                             "padded on others)"),
    ("batch", "q", "must have the same batch size B on every rank"),
    ("tokens", "q", "must hold the same number of tokens on every rank (equal contiguous shards "
                    "of the sequence, see nsa.distributed.shard_sequence)"),
    ("heads", "q", "must have the same number of heads H on every rank"),
    ("kv_heads", "k", "must have the same number of KV heads Hkv on every rank"),
    ("head_dim", "q", "must have the same head dim D on every rank"),
    ("dtype", "q", "must have the same dtype on every rank"),
    ("device_type", "q", "must be on the same device type on every rank"),
    ("requires_grad", "q, k, v, W_k, W_v, W_gate",
     "must require grad alike on every rank (the backward is a collective every rank joins)"),
    ("grad_enabled", "torch.is_grad_enabled()", "must be the same on every rank"),
    ("weights", "W_k, W_v, W_gate", "must be given (or None) alike on every rank"),
    ("cu_seqlens_length", "cu_seqlens", "must be the same global cu_seqlens (of the whole packed "
                                        "sequence) on every rank; its lengths differ"),
    ("cu_seqlens_checksum", "cu_seqlens", "must be the same global cu_seqlens (of the whole "
                                          "packed sequence) on every rank; its values differ"),
    ("mode", "mode", "must be the same on every rank"),
) + tuple((f"option:{name}", name, "must be the same on every rank")
          for name in NSA_OPTIONS + CONTEXT_PARALLEL_OPTIONS)


def agree_on_call(group: ContextParallelGroup, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                  host_cu_seqlens, mode, options: dict) -> AgreedCall:
    """Check the call locally, then across ranks; raise the same error on every rank, or return
    what was agreed. Collective: every rank of the group must call it."""
    error, fields, host_values = None, {}, None
    try:
        host_values = _check_locally(group, q, k, v, W_k, W_v, W_gate, cu_seqlens,
                                     host_cu_seqlens, mode, options)
        fields = _describe(q, k, v, (W_k, W_v, W_gate), cu_seqlens, host_values, mode, options)
    except (ValueError, TypeError) as local_error:
        error = local_error
    record = _encode(error, fields)
    device = group.collective_device(q)
    records = _all_gather(record.to(device), group).cpu()
    _raise_if_any_rank_failed(records, group, error)
    _raise_if_ranks_disagree(records, group)
    if host_values is not None:
        # Checked only now that the shards are known equal, so a rank with a short shard hears
        # "unequal shards", not a cu_seqlens complaint: the same verdict on every rank.
        _check_global_end(host_values, q.shape[0], group.world_size,
                          "host_cu_seqlens" if host_cu_seqlens is not None else "cu_seqlens")
    return AgreedCall(host_cu_seqlens=host_values)


def _check_global_end(values: tuple[int, ...], local_tokens: int, world: int, name: str) -> None:
    total = local_tokens * world
    if values[-1] != total:
        raise ValueError(
            f"{name} must be the global cu_seqlens of the whole packed sequence, ending at "
            f"{total} = {world} ranks x {local_tokens} local tokens, got {values[-1]} "
            "(every rank passes the same global cu_seqlens, not its shard's)")


# --- local checks ---------------------------------------------------------------------------------

def _check_locally(group, q, k, v, W_k, W_v, W_gate, cu_seqlens, host_cu_seqlens, mode,
                   options) -> tuple[int, ...] | None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    unknown = sorted(set(options) - set(NSA_OPTIONS) - set(CONTEXT_PARALLEL_OPTIONS))
    if unknown:
        raise TypeError(f"nsa_context_parallel got unexpected keyword arguments {unknown}; the "
                        f"nsa() options it passes on are {NSA_OPTIONS}")
    packed = cu_seqlens is not None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    rank, form = (3, "(T_local, H, D) (packed: cu_seqlens given)") if packed else \
        (4, "(B, N_local, H, D) (padded: no cu_seqlens)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {form}, got shape {tuple(x.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype ({q.dtype}), got {x.dtype}")
    _check_device(group, "q", q, q.device)
    for name, x in (("k", k), ("v", v), ("W_k", W_k), ("W_v", W_v), ("W_gate", W_gate),
                    ("cu_seqlens", cu_seqlens)):
        if isinstance(x, Tensor):
            _check_device(group, name, x, q.device)
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"k must hold q's tokens (leading dims {tuple(q.shape[:-2])}), got "
                         f"shape {tuple(k.shape)}")
    heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have q's head dim {head_dim}, got shape {tuple(k.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's heads ({kv_heads})")
    for name, W, shape, form in (("W_k", W_k, (kv_heads, head_dim, head_dim), "(Hkv, D, D)"),
                                 ("W_v", W_v, (kv_heads, head_dim, head_dim), "(Hkv, D, D)"),
                                 ("W_gate", W_gate, (heads, 3, head_dim), "(H, 3, D)")):
        if W is None:
            continue
        if not isinstance(W, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(W).__name__}")
        if tuple(W.shape) != shape:
            raise ValueError(f"{name} must be {form} = {shape}, got {tuple(W.shape)}")
    _check_overlap_chunks(options.get("overlap_chunks", 1), kv_heads, group.world_size)
    _check_layout_splits(options.get("layout", "contiguous"), q.shape[0 if packed else 1])
    if not packed:
        if host_cu_seqlens is not None:
            raise ValueError("host_cu_seqlens must be None without cu_seqlens (a padded batch's "
                             "bounds come from its shape)")
        return None
    return _host_cu_seqlens(cu_seqlens, host_cu_seqlens)


def _check_overlap_chunks(chunks, kv_heads: int, world: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"overlap_chunks must be a positive int, got {chunks!r}")
    if chunks > 1 and kv_heads % world == 0 and (kv_heads // world) % chunks:
        raise ValueError(f"overlap_chunks must divide the KV heads of a rank in heads mode "
                         f"(Hkv / world size = {kv_heads} / {world} = {kv_heads // world}), "
                         f"got {chunks}")


def _check_layout_splits(layout, local_tokens: int) -> None:
    chunks = chunks_per_rank(layout)  # a ValueError naming `layout` unless it is a known one
    if local_tokens % chunks:
        raise ValueError(f"q must hold a multiple of {chunks} tokens on every rank with "
                         f"layout={layout!r} (each rank's shard is {chunks} equal chunks of the "
                         f"sequence; see nsa.distributed.shard_sequence), got {local_tokens}")


def _check_device(group: ContextParallelGroup, name: str, x: Tensor, expected) -> None:
    if x.is_meta:
        raise ValueError(f"{name} is on the meta device (a shape without values); pass tensors "
                         "with values")
    if x.device != expected:
        raise ValueError(f"{name} must be on q's device ({expected}), got {x.device}")
    types = group.data_device_types()
    if types is not None and x.device.type not in types:
        raise ValueError(f"{name} is on {x.device}, which the group's {group.backend!r} backend "
                         f"does not communicate (it moves {sorted(types)} tensors)")


def _host_cu_seqlens(cu_seqlens, host_cu_seqlens) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor (S+1,) with S >= 1, got "
                         f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    if host_cu_seqlens is not None:
        values, name = tuple(int(x) for x in host_cu_seqlens), "host_cu_seqlens"
        if len(values) != cu_seqlens.numel():
            raise ValueError(f"host_cu_seqlens must have cu_seqlens's {cu_seqlens.numel()} "
                             f"entries, got {len(values)}")
    else:
        values, name = tuple(cu_seqlens.tolist()), "cu_seqlens"
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must start at 0 and never decrease, got {list(values[:8])}...")
    return values


# --- the record -----------------------------------------------------------------------------------

def _describe(q, k, v, weights, cu_seqlens, host_values, mode, options) -> dict:
    packed = cu_seqlens is not None
    tensors = (q, k, v, *weights)
    fields = {
        "packed": int(packed), "batch": 1 if packed else q.shape[0],
        "tokens": q.shape[0] if packed else q.shape[1],
        "heads": q.shape[-2], "kv_heads": k.shape[-2], "head_dim": q.shape[-1],
        "dtype": _DTYPES.index(q.dtype), "device_type": _code(q.device.type, _DEVICE_TYPES),
        "requires_grad": sum(1 << i for i, x in enumerate(tensors)
                             if x is not None and x.requires_grad),
        "grad_enabled": int(torch.is_grad_enabled()),
        "weights": sum(1 << i for i, W in enumerate(weights) if W is not None),
        "cu_seqlens_length": len(host_values) if packed else 0,
        "cu_seqlens_checksum": _checksum(host_values) if packed else 0,
        "mode": MODES.index(mode),
    }
    fields.update({f"option:{name}": _hash(options.get(name, _ABSENT))
                   for name in NSA_OPTIONS + CONTEXT_PARALLEL_OPTIONS})
    return fields


_ABSENT = object()


def _hash(value) -> int:
    return 0 if value is _ABSENT else 1 + zlib.crc32(repr(value).encode())


def _code(value: str, known: tuple[str, ...]) -> int:
    return known.index(value) if value in known else len(known) + zlib.crc32(value.encode())


def _checksum(values: tuple[int, ...]) -> int:
    # Position-weighted, so swapped or shifted bounds change it too.
    total = 0
    for position, value in enumerate(values):
        total = (total * 1_000_003 + value + position) % _MOD
    return total


def _encode(error: Exception | None, fields: dict) -> Tensor:
    code = 0 if error is None else _ERROR_CLASSES.index(type(error)) \
        if type(error) in _ERROR_CLASSES else 1
    message = b"" if error is None else str(error).encode()[:_MESSAGE_BYTES]
    values = [code, len(message)] + [int(fields.get(name, 0)) for name, _, _ in _FIELDS]
    values += list(message) + [0] * (_MESSAGE_BYTES - len(message))
    return torch.tensor(values, dtype=torch.int64)


def _all_gather(record: Tensor, group: ContextParallelGroup) -> Tensor:
    if group.world_size == 1:
        return record.unsqueeze(0)
    records = [torch.empty_like(record) for _ in range(group.world_size)]
    dist.all_gather(records, record, group=group.process_group)
    return torch.stack(records)


def _raise_if_any_rank_failed(records: Tensor, group: ContextParallelGroup,
                              local_error: Exception | None) -> None:
    if local_error is not None:
        raise local_error
    failed = [rank for rank in range(group.world_size) if int(records[rank, 0]) != 0]
    if not failed:
        return
    rank = failed[0]
    length = int(records[rank, 1])
    start = 2 + len(_FIELDS)
    message = bytes(records[rank, start:start + length].tolist()).decode(errors="ignore")
    error_class = _ERROR_CLASSES[int(records[rank, 0])]
    raise error_class(f"{message} (raised on rank {rank} of the context-parallel group; "
                      f"failing ranks: {failed})")


def _raise_if_ranks_disagree(records: Tensor, group: ContextParallelGroup) -> None:
    for index, (field, argument, requirement) in enumerate(_FIELDS):
        column = records[:, 2 + index]
        if bool((column != column[0]).any()):
            shown = ("" if field.startswith(("option:", "cu_seqlens_checksum", "requires_grad",
                                             "mode", "dtype", "device_type", "weights"))
                     else f"; per rank: {column.tolist()}")
            raise ValueError(f"{argument} {requirement}{shown}")
