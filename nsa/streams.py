"""The forward's selection chain on a stream of its own, beside the window.

nsa()'s forward holds two independent chains of work: the window and the compressed branch on
one side, and compress -> score tiles -> select -> lists -> selected branch on the other,
whose first kernels are small and latency-bound (at 8K tokens five launches of 0.015 to 0.028
ms, about 0.1 ms in all; docs/history.md). On one stream the GPU ran them one after the other.
Here the chain runs on a high-priority side stream, forked before the window's launch and
joined before the gated sum reads the outputs (`Beside`), so callers, autograd's saved tensors
and CUDA-graph captures (a side stream forked from a capturing one is captured with it) see
one stream's order.

The window and the compressed branch are persistent kernels: a CTA per SM that holds its SM
until the whole grid is done, so a kernel of the chain queued meanwhile found no SM free and
waited for them, as on one stream (measured: 0.604 -> 0.598 ms at 8K). Beside the chain their
grids take SMS_LEFT SMs fewer (`kernels.device.sms_left_to_other_streams`): the chain runs on
those, at its own pace, and the selected branch's CTAs take the rest as the window's finish.
H200, `python tools/profile_kernels.py --seqlens 8192,16384 --forward --graph --warmup 3
--repeats 10 --rounds 4 --from-idle --switch nsa.function.SELECTION_STREAM=False`, a forward
from an idle GPU: 8K 0.533-0.536 ms against 0.600-0.601 on one stream, 16K 1.082-1.085
against 1.129-1.132; SMS_LEFT 0 / 8 / 16 / 24 / 32 at 8K 0.584 / 0.568 / 0.534 / 0.537 /
0.543, at 16K 1.115 / 1.104 / 1.085 / 1.092 / 1.097 (means of two rounds; FINDINGS.md).

The backward forks the same stream under the same rule to build the selected lists'
transposes (about 20 small launches) beside its gate pass, a memory-bound pass over dO and
the branch outputs that reads neither (`nsa.function.LISTS_BESIDE_GATE_PASS`).

When (`beside_applies`, decided here only): with `nsa.function.SELECTION_STREAM` on, the window
launched first (`UNSELECTED_FIRST`), on a CUDA device, from the default stream or a capturing
one (from a user's own stream the chain stays on it: sparsity/host_cache.py's forked-stream
bookkeeping is the default stream's, and beside a user's stream it is not measured), up to
MAX_ROW_HEADS query rows x heads and on documents of at most MAX_DOCUMENT_TOKENS tokens. A
forward of 64K tokens as one sequence ran 4% slower beside (the same A/B, `--seqlens 65536`:
5.574 / 5.608 ms against 5.388 / 5.364 on one stream): there the window and the compressed
branch, over 1024 compressed keys, lose 16 SMs for longer than the chain's small launches
gain. The 64K-token packings of documents up to 8K gain as 8K does
(`--packed lognormal-2k --packed docs-8k --forward --capture off --switch
nsa.streams.MAX_ROW_HEADS=...`: log-normal 4.564 / 4.606 ms on one stream against 4.423 /
4.469 beside, 8 x 8K 4.517 / 4.477 against 4.368 / 4.263; in a graph 0.1 ms alike). Past 64K
tokens it is not measured, and the allocator, which keeps each stream's freed blocks for that
stream, would hold the side stream's outputs apart from what the backward could reuse (the
1M-token peak's margin).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from kernels.device import sms_left_to_other_streams
from sparsity.host_cache import current_stream_id, forked_side_stream, on_default_stream

# Query rows x heads up to which the chain runs beside the window (64K tokens x 32 heads), on
# documents of up to MAX_DOCUMENT_TOKENS tokens.
MAX_ROW_HEADS = 65536 * 32
MAX_DOCUMENT_TOKENS = 16384
# SMs the current stream's persistent grids leave to the side stream while it runs.
SMS_LEFT = 16

_side_streams: dict[int, torch.cuda.Stream] = {}
_default_streams: dict[int, torch.cuda.Stream] = {}


def beside_applies(q: Tensor, longest: int, window_launched: bool, enabled: bool) -> bool:
    """Whether this call's side-stream work (the forward's selection chain, the backward's list
    transposes) runs on the side stream (the module's "When"); longest: the longest
    document's tokens."""
    if not (enabled and window_launched and q.is_cuda and q.numel()):
        return False
    if q.shape[0] * q.shape[1] > MAX_ROW_HEADS or longest > MAX_DOCUMENT_TOKENS:
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
    """`beside = Beside(q, on)` marks the fork point: work queued inside `with beside.side():`,
    within a later `with beside:`, runs on the side stream, which starts after everything queued
    on the current stream before the mark, not after what was queued between the mark and the
    `with` (the window, launched there, so that the host reaches its launch sooner: nothing
    the side stream reads may be queued there); the rest stays on the current stream; on exit
    the current stream waits for the side stream. With `on` False every `side()` is a no-op:
    the work stays on the current stream, in the same order."""

    def __init__(self, like: Tensor, on: bool):
        self.on = on
        if on:
            self.main = current_stream(like)
            self._fork = torch.cuda.Event()
            self._fork.record(self.main)
            self._like = like

    def __enter__(self) -> "Beside":
        if self.on:
            self.stream = side_stream(self._like.device)
            self.stream.wait_event(self._fork)
            # From the default stream, the side stream shares the cached layouts (it joins
            # before anything it read can be freed: sparsity/host_cache.py's rules).
            self._forked = (forked_side_stream(self.stream, self.wait_for_side)
                            if self.main.stream_id == 0
                            else _joined_on_exit(self.wait_for_side))
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


def current_stream(like: Tensor) -> torch.cuda.Stream:
    """like's device's current stream; on the default stream (nsa()'s common case) a Stream
    object made once per device: `torch.cuda.current_stream` builds one per call (5 us in a
    warm loop on the H200 host, several times that inside an eager call, whose code runs
    cold), before the window's launch."""
    index, stream_id = current_stream_id(like)
    if stream_id != 0:
        return torch.cuda.current_stream(index)
    if index not in _default_streams:
        _default_streams[index] = torch.cuda.default_stream(index)
    return _default_streams[index]


@contextmanager
def _joined_on_exit(join):
    try:
        yield
    finally:
        join()
