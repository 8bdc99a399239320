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
profile, the largest single stage of `nsa()`'s forward at 64K; the kernel 0.87 ms
(docs/history.md, section 2).

`gated_sum_backward` is the backward of one term (NSA's backward, per branch): the gate
gradient rowsum(dO * o_b) and the term's gradient g_b * dO, one CuTe DSL pass on sm90;
`gate_gradient` the gate gradient alone, `gate_gradients` that of several terms in one pass
over dO.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch


class GatedSum:
    """Accumulate `gates[..., column] * term` for terms shaped like `like`, then `result()`.

    gates: (T, H, G) floating, on like's device; terms: (T, H, D) with like's shape and dtype.
    keep_terms: the caller reads the terms after `result()` (nsa() keeps its branch outputs for
    the backward), so the sm90 path writes the sum into a new tensor instead of over a term.
    """

    def __init__(self, gates: Tensor, like: Tensor, keep_terms: bool = False):
        if gates.dim() != 3 or gates.shape[:2] != like.shape[:2]:
            raise ValueError(f"gates: expected shape ({like.shape[0]}, {like.shape[1]}, G) for "
                             f"terms of shape {tuple(like.shape)}, got {tuple(gates.shape)}")
        if not gates.is_floating_point() or gates.device != like.device:
            raise ValueError(f"gates: expected a floating tensor on {like.device}, got "
                             f"{gates.dtype} on {gates.device}")
        self.like = like
        self.keep_terms = keep_terms
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
    def choose_backend(like: Tensor, backward: bool = False) -> tuple[str, str]:
        """("sm90", "") or ("torch", why not the kernel), for terms shaped like `like` (with
        `backward`: for `gated_sum_backward` of such a term): the device and the import asked
        of `kernels.dispatch`, the shapes of the kernel module."""
        gated_sum, reason = dispatch.sm90_module("gated_sum", like.device)
        if gated_sum is None:
            return "torch", reason
        ok, reason = gated_sum.can_run(like, backward=backward)
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
            self.terms.append(_aligned(term))
            self.columns.append(column)
        else:
            self.total.addcmul_(self.gates[..., column, None], term)

    def result(self) -> Tensor:
        """The sum in like's dtype (zeros without terms); later calls return the same tensor.
        On the sm90 path it is written over the term of the lowest column as `add` kept it (the
        caller's tensor when that was contiguous and 16-byte aligned, else a copy): that term
        must not be used afterwards, unless the sum was made with keep_terms."""
        if self._result is None:
            self._result = self._sum()
        return self._result

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the sum reads: the kept terms and the gates (sm90), or the float32
        accumulator and the gates (torch)."""
        return (*self.terms, self.gates) if self.backend == "sm90" else (self.total, self.gates)

    def sum_copy(self) -> Tensor:
        """The sum in a new tensor, the terms left as they are: a sum made with keep_terms can
        be taken again (nsa()'s captured plans take it outside their graph, into a tensor the
        caller owns, instead of copying the graph's static result out)."""
        if not self.keep_terms:
            raise RuntimeError("GatedSum.sum_copy needs keep_terms=True (the sm90 path writes "
                               "the sum over a term otherwise)")
        return self._sum(again=True)

    def _sum(self, again: bool = False) -> Tensor:
        """The sum; `again`: in a new tensor even where no conversion makes one (float64), the
        terms kept for another sum."""
        if self.backend != "sm90":
            return self.total.to(self.like.dtype, copy=again)
        if not self.terms:
            return torch.zeros_like(self.like)
        from kernels.sm90 import gated_sum

        # In column order, whatever order the terms came in: a call's sum is the same bits
        # whichever branch was launched first (nsa/streams.py's two streams, or one).
        order = sorted(range(len(self.terms)), key=self.columns.__getitem__)
        terms = [self.terms[i] for i in order]
        into = torch.empty_like(terms[0]) if self.keep_terms else None
        out = gated_sum.run(terms, [self.columns[i] for i in order], self.gates, into=into)
        if not again:
            self.terms.clear()
        return out


def gated_sum_backward(dout: Tensor, term: Tensor, gates: Tensor, column: int,
                       d_gates: Tensor) -> Tensor:
    """The backward of one term of a gated sum out = sum_b gates[..., b] * o_b.

    Returns dL/d(term) = gates[..., column] * dout in dout's dtype and writes dL/d(gates) of the
    column, rowsum(dout * term), into d_gates[..., column] in d_gates' dtype. A row where dout is
    0 contributes exactly 0 (the loss does not depend on it: a NaN or Inf in its term must not
    reach the gate gradient). dout, term: (T, H, D) of one shape and dtype; gates, d_gates:
    (T, H, G) floating, on their device. One CuTe DSL pass on sm90
    (kernels/sm90/gated_sum.py), torch elsewhere; both add the products in float32 (float64
    for float64 terms)."""
    _check_term_backward(dout, term, gates, column, d_gates)
    if backward_runs_on_sm90(dout, d_gates):
        from kernels.sm90 import gated_sum

        return gated_sum.run_backward(_aligned(dout), (_aligned(term),),
                                      gates.to(torch.float32).contiguous(), (column,), d_gates)
    _write_gate_gradient(dout, term, column, d_gates)
    d_term = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)  # dense strides
    return torch.mul(gates[..., column, None], dout, out=d_term)


def gate_gradient(dout: Tensor, term: Tensor, column: int, d_gates: Tensor) -> None:
    """Only the gate gradient of `gated_sum_backward`: rowsum(dout * term) into
    d_gates[..., column], without the term's gradient (nsa()'s backward on the sm90 kernels
    folds the gate into the attention backward instead, and takes this row dot from the
    recomputing forward where that runs on the kernel); one pass over dout and term."""
    gate_gradients(dout, (term,), (column,), d_gates)


def gate_gradients(dout: Tensor, terms, columns, d_gates: Tensor) -> None:
    """`gate_gradient` of several terms at once: rowsum(dout * terms[i]) into
    d_gates[..., columns[i]]; on sm90 one pass reads dout once for up to three of them (nsa()'s
    backward with its branch outputs kept)."""
    terms, columns = tuple(terms), tuple(columns)
    if not terms or len(columns) != len(terms) or len(set(columns)) != len(columns):
        raise ValueError(f"terms, columns: expected one distinct gate column per term, got "
                         f"{len(terms)} terms and columns {columns}")
    for term, column in zip(terms, columns):
        _check_term_backward(dout, term, None, column, d_gates)
    if backward_runs_on_sm90(dout, d_gates):
        from kernels.sm90 import gated_sum

        dout = _aligned(dout)
        for first in range(0, len(terms), gated_sum.MAX_TERMS):
            last = first + gated_sum.MAX_TERMS
            gated_sum.run_backward(dout, tuple(_aligned(t) for t in terms[first:last]), None,
                                   columns[first:last], d_gates, term_gradient=False)
        return
    for term, column in zip(terms, columns):
        _write_gate_gradient(dout, term, column, d_gates)


def _write_gate_gradient(dout: Tensor, term: Tensor, column: int, d_gates: Tensor) -> None:
    """The torch path of the gate gradient, for checked arguments."""
    accumulate = torch.promote_types(dout.dtype, torch.float32)
    d_gates[..., column] = _masked_row_dot(dout, term, accumulate)


def _check_term_backward(dout: Tensor, term: Tensor, gates: Tensor | None, column: int,
                         d_gates: Tensor) -> None:
    if term.shape != dout.shape or term.dtype != dout.dtype or term.device != dout.device:
        raise ValueError(f"term: expected {tuple(dout.shape)} {dout.dtype} on {dout.device} "
                         f"like dout, got {tuple(term.shape)} {term.dtype} on {term.device}")
    for name, t in (("gates", gates), ("d_gates", d_gates)):
        if t is None:
            continue
        if (t.dim() != 3 or t.shape[:2] != dout.shape[:2] or not t.is_floating_point()
                or t.device != dout.device):
            raise ValueError(f"{name}: expected a floating ({dout.shape[0]}, {dout.shape[1]}, "
                             f"G) tensor on {dout.device}, got {tuple(t.shape)} {t.dtype} on "
                             f"{t.device}")
    width = d_gates.shape[-1] if gates is None else gates.shape[-1]
    if not 0 <= column < width or width != d_gates.shape[-1]:
        raise ValueError(f"column: {column} outside the {width} gate columns (d_gates "
                         f"has {d_gates.shape[-1]})")


def _masked_row_dot(d: Tensor, x: Tensor, accumulate: torch.dtype) -> Tensor:
    """rowsum(d * x) over the last dim in `accumulate`, a product with d == 0 counted as 0."""
    return (d.to(accumulate) * x).masked_fill_(d == 0, 0).sum(dim=-1)


def backward_runs_on_sm90(dout: Tensor, d_gates: Tensor) -> bool:
    """Whether `gated_sum_backward` (and `gate_gradient`) of a term like dout into d_gates runs
    the CuTe DSL pass."""
    if d_gates.dtype != torch.float32 or not d_gates.is_contiguous():
        return False
    return GatedSum.choose_backend(dout, backward=True)[0] == "sm90"


def _aligned(t: Tensor) -> Tensor:
    """t when contiguous and 16-byte aligned (the kernels load 16 bytes at a time), else a
    copy."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
