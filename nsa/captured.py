"""Captured plans: an eager nsa() call replayed from CUDA graphs.

At 8K-16K tokens an eager nsa() step spends longer on the host than the GPU spends on its work
(about 400 torch ops and 100 launches a forward+backward: 4.7-5.4 ms of host time against
2.9-5.2 ms of device work, H200, FINDINGS.md), so the GPU waits. Everything such a call launches
is a function of its signature: the device, shapes and dtypes, which weights are given, which
inputs need gradients, the config, the packing's host bounds and inference mode (selection
reads the data, but on the device). So once a signature has run eagerly, later calls with it
replay CUDA graphs of `packed_forward` and `packed_gradients`: the host work of a call becomes
a few copies and one graph launch per direction.

The rules, decided here only:
- **When** (`capture`): None (the default) on an sm_90 GPU for calls of at most
  AUTO_MAX_ROW_HEADS query rows x heads, AUTO_MAX_ROW_HEADS_FORWARD for a forward that no
  backward will follow (where the host time exceeds the device work: measured below); True on
  any CUDA device and size; False never. Never while a graph is being captured (the caller's
  own graph holds the whole call) or compiled (nsa/ops.py runs then), nor under saved-tensor
  hooks (activation checkpointing, save_on_cpu: they drop or move what a call saves, which a
  plan would keep in its slot).
- **Warm-up**: a signature's first calls run eagerly: its forward is captured once a forward
  has run, and a differentiable one only once a backward of that signature has run too, so the
  kernels are compiled and the libraries' handles made before any capture.
- **Slots**: a slot is one set of static buffers: the inputs (copied in on each call), the
  forward graph and what it keeps for the backward, the backward graph. A slot is busy from its
  forward until its backward has run (or until the call's autograd graph is freed without one),
  so the layers of a model that share a signature get one slot each, and two calls in flight
  never share buffers. A second backward through a retained graph works while the slot has not
  been reused, and raises a RuntimeError that says so once it has.
- **A signature's first step** (a loop whose packing changes every step: each step's layers
  share a signature that no earlier step had): after the signature's first eager forward, its
  other calls share one slot whose forward graph replays, and each call copies what its
  backward reads out of the slot (the lists, lses, compressed keys and kept outputs: its
  "state") and back in before its backward replays. The first backward through the shared
  slot runs eagerly (the backward's warm-up), the second captures. Once the signature has
  run a backward eagerly its calls take slots of their own (no state copies), and the shared
  slot goes. Only up to AUTO_MAX_ROW_HEADS_SHARED query rows x heads (with capture=True
  too): the state copies cost device time that only a host-bound step earns back (the LM of
  tools/train_lm.py, a new packing every step, 2 x H200, 2026-11-28: +12% tokens/s at 8K
  tokens x 16 heads, -4% at 32K x 16).
- **Copies**: the inputs are copied in; what the caller gets must outlive the next replay, so
  the output is the gated sum of the branch outputs taken outside the graph, straight into a
  new tensor (`_output`), dk and dv leave the graph in float32 and are converted into new
  tensors (the conversion a call makes anyway), and dq and the weights' gradients are copied
  out. At 8K, H=32, that is
  about 0.4 GB of memory traffic a step (~0.1 ms of an H200's), against ~2 ms of host time
  saved.
- **Memory**: each slot keeps its inputs, the forward's peak and what the backward reads; the
  backward graphs of a device share one pool (their memory lives only during a replay, as the
  gradients are copied out at once). All slots together take at most CAPTURE_FRACTION of the
  device's memory, measured at capture; past it calls run eagerly. `release_captured_plans()`
  drops every plan (memory of busy slots goes when their backward has run).
- A capture that raises is reported once (a warning) and its signature runs eagerly from then
  on: a plan is a speed-up, never a new failure.

Results are those of the eager call: the same kernels on the same data (bit-identical forward;
gradients bit-identical with deterministic=True, like two eager calls).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from kernels.autograd import refuse_double_backward
from kernels.device import kernels_unavailable, total_memory
from kernels.gated_sum import GatedSum
from nsa.config import NSAConfig
from nsa.function import packed_forward, packed_gradients, transposed_lists
from nsa.validation import PackedSequences
from sparsity.host_cache import pinned_for_capture

# Query rows x heads up to which a call is captured by default (2 x H200, 2026-11-28,
# FINDINGS.md, learned gates): forward+backward 8K 5.50 -> 3.71 ms and 16K 6.85 -> 6.48 ms with a
# plan. A forward alone: 8K 1.18 -> 1.04 ms then, 16K 1.68 -> 1.77 ms while the plan copied its
# output out of the graph; since the gated sum writes the returned output outside the graph
# (`_output`), 16K 1.742 -> 1.379 ms (H200, 2026-11-29, mean gates, FINDINGS.md).
AUTO_MAX_ROW_HEADS = 16384 * 32
AUTO_MAX_ROW_HEADS_FORWARD = 16384 * 32
AUTO_MAX_ROW_HEADS_SHARED = 8192 * 32
CAPTURE_FRACTION = 1 / 8
# Shared slots (a signature's first step) alive at once: the current step's and the last one's.
MAX_SHARED_SLOTS = 2
# Signatures remembered (most recent first); a packing seen once never captures, so a stream of
# distinct packings only cycles this table.
MAX_SIGNATURES = 64


def capture_applies(q: Tensor, capture: bool | None, differentiable: bool) -> bool:
    """Whether this call may run from a captured plan (the module's "When"; nsa()'s checks
    refused capture=True off CUDA). differentiable: a backward can follow."""
    if capture is False or _saved_tensor_hooks_active():
        return False
    return _device_allows(q, capture, differentiable)


def _device_allows(q: Tensor, capture: bool | None, differentiable: bool) -> bool:
    """A CUDA call outside any capture; unless capture=True, on sm_90 and within the size
    rule."""
    if q.device.type != "cuda" or q.numel() == 0 or torch.cuda.is_current_stream_capturing():
        return False  # (an empty call launches nothing worth a graph)
    if capture:
        return True
    limit = AUTO_MAX_ROW_HEADS if differentiable else AUTO_MAX_ROW_HEADS_FORWARD
    return not kernels_unavailable(q.device) and q.shape[0] * q.shape[1] <= limit


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are on (torch.utils.checkpoint's non-reentrant form,
    torch.autograd.graph.save_on_cpu): they exist to drop or move what a call saves for its
    backward, which a plan keeps in its slot instead; and checkpoint's recomputation must save
    what the original forward saved, which a plan that became ready in between would not."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class _Signature:
    """What one signature has seen: eager forwards and backwards (the warm-up), its slots."""

    def __init__(self):
        self.eager_forwards = 0
        self.eager_backwards = 0
        self.slots: list[_Slot] = []
        self.shared: _Slot | None = None  # the first step's slot (the module's rules)
        self.failed = False

    def ready(self, differentiable: bool) -> bool:
        return not self.failed and self.eager_forwards > 0 and (
            not differentiable or self.eager_backwards > 0)

    def count_backward(self, *_):
        self.eager_backwards += 1

    def shares(self, differentiable: bool) -> bool:
        """Whether a call runs on the shared slot: a differentiable call after the signature's
        first eager forward and before its calls have slots of their own."""
        return (differentiable and not self.failed and self.eager_forwards > 0
                and not self.ready(differentiable))


class _Slot:
    """Static buffers and graphs of one call in flight (see the module's "Slots")."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.inputs: tuple | None = None
        self.forward_graph = None
        self.state = None  # packed_forward's result on the static inputs
        self.backward_graph = None
        self.dout: Tensor | None = None
        self.grads: tuple | None = None
        self.busy = False
        self.generation = 0
        self.bytes = 0
        self._state_tensors: list[Tensor] | None = None
        # Cached layouts its graphs read (sparsity.host_cache.pinned_for_capture): kept with
        # the graphs, as the static inputs are.
        self.pins: list = []

    def acquire(self) -> int:
        self.busy = True
        self.generation += 1
        return self.generation

    def release(self, generation: int) -> None:
        if self.generation == generation:
            self.busy = False

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the forward's state that the backward reads (branches' lists,
        lses, compressed keys, kept outputs and gates; not the output, not the static
        inputs, not the pinned cache entries), once each: what a call on a shared slot copies
        out and back in."""
        if self._state_tensors is None:
            # Neither the static inputs nor the cached layouts the graphs read (`pins`: the
            # same for every call of the signature, and never written).
            inputs = {x.data_ptr() for x in self.inputs if x is not None}
            inputs |= {t.data_ptr() for t in tensors_in(self.pins)}
            seen, found = set(), []
            for t in tensors_in(self.state[1:]):
                key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
                if t.numel() and key not in seen and t.data_ptr() not in inputs:
                    seen.add(key)
                    found.append(t)
            self._state_tensors = found
        return self._state_tensors

    def restore(self, inputs, state) -> None:
        """Put one call's inputs and state (`state_tensors` copies) back into the slot."""
        self.load(inputs)
        for static, saved in zip(self.state_tensors(), state):
            static.copy_(saved)

    def load(self, inputs) -> None:
        """Copy this call's tensors into the static inputs (cu_seqlens is part of the signature:
        its values never change for a slot): their values only. A copy recorded by autograd
        would make each static input a non-leaf whose history holds the call's inputs, their
        graph and the leaves' gradient accumulators alive until the next call, which torch's
        capture of a later step then finds on the stream of an earlier one."""
        with torch.no_grad():
            for static, x in zip(self.inputs[:6], inputs[:6]):
                if static is not None:
                    static.copy_(x)


class _Plans:
    """Signature -> _Signature, most recent first, and the bytes all slots hold."""

    def __init__(self):
        self.signatures: OrderedDict = OrderedDict()
        self.bytes: dict[torch.device, int] = {}
        self.backward_pools: dict[torch.device, tuple] = {}
        self.capture_streams: dict[torch.device, torch.cuda.Stream] = {}

    def signature(self, key) -> _Signature:
        entry = self.signatures.get(key)
        if entry is None:
            entry = self.signatures[key] = _Signature()
            while len(self.signatures) > MAX_SIGNATURES:
                _, dropped = self.signatures.popitem(last=False)
                self.forget(dropped)
        else:
            self.signatures.move_to_end(key)
        return entry

    def backward_pool(self, device: torch.device):
        if device not in self.backward_pools:
            self.backward_pools[device] = torch.cuda.graph_pool_handle()
        return self.backward_pools[device]

    def capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream captures run on (capture never runs on the default stream)."""
        if device not in self.capture_streams:
            self.capture_streams[device] = torch.cuda.Stream(device)
        return self.capture_streams[device]

    def room_for_slot(self, signature: _Signature, device: torch.device) -> bool:
        """Whether one more slot fits the budget, counting it as large as this signature's
        first (unknown before the first capture: allowed)."""
        estimate = signature.slots[0].bytes if signature.slots else 0
        return self.bytes.get(device, 0) + estimate <= total_memory(device) * CAPTURE_FRACTION

    def add_bytes(self, device: torch.device, nbytes: int) -> None:
        self.bytes[device] = self.bytes.get(device, 0) + nbytes

    def drop_shared_slots(self, keep: int) -> None:
        """Drop the shared slots of all but the `keep` most recent signatures that have one
        (a loop whose packing changes every step leaves one behind a step; a call still
        waiting for its backward keeps its slot alive until then)."""
        kept = 0
        for signature in reversed(self.signatures.values()):
            if signature.shared is None:
                continue
            if kept < keep:
                kept += 1
                continue
            self.add_bytes(signature.shared.device, -signature.shared.bytes)
            signature.shared = None

    def forget(self, signature: _Signature) -> None:
        for slot in signature.slots + ([signature.shared] if signature.shared else []):
            self.add_bytes(slot.device, -slot.bytes)
        signature.slots, signature.shared = [], None

    def clear(self) -> None:
        for signature in self.signatures.values():
            self.forget(signature)
        self.signatures.clear()
        self.backward_pools.clear()


_plans = _Plans()


def release_captured_plans() -> None:
    """Drop every captured plan (their graphs and static buffers; a slot whose backward is
    still pending keeps its memory until that backward has run)."""
    _plans.clear()


def captured_bytes(device: torch.device | None = None) -> int:
    """Bytes the captured plans hold on `device` (all devices: None), as measured at capture."""
    if device is not None:
        return _plans.bytes.get(torch.device(device), 0)
    return sum(_plans.bytes.values())


def run(inputs: tuple, cu_seqlens: Tensor, config: NSAConfig, sequences: PackedSequences,
        keep_outputs: bool, differentiable: bool, eager) -> Tensor:
    """nsa() on packed, checked tensors from a captured plan where one is ready, else `eager()`
    (NSAFunction.apply), counted as this signature's warm-up."""
    q = inputs[0]
    key = _signature_key(inputs, cu_seqlens, config, sequences, keep_outputs, differentiable)
    signature = _plans.signature(key)
    if signature.shares(differentiable) and q.shape[0] * q.shape[1] <= AUTO_MAX_ROW_HEADS_SHARED:
        out = _shared_call(signature, inputs, cu_seqlens, sequences, config, keep_outputs)
        if out is not None:
            return out
    slot = _free_slot(signature, q.device) if signature.ready(differentiable) else None
    if slot is None:
        out = eager()
        signature.eager_forwards += 1
        if differentiable and out.grad_fn is not None and not signature.eager_backwards:
            out.grad_fn.register_hook(signature.count_backward)
        return out
    if not _forward_on(signature, slot, inputs, cu_seqlens, sequences, config, keep_outputs):
        return eager()
    if not differentiable:
        return _output(slot)
    return _CapturedNSA.apply(slot, signature, sequences, config, *inputs)


def _forward_on(signature: _Signature, slot: _Slot, inputs: tuple, cu_seqlens: Tensor,
                sequences: PackedSequences, config: NSAConfig, keep_outputs: bool) -> bool:
    """Run this call's forward on the slot: its graph replayed on the inputs copied in, or
    captured on its first call; False where that capture failed (the caller runs eagerly)."""
    if slot.forward_graph is None:
        return _capture(signature, slot, lambda: _capture_forward(
            slot, inputs, cu_seqlens, sequences, config, keep_outputs))
    slot.load(inputs)
    slot.forward_graph.replay()
    return True


def _signature_key(inputs, cu_seqlens, config, sequences, keep_outputs, differentiable) -> tuple:
    """What a plan depends on. Inference mode among it: a plan captured under
    torch.inference_mode holds inference tensors, which a call outside it cannot write."""
    tensors = tuple(None if x is None else (tuple(x.shape), x.dtype, x.requires_grad)
                    for x in inputs)
    return (inputs[0].device, tensors, cu_seqlens.dtype, config, sequences, keep_outputs,
            differentiable, torch.is_inference_mode_enabled())


def _shared_call(signature: _Signature, inputs: tuple, cu_seqlens: Tensor,
                 sequences: PackedSequences, config: NSAConfig,
                 keep_outputs: bool) -> Tensor | None:
    """The call on the signature's shared slot (the module's "first step"); None where it
    cannot run there (no room, or the capture failed: the caller runs it eagerly)."""
    slot = signature.shared
    if slot is None:
        _plans.drop_shared_slots(keep=MAX_SHARED_SLOTS - 1)
        if not _plans.room_for_slot(signature, inputs[0].device):
            return None
        slot = signature.shared = _Slot(inputs[0].device)
    if not _forward_on(signature, slot, inputs, cu_seqlens, sequences, config, keep_outputs):
        return None
    state = tuple(t.clone() for t in slot.state_tensors())
    return _SharedNSA.apply(slot, signature, state, sequences, config, *inputs)


def _free_slot(signature: _Signature, device: torch.device) -> _Slot | None:
    if signature.shared is not None:  # calls have slots of their own from now on
        _plans.add_bytes(signature.shared.device, -signature.shared.bytes)
        signature.shared = None
    for slot in signature.slots:
        if not slot.busy:
            return slot
    if not _plans.room_for_slot(signature, device):
        return None
    slot = _Slot(device)
    signature.slots.append(slot)
    return slot


def _capture(signature: _Signature, slot: _Slot, capture_step) -> bool:
    """Run `capture_step` (which captures a graph into `slot` and replays it once), counting
    the memory it took; on failure warn once, drop the signature's plans and say False."""
    # A private pool takes new segments (it never reuses the allocator's cached blocks), so
    # what is reserved after, less before, is the plan's: its static inputs and its pool.
    before = torch.cuda.memory_reserved(slot.device)
    try:
        capture_step()
    except Exception as error:  # noqa: BLE001 - any failure to capture falls back to eager
        signature.failed = True
        _plans.forget(signature)
        warnings.warn(f"nsa(): capturing a CUDA graph of this call failed ({error!r}); calls "
                      "with its signature run eagerly (pass capture=False to skip the attempt)",
                      RuntimeWarning, stacklevel=4)
        return False
    grown = max(torch.cuda.memory_reserved(slot.device) - before, 0)
    slot.bytes += grown
    _plans.add_bytes(slot.device, grown)
    return True


def _captured(device: torch.device, pool, work, pins: list):
    """(a CUDA graph of work(), work()'s result), captured into `pool` on the device's capture
    stream, then replayed once on the current stream (capture runs nothing). Not
    torch.cuda.graph: its synchronize and empty_cache on entry would stall a training step and
    make the step after it allocate afresh, at every capture. The layouts and ranges the
    signature's eager calls left in sparsity.host_cache are read, not rebuilt, by the graph
    (about 120 small launches of a forward+backward): `pins` (the slot's) keeps them alive as
    long as the graph."""
    stream = _plans.capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(stream), pinned_for_capture(pins):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = work()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph.replay()
    return graph, result


def _capture_forward(slot: _Slot, inputs: tuple, cu_seqlens: Tensor,
                     sequences: PackedSequences, config: NSAConfig, keep_outputs: bool) -> None:
    slot.inputs = tuple(None if x is None else x.detach().clone()
                        for x in (*inputs, cu_seqlens))
    # The gated sum runs outside the graph, into the tensor the call returns (`_output`).
    slot.forward_graph, slot.state = _captured(
        slot.device, slot.pool,
        lambda: packed_forward(*slot.inputs, sequences, config, keep_outputs, combine=False),
        slot.pins)


def _capture_backward(slot: _Slot, dout: Tensor, sequences: PackedSequences,
                      config: NSAConfig) -> None:
    slot.dout = dout.detach().clone(memory_format=torch.contiguous_format)
    slot.backward_graph, slot.grads = _captured(
        slot.device, _plans.backward_pool(slot.device),
        lambda: _slot_gradients(slot, slot.dout, sequences, config), slot.pins)


def _slot_gradients(slot: _Slot, dout: Tensor, sequences: PackedSequences,
                    config: NSAConfig) -> tuple:
    """packed_gradients on the slot's inputs and the state its forward left."""
    out, branches, cu_seqlens_cmp, lses, kept = slot.state
    q, k, v, W_k, W_v, W_gate, cu_seqlens = slot.inputs
    return packed_gradients(dout, q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, lses,
                            branches, sequences, config, lambda: transposed_lists(branches),
                            kept, convert_dkv=False)


def _output(slot: _Slot) -> Tensor:
    """The call's output in a tensor of its own (a later replay overwrites the graph's): the
    gated sum of the slot's branch outputs, taken outside the graph straight into it (in the
    graph, then copied out, it would cost a pass over the output more)."""
    return slot.state[0].sum_copy()


def _owned_gradients(grads: tuple, inputs: tuple, needed) -> tuple:
    """The gradients the caller gets, in tensors of its own and each input's dtype: dk and
    dv leave the graph unconverted (`convert_dkv=False`: their `KeyValueGradients`) and are
    finished into new tensors, which costs what a copy of the finished ones would; the others
    are copied. None where an input needs none."""
    dq, key_grads, _, *weight_grads = grads
    dk = dv = None
    if needed[1] or needed[2]:
        dk, dv = key_grads.finish(inputs[1], inputs[2], copy=True)
    copied = (None if g is None or not need else g.clone()
              for g, need in zip((dq, *weight_grads), (needed[0], *needed[3:])))
    dq, *weight_grads = copied
    return (dq, dk if needed[1] else None, dv if needed[2] else None, *weight_grads)


def _backward(ctx, slot: _Slot, dout: Tensor) -> tuple:
    """The slot's gradients for dout: its backward graph replayed (captured on its first
    backward); without a graph (the capture failed) the same work eagerly."""
    if slot.backward_graph is not None:
        slot.dout.copy_(dout)
        slot.backward_graph.replay()
        return slot.grads
    capture_step = lambda: _capture_backward(slot, dout, ctx.sequences, ctx.config)  # noqa: E731
    if _capture(ctx.signature, slot, capture_step):
        return slot.grads
    return _slot_gradients(slot, dout, ctx.sequences, ctx.config)


def tensors_in(value):
    """Every tensor inside value: tensors, tuples, lists, dict values, dataclass fields and a
    GatedSum's tensors, depth first (a slot's state: nsa.function.packed_forward's result)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, GatedSum):
        yield from value.tensors()
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


class _SharedNSA(torch.autograd.Function):
    """A call on a shared slot: the slot's forward graph has just run on this call's inputs;
    `state` is this call's copy of what the backward reads, put back before the backward."""

    @staticmethod
    def forward(ctx, slot: _Slot, signature: _Signature, state: tuple,
                sequences: PackedSequences, config: NSAConfig, q, k, v, W_k, W_v,
                W_gate) -> Tensor:
        ctx.slot, ctx.signature, ctx.state = slot, signature, state
        ctx.sequences, ctx.config = sequences, config
        ctx.save_for_backward(q, k, v, W_k, W_v, W_gate)
        return _output(slot)

    @staticmethod
    def backward(ctx, dout: Tensor):
        slot, signature = ctx.slot, ctx.signature
        inputs = ctx.saved_tensors
        if ctx.state is None:
            raise RuntimeError(
                "nsa(): a second backward through a call that ran on a shared captured plan "
                "(retain_graph=True) is not supported: its saved state went with the first; "
                "pass capture=False to nsa() for graphs that are differentiated more than once")
        with torch.no_grad():
            slot.restore(inputs, ctx.state)
            if slot.backward_graph is None and not signature.eager_backwards:
                # The signature's first backward: eagerly, as its warm-up.
                grads = _slot_gradients(slot, dout, ctx.sequences, ctx.config)
                signature.eager_backwards += 1
            else:
                grads = _backward(ctx, slot, dout)
            grads = _owned_gradients(grads, inputs, ctx.needs_input_grad[5:])
        ctx.state = None
        grads = refuse_double_backward("nsa()", grads, (dout, *inputs))
        return (None, None, None, None, None, *grads)


class _Lease:
    """Frees its slot when the autograd graph that holds it goes without a backward."""

    def __init__(self, slot: _Slot, generation: int):
        self.slot, self.generation = weakref.ref(slot), generation

    def __del__(self):
        slot = self.slot()
        if slot is not None:
            slot.release(self.generation)


class _CapturedNSA(torch.autograd.Function):
    """NSAFunction's twin over a slot whose forward graph has just run on this call's inputs."""

    @staticmethod
    def forward(ctx, slot: _Slot, signature: _Signature, sequences: PackedSequences,
                config: NSAConfig, q, k, v, W_k, W_v, W_gate) -> Tensor:
        generation = slot.acquire()
        ctx.slot, ctx.signature, ctx.generation = slot, signature, generation
        ctx.sequences, ctx.config = sequences, config
        ctx.lease = _Lease(slot, generation)
        ctx.save_for_backward(q, k, v, W_k, W_v, W_gate)
        return _output(slot)

    @staticmethod
    def backward(ctx, dout: Tensor):
        slot = ctx.slot
        if slot.generation != ctx.generation:
            raise RuntimeError(
                "nsa(): this backward's captured plan was reused by a later call after an "
                "earlier backward through the same graph (retain_graph=True); pass "
                "capture=False to nsa() for graphs that are differentiated more than once")
        with torch.no_grad():
            grads = _owned_gradients(_backward(ctx, slot, dout), ctx.saved_tensors,
                                     ctx.needs_input_grad[4:])
        slot.release(ctx.generation)
        grads = refuse_double_backward("nsa()", grads, (dout, *ctx.saved_tensors))
        return (None, None, None, None, *grads)
