"""nsa() captured in a CUDA graph, forward and forward+backward, replayed on new values.

With the sequence bounds on the host (`host_cu_seqlens` for packed inputs; a padded batch needs
nothing) nsa() reads the device nowhere in the default configuration (counted on the CPU in
test_nsa_host_reads.py), which is what capture needs. Here, on an sm_90 GPU: warm up (the
kernels compile on their first call, outside the capture), capture one forward+backward into
static tensors, copy new inputs into them, replay, and compare with eager nsa() on the same new
inputs, bit for bit (same kernels, same order; deterministic=True makes the dQ sums ordered).

    python -m pytest -q tests/nsa/test_nsa_cuda_graph.py     # on an sm_90 GPU
"""
import pytest
import torch

from nsa import nsa
from nsa_testing import gpu_inputs
from sparsity import host_cache
from gpu_marks import requires_sm90

pytestmark = pytest.mark.gpu


def _step(tensors, extra, dout):
    """One forward+backward; the gradients land in .grad (zeroed first, as a training step)."""
    for t in tensors.values():
        t.grad = None
    out = nsa(**tensors, **extra, deterministic=True)
    out.backward(dout)
    return out


def _captured_step(tensors, extra, dout):
    """One forward+backward captured after torch's recipe (two warm-up steps on a side
    stream): (the graph, its static output, its static gradients)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(tensors, extra, dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in tensors.values():
        t.grad = None
    with torch.cuda.graph(graph):
        static_out = nsa(**tensors, **extra, deterministic=True)
        static_out.backward(dout)
    return graph, static_out, {n: t.grad for n, t in tensors.items()}


def _assert_replay_equals_eager(captured, tensors, extra, dout, seed: int):
    """New values copied into the captured step's inputs, the graph replayed: its output and
    gradients equal eager nsa() on those values, bit for bit."""
    graph, static_out, static_grads = captured
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for t in (*tensors.values(), dout):
            t.copy_(torch.randn(t.shape, generator=generator, device="cuda", dtype=t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    eager = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    eager_out = _step(eager, extra, dout)
    assert torch.equal(static_out, eager_out)
    for name, grad in static_grads.items():
        assert torch.equal(grad, eager[name].grad), name


@requires_sm90
@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_captured_forward_backward_replays_new_inputs_like_eager(layout):
    tensors, extra = gpu_inputs(("q", "k", "v", "W_gate"), layout, seed=11)
    dout = torch.randn_like(tensors["q"])
    host_cache.clear()  # the recipe's warm-up is the first call of this packing
    captured = _captured_step(tensors, extra, dout)
    assert host_cache._entries  # the side stream's misses were stored (built on the default)
    # The capture read the warm-up's layouts instead of building them into its graph.
    assert host_cache._captured_entries
    _assert_replay_equals_eager(captured, tensors, extra, dout, seed=3)


@requires_sm90
def test_a_step_captured_after_eager_steps_on_the_default_stream():
    """Eager steps of the same leaves on the default stream first, with nsa()'s captured plans
    (the default at this size: the second and third calls run from a plan), then torch's
    recipe and capture: the capture must not meet gradient accumulators that a plan kept from
    a default-stream step (it raised cudaErrorStreamCaptureImplicit while the plans' input
    copies were recorded by autograd), and its replay equals eager nsa()."""
    from nsa import release_captured_plans

    release_captured_plans()
    tensors, extra = gpu_inputs(("q", "k", "v", "W_gate"), "varlen", seed=13)
    dout = torch.randn_like(tensors["q"])
    for _ in range(3):  # eager, the plan's capture, its replay: all on the default stream
        _step(tensors, extra, dout)
    _assert_replay_equals_eager(_captured_step(tensors, extra, dout), tensors, extra, dout,
                                seed=4)
    release_captured_plans()
