"""Device tensors that depend on host values only, kept from one call to the next.

nsa()'s tile layouts, selection ranges and compression rows are functions of the sequence
bounds (which nsa() holds on the host) and of its configuration; built on the device they cost
about a hundred small launches per forward, which is host time in an eager step (H100, 16K
tokens: the eager forward is launch-bound; docs/history.md, 2026-11-24). A call whose packing
repeats (a padded batch, a fixed-shape training loop, a benchmark) finds them here instead. A
loop whose packing changes every step gains nothing and keeps the last few packings' tensors alive
(about 8 entries per packing, the largest a few bytes per token, e.g. the backward's query
tile slots, 4 bytes a token); `clear()` frees them.

Rules that keep it correct:
- the key holds every value the build depends on; the device is added here;
- on a GPU every entry is built on the device's default stream and belongs to it (or on
  nsa()'s side stream forked from it, which counts as it: the last rule). A tensor made on one
  stream and read on another could be read before it is written, or freed (evicted) while
  the other stream still reads it and its memory reused under it; so:
- CUDA-graph capture never runs on the default stream, and a captured graph never stores a
  tensor that holds no values until replay: a miss in a capture builds its own, as without
  the cache. A hit in a capture is read, so the graph does not replay the entry's build
  (about 120 small launches of an nsa() forward+backward), and its memory is kept as long as
  the graph may read it: by the capture's owner where it says so (`pinned_for_capture`:
  nsa()'s captured plans, whose slots hold their static buffers the same way), else in
  `_captured_entries`, never evicted (a user's own capture of nsa(): its graph's life is
  unknown here; `clear()` drops them);
- any other stream (a user's own, the side stream of torch.cuda.graph's warm-up recipe)
  reads and stores too (`_read_on_side_stream`): a miss is built on the default stream after
  the side stream's work so far (the build may read what that stream wrote) and stored as a
  default-stream entry; before its first read from a side stream an entry gets an event
  recorded on the default stream after its build, which each side stream's first read of it
  waits for, and each such stream is recorded on its tensors (`Tensor.record_stream`), so
  that when it is evicted the allocator reuses its memory only after that stream's work
  queued until then (its later reads need neither again). The recipe's warm-up calls thus
  leave the entries its capture reads (a capture that built them replayed 0.27 ms of small
  launches more per 8K-token forward: the bench's nsa-graph, H200, FINDINGS.md);
- a side stream forked from the default stream and joined back into it (`forked_side_stream`:
  nsa()'s selection stream, nsa/streams.py) counts as the default stream: what is evicted
  while it is forked stays alive until the join is queued, after which the default stream
  reuses memory only behind the side stream's reads;
- fake tensors (torch.compile's tracing) and meta tensors bypass the cache;
- callers never write into a returned tensor;
- entries are built outside inference mode, so a training call may use what an evaluation
  call under torch.inference_mode() stored.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

MAX_ENTRIES = 32  # a few packings at once (train and eval shapes), ~8 keys each

T = TypeVar("T")
_entries: OrderedDict = OrderedDict()  # least recently used first
_capture_pins: list | None = None  # the owner's list while a pinning capture runs
_captured_entries: dict = {}  # entries a capture without an owner read: kept until clear()
# (device index, stream id) of a side stream forked from the default stream, until joined
_forked_stream: tuple[int, int] | None = None
_evicted_while_forked: list = []  # entries evicted meanwhile: kept until the join
# Full key -> (an event on the default stream after the entry's build, the ids of the side
# streams recorded on its tensors): entries read from a side stream (`_read_on_side_stream`)
_side_reads: dict = {}


def cached(key: tuple, like: torch.Tensor, build: Callable[[], T]) -> T:
    """build()'s result for `key` on like's device: from the cache, or built and kept (on a
    GPU built on the default stream; a capture keeps nothing: see the module's rules)."""
    device = like.device
    if device.type == "meta" or (not _plain_tensor(like) and is_fake(like)):
        return build()
    full_key = (key, device)
    if on_default_stream(like):
        return _read_or_store(full_key, build)
    if not _capturing(like):
        return _read_on_side_stream(full_key, like, build)
    value = _entries.get(full_key, _captured_entries.get(full_key))
    if value is None:
        return build()
    if _capture_pins is not None:
        _capture_pins.append(value)  # alive as long as the capture's owner keeps it
    else:
        _captured_entries[full_key] = value  # alive as long as a graph may read it
    return value


def _read_or_store(full_key: tuple, build: Callable[[], T]) -> T:
    """The entry, or build() stored as it, on the current stream (the default stream)."""
    if full_key in _entries:
        _entries.move_to_end(full_key)
        return _entries[full_key]
    if torch.is_inference_mode_enabled():
        # An inference tensor kept here could not be saved for backward by a later training
        # call (e.g. the first call ran under torch.inference_mode for evaluation).
        with torch.inference_mode(False):
            value = build()
    else:
        value = build()
    _entries[full_key] = value
    while len(_entries) > MAX_ENTRIES:
        evicted = _entries.popitem(last=False)
        _side_reads.pop(evicted[0], None)
        if _forked_stream is not None:
            _evicted_while_forked.append(evicted)
    return value


def _read_on_side_stream(full_key: tuple, like: torch.Tensor, build: Callable[[], T]) -> T:
    """The entry for a stream that is neither the default stream nor capturing (the module's
    rules): a miss built and stored on the default stream; the stream's first read of an entry
    ordered after its build and recorded on its tensors. Later reads from that stream return
    at once: its work is ordered after the build already, and its record on the tensors covers
    all of it (a user training on their own stream reads about 60 entries a step)."""
    index, stream_id = current_stream_id(like)
    if full_key in _entries:
        _entries.move_to_end(full_key)
        value = _entries[full_key]
        ready, readers = _side_reads.get(full_key, (None, frozenset()))
        if stream_id in readers:
            return value
    else:
        value = _queued_on_default_stream(index, lambda: _read_or_store(full_key, build))
        ready, readers = None, frozenset()
    ready = _order_side_read(index, value, ready)
    if full_key in _entries:  # (an entry its own build's stores evicted is not tracked)
        _side_reads[full_key] = (ready, readers | {stream_id})
    return value


def _queued_on_default_stream(index: int, work: Callable[[], T]) -> T:
    """work() queued on device `index`'s default stream, after the current stream's work so far
    (a build may read what the current stream wrote: the caller's cu_seqlens)."""
    default = torch.cuda.default_stream(index)
    default.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(default):
        return work()


def _order_side_read(index: int, value, ready):
    """The current (side) stream of device `index` made to wait for `ready`, an event on the
    default stream after the entry's build (recorded now where None: after everything the
    default stream queued so far), and recorded on the entry's tensors (their memory then
    waits for its work when freed); returns the event."""
    stream = torch.cuda.current_stream(index)
    if ready is None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.default_stream(index))
    stream.wait_event(ready)
    for tensor in _tensors_in(value):
        tensor.record_stream(stream)
    return ready


def _tensors_in(value, seen: set | None = None):
    """The CUDA tensors inside an entry: tensors, tuples, lists, dict values and the fields of
    other objects (dataclasses, layout classes), depth first, each object once."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, (int, float, str, bool)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield value
        return
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = getattr(value, "__dict__", {}).values()
        if hasattr(type(value), "__slots__"):
            items = [*items, *(getattr(value, name, None)
                               for name in type(value).__slots__)]
    for item in items:
        yield from _tensors_in(item, seen)


@contextmanager
def forked_side_stream(stream: torch.cuda.Stream, join):
    """Within: `stream`, which waits for the default stream's work queued so far, counts as
    the default stream here (reads and stores); on exit `join()` makes the default stream
    wait for it, and only then are the entries evicted meanwhile let go (either stream may
    still read them until then). For a fork from the default stream only (a stream forked from
    another reads as that stream would: `_read_on_side_stream`)."""
    global _forked_stream
    outer = _forked_stream
    _forked_stream = (stream.device.index, stream.stream_id)
    try:
        yield
    finally:
        try:
            join()
        finally:
            _forked_stream = outer
            if outer is None:
                _evicted_while_forked.clear()


def _plain_tensor(like: torch.Tensor) -> bool:
    """Whether like is an ordinary tensor (no subclass, functional or functorch wrapper), which
    is never fake: the common case, decided without `is_fake`'s checks (3.6 us against 0.5 on
    a CPU, and nsa() asks about 60 times per forward+backward)."""
    return (type(like) is torch.Tensor and not torch._is_functional_tensor(like)
            and not torch._C._functorch.is_functorch_wrapped_tensor(like))


def on_default_stream(like: torch.Tensor) -> bool:
    """Whether work for like's device is queued on its default stream (always on the CPU).
    Asked of torch's C binding where it has one (stream id 0 is the default stream): building
    two torch.cuda.Stream objects to compare cost ~25 us per call, a dozen calls per nsa()
    step (H200 host, 2026-11-28)."""
    if not like.is_cuda:
        return True
    index, stream_id = current_stream_id(like)
    return stream_id == 0 or (index, stream_id) == _forked_stream


def current_stream_id(like: torch.Tensor) -> tuple[int, int]:
    """(device index, stream id) of like's CUDA device's current stream, the id from torch's C
    binding where it has one (no Stream object built); id 0 is the default stream."""
    index = torch.cuda.current_device() if like.device.index is None else like.device.index
    current = getattr(torch._C, "_cuda_getCurrentStream", None)
    if current is not None:
        return index, current(index)[0]
    return index, torch.cuda.current_stream(index).stream_id


@contextmanager
def pinned_for_capture(pins: list):
    """Within: a CUDA-graph capture (off the default stream) reads the entries already built,
    appending each value it reads to `pins`, which the caller keeps as long as the graph (so
    no eviction frees memory the graph reads). Entries not built yet are built by the capture,
    as without this."""
    global _capture_pins
    outer, _capture_pins = _capture_pins, pins
    try:
        yield pins
    finally:
        _capture_pins = outer


def _capturing(like: torch.Tensor) -> bool:
    """Whether like's device's current stream is capturing a CUDA graph."""
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def clear() -> None:
    """Drop every entry (tests; or to free the memory they hold), those a user's CUDA graph
    read too: call it only when no such graph will replay."""
    _entries.clear()
    _captured_entries.clear()
    _side_reads.clear()
