"""nsa()'s captured plans (nsa/captured.py): eager calls replayed from CUDA graphs.

On the CPU: the argument's checks and the rule that says when a call may be captured; and the
plans' bookkeeping (slots, leases, copies in and out) on the fallback with graphs emulated: a
"replay" runs the captured work again and writes its results into the tensors the capture
returned, as a CUDA graph writes the same addresses (a tensor the plans failed to copy would
hold another call's values, as on the GPU). On an
sm_90 GPU: calls with one signature run eagerly, then capture, then replay, each on new values,
and every call's output and gradients equal capture=False's on the same values, bit for bit
(deterministic=True orders the dQ sums); two calls in flight with one signature (two layers)
use two slots; a plan's output survives later calls; a second backward through a retained graph
works until the plan is reused and then raises; forward-only calls replay; the plans' memory is
counted and freed.

    python -m pytest -q tests/nsa/test_nsa_captured.py     # the GPU half on an sm_90 GPU
"""
import pytest
import torch

import nsa.captured as captured
from nsa import nsa, release_captured_plans
from nsa_testing import GPU_LENGTHS, gpu_inputs, random_inputs
from gpu_marks import requires_sm90

NAMES = ("q", "k", "v", "W_k", "W_v", "W_gate")


# --- CPU: the argument and the rule -------------------------------------------------------------

def test_capture_must_be_none_or_a_bool():
    x = random_inputs([64], heads=2, kv_heads=1, head_dim=16, seed=0, weights=False)
    with pytest.raises(TypeError, match="capture must be None or a bool"):
        nsa(x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"], capture="yes")


def test_capture_true_needs_cuda_tensors():
    x = random_inputs([64], heads=2, kv_heads=1, head_dim=16, seed=0, weights=False)
    with pytest.raises(ValueError, match="capture=True needs CUDA tensors"):
        nsa(x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"], capture=True)


def test_cpu_calls_are_never_captured():
    q = torch.zeros(8, 2, 16)
    for differentiable in (True, False):
        assert not captured.capture_applies(q, None, differentiable)
        assert not captured.capture_applies(q, False, differentiable)


def test_the_automatic_rule_is_a_size_limit(monkeypatch):
    """capture=None: an sm_90 device and at most AUTO_MAX_ROW_HEADS rows x heads
    (AUTO_MAX_ROW_HEADS_FORWARD without a backward); True: any CUDA size; False: never. (An
    object posing as a CUDA tensor: only the rule is exercised.)"""
    monkeypatch.setattr(captured, "kernels_unavailable", lambda device: "")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rows = captured.AUTO_MAX_ROW_HEADS // 32

    class FakeCuda:
        def __init__(self, rows):
            self.shape, self.device = (rows, 32, 128), torch.device("cuda", 0)

        def numel(self):
            return self.shape[0] * self.shape[1] * self.shape[2]

    forward_rows = captured.AUTO_MAX_ROW_HEADS_FORWARD // 32
    assert forward_rows <= rows
    assert captured.capture_applies(FakeCuda(rows), None, True)
    assert not captured.capture_applies(FakeCuda(rows + 1), None, True)
    assert captured.capture_applies(FakeCuda(forward_rows), None, False)
    assert not captured.capture_applies(FakeCuda(forward_rows + 1), None, False)
    assert captured.capture_applies(FakeCuda(rows + 1), True, True)
    assert captured.capture_applies(FakeCuda(rows + 1), True, False)
    assert not captured.capture_applies(FakeCuda(rows), False, True)
    assert not captured.capture_applies(FakeCuda(0), True, True)  # nothing to launch
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not captured.capture_applies(FakeCuda(rows), True, True)  # checkpointing
    monkeypatch.setattr(captured, "kernels_unavailable", lambda device: "GPU is sm_80")
    assert not captured.capture_applies(FakeCuda(rows), None, True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not captured.capture_applies(FakeCuda(rows), True, True)


class _FakeSlot:
    """What _Plans reads of a slot: its device, bytes and whether it is busy."""

    def __init__(self, nbytes: int, busy: bool = False):
        self.device, self.bytes, self.busy = torch.device("cuda", 0), nbytes, busy


def test_a_signature_is_ready_after_its_warm_up():
    signature = captured._Signature()
    assert not signature.ready(False) and not signature.ready(True)
    signature.eager_forwards = 1
    assert signature.ready(False) and not signature.ready(True)  # a backward must run first
    signature.count_backward(None, None)  # the hook on the eager call's autograd node
    assert signature.ready(True)
    signature.failed = True
    assert not signature.ready(False) and not signature.ready(True)


def test_the_budget_counts_every_slot_and_eviction_frees_it(monkeypatch):
    """One more slot fits while the plans' bytes plus one of this signature's slots stay within
    CAPTURE_FRACTION of the device; the least recent signature beyond MAX_SIGNATURES is dropped
    with its bytes."""
    monkeypatch.setattr(captured, "total_memory", lambda device: 8000)  # budget: 1000 bytes
    monkeypatch.setattr(captured, "MAX_SIGNATURES", 2)
    plans, device = captured._Plans(), torch.device("cuda", 0)
    first = plans.signature("first")
    assert plans.room_for_slot(first, device)  # no slot yet: size unknown, allowed
    for _ in range(2):
        first.slots.append(_FakeSlot(400))
        plans.add_bytes(device, 400)
    assert not plans.room_for_slot(first, device)  # 800 + 400 > 1000
    assert plans.room_for_slot(plans.signature("second"), device)  # unknown size
    plans.signature("first")  # most recent again
    plans.signature("third")  # evicts "second", the least recent
    assert list(plans.signatures) == ["first", "third"]
    plans.signature("fourth")  # evicts "first" and its 800 bytes
    assert list(plans.signatures) == ["third", "fourth"] and plans.bytes[device] == 0
    assert first.slots == []


def test_a_failed_capture_warns_and_leaves_the_signature_eager(monkeypatch):
    """A capture that raises is a warning, never an error: the signature runs eagerly from then
    on and its plans' bytes are returned."""
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    plans = captured._Plans()
    monkeypatch.setattr(captured, "_plans", plans)
    signature = plans.signature("s")
    signature.eager_forwards = signature.eager_backwards = 1
    slot = _FakeSlot(300)
    signature.slots.append(slot)
    plans.add_bytes(slot.device, 300)

    def failing_capture():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(RuntimeWarning, match="capturing a CUDA graph of this call failed"):
        assert not captured._capture(signature, slot, failing_capture)
    assert signature.failed and not signature.ready(True) and signature.slots == []
    assert plans.bytes[slot.device] == 0


def test_a_shared_slot_copies_every_tensor_of_the_forward_state():
    """tensors_in finds the tensors a backward reads inside packed_forward's result (lses,
    the branches' lists, compressed keys, kept outputs and gates): what a call on a shared
    slot copies out and back in."""
    from nsa.function import packed_forward
    from nsa.validation import validate_nsa_call

    x = random_inputs([300, 77], heads=4, kv_heads=2, head_dim=16, seed=1)
    config, sequences = validate_nsa_call(
        x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"], max_seqlen=None,
        compress_block_size=16, selected_block_size=16, num_selected_blocks=4, window_size=32,
        W_k=x["W_k"], W_v=x["W_v"], W_gate=x["W_gate"], causal=True, softmax_scale=None,
        num_cmp_selected_blocks=None, q_tile=32, cmp_kv_block=32)
    out, branches, cu_cmp, lses, kept = packed_forward(
        x["q"], x["k"], x["v"], x["W_k"], x["W_v"], x["W_gate"], x["cu_seqlens"], sequences,
        config, keep_outputs=True)
    found = {id(t) for t in captured.tensors_in((branches, cu_cmp, lses, kept))}
    expected = [*lses, *kept.compressed, *kept.outputs, kept.gates, cu_cmp]
    expected += [t for b in branches for t in b.kernel_kwargs.values()
                 if isinstance(t, torch.Tensor)]
    lists = branches[1].kernel_kwargs["block_sparse"]
    expected += [lists.full_count, lists.full_index, lists.mask_count, lists.mask_index]
    assert all(id(t) in found for t in expected)


def test_only_the_two_newest_shared_slots_stay():
    plans, device = captured._Plans(), torch.device("cuda", 0)
    for name in ("a", "b", "c"):
        plans.signature(name).shared = _FakeSlot(100)
        plans.add_bytes(device, 100)
    plans.drop_shared_slots(keep=captured.MAX_SHARED_SLOTS)
    assert [n for n, sig in plans.signatures.items() if sig.shared] == ["b", "c"]
    assert plans.bytes[device] == 200


# --- CPU: the bookkeeping, with graphs emulated -------------------------------------------------

class _ReplayedByRunningAgain:
    """A CUDA graph's replay on the CPU: the captured work runs again (reading the static
    inputs it closes over) and its results are written into the tensors the capture
    returned."""

    def __init__(self, work, result):
        self.work, self.result = work, result

    def replay(self):
        fresh = _as_captured(self.work, pins=[])
        statics, news = list(captured.tensors_in(self.result)), list(captured.tensors_in(fresh))
        assert len(statics) == len(news)
        for static, new in zip(statics, news):
            if static is not new:  # a pinned cache entry is read, never written, by a graph
                static.copy_(new)


def _as_captured(work, pins: list):
    """work() as a capture runs it: without autograd, and off the default stream (a GPU
    capture runs on a side stream), where sparsity's host cache serves only the entries built
    before, into the plan's `pins` (`host_cache.pinned_for_capture`)."""
    import sparsity.host_cache as host_cache

    on_default_stream, capturing = host_cache.on_default_stream, host_cache._capturing
    host_cache.on_default_stream = lambda like: False
    host_cache._capturing = lambda like: True
    try:
        with torch.no_grad(), host_cache.pinned_for_capture(pins):
            return work()
    finally:
        host_cache.on_default_stream, host_cache._capturing = on_default_stream, capturing


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Plans on CPU tensors: the device allows every call (nsa()'s checks refuse capture=True
    off CUDA, so the tests pass None), and captures are `_ReplayedByRunningAgain`."""
    monkeypatch.setattr(captured, "_device_allows", lambda q, capture, differentiable: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(captured, "total_memory", lambda device: 2 ** 40)

    def capture(device, pool, work, pins):
        result = _as_captured(work, pins)
        return _ReplayedByRunningAgain(work, result), result

    monkeypatch.setattr(captured, "_captured", capture)
    release_captured_plans()
    yield
    release_captured_plans()


CPU_LENGTHS = [150, 37, 90]


def _cpu_call(seed: int, lengths=CPU_LENGTHS) -> tuple[dict, dict]:
    x = random_inputs(lengths, heads=4, kv_heads=2, head_dim=16, seed=seed)
    tensors = {n: x[n].requires_grad_() for n in NAMES}
    extra = dict(cu_seqlens=x["cu_seqlens"], host_cu_seqlens=tuple(x["cu_seqlens"].tolist()),
                 max_seqlen=max(lengths), compress_block_size=16, selected_block_size=16,
                 num_selected_blocks=4, window_size=32, _q_tile=32, _cmp_kv_block=32)
    return tensors, extra


def _cpu_step(layers: list, extra: dict, capture) -> tuple[list, list]:
    """Forward of every layer, then one backward through all: (outputs, gradients)."""
    leaves = [{n: t.detach().clone().requires_grad_() for n, t in x.items()} for x in layers]
    outs = [nsa(**x, **extra, capture=capture) for x in leaves]
    douts = [torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(i))
             for i, o in enumerate(outs)]
    torch.autograd.backward(outs, douts)
    return [o.detach() for o in outs], [{n: t.grad for n, t in x.items()} for x in leaves]


def _assert_same(got, want):
    for (outs, grads), (ref_outs, ref_grads) in [(got, want)]:
        for layer, (out, ref) in enumerate(zip(outs, ref_outs)):
            assert torch.equal(out, ref), layer
            for name in NAMES:
                assert torch.equal(grads[layer][name], ref_grads[layer][name]), (layer, name)


def test_emulated_plans_equal_eager_call_by_call(emulated_graphs):
    """One call a step: eager, then captured, then replayed, each on new values."""
    for seed in range(4):
        tensors, extra = _cpu_call(seed)
        _assert_same(_cpu_step([tensors], extra, None), _cpu_step([tensors], extra, False))
    slots = _slots()
    assert len(slots) == 1 and slots[0].forward_graph is not None
    assert slots[0].backward_graph is not None and not slots[0].busy


def test_emulated_plans_keep_no_autograd_history_of_their_calls(emulated_graphs):
    """A plan copies each call's inputs into its static buffers as values only: the buffers
    never join the caller's autograd graph. (Copied with grad mode on, each buffer became a
    non-leaf whose history held the last call's inputs and, through them, their gradient
    accumulators and graphs, from one step to the next: a capture of a later step then found
    the leaves' accumulators on the stream of an earlier one, the default stream, and failed.)"""
    for seed in range(4):  # eager, the capture, then replays and the shared slot's calls
        tensors, extra = _cpu_call(seed)
        layers = [{n: t * 1.0 for n, t in tensors.items()}]  # non-leaves, as in a model
        outs = [nsa(**x, **extra) for x in layers]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    slots = _slots()
    assert slots and slots[0].forward_graph is not None
    for slot in slots:
        for static in slot.inputs:
            assert static is None or (static.grad_fn is None and not static.requires_grad)


def test_emulated_plans_free_the_graph_of_a_call_without_backward(emulated_graphs):
    """A call from a plan with grad enabled whose backward never runs (an evaluation without
    torch.no_grad): once its output and inputs are dropped, its inputs' graph and what that
    graph saved are freed. (With the copies into the slot recorded by autograd, the slot
    held every such graph, saved activations included, for good.)"""
    import gc
    import weakref

    tensors, extra = _cpu_call(0)
    for _ in range(3):  # eager, captured, replayed: the signature has a plan
        torch.autograd.backward(nsa(**tensors, **extra), torch.ones_like(tensors["q"]))
    factor = torch.full((1,), 1.0)
    saved = weakref.ref(factor)  # saved by the product's backward, for q's gradient
    inputs = dict(tensors, q=tensors["q"] * factor)
    out = nsa(**inputs, **extra)
    assert _slots()[0].busy  # the call ran from the plan
    del out, inputs, factor
    gc.collect()
    assert saved() is None


def test_emulated_plans_equal_eager_with_three_calls_in_flight(emulated_graphs):
    """Three layers of one signature, all forwards before the backward: a slot each."""
    for seed in range(3):
        layers = [_cpu_call(10 * seed + layer)[0] for layer in range(3)]
        extra = _cpu_call(0)[1]
        _assert_same(_cpu_step(layers, extra, None), _cpu_step(layers, extra, False))
    assert len(_slots()) == 3 and not any(slot.busy for slot in _slots())


def test_emulated_inference_mode_and_no_grad_plans_stay_apart(emulated_graphs):
    """A plan captured under torch.inference_mode holds inference tensors, which a call under
    plain no_grad could not write into: the two modes are two signatures."""
    tensors, extra = _cpu_call(0)
    for mode in (torch.inference_mode, torch.inference_mode, torch.no_grad, torch.no_grad,
                 torch.inference_mode, torch.no_grad):
        with mode():
            out = nsa(**tensors, **extra)
        assert torch.equal(out, nsa(**tensors, **extra, capture=False))
    assert len(_slots()) == 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_emulated_plans_under_activation_checkpointing(emulated_graphs, reentrant):
    """torch.utils.checkpoint recomputes the forward during the backward (with its own calls
    to nsa()): gradients equal capture=False's, step after step."""
    from torch.utils.checkpoint import checkpoint

    def step(tensors, extra, capture):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
        out = checkpoint(lambda *xs: nsa(**dict(zip(NAMES, xs)), **extra, capture=capture),
                         *(leaves[n] for n in NAMES), use_reentrant=reentrant)
        out.backward(torch.ones_like(out))
        return out.detach(), {n: t.grad for n, t in leaves.items()}

    for seed in range(3):
        tensors, extra = _cpu_call(seed)
        out, grads = step(tensors, extra, None)
        ref_out, ref_grads = step(tensors, extra, False)
        assert torch.equal(out, ref_out)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in NAMES)


def test_emulated_checkpointed_layers_run_eagerly(emulated_graphs):
    """Three checkpointed layers of one signature a step (non-reentrant): the recomputation in
    the backward must save what the forward saved, so no call under saved-tensor hooks takes a
    plan (one that became ready between a layer's forward and its recomputation would save
    other tensors), and gradients equal the plain calls'."""
    from torch.utils.checkpoint import checkpoint

    def step(layers, extra, checkpointed):
        leaves = [{n: t.detach().clone().requires_grad_() for n, t in x.items()}
                  for x in layers]

        def call(*xs):
            return nsa(**dict(zip(NAMES, xs)), **extra)
        outs = [checkpoint(call, *(x[n] for n in NAMES), use_reentrant=False) if checkpointed
                else call(*(x[n] for n in NAMES)) for x in leaves]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return [o.detach() for o in outs], [{n: t.grad for n, t in x.items()} for x in leaves]

    extra = _cpu_call(0)[1]
    for seed in range(3):
        layers = [_cpu_call(10 * seed + layer)[0] for layer in range(3)]
        extra = {**extra, "capture": False}
        plain = step(layers, extra, False)
        extra.pop("capture")
        _assert_same(step(layers, extra, True), plain)
    assert _slots() == []


def test_emulated_plans_train_the_lm_like_eager(emulated_graphs, monkeypatch):
    """The tiny LM, two layers sharing a signature, for six steps whose packings repeat and
    change: every step's loss and every parameter's gradient equal those of the same model with
    plans switched off."""
    from dataclasses import replace

    from nsa.models.lm import MODEL_PRESETS, CausalLM

    config = replace(MODEL_PRESETS["tiny"], compress_block_size=4, selected_block_size=8,
                     num_selected_blocks=4, window_size=12, test_q_tile=16,
                     test_cmp_kv_block=4, compute_dtype="float64")
    packings = [[50, 7, 39], [50, 7, 39], [50, 7, 39], [30, 66], [50, 7, 39], [96],
                [20, 40, 36], [60, 36], [11, 85]]  # the last three: a new packing a step

    def train(plans: bool) -> list:
        if not plans:
            monkeypatch.setattr(captured, "_device_allows", lambda *args: False)
        model = CausalLM(config, seed=0).double()
        record = []
        for step, lengths in enumerate(packings):
            ids = torch.randint(0, 256, (sum(lengths),),
                                generator=torch.Generator().manual_seed(step))
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
            model.zero_grad(set_to_none=True)
            loss = model(ids, cu_seqlens=cu, host_cu_seqlens=tuple(cu.tolist()), labels=ids)
            loss.backward()
            record.append((loss.detach(), {n: p.grad.clone()
                                           for n, p in model.named_parameters()}))
        return record

    with_plans = train(True)
    assert _slots(), "the repeated packing was captured"
    newest = next(reversed(captured._plans.signatures.values()))
    assert newest.shared is not None and newest.shared.forward_graph is not None
    without = train(False)
    for (loss, grads), (ref_loss, ref_grads) in zip(with_plans, without):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_emulated_new_packing_every_step_runs_on_a_shared_slot(emulated_graphs):
    """A loop whose packing changes every step, three layers a step: the first call eager, the
    other two on the step's shared slot (their state copied out and back in); the first
    shared backward eager, the second replayed; equal to capture=False."""
    for step in range(3):
        lengths = [150 - 20 * step, 37 + 10 * step, 90 + 10 * step]
        layers = [_cpu_call(10 * step + layer, lengths)[0] for layer in range(3)]
        extra = _cpu_call(0, lengths)[1]
        _assert_same(_cpu_step(layers, extra, None), _cpu_step(layers, extra, False))
        signature = next(reversed(captured._plans.signatures.values()))
        assert signature.shared is not None and signature.shared.backward_graph is not None
        assert signature.slots == []
    assert sum(sig.shared is not None for sig in captured._plans.signatures.values()) <= 2


def test_emulated_shared_slots_stop_at_their_size_limit(emulated_graphs, monkeypatch):
    """Above AUTO_MAX_ROW_HEADS_SHARED query rows x heads a step's calls run eagerly instead of
    sharing a slot (the state copies cost more than the host time they save there)."""
    monkeypatch.setattr(captured, "AUTO_MAX_ROW_HEADS_SHARED", 1)
    lengths = [150, 37, 90]
    layers = [_cpu_call(layer, lengths)[0] for layer in range(3)]
    extra = _cpu_call(0, lengths)[1]
    _assert_same(_cpu_step(layers, extra, None), _cpu_step(layers, extra, False))
    assert all(sig.shared is None for sig in captured._plans.signatures.values())


def test_emulated_retained_graph_raises_once_its_plan_is_reused(emulated_graphs):
    tensors, extra = _cpu_call(0)
    for _ in range(2):
        _cpu_step([tensors], extra, None)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    out = nsa(**leaves, **extra)
    dout = torch.randn(out.shape, dtype=out.dtype)
    out.backward(dout, retain_graph=True)
    first = {n: t.grad.clone() for n, t in leaves.items()}
    for t in leaves.values():
        t.grad = None
    out.backward(dout, retain_graph=True)
    assert all(torch.equal(leaves[n].grad, first[n]) for n in NAMES)
    _cpu_step([_cpu_call(5)[0]], extra, None)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward(dout)


# --- GPU -----------------------------------------------------------------------------------------

def _inputs(seed: int, layout: str = "varlen") -> tuple[dict, dict]:
    return gpu_inputs(NAMES, layout, seed)


def _step(tensors: dict, extra: dict, dout: torch.Tensor, capture) -> tuple:
    """out and the gradients of one forward+backward (fresh leaves, so nothing accumulates)."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    out = nsa(**leaves, **extra, deterministic=True, capture=capture)
    out.backward(dout)
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def _slots() -> list:
    return [slot for signature in captured._plans.signatures.values()
            for slot in signature.slots]


@pytest.fixture
def fresh_plans():
    release_captured_plans()
    yield
    release_captured_plans()


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_eager_then_captured_then_replayed_calls_equal_eager_ones(fresh_plans, layout):
    for seed in range(4):  # call 0 eager (warm-up), 1 captures, 2 and 3 replay
        tensors, extra = _inputs(seed, layout)
        dout = torch.randn_like(tensors["q"])
        out, grads = _step(tensors, extra, dout, capture=True)
        ref_out, ref_grads = _step(tensors, extra, dout, capture=False)
        assert torch.equal(out, ref_out), seed
        for name in NAMES:
            assert torch.equal(grads[name], ref_grads[name]), (seed, name)
    slots = _slots()
    assert len(slots) == 1 and slots[0].forward_graph is not None
    assert slots[0].backward_graph is not None and not slots[0].busy
    assert captured.captured_bytes() > 0


@requires_sm90
@pytest.mark.gpu
def test_two_calls_in_flight_use_two_slots(fresh_plans):
    """Two layers with one signature: both forwards before either backward."""
    dout = [torch.randn(sum(GPU_LENGTHS), 8, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)]

    def two_layer_step(seed: int, capture):
        first, extra = _inputs(seed)
        second, _ = _inputs(seed + 100)
        leaves = [{n: t.detach().clone().requires_grad_() for n, t in x.items()}
                  for x in (first, second)]
        outs = [nsa(**x, **extra, deterministic=True, capture=capture) for x in leaves]
        torch.autograd.backward(outs, dout)
        return [o.detach() for o in outs], [{n: t.grad for n, t in x.items()} for x in leaves]

    for seed in range(3):
        outs, grads = two_layer_step(seed, True)
        ref_outs, ref_grads = two_layer_step(seed, False)
        for layer in range(2):
            assert torch.equal(outs[layer], ref_outs[layer]), (seed, layer)
            for name in NAMES:
                assert torch.equal(grads[layer][name], ref_grads[layer][name]), (seed, name)
    assert len(_slots()) == 2


@requires_sm90
@pytest.mark.gpu
def test_an_output_survives_later_replays(fresh_plans):
    tensors, extra = _inputs(0)
    with torch.no_grad():
        outs = [nsa(**_inputs(seed)[0], **extra, capture=True) for seed in range(4)]
        refs = [nsa(**_inputs(seed)[0], **extra, capture=False) for seed in range(4)]
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    assert len(_slots()) == 1 and not _slots()[0].busy  # forward-only calls free it at once


@requires_sm90
@pytest.mark.gpu
def test_a_retained_graph_backward_works_until_its_plan_is_reused(fresh_plans):
    tensors, extra = _inputs(0)
    dout = torch.randn_like(tensors["q"])
    for _ in range(2):  # warm-up: the signature's eager forward and backward
        _step(tensors, extra, dout, capture=True)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    out = nsa(**leaves, **extra, deterministic=True, capture=True)
    out.backward(dout, retain_graph=True)
    first = {n: t.grad.clone() for n, t in leaves.items()}
    for t in leaves.values():
        t.grad = None
    out.backward(dout, retain_graph=True)  # the plan is still this call's
    for name in NAMES:
        assert torch.equal(leaves[name].grad, first[name]), name
    _step(_inputs(5)[0], extra, dout, capture=True)  # reuses the free slot
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward(dout)


@requires_sm90
@pytest.mark.gpu
def test_an_output_dropped_without_backward_frees_its_slot(fresh_plans):
    tensors, extra = _inputs(0)
    dout = torch.randn_like(tensors["q"])
    for _ in range(2):
        _step(tensors, extra, dout, capture=True)
    nsa(**tensors, **extra, capture=True)  # graph freed at once: no backward will come
    assert len(_slots()) == 1 and not _slots()[0].busy
    _step(tensors, extra, dout, capture=True)
    assert len(_slots()) == 1


@requires_sm90
@pytest.mark.gpu
def test_release_frees_the_plans(fresh_plans):
    tensors, extra = _inputs(0)
    dout = torch.randn_like(tensors["q"])
    for _ in range(3):
        _step(tensors, extra, dout, capture=None)  # small: the automatic rule captures
    assert _slots() and captured.captured_bytes() > 0
    release_captured_plans()
    assert not _slots() and captured.captured_bytes() == 0


@requires_sm90
@pytest.mark.gpu
def test_a_new_packing_every_step_runs_on_a_shared_slot(fresh_plans):
    """A loop whose packing changes every step (three layers a step): each step's first call is
    eager, the others share one slot; outputs and gradients equal capture=False's, bit for
    bit; the first backward on the shared slot is eager, the next ones replay its graph."""
    def packing(step: int) -> list[int]:
        return [1500 - 100 * step, 77 + 50 * step, 700 + 50 * step]

    def step_run(step: int, capture):
        lengths = packing(step)
        x = random_inputs(lengths, heads=8, kv_heads=2, head_dim=128, seed=step)
        cu = x["cu_seqlens"].cuda()
        extra = dict(cu_seqlens=cu, host_cu_seqlens=tuple(cu.tolist()),
                     max_seqlen=max(lengths))
        layers = [{n: (x[n].cuda().bfloat16() * (1 + 0.1 * layer)).requires_grad_()
                   for n in NAMES} for layer in range(3)]
        outs = [nsa(**t, **extra, deterministic=True, capture=capture) for t in layers]
        douts = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, douts)
        return [o.detach() for o in outs], [{n: t.grad for n, t in x.items()} for x in layers]

    for step in range(3):
        torch.manual_seed(step)
        outs, grads = step_run(step, True)
        torch.manual_seed(step)
        ref_outs, ref_grads = step_run(step, False)
        for layer in range(3):
            assert torch.equal(outs[layer], ref_outs[layer]), (step, layer)
            for name in NAMES:
                assert torch.equal(grads[layer][name], ref_grads[layer][name]), (step, name)
        signature = next(reversed(captured._plans.signatures.values()))
        assert signature.shared is not None and signature.shared.backward_graph is not None
    assert sum(sig.shared is not None for sig in captured._plans.signatures.values()) <= 2
