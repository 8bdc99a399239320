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
    return torch.sigmoid(gate_logits(q, W_gate)) * running


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
    dtype = compute_dtype(q.dtype)
    return torch.einsum("thd,hbd->thb", q.to(dtype), W_gate.to(dtype))


# Rows per step of `gate_backward`: bounds its compute-dtype copies of q and of the gate's dq
# (at 1M tokens, H=32, D=128 a whole float32 copy is 16 GiB, twice the bf16 dq it adds into).
GATE_BACKWARD_CHUNK_ELEMENTS = 2 ** 26


def gate_backward(q: Tensor, W_gate: Tensor, weights: Tensor, d_weights: Tensor, dq: Tensor
                  ) -> Tensor:
    """Adds the gate's dq into `dq` (q's shape, any floating dtype) and returns dW_gate
    (H, 3, D) in the compute dtype, from dL/dg (T, H, 3); row chunk by row chunk, so that no
    compute-dtype copy of q or dq is whole.

    `weights` are gate_weights' output; a branch that does not run has weight 0 and gets none.
    """
    dtype = compute_dtype(q.dtype)
    d_logits = d_weights * weights * (1 - weights)  # sigmoid' = g (1 - g); g = 0 stops the flow
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
