"""NSAFunction: the autograd Function behind nsa(), on packed varlen tensors.

Forward: compress K/V -> select blocks -> run the three branches through `kernels` -> gate.
It saves the inputs, the compact block-sparse lists and each branch's lse, never a branch output:
the backward recomputes one branch at a time (its output is needed for dO.O and the gate
gradients), runs that branch's attention backward with dO_b = g_b * dO, adds its dq/dk/dv into
the running sums and frees the branch's tensors before the next, so the peak is one branch.
The lists' transposes that the sm90 backward reads are built once, on the first backward, and
kept with the saved lists (a retained graph's next backward reuses them); `config.deterministic`
goes to every branch's attention backward. The backward builds no autograd graph: gradients
taken with create_graph=True are right to first order, and differentiating them again raises
(`kernels.autograd.refuse_double_backward`).

The sequence bounds live on the host too (`PackedSequences`, as nsa() read them while checking):
the compressed bounds, the number of compressed tokens and every kernel call's checks use those
values, so after the checks only selection and the block-list builders read the device.

`packed_forward` and `packed_gradients` are the Function's work without its ctx: the custom ops
that torch.compile sees (nsa/ops.py) run them too.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.autograd import refuse_double_backward
from kernels.gated_sum import GatedSum, gated_sum_backward, sum_terms
from nsa.branches import Branch, compressed_branch, selected_branch, window_branch
from nsa.compression import (compress, compress_backward, compressed_block_rows,
                             compressed_cu_seqlens, compute_dtype)
from nsa.config import NSAConfig
from nsa.gating import NUM_BRANCHES, gate_backward, gate_weights
from nsa.selection import select_blocks
from nsa.validation import PackedSequences


class NSAFunction(torch.autograd.Function):
    """nsa() on packed tensors: q (T, H, D), k, v (T, Hkv, D), cu_seqlens (S+1,) int32.

    Arguments are trusted (nsa() validates them); gradients flow to q, k, v, W_k, W_v, W_gate.
    host_cu_seqlens: cu_seqlens's values as nsa() read them; None reads them here (once).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None, W_v: Tensor | None,
                W_gate: Tensor | None, cu_seqlens: Tensor, max_seqlen: int,
                config: NSAConfig, host_cu_seqlens: tuple[int, ...] | None = None) -> Tensor:
        if host_cu_seqlens is None:
            host_cu_seqlens = tuple(cu_seqlens.tolist())
        sequences = PackedSequences(tuple(host_cu_seqlens), max_seqlen)
        out, branches, cu_seqlens_cmp, lses = packed_forward(
            q, k, v, W_k, W_v, W_gate, cu_seqlens, sequences, config)
        ctx.save_for_backward(q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, *lses)
        ctx.branches, ctx.config, ctx.sequences = branches, config, sequences
        ctx.transposed_lists = None  # built by the first backward (`_transposed_lists`)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        # No graph is built (each branch's attention backward has none), so a gradient of these
        # gradients would be wrong: refuse it, never return a partial second order.
        with torch.no_grad():
            grads = _gradients(ctx, dout)
        q, k, v, W_k, W_v, W_gate = ctx.saved_tensors[:6]
        grads = refuse_double_backward("nsa()", grads, (dout, q, k, v, W_k, W_v, W_gate))
        return (*grads, None, None, None, None)


def packed_forward(q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None, W_v: Tensor | None,
                   W_gate: Tensor | None, cu_seqlens: Tensor, sequences: PackedSequences,
                   config: NSAConfig) -> tuple[Tensor, list[Branch], Tensor, list[Tensor]]:
    """NSAFunction's forward without autograd: (out, the branches that ran, the compressed
    cu_seqlens, each branch's lse), the last three what `packed_gradients` needs."""
    branches, cu_seqlens_cmp, rows, k_cmp = compress_and_plan(q, k, W_k, cu_seqlens, sequences,
                                                              config)
    k_cmp, v_cmp = k_cmp.to(k.dtype), compress(v, rows, W_v).to(v.dtype)
    del rows

    # One pass over the branch outputs on sm90; elsewhere a float32 sum that frees each
    # output as it is added (kernels/gated_sum.py).
    out = GatedSum(gate_weights(q, W_gate, config.branches), like=q)
    lses = []
    for branch in branches:
        keys, values = (k_cmp, v_cmp) if branch.reads_compressed else (k, v)
        branch_out, lse = branch.forward(q, keys, values)
        out.add(branch.index, branch_out)
        lses.append(lse)
        del branch_out
    del k_cmp, v_cmp
    return out.result(), branches, cu_seqlens_cmp, lses


def compress_and_plan(q: Tensor, k: Tensor, W_k: Tensor | None, cu_seqlens: Tensor,
                      sequences: PackedSequences, config: NSAConfig
                      ) -> tuple[list[Branch], Tensor, Tensor, Tensor]:
    """Compressed keys, selection and the branches: (branches, the compressed cu_seqlens, the
    rows of each compression block, k_cmp in the compute dtype, which the selection scores
    read). Deterministic, so a later call plans the same branches (nsa/ops.py's backward)."""
    cu_seqlens_cmp = compressed_cu_seqlens(cu_seqlens, config.compress_block_size)
    rows = compressed_rows(cu_seqlens, cu_seqlens_cmp, sequences, config)
    k_cmp = compress(k, rows, W_k)
    branches = _plan_branches(q, k_cmp, cu_seqlens, cu_seqlens_cmp, sequences, config)
    return branches, cu_seqlens_cmp, rows, k_cmp


def _gradients(ctx, dout: Tensor) -> tuple:
    """(dq, dk, dv, dW_k, dW_v, dW_gate) of NSAFunction, None for absent weights."""
    q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, *lses = ctx.saved_tensors
    return packed_gradients(dout, q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, lses,
                            ctx.branches, ctx.sequences, ctx.config, _transposed_lists(ctx))


def packed_gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None,
                     W_v: Tensor | None, W_gate: Tensor | None, cu_seqlens: Tensor,
                     cu_seqlens_cmp: Tensor, lses, branches: list[Branch],
                     sequences: PackedSequences, config: NSAConfig, transposed: dict) -> tuple:
    """(dq, dk, dv, dW_k, dW_v, dW_gate) of `packed_forward`, None for absent weights, given
    what it returned; `transposed` as `_transposed_lists` builds it."""
    dtype = compute_dtype(q.dtype)
    dout = dout.contiguous()
    gates = gate_weights(q, W_gate, config.branches).contiguous()

    d_gates = torch.zeros(*q.shape[:2], NUM_BRANCHES, dtype=dtype, device=q.device)
    # Each branch's dq, dk, dv (the kernels' output type) are kept and added once at the end,
    # in float32 and rounded once (kernels.gated_sum.sum_terms): the same sums as float32
    # accumulators updated branch by branch, for a fraction of the memory traffic (a float32
    # (T, H, D) read and written per branch). Float32 partials (the compressed branch's dk, dv
    # through compress_backward, the gate's dq) start the sums.
    grads = {"q": _Sum(q), "k": _Sum(k), "v": _Sum(v)}
    dW_k = dW_v = dW_gate = None

    branch: Branch
    for branch, lse in zip(branches, lses):
        if branch.reads_compressed:
            rows = compressed_rows(cu_seqlens, cu_seqlens_cmp, sequences, config)
            keys = compress(k, rows, W_k).to(k.dtype)
            values = compress(v, rows, W_v).to(v.dtype)
        else:
            keys, values = k, v
        branch_out, _ = branch.forward(q, keys, values)
        options = dict(deterministic=config.deterministic,
                       block_sparse_transposed=transposed[branch.index])
        # On the sm90 kernel the attention backward reads the branch output only for
        # rowsum(dO_b * o_b); the gate pass below writes it, so the output (a (T, H, D) tensor)
        # is freed before the backward, the largest one alive there.
        row_dots = None
        if branch.backward_takes_row_dots(q, keys, values, **options):
            row_dots = torch.empty(q.shape[:2], dtype=dtype, device=q.device)
        # out = sum_b g_b o_b: dL/dg_b = <dO, o_b> per row and head, dL/do_b = g_b dO, in one
        # pass (kernels.gated_sum); a zero dO contributes exactly zero, even against a
        # non-finite output of a later row (its NaN must not reach dW_gate).
        branch_dout = gated_sum_backward(dout, branch_out, gates, branch.index, d_gates,
                                         row_dots)
        if row_dots is not None:
            del branch_out
            branch_out = None
        dq_b, dk_b, dv_b = branch.backward(branch_dout, q, keys, values, branch_out, lse,
                                           dout_dot_out=row_dots, **options)
        del branch_out, branch_dout, keys, values, row_dots
        grads["q"].add(dq_b)
        if branch.reads_compressed:
            # dk_cmp, dv_cmp flow back through the projection and the mean pooling.
            dk_b, dW_k = compress_backward(dk_b, k, rows, W_k)
            dv_b, dW_v = compress_backward(dv_b, v, rows, W_v)
            del rows
        grads["k"].add(dk_b)
        grads["v"].add(dv_b)
        del dq_b, dk_b, dv_b

    if W_gate is not None:
        dq_gate, dW_gate = gate_backward(q, W_gate, gates, d_gates)
        grads["q"].add(dq_gate)
        dW_gate = dW_gate.to(W_gate.dtype)
        del dq_gate
    if dW_k is not None:
        dW_k = dW_k.to(W_k.dtype)
    if dW_v is not None:
        dW_v = dW_v.to(W_v.dtype)
    return grads["q"].result(), grads["k"].result(), grads["v"].result(), dW_k, dW_v, dW_gate


class _Sum:
    """One gradient's per-branch terms, all fresh tensors of this backward (they are consumed).
    For half-precision inputs the terms in the input type are kept for `sum_terms` and the
    compute-dtype ones added into its base; for float32/float64 inputs everything is added
    into the base as it arrives."""

    def __init__(self, like: Tensor):
        self.like = like
        self.keep = like.dtype != compute_dtype(like.dtype)
        self.terms: list[Tensor] = []
        self.base: Tensor | None = None

    def add(self, term: Tensor) -> None:
        if self.keep and term.dtype == self.like.dtype:
            self.terms.append(term)
        elif self.base is None:
            self.base = term.to(compute_dtype(self.like.dtype))
        else:
            self.base.add_(term)

    def result(self) -> Tensor:
        """The sum in the input dtype (zeros without terms)."""
        if self.terms:
            return sum_terms(self.terms, self.base)
        if self.base is not None:
            return self.base.to(self.like.dtype)
        return torch.zeros_like(self.like)


def _transposed_lists(ctx) -> dict:
    """Branch index -> its lists' transpose for the sm90 backward (None where there is nothing
    to transpose or no kernel runs); built on the first backward, not in the forward: a forward
    cannot tell whether a backward will follow (under no_grad it still sees needs_input_grad)."""
    if ctx.transposed_lists is None:
        ctx.transposed_lists = transposed_lists(ctx.branches)
    return ctx.transposed_lists


def transposed_lists(branches: list[Branch]) -> dict:
    """Branch index -> `Branch.transposed_lists()` (see `_transposed_lists`)."""
    return {branch.index: branch.transposed_lists() for branch in branches}


def compressed_rows(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, sequences: PackedSequences,
                    config: NSAConfig) -> Tensor:
    """The rows of each compression block (`compressed_block_rows`), sized from host values."""
    l = config.compress_block_size
    num_compressed = sequences.compressed_cu_seqlens(l)[-1]
    return compressed_block_rows(cu_seqlens, cu_seqlens_cmp, l, num_compressed)


def _plan_branches(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                   sequences: PackedSequences, config: NSAConfig) -> list[Branch]:
    """Select blocks (scored against k_cmp in the compute dtype); describe the branches that run."""
    host_bounds = (sequences.cu_seqlens,
                   sequences.compressed_cu_seqlens(config.compress_block_size))
    selection = select_blocks(q, k_cmp, cu_seqlens, cu_seqlens_cmp, host_bounds=host_bounds,
                              **config.selection_kwargs())
    return describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences, config)


def describe_branches(selection, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                      sequences: PackedSequences, config: NSAConfig) -> list[Branch]:
    """The branches that run, their block-sparse lists built from `selection`
    (`select_blocks`' result). tools/profile_nsa_forward.py times the stages as they run here."""
    scale, max_seqlen, host = config.softmax_scale, sequences.max_seqlen, sequences.cu_seqlens
    host_cmp = sequences.compressed_cu_seqlens(config.compress_block_size)
    branches = [
        compressed_branch(cu_seqlens, cu_seqlens_cmp,
                          compress_block_size=config.compress_block_size, softmax_scale=scale,
                          causal=config.causal, cmp_selected=selection.cmp_selected,
                          q_tile=config.q_tile, cmp_kv_block=config.cmp_kv_block,
                          max_seqlen=max_seqlen, host_cu_seqlens=(host, host_cmp)),
        selected_branch(cu_seqlens, selection.selected,
                        selected_block_size=config.selected_block_size, softmax_scale=scale,
                        causal=config.causal, q_tile=config.q_tile, max_seqlen=max_seqlen,
                        host_cu_seqlens=host),
    ]
    if config.window_size > 0:
        branches.append(window_branch(cu_seqlens, window_size=config.window_size,
                                      softmax_scale=scale, max_seqlen=max_seqlen,
                                      host_cu_seqlens=host))
    return branches
