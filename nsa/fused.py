"""Chains of elementwise ops as one kernel each on the GPU (torch.compile), eager elsewhere.

A model layer's rotary embedding, RMSNorm and SwiGLU product are each a handful of elementwise
ops over (tokens x hidden) tensors. Run eagerly, every op reads and writes a whole tensor (the
float32 intermediates included): at 32K tokens that is tens of ms of a 12-layer model's step
(tools/train_lm.py --profile-step), the same for NSA and dense attention. torch.compile fuses
each chain into one kernel forward and one backward.

Only CUDA tensors take the compiled path; CPU tensors run the function itself (the same
arithmetic, and no compiler needed in CI). A compile that fails (no triton, an unsupported
torch) warns once and leaves that function eager for the rest of the process. Inside a caller's
own torch.compile the function is traced as it is.
"""
from __future__ import annotations

import functools
import warnings

import torch


def fused_on_gpu(fn):
    """`fn(x, ...)` compiled with torch.compile when x is a CUDA tensor, `fn` otherwise.
    The wrapper's `eager` attribute is `fn` itself."""
    compiled = None
    failed = False

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled, failed
        if failed or not x.is_cuda or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        try:
            return compiled(x, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
            failed = True
            warnings.warn(f"{fn.__qualname__}: torch.compile failed ({type(error).__name__}: "
                          f"{error}); running it eagerly from now on", RuntimeWarning,
                          stacklevel=2)
            return fn(x, *args, **kwargs)

    wrapper.eager = fn
    return wrapper
