"""When attention_forward/backward take the fallback, and what a kernel module receives when they
do not. The GPU is faked: the device check is patched and `kernels.sm90.forward/backward` are
replaced by recording stand-ins, so the dispatch rules run on CPU."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from kernels import attention_backward, attention_forward, device as kernels_device, which_backend
from kernels.fallback import attention_forward_fallback
from reference_attention import one_thread, random_block_sparse  # noqa: F401 (fixture)

from kernels.interface import attention_backward_trusted
from op_counting import OpCounter
from sparsity import BlockSparseCSR, check_csr_matches, transpose_block_sparse_csr

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(varlen=False):
    generator = torch.Generator().manual_seed(0)
    if varlen:
        shape_q, shape_kv = (10, 4, 8), (10, 2, 8)
    else:
        shape_q, shape_kv = (1, 10, 4, 8), (1, 10, 2, 8)
    return tuple(torch.randn(shape, generator=generator) for shape in (shape_q, shape_kv, shape_kv))


class FakeKernel(types.ModuleType):
    """Stands in for kernels.sm90.<direction>: records calls, answers a fixed can_run."""

    def __init__(self, name, ok=True, error=None):
        super().__init__(name)
        self.ok, self.error = ok, error
        self.can_run_calls, self.run_calls = [], []

    def can_run(self, q, k, v, **kwargs):
        self.can_run_calls.append(kwargs)
        return self.ok, "fake says no"

    def run(self, *tensors, **kwargs):
        if self.error is not None:
            raise self.error
        self.run_calls.append(kwargs)
        q = tensors[0] if len(tensors) == 3 else tensors[1]
        if len(tensors) == 3:
            return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return tuple(torch.zeros_like(t) for t in tensors[1:4])


@pytest.fixture
def fake_sm90(monkeypatch):
    """Pretend the tensors sit on an sm_90 GPU; install fake kernel modules."""
    monkeypatch.setattr(kernels_device, "_device_unsupported", lambda device: "")
    monkeypatch.delenv(kernels_device.DISABLE_ENV, raising=False)
    kernels = {direction: FakeKernel(f"kernels.sm90.{direction}")
               for direction in ("forward", "backward")}
    for direction, module in kernels.items():
        monkeypatch.setitem(sys.modules, f"kernels.sm90.{direction}", module)
    return kernels


def test_cpu_takes_the_fallback():
    q, k, v = _inputs()
    assert which_backend(q, k, v, causal=True) == "fallback (tensors on cpu)"
    assert which_backend(q, k, v, backward=True).startswith("fallback")
    out, lse = attention_forward(q, k, v, causal=True)
    expected_out, expected_lse = attention_forward_fallback(q, k, v, causal=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_kernel_receives_normalised_arguments(fake_sm90):
    q, k, v = _inputs(varlen=True)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert which_backend(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu) == "sm90"
    out, lse = attention_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                 window_size=[4, 0])
    assert (out == 0).all()  # the fake's answer, so the kernel path ran
    kwargs = fake_sm90["forward"].run_calls[-1]
    assert fake_sm90["forward"].can_run_calls[-1] == kwargs
    assert kwargs["cu_seqlens_q"] is cu and kwargs["block_sparse"] is None
    assert kwargs["max_seqlen_q"] == 7 and kwargs["max_seqlen_k"] == 7
    assert kwargs["softmax_scale"] == pytest.approx(8 ** -0.5)
    assert kwargs["window_size"] == (4, 0) and kwargs["causal"] is True
    assert kwargs["compress_factor"] == 1


def test_backward_kernel_gets_the_transposed_lists(fake_sm90):
    q, k, v = _inputs()
    generator = torch.Generator().manual_seed(1)
    block_sparse = random_block_sparse(generator, [10], [10], heads=2, q_tile=4, kv_block=2)
    out, lse = attention_forward_fallback(q, k, v, block_sparse=block_sparse)
    attention_backward(torch.randn_like(out), q, k, v, out, lse, block_sparse=block_sparse)
    kwargs = fake_sm90["backward"].run_calls[-1]
    expected = transpose_block_sparse_csr(block_sparse,
                                          col_block_offsets=torch.tensor([0, 5], dtype=torch.int32))
    assert kwargs["block_sparse"] is block_sparse
    assert isinstance(kwargs["block_sparse_transposed"], BlockSparseCSR)
    assert kwargs["block_sparse_transposed"].equals(expected)
    assert fake_sm90["backward"].can_run_calls[-1] == kwargs
    assert kwargs["max_seqlen_q"] == 10 and kwargs["cu_seqlens_q"] is None
    assert kwargs["deterministic"] is False


def _varlen_lists(cu_values=(0, 3, 3, 10)):
    """Varlen inputs over sequences of 3, 0 and 7 rows, with random lists (tiles of 2, blocks
    of 2 keys)."""
    q, k, v = _inputs(varlen=True)
    cu = torch.tensor(cu_values, dtype=torch.int32)
    lengths = [b - a for a, b in zip(cu_values, cu_values[1:])]
    block_sparse = random_block_sparse(torch.Generator().manual_seed(2), lengths, lengths,
                                       heads=2, q_tile=2, kv_block=2)
    return q, k, v, cu, block_sparse


def test_backward_kernel_gets_varlen_transposed_lists_built_without_reads(fake_sm90,
                                                                          monkeypatch):
    q, k, v, cu, block_sparse = _varlen_lists()
    out, lse = attention_forward_fallback(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          block_sparse=block_sparse)
    dout = torch.randn_like(out)
    host = (tuple(cu.tolist()),) * 2
    counter = OpCounter(monkeypatch)
    with counter:
        attention_backward_trusted(dout, q, k, v, out, lse, host_cu_seqlens=host,
                                   cu_seqlens_q=cu, cu_seqlens_k=cu, block_sparse=block_sparse)
    assert counter.reads == 0
    transposed = fake_sm90["backward"].run_calls[-1]["block_sparse_transposed"]
    # The full check: the kernel got exactly the transpose, rows = the sequences' KV blocks.
    check_csr_matches(transposed, block_sparse, num_col_blocks=6, check_contents=True)
    assert transposed.row_block_offsets.tolist() == [0, 2, 2, 6]


def test_backward_kernel_gets_the_callers_transposed_lists_and_deterministic(fake_sm90):
    q, k, v, cu, block_sparse = _varlen_lists()
    transposed = transpose_block_sparse_csr(block_sparse, cu_seqlens_k=cu)
    out, lse = attention_forward_fallback(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          block_sparse=block_sparse)
    attention_backward(torch.randn_like(out), q, k, v, out, lse, cu_seqlens_q=cu,
                       cu_seqlens_k=cu, block_sparse=block_sparse,
                       block_sparse_transposed=transposed, deterministic=True)
    kwargs = fake_sm90["backward"].run_calls[-1]
    assert kwargs["block_sparse_transposed"] is transposed  # passed on, not rebuilt
    assert kwargs["deterministic"] is True
    assert fake_sm90["backward"].can_run_calls[-1]["deterministic"] is True


def test_which_backend_passes_deterministic_to_can_run(fake_sm90):
    q, k, v = _inputs()
    assert which_backend(q, k, v, backward=True, deterministic=True) == "sm90"
    assert fake_sm90["backward"].can_run_calls[-1]["deterministic"] is True
    fake_sm90["backward"].ok = False
    assert which_backend(q, k, v, backward=True, deterministic=True) == (
        "fallback (kernels.sm90.backward: fake says no)")


def test_kernel_declining_means_fallback(fake_sm90):
    fake_sm90["forward"].ok = False
    q, k, v = _inputs()
    assert which_backend(q, k, v) == "fallback (kernels.sm90.forward: fake says no)"
    out, _ = attention_forward(q, k, v)
    assert not fake_sm90["forward"].run_calls and (out != 0).any()


def test_missing_kernel_module_means_fallback(fake_sm90, monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels.sm90.backward", None)  # import raises ImportError
    q, k, v = _inputs()
    assert which_backend(q, k, v, backward=True).startswith(
        "fallback (kernels.sm90.backward unavailable")
    out, lse = attention_forward(q, k, v)  # the fake forward
    grads = attention_backward(torch.randn_like(q), q, k, v, out, lse)
    assert all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))


def test_kernel_errors_are_not_swallowed(fake_sm90):
    fake_sm90["forward"].error = RuntimeError("kernel failed")
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="kernel failed"):
        attention_forward(q, k, v)


def test_disable_env_forces_the_fallback(fake_sm90, monkeypatch):
    monkeypatch.setenv(kernels_device.DISABLE_ENV, "1")
    q, k, v = _inputs()
    assert which_backend(q, k, v) == f"fallback ({kernels_device.DISABLE_ENV}=1)"
    attention_forward(q, k, v)
    assert not fake_sm90["forward"].can_run_calls


def test_which_backend_validates():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="^window_size"):
        which_backend(q, k, v, window_size=(-3, 0))
    with pytest.raises(ValueError, match="^block_sparse_transposed"):
        which_backend(q, k, v, block_sparse_transposed=object())
    with pytest.raises(ValueError, match="^deterministic only applies with backward=True"):
        which_backend(q, k, v, deterministic=True)
    with pytest.raises(TypeError, match="^deterministic must be a bool"):
        which_backend(q, k, v, backward=True, deterministic=None)
    with pytest.raises(TypeError, match="^block_sparse_transposed must be a sparsity"):
        which_backend(q, k, v, backward=True, block_sparse=random_block_sparse(
            torch.Generator().manual_seed(1), [10], [10], heads=2, q_tile=4, kv_block=2),
            block_sparse_transposed=object())
