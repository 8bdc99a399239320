"""The forward's selection chain beside the window and the backward's list transposes beside its
gate pass (nsa/streams.py): when they apply and in what order (CPU), and on an sm_90 GPU that
nsa() with them equals nsa() without them bit for bit (the same kernels on the same data;
deterministic=True orders the backward's sums), from the default stream, under a user's
CUDA-graph capture and from a user's own stream (where they do not apply)."""
from __future__ import annotations

import pytest
import torch

import nsa.function as function
import nsa.streams as streams
from nsa import nsa
from gpu_marks import requires_sm90
from nsa_testing import random_cuda_inputs, random_inputs

# Documents shorter than the window, inside a tile, and longer than the selection's cover.
LENGTHS = [2100, 77, 700, 300, 1500]


def test_the_side_stream_applies_only_to_cuda_calls_with_the_window_launched_first():
    q = random_inputs([40], 4, 2, 16, seed=0)["q"]
    assert not streams.beside_applies(q, 40, True, True)  # CPU
    assert not streams.beside_applies(q, 40, False, True)
    assert not streams.beside_applies(q, 40, True, False)


def test_the_side_stream_applies_up_to_its_sizes(monkeypatch):
    """Up to MAX_ROW_HEADS query rows x heads and documents of MAX_DOCUMENT_TOKENS (a CUDA
    call on the default stream, faked: only its shape and device are read)."""
    from types import SimpleNamespace

    monkeypatch.setattr(streams, "on_default_stream", lambda q: True)

    def call(rows: int, heads: int):
        return SimpleNamespace(is_cuda=True, shape=(rows, heads, 128), numel=lambda: 1)
    longest = streams.MAX_DOCUMENT_TOKENS
    assert streams.beside_applies(call(streams.MAX_ROW_HEADS // 32, 32), longest, True, True)
    assert not streams.beside_applies(call(streams.MAX_ROW_HEADS // 32 + 1, 32), 8192, True,
                                      True)
    assert not streams.beside_applies(call(longest + 1, 32), longest + 1, True, True)


def test_the_covered_rows_are_looked_up_before_the_fork(monkeypatch):
    """The side stream waits only for what the current stream queued before `Beside` marked
    the fork, and its lists read the covered rows, which a packing's first call builds on the
    current stream: `packed_forward` must look them up before the mark (the window's launch
    alone goes between the mark and the side stream's work)."""
    order = []
    window_covered, beside = function.window_covered, function.Beside

    def covered(*args, **kwargs):
        order.append("covered rows")
        return window_covered(*args, **kwargs)

    class Marked(beside):
        def __init__(self, *args, **kwargs):
            order.append("fork")
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(function, "window_covered", covered)
    monkeypatch.setattr(function, "Beside", Marked)
    x = random_inputs([300, 40], 4, 2, 16, seed=1, weights=False)
    nsa(x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"], window_size=32,
        compress_block_size=16, selected_block_size=16, num_selected_blocks=4, _q_tile=16,
        _cmp_kv_block=16)
    assert order[:2] == ["covered rows", "fork"], order


def test_the_backward_builds_the_transposes_beside_and_joins_before_the_branches(monkeypatch):
    """The backward's side stream builds the lists' transposes while the current stream runs
    the gate pass, and the current stream waits for it (the exit of `with Beside`) before the
    first branch's backward, whose kernels read them (the CPU runs the same calls, the
    streams' operations no-ops)."""
    from nsa.branches import Branch

    order = []

    class Marked(function.Beside):
        def side(self):
            order.append("side")
            return super().side()

        def __exit__(self, *exc):
            order.append("join")
            return super().__exit__(*exc)
    transposed_lists, gate_pass = function.transposed_lists, function.branches_gate_gradients
    backward = Branch.backward
    monkeypatch.setattr(function, "Beside", Marked)
    monkeypatch.setattr(function, "transposed_lists",
                        lambda branches: order.append("transposes") or transposed_lists(branches))
    monkeypatch.setattr(function, "branches_gate_gradients",
                        lambda *a: order.append("gate pass") or gate_pass(*a))
    monkeypatch.setattr(Branch, "backward",
                        lambda self, *a, **k: order.append("branch") or backward(self, *a, **k))
    x = random_inputs([300, 40], 4, 2, 16, seed=2, weights=False)
    q = x["q"].requires_grad_()
    out = nsa(q, x["k"], x["v"], cu_seqlens=x["cu_seqlens"], window_size=32,
              compress_block_size=16, selected_block_size=16, num_selected_blocks=4, _q_tile=16,
              _cmp_kv_block=16, recompute=False)
    order.clear()
    out.sum().backward()
    assert order[:5] == ["side", "transposes", "gate pass", "join", "branch"], order


def test_off_the_side_stream_beside_queues_nothing_elsewhere():
    """`Beside(..., False)`: side() is a no-op and nothing is forked (the CPU path)."""
    q = torch.zeros(4, 2, 8)
    with streams.Beside(q, False) as beside:
        with beside.side():
            assert not beside.on


def _call(x: dict, dout: torch.Tensor, **kwargs) -> tuple:
    inputs = {n: (t.detach().bfloat16().requires_grad_()
                  if n in ("q", "k", "v", "W_gate") else t) for n, t in x.items()
              if n not in ("W_k", "W_v")}
    out = nsa(**inputs, deterministic=True, capture=False, **kwargs)
    out.backward(dout)
    return out.detach(), {n: inputs[n].grad for n in ("q", "k", "v", "W_gate")}


def _on_and_off(monkeypatch, x, dout, cold: bool = False, **kwargs
                ) -> tuple[tuple, tuple, list]:
    """(nsa() with the side stream, without it, whether each call's forward used it); cold:
    each call as a packing's first (nothing in sparsity/host_cache.py), its small
    allocations on memory filled with -1 (NaN as float32, an index out of range), so a read
    before a write shows."""
    from sparsity import host_cache

    used = []
    beside_applies = streams.beside_applies
    monkeypatch.setattr(function, "beside_applies",
                        lambda *a: used.append(beside_applies(*a)) or used[-1])
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(function, "SELECTION_STREAM", on)
        if cold:
            torch.cuda.synchronize()
            host_cache.clear()
            torch.cuda.empty_cache()
            poison = [torch.full((1 << 18,), -1, dtype=torch.int32, device="cuda")
                      for _ in range(32)]  # 1 MiB blocks: the allocator's small pool
            torch.cuda.synchronize()
            poison.clear()  # freed: the call's small allocations land on them
        runs[on] = _call(x, dout, **kwargs)
    torch.cuda.synchronize()
    return runs[True], runs[False], used


def _assert_equal(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0])
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("lengths", [LENGTHS, [4096]], ids=["packed", "single"])
def test_the_forward_beside_the_window_equals_one_stream(monkeypatch, lengths):
    x = random_cuda_inputs(lengths, 16, 4, 128, seed=5)
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(6)).cuda().bfloat16()
    on, off, used = _on_and_off(monkeypatch, x, dout)
    assert used == [True, True, False, False]  # forward, backward; each on, then off
    _assert_equal(on, off)


@pytest.mark.gpu
@requires_sm90
def test_a_first_call_beside_a_slow_window_equals_one_stream(monkeypatch):
    """A packing's first call, whose layouts (the covered rows among them) are built by the
    call itself, with the current stream held up ~50 ms after the window's launch: the side
    stream starts before the window, so it must read nothing the current stream queues after
    the fork (a covered-rows build queued after the window's launch was read unbuilt)."""
    from nsa.branches import WINDOW, Branch

    forward = Branch.forward

    def slow_window(self, q, k, v):
        result = forward(self, q, k, v)
        if self.index == WINDOW:
            torch.cuda._sleep(100_000_000)  # on the current stream, behind the window
        return result
    monkeypatch.setattr(Branch, "forward", slow_window)
    x = random_cuda_inputs(LENGTHS, 16, 4, 128, seed=11)
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(12)).cuda().bfloat16()
    on, off, used = _on_and_off(monkeypatch, x, dout, cold=True)
    assert used == [True, True, False, False]
    _assert_equal(on, off)


@pytest.mark.gpu
@requires_sm90
def test_the_backward_waits_for_a_slow_side_stream_s_transposes(monkeypatch):
    """A packing's first call whose transposes start ~50 ms late on the side stream (their
    memory poisoned): the branches' backward must wait for them, and equals one stream's."""
    transposed_lists = function.transposed_lists

    def late(branches):
        torch.cuda._sleep(100_000_000)  # on the stream that builds them
        return transposed_lists(branches)
    monkeypatch.setattr(function, "transposed_lists", late)
    x = random_cuda_inputs(LENGTHS, 16, 4, 128, seed=13)
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(14)).cuda().bfloat16()
    on, off, used = _on_and_off(monkeypatch, x, dout, cold=True, recompute=False)
    assert used == [True, True, False, False]
    _assert_equal(on, off)


@pytest.mark.gpu
@requires_sm90
def test_the_forward_beside_the_window_from_a_users_stream_stays_on_it(monkeypatch):
    """From a stream of the caller's (not capturing) the chain stays on that stream
    (nsa/streams.py's rule); the result is the default stream's."""
    x = random_cuda_inputs(LENGTHS, 16, 4, 128, seed=7)
    dout = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(8)).cuda().bfloat16()
    on_default, _, _ = _on_and_off(monkeypatch, x, dout)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    used = []
    beside_applies = streams.beside_applies
    monkeypatch.setattr(function, "SELECTION_STREAM", True)
    monkeypatch.setattr(function, "beside_applies",
                        lambda *a: used.append(beside_applies(*a)) or used[-1])
    with torch.cuda.stream(user):
        on_user = _call(x, dout)
    torch.cuda.current_stream().wait_stream(user)
    torch.cuda.synchronize()
    assert used == [False, False]
    _assert_equal(on_user, on_default)


@pytest.mark.gpu
@requires_sm90
def test_a_captured_forward_beside_the_window_replays_like_eager(monkeypatch):
    """A user's capture of a forward: the side stream joins the capture and rejoins before
    it ends; the replay on new values equals an eager call on them."""
    monkeypatch.setattr(function, "SELECTION_STREAM", True)
    x = random_cuda_inputs(LENGTHS, 16, 4, 128, seed=9)
    q, k, v = (x[n].bfloat16() for n in ("q", "k", "v"))
    kwargs = dict(cu_seqlens=x["cu_seqlens"], host_cu_seqlens=tuple(x["cu_seqlens"].tolist()),
                  max_seqlen=max(LENGTHS), capture=False)
    with torch.no_grad():
        nsa(q, k, v, **kwargs)  # compiles the kernels, fills the caches
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = nsa(q, k, v, **kwargs)
        generator = torch.Generator(device="cuda").manual_seed(3)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=generator, device="cuda", dtype=t.dtype))
        graph.replay()
        eager = nsa(q.clone(), k.clone(), v.clone(), **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


def test_persistent_grids_leave_sms_to_the_side_stream_only_inside_the_block(monkeypatch):
    import kernels.device as device

    monkeypatch.setattr(device, "sm_count", lambda d: 132)
    cuda = torch.device("cuda", 0)
    assert device.persistent_grid_sms(cuda) == 132
    with device.sms_left_to_other_streams(16):
        assert device.persistent_grid_sms(cuda) == 116
        with device.sms_left_to_other_streams(500):
            assert device.persistent_grid_sms(cuda) == 1  # never an empty grid
        assert device.persistent_grid_sms(cuda) == 116
    assert device.persistent_grid_sms(cuda) == 132
