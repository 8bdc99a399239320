"""Gating: the per-row, per-head weights that combine the three branch outputs.

g[t, h, b] = sigmoid(q[t, h] . W_gate[h, b]) for branches b = (compressed, selected, window), or,
without W_gate, 1 / (number of running branches). A branch that does not run (window_size = 0)
gets weight 0. Weights are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from nsa.compression import compute_dtype
from sparsity.host_cache import cached

NUM_BRANCHES = 3


def gate_weights(q: Tensor, W_gate: Tensor | None, branches: tuple[bool, bool, bool]) -> Tensor:
    """(T, H, 3) branch weights for packed q (T, H, D)."""
    dtype = compute_dtype(q.dtype)
    # A function of (branches, dtype, device) only: kept across calls (sparsity/host_cache.py;
    # it was 5 launches of host time per call, twice per training step).
    key = ("running branches", tuple(branches), dtype, W_gate is None)
    running = cached(key, q, lambda: _running_weights(branches, dtype, q.device, W_gate is None))
    if W_gate is None:
        return running.expand(*q.shape[:2], NUM_BRANCHES)
    # Written contiguous (T, H, 3) whatever the logits' layout: the gated sum and the backward
    # read it so, without a copy. With every branch running, `running` is all ones.
    weights = torch.sigmoid(gate_logits(q, W_gate),
                            out=torch.empty(*q.shape[:2], NUM_BRANCHES, dtype=dtype,
                                            device=q.device))
    return weights if all(branches) else weights.mul_(running)


def _running_weights(branches: tuple[bool, bool, bool], dtype, device, mean: bool) -> Tensor:
    """(3,) 1 for a running branch, 0 for the others; divided by the running count (mean
    gating) when `mean`. Filled on the device from Python scalars: a host-to-device copy
    (torch.tensor(branches)) is refused inside CUDA-graph capture."""
    running = torch.zeros(NUM_BRANCHES, dtype=dtype, device=device)
    for branch, runs in enumerate(branches):
        if runs:
            running[branch].fill_(1.0)
    return running / sum(branches) if mean else running


def gate_logits(q: Tensor, W_gate: Tensor) -> Tensor:
    """(T, H, 3) q[t, h] . W_gate[h, b] in the compute dtype."""
    if products_in_input_dtype(q, W_gate):
        return _head_products(q, W_gate).transpose(0, 1)
    dtype = compute_dtype(q.dtype)
    return torch.einsum("thd,hbd->thb", q.to(dtype), W_gate.to(dtype))


def products_in_input_dtype(q: Tensor, W_gate: Tensor) -> bool:
    """Whether the gate's products read q as it is: bfloat16 q and W_gate on a GPU, where
    cuBLAS multiplies them with float32 accumulation and a float32 result. The same numbers as
    the float32 products of the generic path (bfloat16 values are exact in float32; only the
    summation order differs), without the float32 copies of q that path writes and reads (at
    8K tokens, H=32, D=128 about 1 GB of reads and writes a training step). Elsewhere (CPU,
    float16 whose range cannot hold the backward's hi/lo split of a float32 gradient,
    float32/float64, mixed dtypes): the generic path."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and W_gate.dtype == q.dtype
            and _HAS_FLOAT32_PRODUCTS)


# torch.bmm(..., out_dtype=torch.float32) for bfloat16 inputs (torch >= 2.8 on CUDA).
_HAS_FLOAT32_PRODUCTS = hasattr(torch.ops.aten.bmm, "dtype")


def _float32_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b batched, bfloat16 operands, float32 accumulation and result."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())  # CPU: the unit tests' stand-in, the same numbers


def _head_products(q: Tensor, W_gate: Tensor) -> Tensor:
    """(H, T, 3) float32 q[:, h] @ W_gate[h]^T, q read in place as (H, T, D) strided."""
    return _float32_bmm(q.transpose(0, 1), W_gate.transpose(1, 2))


def _split_bfloat16(x: Tensor) -> Tensor:
    """x (..., n) float32 as (..., 2n) bfloat16: hi then lo, hi + lo = x to about 2^-17
    relative, so products with bfloat16 operands keep (nearly) float32's precision."""
    pair = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=torch.bfloat16, device=x.device)
    hi, lo = pair.split(x.shape[-1], dim=-1)
    hi.copy_(x)
    torch.sub(x, hi, out=lo)
    return pair


# Rows per step of `gate_backward`: bounds its compute-dtype copies of q and of the gate's dq
# (at 1M tokens, H=32, D=128 a whole float32 copy is 16 GiB, twice the bf16 dq it adds into).
GATE_BACKWARD_CHUNK_ELEMENTS = 2 ** 26


def gate_backward(q: Tensor, W_gate: Tensor, weights: Tensor, d_weights: Tensor, dq: Tensor
                  ) -> Tensor:
    """Adds the gate's dq into `dq` (q's shape, any floating dtype) and returns dW_gate
    (H, 3, D) in the compute dtype, from dL/dg (T, H, 3). bfloat16 on a GPU: in place, with
    no float32 copy (`products_in_input_dtype`); otherwise row chunk by row chunk, so that no
    compute-dtype copy of q or dq is whole.

    `weights` are gate_weights' output; a branch that does not run has weight 0 and gets none.
    """
    dtype = compute_dtype(q.dtype)
    d_logits = d_weights * weights * (1 - weights)  # sigmoid' = g (1 - g); g = 0 stops the flow
    if products_in_input_dtype(q, W_gate) and dq.dtype == q.dtype:
        return _gate_backward_in_input_dtype(q, W_gate, d_logits, dq)
    W = W_gate.to(dtype)
    dW_gate = torch.zeros(W.shape, dtype=dtype, device=q.device)
    step = max(1, GATE_BACKWARD_CHUNK_ELEMENTS // max(1, q.shape[1] * q.shape[2]))
    # Per head: dq[:, h] += d_logits[:, h] @ W[h] and dW[h] += d_logits[:, h]^T @ q[:, h], as
    # batched products over the heads, added in place (no copy back of a slice).
    for r0 in range(0, q.shape[0], step):
        rows = slice(r0, r0 + step)
        d_rows = d_logits[rows].transpose(0, 1)  # (H, t, 3)
        dq[rows].add_(torch.bmm(d_rows, W).transpose(0, 1))
        dW_gate.baddbmm_(d_rows.transpose(1, 2), q[rows].to(dtype).transpose(0, 1))
    return dW_gate


def _gate_backward_in_input_dtype(q: Tensor, W_gate: Tensor, d_logits: Tensor, dq: Tensor
                                  ) -> Tensor:
    """`gate_backward` on bfloat16 q, W_gate and dq (`products_in_input_dtype`), whole, with no
    float32 copy of q or dq: dL/dlogits split into bfloat16 hi + lo (`_split_bfloat16`), so that
    the products below equal the float32 ones of the generic path to about 2^-17 relative (dq
    is bfloat16, 2^-8; dW_gate goes back to W_gate's bfloat16).
    dq (T, H, D) seen as (H, T, D) takes d_logits[:, h] @ W[h] in one in-place product per
    head (float32 accumulation, one rounding into dq, as the generic path's add);
    dW[h] = d_logits[:, h]^T @ q[:, h] reads q once."""
    d_pair = _split_bfloat16(d_logits).transpose(0, 1)  # (H, T, 6)
    dq.transpose(0, 1).baddbmm_(d_pair, torch.cat([W_gate, W_gate], dim=1))
    halves = _float32_bmm(d_pair.transpose(1, 2), q.transpose(0, 1))  # (H, 6, D)
    return halves[:, :NUM_BRANCHES] + halves[:, NUM_BRANCHES:]
