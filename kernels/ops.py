"""``flash_attn_func``'s attention as ``torch.library`` custom ops, for torch.compile.

torch.compile cannot trace ``attention_forward`` / ``attention_backward``: they validate with
Python control flow on values, pick a kernel or the fallback, and launch opaque kernels. Under
compile ``kernels.flash_attn_func`` therefore calls two ops, opaque to the compiler, with fake
implementations that give the output shapes from the input shapes alone, and the backward
registered as the forward's autograd:

- ``nsa_cute::attention_forward(q, k, v, ...) -> (out, lse)``: padded q (B, Nq, H, D), k, v
  (B, Nk, Hkv, D); out like q, lse (B, H, Nq) in ``validate.lse_dtype(q.dtype)``;
- ``nsa_cute::attention_backward(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)``.

The options travel as primitives (custom ops take tensors and numbers only): ``softmax_scale``
(None: D ** -0.5), ``causal``, the window as two ints, ``compress_factor``, ``deterministic``.
Block-sparse lists and packed varlen inputs are not taken under compile yet
(``flash_attn_func`` refuses them there with a ValueError naming the argument); nsa() has its
own ops (nsa/ops.py). As the eager Function, the lse is a constant (no gradient flows through
it) and second-order gradients are refused: the backward op has no autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .interface import attention_backward, attention_forward
from .validate import lse_dtype

NAMESPACE = "nsa_cute"


def _options(softmax_scale, causal, window_left, window_right, compress_factor) -> dict:
    return dict(softmax_scale=softmax_scale, causal=causal,
                window_size=(window_left, window_right), compress_factor=compress_factor)


@torch.library.custom_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float],
                         causal: bool, window_left: int, window_right: int,
                         compress_factor: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``kernels.attention_forward`` on padded inputs; ``deterministic`` is the
    backward's mode, carried to it."""
    return attention_forward(q, k, v, **_options(softmax_scale, causal, window_left,
                                                 window_right, compress_factor))


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, softmax_scale, causal, window_left, window_right,
                            compress_factor, deterministic):
    batch, rows, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, rows), dtype=lse_dtype(q.dtype))


@torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, softmax_scale: Optional[float], causal: bool,
                          window_left: int, window_right: int, compress_factor: int,
                          deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``kernels.attention_backward`` on padded inputs."""
    # The compiler may hand over other strides than eager's (the kernels want unit last ones).
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    return attention_backward(dout, q, k, v, out, lse.contiguous(),
                              **_options(softmax_scale, causal, window_left, window_right,
                                         compress_factor), deterministic=deterministic)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, *_options_and_mode):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options  # softmax_scale, causal, window, compress_factor, deterministic
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
