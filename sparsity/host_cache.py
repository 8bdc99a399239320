"""Device tensors that depend on host values only, kept from one call to the next.

nsa()'s tile layouts, selection ranges and compression rows are functions of the sequence
bounds (which nsa() holds on the host) and of its configuration; built on the device they cost
about a hundred small launches per forward, which is host time in an eager step (H100, 16K
tokens: the eager forward is launch-bound, FINDINGS session 14). A call whose packing repeats
(a padded batch, a fixed-shape training loop, a benchmark) finds them here instead. A loop whose
packing changes every step gains nothing and loses nothing but a dictionary lookup.

Rules that keep it correct:
- the key holds every value the build depends on; the device is added here;
- nothing is stored while the current CUDA stream is being captured into a graph: capture
  records kernels without running them, so a tensor built then has no values until the graph
  replays (lookups are fine: a stored tensor holds real values);
- an entry found during a capture is pinned, never evicted: the graph reads its memory at every
  replay, without holding a reference;
- fake tensors (torch.compile's tracing) and meta tensors bypass the cache both ways;
- callers never write into a returned tensor.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

MAX_ENTRIES = 8  # a few packings at once (e.g. train and eval shapes), bounded memory

T = TypeVar("T")
_entries: OrderedDict = OrderedDict()  # least recently used first
_pinned: dict = {}  # read by a captured CUDA graph: kept while the process lives


def cached(key: tuple, like: torch.Tensor, build: Callable[[], T]) -> T:
    """build()'s result for `key` on like's device: from the cache, or built (and kept unless
    a graph capture is under way)."""
    if is_fake(like) or like.device.type == "meta":
        return build()
    full_key = (key, like.device)
    capturing = _capturing(like)
    if full_key in _pinned:
        return _pinned[full_key]
    if full_key in _entries:
        if capturing:
            _pinned[full_key] = _entries.pop(full_key)
            return _pinned[full_key]
        _entries.move_to_end(full_key)
        return _entries[full_key]
    value = build()
    if not capturing:
        _entries[full_key] = value
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)
    return value


def _capturing(like: torch.Tensor) -> bool:
    """Whether like's device's current stream is being captured into a CUDA graph."""
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def clear() -> None:
    """Drop every entry, pinned ones too (tests: no captured graph may replay afterwards)."""
    _entries.clear()
    _pinned.clear()
