"""Helpers the tools share: argument types, device choice, timing, random inputs."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096] (each positive)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def resolve_device(name: str | None) -> torch.device:
    """The device a tool runs on: the one asked for, else cuda when available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: expected cpu, cuda or cuda:N")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
            repeats: int = 5) -> float:
    """Median wall time of fn() in milliseconds after `warmup` untimed calls.

    CUDA: one pair of events around each call (GPU time of the launched work); CPU:
    time.perf_counter around each call.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def varlen_lengths(total: int, num_sequences: int, generator: torch.Generator) -> list[int]:
    """`num_sequences` random lengths (each >= 1) summing to `total`."""
    if num_sequences > total:
        raise ValueError(f"cannot split {total} tokens into {num_sequences} non-empty sequences")
    if num_sequences == 1:
        return [total]
    cuts = torch.randperm(total - 1, generator=generator)[: num_sequences - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def cu_seqlens_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def random_qkv(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], dtype: torch.dtype,
               device: torch.device, *, requires_grad: bool = False, seed: int = 0):
    """Random (never zero) q, k, v, drawn on the CPU for reproducibility then moved."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
               for shape in (shape_q, shape_kv, shape_kv)]
    return [t.requires_grad_(requires_grad) for t in tensors]
