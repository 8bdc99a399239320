"""Gating: the per-row, per-head weights that combine the three branch outputs.

g[t, h, b] = sigmoid(q[t, h] . W_gate[h, b]) for branches b = (compressed, selected, window), or,
without W_gate, 1 / (number of running branches). A branch that does not run (window_size = 0)
gets weight 0. Weights are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from nsa.compression import compute_dtype

NUM_BRANCHES = 3


def gate_weights(q: Tensor, W_gate: Tensor | None, branches: tuple[bool, bool, bool]) -> Tensor:
    """(T, H, 3) branch weights for packed q (T, H, D)."""
    dtype = compute_dtype(q.dtype)
    # Filled on the device from Python scalars: a host-to-device copy (torch.tensor(branches))
    # is refused inside CUDA-graph capture.
    running = torch.zeros(NUM_BRANCHES, dtype=dtype, device=q.device)
    for branch, runs in enumerate(branches):
        if runs:
            running[branch].fill_(1.0)
    if W_gate is None:
        return (running / sum(branches)).expand(*q.shape[:2], NUM_BRANCHES)
    return torch.sigmoid(gate_logits(q, W_gate)) * running


def gate_logits(q: Tensor, W_gate: Tensor) -> Tensor:
    dtype = compute_dtype(q.dtype)
    return torch.einsum("thd,hbd->thb", q.to(dtype), W_gate.to(dtype))


def gate_backward(q: Tensor, W_gate: Tensor, weights: Tensor, d_weights: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """dq (T, H, D) and dW_gate (H, 3, D), in the compute dtype, from dL/dg (T, H, 3).

    `weights` are gate_weights' output; a branch that does not run has weight 0 and gets none.
    """
    dtype = compute_dtype(q.dtype)
    d_logits = d_weights * weights * (1 - weights)  # sigmoid' = g (1 - g); g = 0 stops the flow
    dq = torch.einsum("thb,hbd->thd", d_logits, W_gate.to(dtype))
    dW_gate = torch.einsum("thb,thd->hbd", d_logits, q.to(dtype))
    return dq, dW_gate
