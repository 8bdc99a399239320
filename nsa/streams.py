"""The forward's selection chain on a stream of its own, beside the window.

nsa()'s forward holds two independent chains of work: the window branch, which reads q, k and
v alone, and compress -> compressed branch -> score tiles -> select -> lists -> selected
branch. The second starts with small launches that fill few SMs (at 8K tokens six of 0.015 to
0.044 ms, 0.14 ms in all, against the window's 0.149 ms over every SM; docs/history.md), and on
one stream the GPU runs them one after the other, the window's SMs idle behind them or theirs
behind the window. Here the chain runs on a high-priority side stream forked after the window's
launch: whenever an SM frees, the block scheduler gives it the chain's pending CTAs before the
window's, so the chain's latency-bound kernels go at their own pace and the window fills every
SM they leave. The current stream waits for the side stream before the gated sum reads the
outputs (`Beside.__exit__`), so a call's work joins back on the caller's stream: callers,
autograd's saved tensors and CUDA-graph captures (a side stream forked from a capturing one is
captured with it) see one stream's order.

When (`beside_applies`, decided here only): with `nsa.function.SELECTION_STREAM` on, the window
launched first (`UNSELECTED_FIRST`), on a CUDA device, from the default stream or a capturing
one (from a user's own stream the side stream could not share sparsity/host_cache.py's
entries, see its rules), and up to MAX_ROW_HEADS query rows x heads: beyond it the chain's
small launches are a share of a percent, and the allocator keeps each stream's freed blocks
for that stream, so the side stream's outputs would hold memory the backward could not reuse
(the 1M-token peak's margin).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from kernels.device import sms_left_to_other_streams
from sparsity.host_cache import forked_side_stream, on_default_stream

# Query rows x heads up to which the chain runs beside the window: 64K tokens x 32 heads.
MAX_ROW_HEADS = 65536 * 32
# SMs the current stream's persistent grids leave to the side stream while it runs.
SMS_LEFT = 16

_side_streams: dict[int, torch.cuda.Stream] = {}


def beside_applies(q: Tensor, window_launched: bool, enabled: bool) -> bool:
    """Whether this forward's selection chain runs on the side stream (the module's "When")."""
    if not (enabled and window_launched and q.is_cuda and q.numel()):
        return False
    if q.shape[0] * q.shape[1] > MAX_ROW_HEADS:
        return False
    return on_default_stream(q) or torch.cuda.is_current_stream_capturing()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's selection stream, at the greatest priority its driver offers."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _side_streams:
        _, greatest = torch.cuda.Stream.priority_range()
        _side_streams[index] = torch.cuda.Stream(device=index, priority=greatest)
    return _side_streams[index]


class Beside:
    """`with Beside(q, on) as beside:` work queued inside `with beside.side():` runs on the
    side stream, which starts after everything queued so far on the current stream; the rest
    stays on the current stream; on exit the current stream waits for the side stream. With
    `on` False every `side()` is a no-op: the work stays on the current stream, in the same
    order."""

    def __init__(self, like: Tensor, on: bool):
        self.on = on
        if on:
            self.main = torch.cuda.current_stream(like.device)
            self.stream = side_stream(like.device)
            self._from_default = self.main.stream_id == 0

    def __enter__(self) -> "Beside":
        if self.on:
            self.stream.wait_stream(self.main)
            # From the default stream, the side stream shares the cached layouts (it joins
            # before anything it read can be freed: sparsity/host_cache.py's rules).
            self._forked = (forked_side_stream(self.stream, self._join) if self._from_default
                            else _joined_on_exit(self._join))
            self._forked.__enter__()
        return self

    def side(self):
        return torch.cuda.stream(self.stream) if self.on else nullcontext()

    def beside_side(self):
        """Within: work on the current stream, its persistent grids leaving SMS_LEFT SMs to
        the side stream (a persistent CTA holds its SM to the end of its grid)."""
        return sms_left_to_other_streams(SMS_LEFT) if self.on else nullcontext()

    def wait_for_side(self) -> None:
        """The current stream's next work waits for the side stream's work queued so far."""
        if self.on:
            self.main.wait_stream(self.stream)

    def __exit__(self, *exc) -> None:
        if self.on:
            self._forked.__exit__(*exc)

    def _join(self) -> None:
        self.main.wait_stream(self.stream)


@contextmanager
def _joined_on_exit(join):
    try:
        yield
    finally:
        join()
