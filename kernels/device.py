"""What the device offers the CuTe DSL kernels: the one place every layer asks.

Kept apart from the entry points (`kernels.interface`) and the dispatcher (`kernels.dispatch`)
so that the kernel modules under `kernels/sm90` can ask it without importing the layers above
them. Imports torch only.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch

# NSA_CUTE_DISABLE=1 sends every call to the torch paths, also on an sm_90 GPU.
DISABLE_ENV = "NSA_CUTE_DISABLE"
# The only architecture the kernels are built for.
KERNEL_CAPABILITY = (9, 0)


def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability of a CUDA device, kept per device index: asked at every
    kernel decision (a dozen per nsa() step), it cost the host about 25 us each time (H200 host,
    2026-11-27, docs/history.md "nsa()'s eager backward, host time")."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def is_sm90(device: torch.device) -> bool:
    """Whether `device` is an sm_90 GPU (the environment switch aside)."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and device_capability(device) == KERNEL_CAPABILITY)


def kernels_unavailable(device: torch.device) -> str:
    """Why no CuTe DSL kernel runs on ``device`` (``NSA_CUTE_DISABLE=1``, not an sm_90 GPU);
    empty when they can."""
    if os.environ.get(DISABLE_ENV) == "1":
        return f"{DISABLE_ENV}=1"
    return _device_unsupported(device)


def _device_unsupported(device: torch.device) -> str:
    """Why the kernels cannot run on ``device``; empty when they can. (Tests replace it to run
    the kernel path's host logic on the CPU.)"""
    if device.type != "cuda":
        return f"tensors on {device.type}"
    major, minor = device_capability(device)
    if (major, minor) != KERNEL_CAPABILITY:
        return f"GPU is sm_{major}{minor}, the kernels need sm_90"
    return ""


@functools.lru_cache(maxsize=8)
def total_memory(device: torch.device) -> int:
    """Bytes of memory of a CUDA device (nsa()'s memory policy sizes what it keeps by it)."""
    return torch.cuda.get_device_properties(device).total_memory


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (the persistent grids' size)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_persistent_sms_left: int = 0  # SMs a persistent forward grid leaves to other streams


@contextmanager
def sms_left_to_other_streams(count: int):
    """Within: persistent forward grids take count SMs fewer than the device has (at least
    one), so kernels queued on another stream meanwhile find SMs free (nsa/streams.py)."""
    global _persistent_sms_left
    outer, _persistent_sms_left = _persistent_sms_left, count
    try:
        yield
    finally:
        _persistent_sms_left = outer


def persistent_grid_sms(device: torch.device) -> int:
    """The SMs a persistent forward grid launched now spreads over (`sms_left_to_other_streams`)."""
    return max(1, sm_count(device) - _persistent_sms_left)
