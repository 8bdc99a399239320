"""The float32 dK/dV sums that several backward calls add into, from first write to last.

nsa()'s backward sums the attention branches' dK and dV in float32 (rounded once at the end).
Two passes over those sums, each the keys' float32 size, need not be made:

- the zeroing before the first call: `UnwrittenDkvSums` marks accumulators that hold nothing
  yet (`torch.empty`), so the first call writes instead of adding (the sm90 backward stores its
  dK/dV where one CTA owns each KV tile; where several CTAs add partials it zeroes them first);
- the compressed branch's expansion: its gradient reaches each key row as 1/l of its
  compressed token's (mean pooling), which used to be written out at the keys' float32 size and
  added into; `finish_dkv` reads it per row in the final conversion instead
  (kernels/sm90/dkv_finish.py on sm90, torch elsewhere, the same values bit for bit).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch


class UnwrittenDkvSums(tuple):
    """``dkv_accumulators`` (dk_sum, dv_sum) that hold nothing yet: the backward call writes its
    dk, dv into them instead of adding (kernels.interface's accumulators otherwise)."""


def write_into(accumulators, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
    """dk and dv added into `accumulators`, or copied there when they are `UnwrittenDkvSums`;
    returned as them. For a path that computed dk and dv fresh (the fallback)."""
    if isinstance(accumulators, UnwrittenDkvSums):
        return accumulators[0].copy_(dk), accumulators[1].copy_(dv)
    return accumulators[0].add_(dk), accumulators[1].add_(dv)


def finish_dkv(sums: tuple[Tensor, Tensor], row_gradients: tuple[Tensor, Tensor],
               row_tokens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dk, dv) in `dtype`, new tensors: sums[i] + row_gradients[i][row_tokens], summed in the
    sums' dtype and rounded once. sums: (T, Hkv, D) float32 (float64 for float64 inputs);
    row_gradients: (Tc + 1, Hkv, D) of the sums' dtype, the last row zeros; row_tokens: (T,)
    int64, each row's token in row_gradients."""
    module, _ = dispatch.sm90_module("dkv_finish", sums[0].device)
    if module is not None and module.can_run(sums, row_gradients, row_tokens, dtype)[0]:
        out = tuple(torch.empty(s.shape, dtype=dtype, device=s.device) for s in sums)
        module.run(sums, row_gradients, row_tokens, out)
        return out
    return tuple((s + g.index_select(0, row_tokens)).to(dtype)
                 for s, g in zip(sums, row_gradients))
