"""NSA's block selection kernels behind one front: scoring and ranking in one launch
(`kernels.sm90.select_blocks`), and ranking alone (`kernels.sm90.top_blocks`).

`nsa.selection` computes the same lists in torch everywhere; these say whether a kernel serves
a call (`kernels.dispatch` asks the device) and run it.
"""
from __future__ import annotations

from torch import Tensor

from .dispatch import sm90_module


def selection_kernel_serves(q_bar: Tensor, keys: Tensor, width: int, cmp_width: int = 0,
                            cmp_kv_block: int = 128) -> bool:
    """Whether the selection kernel scores queries q_bar (R, H, D) against compressed keys
    (Tc, Hkv, D) and keeps `width` blocks per tile (float32 inputs on an sm90 GPU), and
    `cmp_width` KV blocks of `cmp_kv_block` compressed tokens of the sparse compressed branch
    where that is > 0."""
    if q_bar.device.type != "cuda" or keys.shape[0] == 0:  # (tests fake the device on the CPU)
        return False
    kernel, _ = sm90_module("select_blocks", q_bar.device)
    return kernel is not None and kernel.can_run(q_bar, keys, width, cmp_width, cmp_kv_block)


def select_blocks(q_bar: Tensor, keys: Tensor, tiles: Tensor, width: int, softmax_scale: float,
                  mask_width: int | None = None, *, tensor_cores: bool = False,
                  cmp_width: int = 0, cmp_kv_block: int = 128, num_cmp_candidates: int = 0):
    """The selection kernel's lists (`kernels.sm90.select_blocks.run`: with cmp_width also the
    sparse compressed branch's), where `selection_kernel_serves` says it runs. tensor_cores:
    score on tensor cores (the kernel's split-products build); False, the float32 FMA build,
    is the dispatched one."""
    from kernels.sm90 import select_blocks as kernel

    return kernel.run(q_bar, keys, tiles, width, softmax_scale, mask_width,
                      tensor_cores=tensor_cores, cmp_width=cmp_width, cmp_kv_block=cmp_kv_block,
                      num_cmp_candidates=num_cmp_candidates)


def ranking_kernel_serves(key: Tensor, width: int) -> bool:
    """Whether the ranking kernel ranks `key` (..., B) for `width` ranks (float32 on an sm90
    GPU, at most one rank per lane)."""
    if key.device.type != "cuda":  # (tests fake the device on the CPU)
        return False
    kernel, _ = sm90_module("top_blocks", key.device)
    return kernel is not None and kernel.can_run(key, width)


def top_blocks(key: Tensor, width: int, num_candidates: int | None) -> Tensor:
    """The ranking kernel's (..., width) int32 lists (`kernels.sm90.top_blocks.run`), where
    `ranking_kernel_serves` says it runs."""
    from kernels.sm90 import top_blocks as kernel

    return kernel.run(key, width, num_candidates)
