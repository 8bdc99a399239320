"""The torch entry points: validate, then run the CuTe DSL kernel where it applies, else the
torch fallback. Both compute the function of docs/interfaces.md.

``kernels.dispatch`` decides which path a call takes (and why), here and in ``which_backend``:
the kernel when the tensors are on an sm_90 GPU, ``NSA_CUTE_DISABLE`` is not set to 1,
``kernels.sm90.<direction>`` imports, the shapes fit the kernels' 32-bit index arithmetic
(``kernels.sm90.limits.int32_limits_reason``) and its ``can_run(q, k, v, **kwargs)`` says yes.
Tensors on the meta device are refused by name (they have no values to compute on). The
kernel modules receive the keyword arguments already validated and normalised (scale resolved,
``max_seqlen_*`` filled in, ``window_size`` a tuple of ints).

The backward takes ``deterministic`` (default False, the fast mode): with True the gradients
are bit-identical from run to run (a kernel sums its partial dQ in a fixed order rather than by
atomic adds, and says no in ``can_run`` where it cannot; the fallback sorts its one scatter on
CUDA, see ``kernels.fallback``).

``attention_forward_trusted`` / ``attention_backward_trusted`` are the internal twins of the
public functions for callers that already checked the sequence boundaries and hold them on the
host (nsa's branches): the same checks without device reads (see ``kernels.validate``). They are
not exported; user input always goes through the public, fully checking functions.
"""
from __future__ import annotations

import sys

import torch

from . import call_cache, dispatch, fallback, masked
from .device import kernels_unavailable
from .dkv_sums import write_into
from .dispatch import normalised_kwargs
from .dispatch import transpose_block_sparse_trusted  # noqa: F401  (nsa's branches take it here)
from .validate import (AttentionProblem, check_backward_tensors, check_block_sparse_transposed,
                       check_deterministic, check_not_meta, validate_attention_backward,
                       validate_attention_forward, validate_trusted_attention_backward,
                       validate_trusted_attention_forward)

FALLBACK = "fallback"
SM90 = "sm90"


def attention_forward(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1), block_sparse=None,
    q_start_positions=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: ``(out, lse)``; not differentiable (see ``flash_attn_func``).

    Padded ``q (B, Nq, H, D)``, ``k, v (B, Nk, Hkv, D)`` give ``out (B, Nq, H, D)``,
    ``lse (B, H, Nq)``; packed varlen ``q (Tq, H, D)`` with ``cu_seqlens_*`` gives
    ``out (Tq, H, D)``, ``lse (H, Tq)``. lse is float32 (float64 for float64 inputs).
    ``q_start_positions`` (packed varlen; host ints, one per sequence): the position of each
    sequence's first query row among its keys' tokens, for the causal, window and compressed
    rules (the queries are the rows from that position on; default 0), on the sm90 kernels
    as on the fallback.
    """
    check_not_meta("q", q)  # k, v and the rest must be on q's device (validation says so)
    problem = validate_attention_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        compress_factor=compress_factor, window_size=window_size, block_sparse=block_sparse,
        q_start_positions=q_start_positions,
    )
    return _run_forward(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, block_sparse)


def attention_backward(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, deterministic=False, q_start_positions=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: ``(dq, dk, dv)``, dk and dv summed over each KV group.

    ``out`` and ``lse`` are the forward's. ``block_sparse_transposed`` (the kernels' layout for
    the backward: a ``sparsity.BlockSparseCSR`` from ``sparsity.transpose_block_sparse_csr`` of
    ``block_sparse``) is built when a kernel needs it and it is not given; pass it to build it
    once for several backward calls over the same lists. ``deterministic=True`` asks for
    gradients that are bit-identical from run to run, at some cost in speed.
    """
    check_not_meta("q", q)
    problem = validate_attention_backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, compress_factor=compress_factor, window_size=window_size,
        block_sparse=block_sparse, block_sparse_transposed=block_sparse_transposed,
        deterministic=deterministic, q_start_positions=q_start_positions,
    )
    return _run_backward(problem, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                         block_sparse, block_sparse_transposed, deterministic)


def masked_attention_forward(q, k, v, *, attn_mask=None, attn_bias=None, softmax_scale=None,
                             causal=False, window_size=(-1, -1), compress_factor=1
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward`` of padded inputs with a user mask and/or an additive bias
    (``kernels.masked`` states the function and the broadcast rules): ``(out, lse)``."""
    out, lse, _ = masked_attention_forward_with_tiles(
        q, k, v, attn_mask=attn_mask, attn_bias=attn_bias, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, compress_factor=compress_factor)
    return out, lse


def masked_attention_forward_with_tiles(q, k, v, *, attn_mask=None, attn_bias=None,
                                        softmax_scale=None, causal=False, window_size=(-1, -1),
                                        compress_factor=1, bias_gradient=False):
    """``masked_attention_forward`` and what the sm90 kernel's backward reuses of it
    (``kernels.masked.ForwardTiles``: the tile lists it ran on and, with ``bias_gradient``
    where the bias's float32 gradient sums need them, the tiles they visit, counted; None on
    the torch path): ``(out, lse, tiles)``; ``masked_attention_backward(forward_tiles=tiles)``
    then builds none of them again (the autograd function passes them)."""
    problem = _validate_masked(q, k, v, attn_mask, attn_bias, softmax_scale, causal,
                               window_size, compress_factor)
    on_kernel = masked.sm90_forward(problem, q, k, v, attn_mask, attn_bias, bias_gradient)
    if on_kernel is not None:
        return on_kernel
    return (*masked.forward(problem, q, k, v, masked.mask_tensor(attn_mask), attn_bias), None)


def masked_attention_backward(dout, q, k, v, out, lse, *, attn_mask=None, attn_bias=None,
                              softmax_scale=None, causal=False, window_size=(-1, -1),
                              compress_factor=1, bias_gradient=False, deterministic=False,
                              forward_tiles=None):
    """The backward of ``masked_attention_forward``: ``(dq, dk, dv, dbias)``, dbias (the bias's
    shape and dtype, summed over its broadcast dims) with ``bias_gradient``, else None. On the
    sm90 kernel where it takes the call, its float32 sums in a run-dependent order; with
    ``deterministic=True`` (or off the kernel) on the torch path, whose sums run in a fixed
    order: bit-identical from run to run. ``forward_tiles``: the forward's tiles of this call
    (``masked_attention_forward_with_tiles``), reused instead of built again."""
    problem = _validate_masked(q, k, v, attn_mask, attn_bias, softmax_scale, causal,
                               window_size, compress_factor)
    if bias_gradient and attn_bias is None:
        raise ValueError("bias_gradient: there is no attn_bias to take a gradient of")
    check_backward_tensors(problem, q, dout, out, lse)
    if not check_deterministic(deterministic):
        on_kernel = masked.sm90_backward(problem, dout, q, k, v, out, lse, attn_mask,
                                         attn_bias, bias_gradient, forward_tiles)
        if on_kernel is not None:
            return on_kernel
    return masked.backward(problem, dout, q, k, v, out, lse, masked.mask_tensor(attn_mask),
                           attn_bias, bias_gradient)


def _validate_masked(q, k, v, attn_mask, attn_bias, softmax_scale, causal, window_size,
                     compress_factor) -> AttentionProblem:
    check_not_meta("q", q)
    problem = validate_attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size,
                                         compress_factor=compress_factor)
    masked.check_mask_and_bias(q, k, attn_mask, attn_bias)
    return problem


def attention_forward_trusted(q, k, v, *, host_cu_seqlens, **kwargs):
    """``attention_forward`` without device reads, for internal callers (nsa's branches).

    ``host_cu_seqlens = (cu_q, cu_k)`` are the caller's host copies of the already checked
    ``cu_seqlens_q/k`` values; ``block_sparse`` must come from ``sparsity``'s builders. Every
    other check runs as in ``attention_forward`` (see ``validate_trusted_attention_forward``),
    once per call signature: a call like an earlier one reuses its checks and kernel choice
    (``kernels.call_cache``).
    """
    signature = _trusted_signature("forward", (q, k, v), host_cu_seqlens, kwargs)
    call = None
    decision = call_cache.lookup(signature)
    if decision is None:
        problem = validate_trusted_attention_forward(q, k, v, host_cu_seqlens=host_cu_seqlens,
                                                     **kwargs)
        call = normalised_kwargs(problem, kwargs.get("cu_seqlens_q"),
                                 kwargs.get("cu_seqlens_k"), kwargs.get("block_sparse"))
        decision = (problem, dispatch.attention_kernel("forward", q, k, v, call)[0])
        call_cache.store(signature, decision)
    problem, kernel = decision
    if call is None:
        call = normalised_kwargs(problem, kwargs.get("cu_seqlens_q"),
                                 kwargs.get("cu_seqlens_k"), kwargs.get("block_sparse"))
    return _forward_on(kernel, problem, q, k, v, call)


def _trusted_signature(kind: str, tensors: tuple, host_cu_seqlens, kwargs: dict) -> tuple:
    """``call_cache.call_signature`` plus what the kernel choice asks besides the arguments:
    the device's answer (``NSA_CUTE_DISABLE``, the GPU) and the kernel modules in use (tests
    swap them), so a changed answer is a new signature."""
    device = tensors[0].device
    modules = (id(sys.modules.get("kernels.sm90.forward")),
               id(sys.modules.get("kernels.sm90.backward")))
    return (call_cache.call_signature(kind, tensors, host_cu_seqlens, kwargs),
            kernels_unavailable(device), modules)


def attention_backward_trusted(dout, q, k, v, out, lse, *, host_cu_seqlens,
                               dq_accumulator=None, dkv_accumulators=None, **kwargs):
    """``attention_backward`` without device reads; trusts what ``attention_forward_trusted``
    trusts, and that ``block_sparse_transposed`` (when given) is the transpose of
    ``block_sparse``.

    The backward from the gate's row dots instead of the output (``dout_dot_out`` and
    ``lse_gate``, which nsa()'s branches use on the sm90 kernels) is the plan's:
    ``plan_backward_trusted(...).backward``, the one route that takes them.

    ``dq_accumulator``: a tensor of q's shape and dtype into which dq is added instead of
    returned fresh (the returned dq is then this tensor); the sm90 dQ kernel adds as it writes
    (in float32, rounded once) where it can write the tensor's strides. nsa() sums its
    branches' dq so.

    ``dkv_accumulators``: ``(dk_sum, dv_sum)``, tensors of k's and v's shape in float32
    (float64 for float64 inputs), into which dk and dv are added instead of returned fresh;
    the returned dk, dv are then these tensors. Where the sm90 kernel sums dK/dV partials in
    float32 it adds into them directly (no buffer of its own, no conversion). As
    ``kernels.dkv_sums.UnwrittenDkvSums`` they hold nothing yet: dk and dv are written into
    them (no zeroing before the call)."""
    _check_internal_arguments(q, k, v, None, None, dq_accumulator, dkv_accumulators)
    problem = validate_trusted_attention_backward(dout, q, k, v, out, lse,
                                                  host_cu_seqlens=host_cu_seqlens, **kwargs)
    return _run_backward(problem, dout, q, k, v, out, lse, kwargs.get("cu_seqlens_q"),
                         kwargs.get("cu_seqlens_k"), kwargs.get("block_sparse"),
                         kwargs.get("block_sparse_transposed"),
                         kwargs.get("deterministic", False), dq_accumulator, dkv_accumulators)


def _check_internal_arguments(q, k, v, dout_dot_out, lse_gate, dq_accumulator,
                              dkv_accumulators) -> None:
    """The internal backward arguments, by name, before any launch: the accumulators
    (``attention_backward_trusted``'s docstring) and the planned backward's ``dout_dot_out``,
    rowsum(dout * out) as (Tq, H) floating, with its ``lse_gate`` ``(gates, b)``: gates a
    floating tensor of shape ``q.shape[:-1] + (B,)``, the output having been
    ``gates[..., b] * out``, the gate the kernel folds into lse
    (``kernels.sm90.backward.gate_folded_lse``)."""
    if dq_accumulator is not None and (
            dq_accumulator.shape != q.shape or dq_accumulator.dtype != q.dtype
            or dq_accumulator.device != q.device):
        raise ValueError(f"dq_accumulator: expected a {tuple(q.shape)} {q.dtype} "
                         f"tensor on {q.device}, got {tuple(dq_accumulator.shape)} "
                         f"{dq_accumulator.dtype} on {dq_accumulator.device}")
    if dkv_accumulators is not None:
        accumulate = torch.promote_types(k.dtype, torch.float32)
        for name, acc, like in (("dk", dkv_accumulators[0], k), ("dv", dkv_accumulators[1], v)):
            if (acc.shape != like.shape or acc.dtype != accumulate or acc.device != like.device
                    or not acc.is_contiguous()):
                raise ValueError(f"dkv_accumulators: {name} expected a contiguous "
                                 f"{tuple(like.shape)} {accumulate} tensor on {like.device}, "
                                 f"got {tuple(acc.shape)} {acc.dtype} on {acc.device}")
    if dout_dot_out is not None:
        expected = tuple(q.shape[:-1])
        if (tuple(dout_dot_out.shape) != expected or not dout_dot_out.is_floating_point()
                or dout_dot_out.device != q.device):
            raise ValueError(f"dout_dot_out: expected a floating tensor of shape {expected} on "
                             f"{q.device}, got {tuple(dout_dot_out.shape)} "
                             f"{dout_dot_out.dtype} on {dout_dot_out.device}")
    if lse_gate is not None:
        _check_lse_gate(lse_gate, q)


def _check_lse_gate(lse_gate, q) -> None:
    """``lse_gate`` of the planned backward: ``(gates, b)``, before any launch (the plan has
    already required ``dout_dot_out``, which the gate goes with)."""
    if not isinstance(lse_gate, (tuple, list)) or len(lse_gate) != 2:
        raise ValueError(f"lse_gate: expected a (gates, branch index) pair, "
                         f"got {type(lse_gate).__name__}")
    gates, index = lse_gate
    rows = tuple(q.shape[:-1])
    if (not isinstance(gates, torch.Tensor) or gates.dim() != len(rows) + 1
            or tuple(gates.shape[:-1]) != rows or not gates.is_floating_point()
            or gates.device != q.device):
        got = (f"{tuple(gates.shape)} {gates.dtype} on {gates.device}"
               if isinstance(gates, torch.Tensor) else type(gates).__name__)
        raise ValueError(f"lse_gate: gates expected a floating tensor of shape {rows} + (B,) on "
                         f"{q.device}, got {got}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < gates.shape[-1]:
        raise ValueError(f"lse_gate: branch index must be an int in [0, {gates.shape[-1]}), "
                         f"got {index!r}")


def plan_backward_trusted(q, k, v, *, host_cu_seqlens, block_sparse_transposed=None,
                          deterministic=False, **kwargs) -> "KernelBackward | None":
    """The sm90 backward of one attention call, checked and dispatched once, for a caller that
    then asks its row dots and its gradients (nsa()'s backward, per branch): a
    ``KernelBackward``, or None where the backward kernel does not run (the caller then takes
    the ``attention_backward_trusted`` path with the output). Arguments and trust as
    ``attention_backward_trusted``'s; pass the ``block_sparse_transposed`` the backward will
    get (without it, block-sparse calls would build the transpose here). Reads no device value.

    Why: asking whether the backward runs on the kernel, then the row dots, then the backward
    (three separate entry points before 2026-11-28) validated the call and chose its kernel
    each time, about 0.3 ms of host time per nsa() branch on an H200's host, which the eager
    backward at 16K tokens waits for (docs/history.md, 2026-11-27). The checks and choices
    are kept per call signature as for the forward (``kernels.call_cache``)."""
    # A backward that would build its lists' transpose here does device work per call:
    # decided afresh each time (nsa() always passes the transpose).
    reusable = block_sparse_transposed is not None or kwargs.get("block_sparse") is None
    signature = _trusted_signature("planned backward", (q, k, v), host_cu_seqlens,
                                   dict(kwargs, deterministic=deterministic,
                                        block_sparse_transposed=block_sparse_transposed))
    decision = call_cache.lookup(signature) if reusable else None
    if decision is None:
        decision = _plan_backward_decision(q, k, v, host_cu_seqlens, block_sparse_transposed,
                                           deterministic, kwargs)
        if reusable:
            call_cache.store(signature, decision)
    problem, forward_kernel, backward_kernel, transposed = decision
    if backward_kernel is None or q.shape[0] == 0:
        return None
    forward_kwargs = normalised_kwargs(problem, kwargs.get("cu_seqlens_q"),
                                       kwargs.get("cu_seqlens_k"), kwargs.get("block_sparse"))
    backward_kwargs = dict(forward_kwargs, deterministic=deterministic,
                           block_sparse_transposed=(transposed if block_sparse_transposed is None
                                                    else block_sparse_transposed))
    return KernelBackward(problem, q, k, v, forward_kernel, forward_kwargs, backward_kernel,
                          backward_kwargs)


def _plan_backward_decision(q, k, v, host_cu_seqlens, block_sparse_transposed, deterministic,
                            kwargs) -> tuple:
    """(problem, forward kernel, backward kernel, the transpose the backward's dispatch built
    or None) of ``plan_backward_trusted``: its checks and kernel choices."""
    problem = validate_trusted_attention_forward(q, k, v, host_cu_seqlens=host_cu_seqlens,
                                                 **kwargs)
    check_deterministic(deterministic)
    if block_sparse_transposed is not None:
        check_block_sparse_transposed(block_sparse_transposed, kwargs.get("block_sparse"),
                                      problem, device=q.device, check_contents=False)
    forward_kwargs = normalised_kwargs(problem, kwargs.get("cu_seqlens_q"),
                                       kwargs.get("cu_seqlens_k"), kwargs.get("block_sparse"))
    backward_kwargs = dict(forward_kwargs, block_sparse_transposed=block_sparse_transposed,
                           deterministic=deterministic)
    backward_kernel, _ = dispatch.attention_kernel("backward", q, k, v, backward_kwargs, problem)
    if backward_kernel is None:
        return problem, None, None, None
    forward_kernel, _ = dispatch.attention_kernel("forward", q, k, v, forward_kwargs)
    built = backward_kwargs["block_sparse_transposed"]
    return problem, forward_kernel, backward_kernel, (
        None if built is block_sparse_transposed else built)


class KernelBackward:
    """``plan_backward_trusted``'s result: the row dots and the backward of its (q, k, v) call
    on the kernels it chose, with only the per-call arguments checked."""

    def __init__(self, problem: AttentionProblem, q, k, v, forward_kernel, forward_kwargs,
                 backward_kernel, backward_kwargs):
        self.problem, self.q, self.k, self.v = problem, q, k, v
        self._forward, self._forward_kwargs = forward_kernel, forward_kwargs
        self._backward, self._backward_kwargs = backward_kernel, backward_kwargs

    def row_dots(self, dout, into) -> bool:
        """The planned call's rowsum(dout * out) into ``into`` ((H, Tq) float32) from the forward
        kernel's float32 accumulator, out never written; False where that kernel does not run."""
        if self._forward is None:
            return False
        self._forward.run(self.q, self.k, self.v, row_dot_with=dout, row_dot_into=into,
                          **self._forward_kwargs)
        return True

    @property
    def fuses_dq(self) -> bool:
        """Whether the planned backward adds its dQ into float32 sums (a ``DqSums`` given to
        ``backward`` takes it, unconverted) rather than writing dq from its dQ kernel."""
        return self._backward.fuses_dq(self.q, self.k, **self._backward_kwargs)

    def backward(self, dout, lse, *, dout_dot_out, lse_gate=None, dq_accumulator=None,
                 dkv_accumulators=None, dq_sums=None):
        """``attention_backward_trusted`` of the planned call with ``dout_dot_out`` (out not
        read): (dq, dk, dv), added into the accumulators where given. ``dq_sums``
        (``kernels.sm90.backward.DqSums``): a fused dQ goes into these shared float32 sums,
        unconverted (dq is then ``dq_accumulator``, None without one; the caller finishes)."""
        if dout_dot_out is None:
            raise ValueError("dout_dot_out: required (the planned backward does not read out)")
        _check_internal_arguments(self.q, self.k, self.v, dout_dot_out, lse_gate,
                                  dq_accumulator, dkv_accumulators)
        check_backward_tensors(self.problem, self.q, dout, None, lse, reads_out=False)
        given = _given_to_kernel(self.problem, dout_dot_out, dq_accumulator, dkv_accumulators,
                                 lse_gate)
        if dq_sums is not None:
            given["dq_sums"] = dq_sums
        return self._backward.run(dout, self.q, self.k, self.v, None, lse, **given,
                                  **self._backward_kwargs)


def _run_forward(problem: AttentionProblem, q, k, v, cu_seqlens_q, cu_seqlens_k, block_sparse):
    """The kernel when it applies, else the fallback, for a validated call."""
    kwargs = normalised_kwargs(problem, cu_seqlens_q, cu_seqlens_k, block_sparse)
    kernel, _ = dispatch.attention_kernel("forward", q, k, v, kwargs)
    return _forward_on(kernel, problem, q, k, v, kwargs)


def _forward_on(kernel, problem: AttentionProblem, q, k, v, kwargs: dict):
    """The forward on the kernel chosen for the call (its normalised keyword arguments),
    or on the fallback where none was."""
    if kernel is not None:
        return kernel.run(q, k, v, **kwargs)
    return fallback.forward(problem, q, k, v, kwargs["block_sparse"])


def _run_backward(problem: AttentionProblem, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                  block_sparse, block_sparse_transposed, deterministic: bool,
                  dq_accumulator=None, dkv_accumulators=None):
    kwargs = normalised_kwargs(problem, cu_seqlens_q, cu_seqlens_k, block_sparse)
    kwargs.update(block_sparse_transposed=block_sparse_transposed, deterministic=deterministic)
    kernel, _ = dispatch.attention_kernel("backward", q, k, v, kwargs, problem)
    if kernel is not None:
        return kernel.run(dout, q, k, v, out, lse, **kwargs,
                          **_given_to_kernel(problem, None, dq_accumulator, dkv_accumulators,
                                             None))
    grads = fallback.backward(problem, dout, q, k, v, out, lse, block_sparse,
                              deterministic=deterministic)
    return add_into_accumulators(grads, dq_accumulator, dkv_accumulators)


def _given_to_kernel(problem: AttentionProblem, dout_dot_out, dq_accumulator, dkv_accumulators,
                     lse_gate) -> dict:
    """The internal arguments of the sm90 backward's run() that a call gives (only those, so
    that run() sees what can_run() saw), and for packed inputs the host bounds the checks read:
    run() keeps its query tile layout by them and reads where each query tile meets one KV
    tile."""
    given = {name: value for name, value in (("dout_dot_out", dout_dot_out),
                                             ("dq_accumulator", dq_accumulator),
                                             ("dkv_accumulators", dkv_accumulators),
                                             ("lse_gate", lse_gate))
             if value is not None}
    if problem.varlen:
        given["host_cu_seqlens_q"] = problem.cu_seqlens_q
        given["host_cu_seqlens_k"] = problem.cu_seqlens_k
    return given


def add_into_accumulators(grads, dq_accumulator, dkv_accumulators):
    """(dq, dk, dv) with dq added into ``dq_accumulator`` and dk, dv into ``dkv_accumulators``
    and returned as them (where given), for a path that computed them fresh."""
    dq, dk, dv = grads
    if dq_accumulator is not None:
        dq = dq_accumulator.add_(dq)
    if dkv_accumulators is not None:  # (copied where they hold nothing yet)
        dk, dv = write_into(dkv_accumulators, dk, dv)
    return dq, dk, dv


def which_backend(q, k, v, *, backward: bool = False, **kwargs) -> str:
    """Name the path a call with these arguments takes: ``"sm90"`` or ``"fallback (<why>)"``.

    ``kwargs`` are the keyword arguments of ``attention_forward`` (plus
    ``block_sparse_transposed`` and ``deterministic`` with ``backward=True``). Validates them
    like the call would.
    """
    transposed = kwargs.pop("block_sparse_transposed", None)
    deterministic = check_deterministic(kwargs.pop("deterministic", False))
    if not backward and (transposed is not None or deterministic):
        name = "block_sparse_transposed" if transposed is not None else "deterministic"
        raise ValueError(f"{name} only applies with backward=True (the forward is deterministic)")
    problem = validate_attention_forward(q, k, v, **kwargs)
    if backward and transposed is not None:
        check_block_sparse_transposed(transposed, kwargs.get("block_sparse"), problem,
                                      device=q.device, check_contents=True)
    call = normalised_kwargs(problem, kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_k"),
                             kwargs.get("block_sparse"))
    if backward:
        call.update(block_sparse_transposed=transposed, deterministic=deterministic)
    kernel, reason = dispatch.attention_kernel("backward" if backward else "forward", q, k, v,
                                               call, problem)
    return SM90 if kernel is not None else f"{FALLBACK} ({reason})"
