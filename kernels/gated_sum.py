"""GatedSum: out = sum_b g[..., b] * o_b over branch outputs that arrive one at a time.

NSA's forward combines its branch outputs with per-row, per-head gates. Two ways, one result
(float32 sums, rounded once to the output dtype):

- sm90 (CuTe DSL, `kernels.sm90.gated_sum`): keeps the branch outputs until `result()`, then
  one pass reads each once and writes the sum into the first one's storage. Peak memory: the
  terms themselves.
- torch (everywhere else): a float32 (float64 for float64) accumulator updated as each term
  arrives, so a term can be freed right after `add`. Peak memory: the accumulator (twice a
  half-precision term) and one term.

On an H100 the torch path took 4.65 ms for 3 terms of 64K x 32 x 128 bf16 in the forward
profile, the largest single stage of `nsa()`'s forward at 64K; the kernel 0.87 ms (FINDINGS
section 2, session 9).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .interface import kernels_unavailable

class GatedSum:
    """Accumulate `gates[..., column] * term` for terms shaped like `like`, then `result()`.

    gates: (T, H, G) floating, on like's device; terms: (T, H, D) with like's shape and dtype.
    """

    def __init__(self, gates: Tensor, like: Tensor):
        if gates.dim() != 3 or gates.shape[:2] != like.shape[:2]:
            raise ValueError(f"gates: expected shape ({like.shape[0]}, {like.shape[1]}, G) for "
                             f"terms of shape {tuple(like.shape)}, got {tuple(gates.shape)}")
        if not gates.is_floating_point() or gates.device != like.device:
            raise ValueError(f"gates: expected a floating tensor on {like.device}, got "
                             f"{gates.dtype} on {gates.device}")
        self.like = like
        self.backend, self.reason = self.choose_backend(like)
        self._result: Tensor | None = None
        accumulate = torch.promote_types(like.dtype, torch.float32)
        if self.backend == "sm90":
            self.gates = gates.to(torch.float32).contiguous()
            self.terms: list[Tensor] = []
            self.columns: list[int] = []
        else:
            self.gates = gates.to(accumulate)
            self.total = torch.zeros(like.shape, dtype=accumulate, device=like.device)

    @staticmethod
    def choose_backend(like: Tensor) -> tuple[str, str]:
        """("sm90", "") or ("torch", why not the kernel), for terms shaped like `like`."""
        unsupported = kernels_unavailable(like.device)
        if unsupported:
            return "torch", unsupported
        try:
            from kernels.sm90 import gated_sum
        except ImportError as error:
            return "torch", f"kernels.sm90.gated_sum unavailable ({error})"
        ok, reason = gated_sum.can_run(like)
        return ("sm90", "") if ok else ("torch", f"kernels.sm90.gated_sum: {reason}")

    def add(self, column: int, term: Tensor) -> None:
        if self._result is not None:
            raise RuntimeError("GatedSum.add after result()")
        if (term.shape != self.like.shape or term.dtype != self.like.dtype
                or term.device != self.like.device):
            raise ValueError(f"term: expected {tuple(self.like.shape)} {self.like.dtype} on "
                             f"{self.like.device}, got {tuple(term.shape)} {term.dtype} on "
                             f"{term.device}")
        if not 0 <= column < self.gates.shape[-1]:
            raise ValueError(f"column: {column} outside the {self.gates.shape[-1]} gate columns")
        if self.backend == "sm90":
            from kernels.sm90.gated_sum import MAX_TERMS

            if len(self.terms) == MAX_TERMS:
                raise ValueError(f"term: at most {MAX_TERMS} terms on the sm90 path")
            term = term.contiguous()
            if term.data_ptr() % 16:  # the kernel loads 16 bytes at a time
                term = term.clone()
            self.terms.append(term)
            self.columns.append(column)
        else:
            self.total.addcmul_(self.gates[..., column, None], term)

    def result(self) -> Tensor:
        """The sum in like's dtype (zeros without terms); later calls return the same tensor.
        On the sm90 path it is written over the first term as `add` kept it (the caller's
        tensor when that was contiguous and 16-byte aligned, else a copy): a caller's first term
        must not be used afterwards."""
        if self._result is None:
            self._result = self._sum()
        return self._result

    def _sum(self) -> Tensor:
        if self.backend != "sm90":
            return self.total.to(self.like.dtype)
        if not self.terms:
            return torch.zeros_like(self.like)
        from kernels.sm90 import gated_sum

        out = gated_sum.run(self.terms, self.columns, self.gates)
        self.terms.clear()
        return out
