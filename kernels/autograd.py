"""Differentiable, flash-attn-compatible entry points over ``attention_forward/backward``.

Differences from flash-attn: causal masks are top-left aligned (row i and key position i are the
same token, also when Nq != Nk), and there is ``compress_factor`` and ``block_sparse``. With
``return_lse=True`` the lse is returned as a constant: gradients do not flow through it.
``deterministic=True`` makes the backward bit-identical from run to run (flash-attn's switch of
the same name; default False, the faster mode).
"""
from __future__ import annotations

import torch

from .interface import attention_backward, attention_forward
from .validate import check_deterministic


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options: dict, deterministic: bool):
        out, lse = attention_forward(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.deterministic = options, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **ctx.options,
                                        deterministic=ctx.deterministic)
        return dq, dk, dv, None, None


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                    compress_factor=1, block_sparse=None, return_lse=False, deterministic=False):
    """Attention over padded ``q (B, Nq, H, D)``, ``k, v (B, Nk, Hkv, D)`` -> ``out (B, Nq, H, D)``.

    With ``return_lse=True`` returns ``(out, lse)``, lse ``(B, H, Nq)`` float32.
    ``deterministic`` applies to the backward (checked now, before the forward runs).
    """
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   compress_factor=compress_factor, block_sparse=block_sparse)
    out, lse = _AttentionFunction.apply(q, k, v, options, check_deterministic(deterministic))
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1),
                           compress_factor=1, block_sparse=None, return_lse=False,
                           deterministic=False):
    """Attention over packed ``q (Tq, H, D)``, ``k, v (Tk, Hkv, D)`` -> ``out (Tq, H, D)``.

    With ``return_lse=True`` returns ``(out, lse)``, lse ``(H, Tq)`` float32.
    ``deterministic`` applies to the backward (checked now, before the forward runs).
    """
    options = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   compress_factor=compress_factor, block_sparse=block_sparse)
    out, lse = _AttentionFunction.apply(q, k, v, options, check_deterministic(deterministic))
    return (out, lse) if return_lse else out
