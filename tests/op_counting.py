"""Counting the torch ops a call dispatches, the device -> host reads it makes and the host ->
device copies of Python values.

On a GPU every op is a kernel launch and every read stalls the host until the device catches up;
the speed tests of selection and of the block-list builders count both on the CPU. A tensor made
from Python values (`torch.tensor(...)`, `x[i] = 1.0`) is a host -> device copy on a GPU, which
CUDA-graph capture refuses; on the CPU it shows as a `lift_fresh` op.
"""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops after which the host waits for the device (on a GPU), and what reads a tensor to Python.
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive",
               "_unique2", "unique_dim", "item", "is_nonzero", "equal"}


class OpCounter(TorchDispatchMode):
    """Counts dispatched torch ops, device reads (syncing ops plus Tensor.tolist calls) and
    host copies (tensors made from Python values)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.reads = Counter(), 0
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.reads += 1
            return tolist(tensor)
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops[name] += 1
        self.reads += name in SYNCING_OPS
        return func(*args, **(kwargs or {}))

    @property
    def host_copies(self) -> int:
        return self.ops["lift_fresh"] + self.ops["lift_fresh_copy"]
