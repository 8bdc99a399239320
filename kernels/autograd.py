"""Differentiable, flash-attn-compatible entry points over ``attention_forward/backward``.

Differences from flash-attn: causal masks are top-left aligned (row i and key position i are the
same token, also when Nq != Nk), and there is ``compress_factor`` and ``block_sparse``. With
``return_lse=True`` the lse is returned as a constant: gradients do not flow through it.
``deterministic=True`` makes the backward bit-identical from run to run (flash-attn's switch of
the same name; default False, the faster mode).

Second-order gradients are not supported: the attention backward (a kernel, or the fallback's
chunked math with ``out`` and ``lse`` as constants) builds no autograd graph. First-order
gradients work with ``create_graph=True`` too; differentiating them again raises a RuntimeError
that says so (:func:`refuse_double_backward`), never a silently wrong number.
"""
from __future__ import annotations

import torch

from .interface import (attention_backward, attention_backward_trusted, attention_forward,
                        attention_forward_trusted, masked_attention_backward,
                        masked_attention_forward_with_tiles)
from . import masked
from .validate import check_deterministic


DOUBLE_BACKWARD_ERROR = (
    "{what}: double backward (a gradient of its gradients, e.g. torch.autograd.grad(..., "
    "create_graph=True) and then a gradient of the result) is not supported: the attention "
    "backward runs without an autograd graph, so second-order gradients would be wrong")


class _RefusedDoubleBackward(torch.autograd.Function):
    """Passes first-order gradients through unchanged; its backward is the refusal.

    Its inputs are the gradients and every tensor they depend on (the Function's inputs and the
    incoming gradients), so a second-order gradient with respect to any of them passes through
    this node and raises. ``torch.autograd.function.once_differentiable`` is not enough: its
    error node hangs off detached copies, so a gradient with respect to k reports "appears to not
    have been used in the graph" (or, with allow_unused=True, returns None as if it were zero).
    """

    @staticmethod
    def forward(ctx, what: str, num_grads: int, *tensors):
        ctx.what = what
        # Copies, not views of the inputs: a caller may update a gradient in place (a view
        # returned by a Function may not be), and the copy is made only under create_graph.
        return tuple(grad.clone() for grad in tensors[:num_grads])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR.format(what=ctx.what))


def refuse_double_backward(what: str, grads: tuple, depends_on) -> tuple:
    """``grads`` (a Function's backward results; None entries stay None), made to raise when a
    second-order gradient reaches them. ``depends_on``: the tensors they are a function of.

    Call it with the backward's results computed under ``torch.no_grad()``: with
    ``create_graph=False`` (grad mode off in the backward) it returns them as they are.
    """
    if not torch.is_grad_enabled():
        return grads
    sources = [t for t in depends_on if isinstance(t, torch.Tensor) and t.requires_grad]
    if not sources:
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    guarded = iter(_RefusedDoubleBackward.apply(what, len(present), *present, *sources))
    return tuple(None if g is None else next(guarded) for g in grads)


class _AttentionFunction(torch.autograd.Function):
    """options: attention_forward's keyword arguments, plus host_cu_seqlens (the bounds'
    values on the host: then neither pass reads them from the device)."""

    @staticmethod
    def forward(ctx, q, k, v, options: dict, deterministic: bool):
        forward = attention_forward_trusted if "host_cu_seqlens" in options else \
            attention_forward
        out, lse = forward(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.deterministic = options, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        contiguous_dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        backward = attention_backward_trusted if "host_cu_seqlens" in ctx.options else \
            attention_backward
        with torch.no_grad():
            dq, dk, dv = backward(contiguous_dout, q, k, v, out, lse, **ctx.options,
                                  deterministic=ctx.deterministic)
        what = "flash_attn_varlen_func" if "cu_seqlens_q" in ctx.options else "flash_attn_func"
        dq, dk, dv = refuse_double_backward(what, (dq, dk, dv), (dout, q, k, v))
        return dq, dk, dv, None, None


class _MaskedAttentionFunction(torch.autograd.Function):
    """flash_attn_func with attn_mask / attn_bias (kernels.masked): gradients for q, k, v and,
    where it requires them, the bias."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, attn_mask, options: dict, deterministic: bool):
        out, lse, tiles = masked_attention_forward_with_tiles(
            q, k, v, attn_mask=attn_mask, attn_bias=attn_bias, **options,
            bias_gradient=ctx.needs_input_grad[3] and not deterministic)
        ctx.save_for_backward(q, k, v, out, lse, masked.mask_tensor(attn_mask), attn_bias)
        ctx.options, ctx.deterministic, ctx.tiles = options, deterministic, tiles
        # A prepared mask goes to the backward as itself (its kept transpose of the lists).
        ctx.prepared = masked.prepared_of(attn_mask)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, attn_mask, attn_bias = ctx.saved_tensors
        if ctx.prepared is not None:
            attn_mask = ctx.prepared
        contiguous_dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        with torch.no_grad():
            dq, dk, dv, dbias = masked_attention_backward(
                contiguous_dout, q, k, v, out, lse, attn_mask=attn_mask, attn_bias=attn_bias,
                bias_gradient=ctx.needs_input_grad[3], deterministic=ctx.deterministic,
                forward_tiles=ctx.tiles, **ctx.options)
        ctx.tiles = None
        grads = refuse_double_backward("flash_attn_func", (dq, dk, dv, dbias),
                                       (dout, q, k, v, attn_bias))
        return (*grads, None, None, None)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                    compress_factor=1, block_sparse=None, return_lse=False, deterministic=False,
                    attn_mask=None, attn_bias=None):
    """Attention over padded ``q (B, Nq, H, D)``, ``k, v (B, Nk, Hkv, D)`` -> ``out (B, Nq, H, D)``.

    With ``return_lse=True`` returns ``(out, lse)``, lse ``(B, H, Nq)`` float32.
    ``deterministic`` applies to the backward (checked now, before the forward runs).
    ``attn_mask`` (bool, True = attend) and ``attn_bias`` (float16/bfloat16/float32, added to
    the scaled scores) broadcast as (B or 1, H or Hkv or 1, Nq, Nk), alone or with causal,
    window_size and compress_factor; the bias gets a gradient where it requires one
    (``kernels.masked``: on the sm90 kernels where they take the call, skipping the tiles
    nothing is seen in; ``deterministic=True`` keeps the backward on the torch path; not with
    block_sparse, not under torch.compile yet). A mask shared by many calls can be passed as
    ``kernels.prepare_mask(attn_mask)``: its tile lists are then built once per call shape.
    """
    if attn_mask is not None or attn_bias is not None:
        if block_sparse is not None:
            raise ValueError("attn_mask/attn_bias: not taken with block_sparse (the lists "
                             "would come from the mask); pass one or the other")
        if torch.compiler.is_compiling():
            raise ValueError("attn_mask/attn_bias: not supported under torch.compile yet")
        out, lse = _MaskedAttentionFunction.apply(
            q, k, v, attn_bias, attn_mask,
            dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 compress_factor=compress_factor), check_deterministic(deterministic))
        return (out, lse) if return_lse else out
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   compress_factor=compress_factor, block_sparse=block_sparse)
    if torch.compiler.is_compiling():
        out, lse = _compiled_attention(q, k, v, options, check_deterministic(deterministic))
    else:
        out, lse = _AttentionFunction.apply(q, k, v, options, check_deterministic(deterministic))
    return (out, lse) if return_lse else out


def _host_bounds_pair(host_cu_seqlens, block_sparse) -> tuple:
    """flash_attn_varlen_func's host_cu_seqlens as the (cu_q, cu_k) pair the trusted entry
    points take (their checks then check its form)."""
    if block_sparse is not None:
        raise ValueError("host_cu_seqlens: not taken with block_sparse (the lists' checks read "
                         "the device anyway); pass None")
    if not isinstance(host_cu_seqlens, (tuple, list)) or not host_cu_seqlens:
        raise TypeError(f"host_cu_seqlens: expected a sequence of ints or a pair of them, got "
                        f"{type(host_cu_seqlens).__name__}")
    if isinstance(host_cu_seqlens[0], (tuple, list)):
        return tuple(host_cu_seqlens)
    return (tuple(host_cu_seqlens), tuple(host_cu_seqlens))


def _compiled_attention(q, k, v, options: dict, deterministic: bool):
    """flash_attn_func under torch.compile: the custom ops of kernels/ops.py (opaque to the
    compiler; eager calls keep _AttentionFunction)."""
    from . import ops

    if options["block_sparse"] is not None:
        raise ValueError("block_sparse: not supported under torch.compile yet (flash_attn_func "
                         "compiles for dense, causal, windowed and compressed attention)")
    left, right = options["window_size"]
    scale = options["softmax_scale"]
    return ops.attention_forward_op(q, k, v, None if scale is None else float(scale),
                                    bool(options["causal"]), int(left), int(right),
                                    int(options["compress_factor"]), deterministic)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1),
                           compress_factor=1, block_sparse=None, return_lse=False,
                           deterministic=False, host_cu_seqlens=None, q_start_positions=None):
    """Attention over packed ``q (Tq, H, D)``, ``k, v (Tk, Hkv, D)`` -> ``out (Tq, H, D)``.

    With ``return_lse=True`` returns ``(out, lse)``, lse ``(H, Tq)`` float32.
    ``deterministic`` applies to the backward (checked now, before the forward runs).
    ``host_cu_seqlens``: the values of ``cu_seqlens_q`` and ``cu_seqlens_k`` on the host, a
    pair of int sequences (one sequence where both are the same bounds), for callers that have
    them (a data loader packing documents): the checks then read no tensor value (no wait on
    the GPU, twice a layer in a training step) and use these, which must equal the tensors'
    values; only their form is checked (start 0, non-decreasing, end at the rows, one per
    entry), as nsa()'s argument of the same name. Not taken with ``block_sparse``, whose
    checks read the lists on the device anyway (a ValueError).
    ``q_start_positions``: host ints, one per sequence: the position of the sequence's first
    query row among its keys' tokens (the causal, window and compressed rules read query row i
    as position q_start + i; default 0). For a shard of a longer sequence's queries against all
    its keys (context parallelism, chunked prefill). Any position: the sm90 kernels read each
    tile's rows at their positions (kernels/sm90/block_range.py).
    """
    options = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   compress_factor=compress_factor, block_sparse=block_sparse)
    if q_start_positions is not None:
        options["q_start_positions"] = q_start_positions
    if host_cu_seqlens is not None:
        options["host_cu_seqlens"] = _host_bounds_pair(host_cu_seqlens, block_sparse)
    if torch.compiler.is_compiling():
        raise ValueError("flash_attn_varlen_func: not supported under torch.compile yet (its "
                         "checks read cu_seqlens); use flash_attn_func on padded inputs, or nsa() "
                         "with host_cu_seqlens")
    out, lse = _AttentionFunction.apply(q, k, v, options, check_deterministic(deterministic))
    return (out, lse) if return_lse else out
