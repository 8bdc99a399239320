"""Checks of every nsa() argument, before any compute.

Each failure raises TypeError (wrong kind of value) or ValueError (right kind, wrong value) whose
message names the argument and the form it should have. Reading cu_seqlens's values is the one
host transfer the checks need; the values read are returned (`PackedSequences`) so that the rest
of the call never reads them again. With `host_cu_seqlens` (the same values, given on the host)
the checks read no tensor value at all, which torch.compile needs: under compile a varlen call
without it is refused (a read to the host would break the graph).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from kernels.validate import check_bool, check_softmax_scale
from nsa.config import NSAConfig
from nsa.selection_rule import min_selected_blocks

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# cu_seqlens is int32, so no sequence is longer; the kernels take max_seqlen as an Int32.
MAX_SEQLEN_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class PackedSequences:
    """The sequences of one checked nsa() call as packed rows, on the host.

    A padded batch (B, N) is B sequences of N rows (an empty batch one empty sequence), exactly as
    nsa() packs it.
    """

    cu_seqlens: tuple[int, ...]  # (S+1,) the values of the packed cu_seqlens tensor
    max_seqlen: int

    def compressed_cu_seqlens(self, compress_block_size: int) -> tuple[int, ...]:
        """The values of nsa.compression.compressed_cu_seqlens, without reading the device."""
        counts = ((b - a) // compress_block_size
                  for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))
        return tuple(accumulate(counts, initial=0))


def validate_nsa_arguments(q, k, v, **kwargs) -> tuple[NSAConfig, int]:
    """The resolved options and max_seqlen (see validate_nsa_call)."""
    config, sequences = validate_nsa_call(q, k, v, **kwargs)
    return config, sequences.max_seqlen


def validate_nsa_call(q, k, v, *, cu_seqlens, max_seqlen, compress_block_size,
                      selected_block_size, num_selected_blocks, window_size, W_k, W_v, W_gate,
                      causal, softmax_scale, num_cmp_selected_blocks, q_tile,
                      cmp_kv_block, deterministic=False, host_cu_seqlens=None,
                      recompute=None, capture=None) -> tuple[NSAConfig, PackedSequences]:
    """The resolved options and the sequences, or an error naming the first bad argument.
    recompute (the backward's memory policy) and capture (nsa/captured.py), not part of the
    config, are only checked here."""
    q_tile = _positive_int("_q_tile", q_tile)
    cmp_kv_block = _positive_int("_cmp_kv_block", cmp_kv_block)
    config = NSAConfig(
        compress_block_size=_positive_int("compress_block_size", compress_block_size),
        selected_block_size=_positive_int("selected_block_size", selected_block_size),
        num_selected_blocks=_positive_int("num_selected_blocks", num_selected_blocks),
        window_size=_int_at_least("window_size", window_size, 0),
        causal=check_bool("causal", causal),
        softmax_scale=1.0,  # resolved below, once the head dim is known
        num_cmp_selected_blocks=None if num_cmp_selected_blocks is None else
        _int_at_least("num_cmp_selected_blocks", num_cmp_selected_blocks, 0),
        q_tile=q_tile, cmp_kv_block=cmp_kv_block,
        deterministic=check_bool("deterministic", deterministic),
    )
    _check_block_sizes(config)

    varlen = cu_seqlens is not None
    _check_qkv(q, k, v, varlen)
    heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    _check_weight("W_k", W_k, (kv_heads, head_dim, head_dim), "(Hkv, D, D)", q)
    _check_weight("W_v", W_v, (kv_heads, head_dim, head_dim), "(Hkv, D, D)", q)
    _check_weight("W_gate", W_gate, (heads, 3, head_dim), "(H, 3, D)", q)
    if varlen:
        sequences = _check_cu_seqlens(cu_seqlens, max_seqlen, q, host_cu_seqlens)
    elif host_cu_seqlens is not None:
        raise ValueError("host_cu_seqlens must be None without cu_seqlens: it gives cu_seqlens's "
                         "values on the host (a padded batch's bounds come from its shape)")
    else:
        batch, seqlen = q.shape[:2]
        sequences = PackedSequences(
            cu_seqlens=tuple(i * (seqlen if batch else 0) for i in range(max(batch, 1) + 1)),
            max_seqlen=_check_padded_max_seqlen(max_seqlen, seqlen))
    scale = check_softmax_scale(softmax_scale, head_dim)
    num_selected = _useful_selected_blocks(config, sequences.max_seqlen)
    _optional_bool("recompute", recompute)
    _optional_bool("capture", capture)
    if capture and q.device.type != "cuda":
        raise ValueError(f"capture=True needs CUDA tensors (it captures CUDA graphs), got q on "
                         f"{q.device}")
    return config.resolved(softmax_scale=scale, num_selected_blocks=num_selected), sequences


# --- tensors -------------------------------------------------------------------------------------

def _check_qkv(q, k, v, varlen: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x)
    # Every other tensor must be on q's device, so checking q refuses them all by name.
    if q.is_meta:
        raise ValueError("q is on the meta device (a shape without values); nsa() computes on "
                         "values (selection reads scores): pass tensors on a CPU or CUDA device")
    if varlen:
        rank, forms = 3, {"q": "(T, H, D)", "k": "(T, Hkv, D)", "v": "(T, Hkv, D)"}
        layout = "packed varlen (cu_seqlens given)"
    else:
        rank, forms = 4, {"q": "(B, N, H, D)", "k": "(B, N, Hkv, D)", "v": "(B, N, Hkv, D)"}
        layout = "padded (no cu_seqlens; pass cu_seqlens for packed (T, H, D) inputs)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {forms[name]} for the {layout} layout, "
                             f"got shape {tuple(x.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    rows = q.shape[:-2]
    if tuple(k.shape[:-2]) != tuple(rows):
        raise ValueError(f"k must have q's leading dims {tuple(rows)} (NSA attends within the "
                         f"same rows), got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if heads < 1 or kv_heads < 1 or head_dim < 1:
        raise ValueError(f"q and k need at least one head and a head dim >= 1, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's heads ({kv_heads})")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have q's head dim ({head_dim}), got {k.shape[-1]}")


def _check_weight(name: str, W, shape: tuple[int, ...], form: str, q: Tensor) -> None:
    if W is None:
        return
    _tensor(name, W)
    if tuple(W.shape) != shape:
        raise ValueError(f"{name} must have shape {form} = {shape}, got {tuple(W.shape)}")
    if W.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype ({q.dtype}), got {W.dtype}")
    if W.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {W.device}")


def _check_cu_seqlens(cu_seqlens, max_seqlen, q: Tensor, host_cu_seqlens=None
                      ) -> PackedSequences:
    _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D (S+1,) with S >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device ({q.device}), got "
                         f"{cu_seqlens.device}")
    if host_cu_seqlens is not None:
        cu, name = _host_bounds(host_cu_seqlens, cu_seqlens), "host_cu_seqlens"
    elif torch.compiler.is_compiling():
        raise ValueError(
            "host_cu_seqlens is required with cu_seqlens under torch.compile: nsa() would "
            "otherwise read cu_seqlens to the host, which breaks the graph; pass "
            "host_cu_seqlens=<cu_seqlens's values as a tuple of ints> (e.g. from the data "
            "loader, which built them on the host)")
    else:
        cu, name = cu_seqlens.tolist(), "cu_seqlens"
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {cu}")
    if cu[-1] != q.shape[0]:
        raise ValueError(f"{name} must end at q's number of rows ({q.shape[0]}), "
                         f"got {cu[-1]}")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if max_seqlen is None:
        return PackedSequences(tuple(cu), longest)
    max_seqlen = _int("max_seqlen", max_seqlen)
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen must be >= the longest sequence in cu_seqlens ({longest}), "
                         f"got {max_seqlen}")
    _check_max_seqlen_limit(max_seqlen)
    return PackedSequences(tuple(cu), max_seqlen)


def _host_bounds(host_cu_seqlens, cu_seqlens: Tensor) -> list[int]:
    """host_cu_seqlens as a list of ints, one per entry of cu_seqlens. Its values are taken to
    be cu_seqlens's: comparing them would read the device, the very thing it spares."""
    if isinstance(host_cu_seqlens, Tensor) or not isinstance(host_cu_seqlens, (list, tuple)):
        raise TypeError(f"host_cu_seqlens must be a tuple or list of ints (cu_seqlens's values "
                        f"on the host), got {type(host_cu_seqlens).__name__}")
    bounds = [_int("host_cu_seqlens[i]", b) for b in host_cu_seqlens]
    if len(bounds) != cu_seqlens.shape[0]:
        raise ValueError(f"host_cu_seqlens must have one entry per entry of cu_seqlens "
                         f"({cu_seqlens.shape[0]}), got {len(bounds)}")
    return bounds


def _check_max_seqlen_limit(max_seqlen: int) -> None:
    if max_seqlen > MAX_SEQLEN_LIMIT:
        raise ValueError(f"max_seqlen must be <= 2**31 - 1 ({MAX_SEQLEN_LIMIT}): cu_seqlens is "
                         f"int32, so no sequence is longer, got {max_seqlen}")


def _check_padded_max_seqlen(max_seqlen, seqlen: int) -> int:
    if max_seqlen is None:
        return seqlen
    _check_max_seqlen_limit(_int("max_seqlen", max_seqlen))
    if max_seqlen != seqlen:
        raise ValueError(f"max_seqlen must be None or q.shape[1] ({seqlen}) without cu_seqlens, "
                         f"got {max_seqlen}")
    return seqlen


# --- options -------------------------------------------------------------------------------------

def _check_block_sizes(config: NSAConfig) -> None:
    l, l_sel = config.compress_block_size, config.selected_block_size
    if l_sel % l:
        raise ValueError(f"selected_block_size ({l_sel}) must be a multiple of "
                         f"compress_block_size ({l}): a selection block is scored by the "
                         "compressed tokens inside it")
    fewest = min_selected_blocks(config.q_tile, l_sel)
    if config.num_selected_blocks < fewest:
        raise ValueError(f"num_selected_blocks must be >= {fewest} with selected_block_size="
                         f"{l_sel}: block 0 and every block a {config.q_tile}-row tile overlaps "
                         f"are always selected, got {config.num_selected_blocks}")


def _useful_selected_blocks(config: NSAConfig, max_seqlen: int) -> int:
    """num_selected_blocks clipped to the blocks of the longest sequence (never below the forced
    minimum): a tile can select no more, and its lists are num_selected_blocks wide, so a larger
    value would select the same blocks and cost memory per tile. Clipping (not refusing) lets one
    value serve batches of mixed lengths."""
    blocks = -(-max_seqlen // config.selected_block_size)
    fewest = min_selected_blocks(config.q_tile, config.selected_block_size)
    return min(config.num_selected_blocks, max(blocks, fewest))


def _tensor(name: str, value) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _int(name: str, value) -> int:
    if type(value) is int:  # the common case, without the abstract class check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _int_at_least(name: str, value, low: int) -> int:
    value = _int(name, value)
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return value


def _positive_int(name: str, value) -> int:
    return _int_at_least(name, value, 1)


def _optional_bool(name: str, value) -> None:
    """None or a bool, strictly (a string such as "false" would be silently truthy)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None or a bool, got {type(value).__name__} {value!r}")
