"""What nsa()'s backward hands each branch's attention backward on an sm_90 GPU, checked on the
CPU: the GPU is faked (the device check patched, `kernels.sm90.backward` replaced by a recording
stand-in), so the dispatch runs here.

The sm90 backward reads each block-sparse branch's lists transposed (a sparsity.BlockSparseCSR).
nsa() builds those once per call, on its first backward, without reading the device, and passes
them to the branches' backward calls with `deterministic`; on the CPU it builds none.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import nsa.branches as branches_module
from kernels import device as kernels_device, dispatch, interface
from kernels.interface import add_into_accumulators
from kernels.fallback import attention_backward_fallback, attention_forward_fallback
from kernels.sm90.backward import gate_folded_lse
from nsa import nsa
from nsa_testing import SMALL, random_inputs
from op_counting import OpCounter
from sparsity import BlockSparseCSR
from gpu_marks import requires_sm90

LENGTHS = [40, 17, 29]
GRAD_INPUTS = ("q", "k", "v", "W_k", "W_v", "W_gate")


class RecordingBackward(types.ModuleType):
    """Stands in for kernels.sm90.backward: records every call's keyword arguments and computes
    the gradients with the fully checking fallback (which checks the transposed lists' contents
    too), or returns zeros with `compute=False` (no device reads of its own)."""

    def __init__(self):
        super().__init__("kernels.sm90.backward")
        self.calls, self.compute, self.folded_calls = [], True, 0

    def can_run(self, q, k, v, **kwargs):
        return True, "recording stand-in"

    def fuses_dq(self, q, k, **kwargs):
        return False  # it computes dq itself, as a kernel without the fused dQ does

    def run(self, dout, q, k, v, out, lse, dout_dot_out=None, dq_accumulator=None,
            dkv_accumulators=None, lse_gate=None, host_cu_seqlens_q=None,
            host_cu_seqlens_k=None, dq_sums=None,
            **kwargs):
        # dq_sums: this fake computes dq itself, as a kernel without the fused dQ does.
        self.calls.append(kwargs)
        if lse_gate is not None:  # the kernel folds the gate into lse itself
            lse = gate_folded_lse(lse, lse_gate[0][..., lse_gate[1]])
        if not self.compute:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            if dout_dot_out is not None:
                # nsa() freed the branch output, folded the gate into lse and passed
                # rowsum(dO * O) of the raw dO: recompute O, check the row dots against it. The
                # fallback with that O and the folded lse runs the kernel's arithmetic
                # (P' = exp(S - lse'), dS = P' (dO V^T - rowsum(dO * O))).
                assert out is None
                self.folded_calls += 1
                forward_kwargs = {name: value for name, value in kwargs.items()
                                  if name not in ("block_sparse_transposed", "deterministic")}
                out, _ = attention_forward_fallback(q, k, v, **forward_kwargs)
                expected = (dout.double() * out.double()).sum(-1)
                torch.testing.assert_close(dout_dot_out.double(), expected, rtol=1e-5,
                                           atol=1e-6)
            dq, dk, dv = attention_backward_fallback(dout, q, k, v, out, lse, **kwargs)
        return add_into_accumulators((dq, dk, dv), dq_accumulator, dkv_accumulators)


class DecliningForward(types.ModuleType):
    """Stands in for kernels.sm90.forward: the forward stays on the fallback."""

    def __init__(self):
        super().__init__("kernels.sm90.forward")

    def can_run(self, q, k, v, **kwargs):
        return False, "forward stays on the fallback"


class RowDotForward(types.ModuleType):
    """Stands in for kernels.sm90.forward: runs every forward on the fallback, and serves the
    row-dot requests of nsa()'s backward (rowsum(dO * out) into an (H, T) tensor, no output)
    from it, counting both kinds of call."""

    def __init__(self):
        super().__init__("kernels.sm90.forward")
        self.plain_calls, self.row_dot_calls = 0, 0

    def can_run(self, q, k, v, **kwargs):
        return True, "row-dot stand-in"

    def run(self, q, k, v, row_dot_with=None, row_dot_into=None, **kwargs):
        out, lse = attention_forward_fallback(q, k, v, **kwargs)
        if row_dot_into is None:
            self.plain_calls += 1
            return out, lse
        self.row_dot_calls += 1
        row_dot_into.copy_((row_dot_with.double() * out.double()).sum(-1).t())
        return None


@pytest.fixture
def fake_sm90(monkeypatch) -> RecordingBackward:
    monkeypatch.setattr(kernels_device, "_device_unsupported", lambda device: "")
    monkeypatch.delenv(kernels_device.DISABLE_ENV, raising=False)
    backward = RecordingBackward()
    monkeypatch.setitem(sys.modules, "kernels.sm90.forward", DecliningForward())
    monkeypatch.setitem(sys.modules, "kernels.sm90.backward", backward)
    return backward


@pytest.fixture
def transpose_builds(monkeypatch) -> list:
    """The lists nsa() transposed for the backward, one entry per build."""
    builds = []
    build = branches_module.transpose_block_sparse_trusted

    def recording(block_sparse, **kwargs):
        builds.append(block_sparse)
        return build(block_sparse, **kwargs)
    monkeypatch.setattr(branches_module, "transpose_block_sparse_trusted", recording)
    return builds


def _inputs(seed: int = 0) -> dict:
    # float32: the sm90 gated sum takes bf16/fp16 only, so the faked GPU leaves it on torch.
    inputs = random_inputs(LENGTHS, heads=4, kv_heads=2, head_dim=8, seed=seed,
                           dtype=torch.float32)
    for name in GRAD_INPUTS:
        inputs[name].requires_grad_()
    return inputs


def _options(compressed: str, **extra) -> dict:
    return dict(SMALL, num_cmp_selected_blocks=1 if compressed == "sparse" else None, **extra)


def _backward(inputs: dict, options: dict, seed: int = 1) -> list[torch.Tensor]:
    out = nsa(**inputs, **options)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    grads = [inputs[name].grad.clone() for name in GRAD_INPUTS]
    for name in GRAD_INPUTS:
        inputs[name].grad = None
    return grads


@pytest.mark.parametrize("compressed, deterministic", [("dense", False), ("sparse", True)])
def test_each_branch_gets_its_transposed_lists_built_once(compressed, deterministic, fake_sm90,
                                                          transpose_builds):
    inputs = _inputs()
    out = nsa(**inputs, **_options(compressed, deterministic=deterministic))
    assert not transpose_builds  # the forward builds none: a backward may never come
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout, retain_graph=True)

    block_sparse_branches = 2 if compressed == "sparse" else 1
    assert len(transpose_builds) == block_sparse_branches
    calls = fake_sm90.calls
    assert len(calls) == 3  # compressed, selected, window: each branch's backward on the kernel
    assert all(call["deterministic"] is deterministic for call in calls)
    transposed = [call["block_sparse_transposed"] for call in calls]
    for call, lists in zip(calls, transposed):
        # Built from the lists this call runs over (the fallback checked their contents).
        assert (lists is None) == (call["block_sparse"] is None)
        assert lists is None or isinstance(lists, BlockSparseCSR)
    assert sum(lists is not None for lists in transposed) == block_sparse_branches

    # A second backward through the retained graph reuses them.
    out.backward(dout)
    assert len(transpose_builds) == block_sparse_branches
    assert all(a is b for a, b in zip(transposed, (c["block_sparse_transposed"]
                                                   for c in calls[3:])))


@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_gradients_on_the_faked_kernel_equal_the_cpu_ones(compressed, fake_sm90, monkeypatch):
    """The stand-in computes with the fallback, so nsa()'s gradients on the "kernel" path (the
    gate folded into lse, the branch output freed, dk/dv added into nsa()'s sums) must equal
    those of the plain CPU path (g_b * dO and the branch output): the same gradients by another
    arithmetic, so to float32 rounding, not bit for bit."""
    on_kernel = _backward(_inputs(seed=2), _options(compressed, deterministic=True))
    assert fake_sm90.calls
    assert fake_sm90.folded_calls == 3  # every branch's backward had the gate folded in
    monkeypatch.setattr(kernels_device, "_device_unsupported", lambda device: "tensors on cpu")
    on_cpu = _backward(_inputs(seed=2), _options(compressed))
    for name, a, b in zip(GRAD_INPUTS, on_kernel, on_cpu):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_the_backward_takes_gate_gradients_from_the_row_dot_forward(compressed, fake_sm90,
                                                                    monkeypatch):
    """Where the forward kernel runs, each branch's recompute asks it for <dO, o_b> only (no
    plain forward in the backward: no branch output is written), and the gradients equal the
    CPU path's."""
    forward = RowDotForward()
    monkeypatch.setitem(sys.modules, "kernels.sm90.forward", forward)
    inputs = _inputs(seed=2)
    out = nsa(**inputs, **_options(compressed, deterministic=True), recompute=True)
    plain_in_forward = forward.plain_calls
    assert plain_in_forward == 3 and forward.row_dot_calls == 0
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert forward.row_dot_calls == 3 and forward.plain_calls == plain_in_forward
    assert fake_sm90.folded_calls == 3  # the recording backward checked the row dots
    on_kernel = [inputs[name].grad.clone() for name in GRAD_INPUTS]
    monkeypatch.setattr(kernels_device, "_device_unsupported", lambda device: "tensors on cpu")
    on_cpu = _backward(_inputs(seed=2), _options(compressed))
    for name, a, b in zip(GRAD_INPUTS, on_kernel, on_cpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture
def decisions(fake_sm90, monkeypatch) -> dict:
    """Counts of the trusted calls' validations and kernel choices, the forward faked with row
    dots (`RowDotForward`)."""
    monkeypatch.setitem(sys.modules, "kernels.sm90.forward", RowDotForward())
    counts = {"validations": 0, "choices": 0}

    def counting(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return call
    for name in ("validate_trusted_attention_forward", "validate_trusted_attention_backward"):
        monkeypatch.setattr(interface, name, counting("validations", getattr(interface, name)))
    monkeypatch.setattr(dispatch, "attention_kernel",
                        counting("choices", dispatch.attention_kernel))
    return counts


def test_the_backward_checks_and_dispatches_each_branch_once(fake_sm90, decisions):
    """Per branch, the backward validates the call once and chooses its two kernels once
    (`kernels.interface.plan_backward_trusted`), then asks the row dots and the gradients of
    the kernels it chose (before: three validations and four kernel choices per branch)."""
    counts = decisions
    inputs = _inputs(seed=2)
    out = nsa(**inputs, **_options("sparse", deterministic=True))
    forward_counts = dict(counts)
    assert forward_counts == {"validations": 3, "choices": 3}  # one per branch's forward
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert counts["validations"] - forward_counts["validations"] == 3
    assert counts["choices"] - forward_counts["choices"] == 6  # backward + row-dot forward
    assert len(fake_sm90.calls) == 3 and fake_sm90.folded_calls == 3


def test_a_repeated_step_reuses_the_checks_and_choices_a_new_packing_makes_afresh(
        fake_sm90, decisions, monkeypatch):
    """kernels/call_cache.py: a second step with the same shapes, options and packing validates
    and dispatches nothing (nsa()'s six trusted calls reuse their decisions), with the same
    gradients; other document lengths, or the kernels switched off, are new signatures."""
    counts = decisions
    options = _options("sparse", deterministic=True)
    first = _backward(_inputs(seed=2), options)
    after_first = dict(counts)
    assert after_first["validations"] > 0 and after_first["choices"] > 0
    second = _backward(_inputs(seed=2), options)
    assert counts == after_first
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    other = random_inputs([33, 24, 29], heads=4, kv_heads=2, head_dim=8, seed=3,
                          dtype=torch.float32)
    for name in GRAD_INPUTS:
        other[name].requires_grad_()
    _backward(other, options)
    assert counts["validations"] > after_first["validations"]
    before_off = dict(counts)
    monkeypatch.setenv(kernels_device.DISABLE_ENV, "1")
    calls_before = len(fake_sm90.calls)
    _backward(_inputs(seed=2), options)
    assert counts["validations"] > before_off["validations"]
    assert len(fake_sm90.calls) == calls_before  # switched off: nothing reached the kernel


def test_a_planned_backward_checks_its_per_call_arguments(fake_sm90):
    """`KernelBackward.backward` skips the validation done when planning, not the checks of
    what each call brings: dout and lse against the planned q, dout_dot_out required, the
    internal arguments by name, all before the kernel runs."""
    q = torch.randn(20, 4, 8)
    k, v = torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    plan = interface.plan_backward_trusted(q, k, v, host_cu_seqlens=((0, 12, 20), (0, 12, 20)),
                                           cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12,
                                           max_seqlen_k=12, causal=True)
    assert plan is not None
    dout, lse, dots = torch.randn(20, 4, 8), torch.randn(4, 20), torch.randn(20, 4)
    for call, message in (
            (lambda: plan.backward(dout, lse, dout_dot_out=None), "dout_dot_out: required"),
            (lambda: plan.backward(dout[:19], lse, dout_dot_out=dots), "dout must have"),
            (lambda: plan.backward(dout, lse[:, :19], dout_dot_out=dots), "lse must have"),
            (lambda: plan.backward(dout, lse, dout_dot_out=dots[:, :1]), "dout_dot_out: expected"),
            (lambda: plan.backward(dout, lse, dout_dot_out=dots, lse_gate=(dots, 0)),
             "lse_gate: gates expected")):
        with pytest.raises(ValueError, match=message):
            call()
    gates = torch.rand(20, 4, 3)
    for lse_gate, message in ((gates, "lse_gate: expected a \\(gates, branch index\\) pair"),
                              ((gates[..., 0], 0), "lse_gate: gates expected"),
                              ((gates.int(), 0), "lse_gate: gates expected"),
                              ((gates, 3), "lse_gate: branch index must be"),
                              ((gates, True), "lse_gate: branch index must be")):
        with pytest.raises(ValueError, match=message):
            plan.backward(dout, lse, dout_dot_out=dots, lse_gate=lse_gate)
    assert not fake_sm90.calls  # refused before the kernel
    # A branch refuses to run a plan on tensors other than those it was made for.
    branch = branches_module.Branch(branches_module.SELECTED, dict(
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12, causal=True),
        ((0, 12, 20), (0, 12, 20)))
    with pytest.raises(ValueError, match="plan: made for other q, k, v"):
        branch.backward(dout, q.clone(), k, v, None, lse, dout_dot_out=dots, plan=plan)
    with pytest.raises(ValueError, match="plan: made for other q, k, v"):
        branch.output_row_dots(dout, q, k.clone(), v, torch.empty(4, 20), plan=plan)
    # The row dots in place of the output are the plan's alone.
    with pytest.raises(ValueError, match="only a planned backward takes them"):
        branch.backward(dout, q, k, v, None, lse, dout_dot_out=dots)


@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_building_the_transposed_lists_reads_nothing(compressed, fake_sm90, transpose_builds,
                                                     monkeypatch):
    fake_sm90.compute = False
    inputs = _inputs(seed=3)
    out = nsa(**inputs, **_options(compressed))
    counter = OpCounter(monkeypatch)
    with counter:
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
    assert transpose_builds and counter.reads == 0


def test_the_cpu_builds_no_transposed_lists(transpose_builds):
    _backward(_inputs(seed=5), _options("sparse", deterministic=True))
    assert not transpose_builds


@pytest.mark.gpu
@requires_sm90
def test_transposed_lists_are_built_on_the_gpu_without_synchronising():
    """On sm_90 nsa() builds the lists' transposes (selected and sparse compressed) in its
    backward: no device read, and no host copy either (a host list copied to the GPU waits for
    the stream as a read would). Checks the build alone: the kernels' own tests run the
    backward."""
    from sparsity import check_csr_matches

    x = random_inputs([3000, 700, 1300], heads=4, kv_heads=2, head_dim=128, seed=6,
                      dtype=torch.bfloat16)
    x = {name: t.cuda() for name, t in x.items()}
    x["q"].requires_grad_()
    out = nsa(**x, num_cmp_selected_blocks=2)
    branches = out.grad_fn.branches  # the NSAFunction's ctx
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        transposed = [branch.transposed_lists() for branch in branches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(lists is not None for lists in transposed) == 2
    for branch, lists in zip(branches, transposed):
        block_sparse = branch.kernel_kwargs.get("block_sparse")
        assert (lists is None) == (block_sparse is None)
        if lists is not None:
            num_kv_blocks = int(lists.row_block_offsets[-1])
            check_csr_matches(lists, block_sparse, num_col_blocks=num_kv_blocks,
                              check_contents=True)


def test_backward_order_puts_the_selected_branch_last_only_when_asked():
    """nsa()'s backward runs the branches as built, or with the selected branch last (its dQ
    kernel then takes the fused branches' dQ sums: nsa.function.backward_order)."""
    from types import SimpleNamespace

    from nsa.branches import COMPRESSED, SELECTED, WINDOW
    from nsa.function import backward_order

    branches = [SimpleNamespace(index=i) for i in (COMPRESSED, SELECTED, WINDOW)]
    assert backward_order(branches, selected_last=False) == [0, 1, 2]
    assert backward_order(branches, selected_last=True) == [0, 2, 1]
    assert backward_order(branches[:2], selected_last=True) == [0, 1]
    assert backward_order(branches[1:], selected_last=True) == [1, 0]
