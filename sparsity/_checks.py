"""Argument checks shared by the builders: each raises before any compute and names the argument."""
from __future__ import annotations

import torch
from torch import Tensor

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_BLOCK_INDEX = 2**31 - 1  # block indices are int32 in every list the builders make


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_tensor(value, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_same_device(tensor: Tensor, device: torch.device, name: str, reference: str) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but {reference} is on {device}; "
                         "put them on the same device")


def check_cu_seqlens(cu_seqlens, name: str, device: torch.device | None = None) -> Tensor:
    """Checks a (S+1,) cumulative-length tensor and returns it as int64 (same device).

    The int64 copy keeps the builders' position arithmetic safe for any total length. The values
    are read to the host once (one device sync on a GPU) and checked there.
    """
    check_cu_seqlens_layout(cu_seqlens, name, device)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths)")
    return cu_seqlens.to(torch.int64)


def check_cu_seqlens_layout(cu_seqlens, name: str, device: torch.device | None = None) -> None:
    """The checks of check_cu_seqlens that need no device read: type, shape, dtype, device."""
    check_tensor(cu_seqlens, name)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D (S+1,) tensor, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 (or int64), got {cu_seqlens.dtype}")
    if device is not None:
        check_same_device(cu_seqlens, device, name, "the other index tensors")


def check_matching_sequences(cu_a: Tensor, name_a: str, cu_b: Tensor, name_b: str) -> None:
    if cu_a.numel() != cu_b.numel():
        raise ValueError(f"{name_a} and {name_b} must describe the same number of sequences, "
                         f"got {cu_a.numel() - 1} and {cu_b.numel() - 1}")


def check_block_indices(indices, name: str, num_rows: int) -> Tensor:
    """Checks a (R, Hs, n) tensor of block indices with -1 as padding; returns it as int64.

    Entries are -1 or in [0, 2**31 - 1]: an int64 index beyond int32 is refused, not dropped
    (it names no block of any sequence an int32 cu_seqlens can describe)."""
    check_tensor(indices, name)
    if indices.dim() != 3:
        raise ValueError(f"{name} must have shape (R, Hs, n) (q tiles, heads, blocks), "
                         f"got shape {tuple(indices.shape)}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {indices.dtype}")
    if indices.shape[0] != num_rows:
        raise ValueError(f"{name} has {indices.shape[0]} rows but the sequences have {num_rows} "
                         "q tiles in total (sum over sequences of ceil(seqlen_q / q_tile))")
    if indices.shape[1] < 1:
        raise ValueError(f"{name} must have at least one head, got shape {tuple(indices.shape)}")
    lowest, highest = -1, -1
    if indices.numel() > 0:  # the one device read
        lowest, highest = torch.stack(torch.aminmax(indices)).tolist()
    if lowest < -1:
        raise ValueError(f"{name} entries must be block indices >= 0 or -1 (padding), "
                         f"got {lowest}")
    if highest > MAX_BLOCK_INDEX:
        # The lists are int32, and the builders' int64 arithmetic on an index this large can
        # wrap (a split into kernel blocks multiplies it) into a block that was never selected.
        raise ValueError(f"{name} entries must be block indices <= {MAX_BLOCK_INDEX} (2**31 - 1, "
                         f"the int32 range of the lists), got {highest}")
    return indices.to(torch.int64)
