"""Whether nsa()'s backward recomputes each branch's forward or reads the output the forward kept.

The backward of a gated branch needs <dO, o_b> per row and head (the gate's gradient, which the
sm90 backward also uses as its dO.O). The forward writes every o_b before the gated sum, so
keeping them costs memory and nothing else; recomputing them costs a forward per branch (about a
fifth of the backward's device time at 8K-64K, H100). The rule, decided here only:

- `recompute=True`: keep nothing, recompute each branch (the peak is the inputs plus one
  branch: what lets 1M tokens train on one 80 GB GPU);
- `recompute=False`: keep every branch output;
- `recompute=None` (the default): keep them when together they take at most KEEP_FRACTION of
  the device's memory (1/8: 10 GB of an 80 GB H100, up to 384K tokens at H=32, D=128, bf16,
  three branches; 1M tokens recompute), else recompute.

The rule depends only on shapes, dtype and the device, so a CUDA graph or a compiled graph sees
the same choice on every call, and the answer is the same either way: the kept outputs are the
ones the recomputation would write, bit for bit. One call cannot see the rest of a model: in a
deep model at long lengths, where every layer keeps its outputs until its backward, pass
recompute=True (the layer's argument) to trade about 20% of nsa()'s backward for that memory.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.device import total_memory

KEEP_FRACTION = 1 / 8
# Off CUDA (the fallback on the CPU) the device's memory is the host's: a fixed budget instead.
HOST_KEEP_BUDGET = 4 * 2**30


def kept_output_bytes(q: Tensor, num_branches: int) -> int:
    """Bytes of the branch outputs the backward would keep: one q-shaped tensor per branch."""
    return num_branches * q.numel() * q.element_size()


def keep_budget_bytes(device: torch.device) -> int:
    """The most bytes of branch outputs kept by default on `device`."""
    if device.type != "cuda":
        return HOST_KEEP_BUDGET
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return int(total_memory(device) * KEEP_FRACTION)


def keeps_branch_outputs(q: Tensor, num_branches: int, recompute: bool | None) -> bool:
    """Whether the forward keeps its branch outputs for the backward (see the module's rule)."""
    if recompute is not None:
        return not recompute
    return kept_output_bytes(q, num_branches) <= keep_budget_bytes(q.device)
