"""NSAFunction: the autograd Function behind nsa(), on packed varlen tensors.

Forward: compress K/V -> select blocks -> run the three branches through `kernels` -> gate;
`packed_forward` launches each branch as soon as its inputs exist (the window first, the dense
compressed branch after the compression, the selected one after the selection).
It saves the inputs, the compressed K/V, the compact block-sparse lists, each branch's lse and,
where nsa/memory_policy.py's rule says so, each branch's output. The backward takes each
branch's gate gradient <dO, o_b> from the kept output, or recomputes the branch for it (on the
sm90 kernels the recomputing forward writes that row dot instead of o_b), runs that branch's
attention backward (on the sm90 kernel with the gate folded into lse; elsewhere with
dO_b = g_b * dO on the output), adds its dq/dk/dv into the running sums and frees the branch's
tensors before the next, so without kept outputs the peak is one branch.
Near a document's start, where the window and the selected branch attend to the same keys,
the selected branch's lists leave those query tiles out and the window's output takes both
gates (nsa/window_covered.py; `describe_branches` decides, `packed_gradients` unfolds the gate
gradients).
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

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from kernels.autograd import refuse_double_backward
from kernels.device import kernels_unavailable
from kernels.dkv_sums import UnwrittenDkvSums, finish_dkv
from kernels.gated_sum import (GatedSum, backward_runs_on_sm90, gate_gradient,
                                gate_gradients, gated_sum_backward)
from kernels.sm90.backward import DqSums
from nsa.branches import (COMPRESSED, SELECTED, WINDOW, Branch, compressed_branch,
                          selected_branch, window_branch)
from nsa.compression import (compress_pair, compressed_block_starts, compressed_row_gradients,
                             compressed_cu_seqlens, compressed_row_tokens, compute_dtype)
from nsa.config import NSAConfig
from nsa.gating import NUM_BRANCHES, gate_backward, gate_weights
from nsa.selection import select_blocks
from nsa.streams import Beside, beside_applies
from nsa.validation import PackedSequences
from nsa.window_covered import (WindowCoveredRows, folded_gates, unfold_gate_gradients,
                                window_covered_rows, without_covered_tiles)
from sparsity import QueryRows
from sparsity.host_cache import cached

# The branches on the fused dQ share one float32 accumulator (`DqSums`); False: each zeroes and
# converts its own (a switch for the A/B, `tools/bench_nsa_vs_dense.py --switch`).
SHARED_DQ_SUMS = True
# With the branch outputs kept, the selected branch's backward runs last and its dQ kernel adds
# the fused branches' `DqSums` into its dQ (no conversion pass); False: the sums are converted
# at the end (the switch for the A/B).
SELECTED_CONSUMES_DQ_SUMS = True
# Where the selected branch consumes the sums and a later branch fuses dQ into them, the first
# branch (the compressed one) stores its dQ as the sums' first values instead of writing dq
# (`DqSums.stores_first`; from its dQ kernel, or on documents up to 8K tokens from its fused dQ:
# `kernels.sm90.backward.dq_store_opens_sums`): the sums are never zeroed and the consuming
# call reads no 16-bit dq back; False: it writes dq (the switch for the A/B).
DQ_KERNEL_OPENS_SUMS = True
# With the branch outputs kept, one pass over dO writes every branch's gate gradient
# (`branches_gate_gradients`); False: a pass per branch (the switch for the A/B).
SHARED_GATE_PASS = True
# The compressed branch's dk, dv stay per compressed token until the conversion of dk and dv
# reads them row by row (`KeyValueGradients.finish`); False: expanded to the keys' rows in
# float32 at once and added into (the switch for the A/B).
FINISH_COMPRESSED_DKV = True
# The forward launches the branches the selection does not choose keys for before selecting
# (`unselected_branches`), the window before compressing; False: every branch after the
# selection (the switch for the A/B).
UNSELECTED_FIRST = True
# Query tiles where the selected branch attends to exactly the window's keys (near a
# document's start) are left out of the selected branch, the window's output standing for
# both (nsa/window_covered.py); False: the selected branch computes them (the switch for the
# A/B).
WINDOW_COVERS_SELECTED = True
# The forward's compression, selection and the compressed and selected branches run on a
# high-priority stream beside the window's launch (nsa/streams.py says when); False: all on
# the current stream, in the same order (the switch for the A/B).
SELECTION_STREAM = True
# The backward builds the lists' transposes on that stream, beside its gate pass, which neither
# reads them nor writes what they read (about 20 small launches, 0.09 ms before the pass at 64K
# tokens on an H200); False: on the current stream, before the pass (the switch for the A/B).
LISTS_BESIDE_GATE_PASS = True


class NSAFunction(torch.autograd.Function):
    """nsa() on packed tensors: q (T, H, D), k, v (T, Hkv, D), cu_seqlens (S+1,) int32.

    Arguments are trusted (nsa() validates them); gradients flow to q, k, v, W_k, W_v, W_gate.
    host_cu_seqlens: cu_seqlens's values as nsa() read them; None reads them here (once).
    keep_outputs: keep the branch outputs for the backward instead of recomputing them
    (`nsa.memory_policy.keeps_branch_outputs` decides).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None, W_v: Tensor | None,
                W_gate: Tensor | None, cu_seqlens: Tensor, max_seqlen: int,
                config: NSAConfig, host_cu_seqlens: tuple[int, ...] | None = None,
                keep_outputs: bool = False, queries: QueryRows | None = None) -> Tensor:
        if host_cu_seqlens is None:
            host_cu_seqlens = tuple(cu_seqlens.tolist())
        sequences = PackedSequences(tuple(host_cu_seqlens), max_seqlen)
        out, branches, cu_seqlens_cmp, lses, kept = packed_forward(
            q, k, v, W_k, W_v, W_gate, cu_seqlens, sequences, config, keep_outputs, queries)
        ctx.num_branches = len(branches)
        ctx.save_for_backward(q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp,
                              *kept.compressed, kept.gates, kept.summed_gates, *lses,
                              *kept.outputs)
        ctx.branches, ctx.config, ctx.sequences = branches, config, sequences
        ctx.transposed_lists = None  # built by the first backward (`_transposed_lists`)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        # No graph is built (each branch's attention backward has none), so a gradient of these
        # gradients would be wrong: refuse it, never return a partial second order.
        # Read once: under torch.utils.checkpoint (non-reentrant) each saved tensor unpacks once.
        saved = ctx.saved_tensors
        with torch.no_grad():
            grads = _gradients(ctx, saved, dout)
        grads = refuse_double_backward("nsa()", grads, (dout, *saved[:6]))
        return (*grads, None, None, None, None, None, None)


@dataclass
class KeptForBackward:
    """What the forward keeps beyond the inputs and lses: the compressed keys and values in the
    input dtype (T / l rows: small; None: the backward compresses again) and, where kept, the
    branch outputs in branch order (empty where the backward recomputes them) with the gate
    weights (T, H, 3) that combined them (None: the backward computes them again; kept with
    the outputs only, 12 bytes a row and head, so the memory-tight recompute path keeps none),
    and where the window stands for the selected branch on some rows, the folded gates the
    outputs were summed with (`folded_gates`, kept with the gates: the backward's passes read
    them; None: the gates themselves)."""
    compressed: tuple[Tensor, Tensor] | None
    outputs: tuple[Tensor, ...] = ()
    gates: Tensor | None = None
    summed_gates: Tensor | None = None


def packed_forward(q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None, W_v: Tensor | None,
                   W_gate: Tensor | None, cu_seqlens: Tensor, sequences: PackedSequences,
                   config: NSAConfig, keep_outputs: bool = False,
                   queries: QueryRows | None = None, combine: bool = True
                   ) -> tuple[Tensor | GatedSum, list[Branch], Tensor, list[Tensor],
                              KeptForBackward]:
    """NSAFunction's forward without autograd: (out, the branches that ran, the compressed
    cu_seqlens, each branch's lse, what it keeps), the last four what `packed_gradients` needs.
    keep_outputs: keep the branch outputs (else the backward recomputes them).
    queries: q holds each sequence's rows from a tile-aligned position on, against all of the
    keys that cu_seqlens bounds (`sparsity.QueryRows`: context parallelism's sequence mode);
    None: q holds the keys' own rows.
    combine=False: out is the `GatedSum` of the branch outputs, not yet summed; each
    `sum_copy()` writes the sum into a new tensor (nsa/captured.py sums outside its graph,
    straight into the tensor it returns)."""
    window = (planned_window_branch(cu_seqlens, sequences, config, queries)
              if UNSELECTED_FIRST and config.window_size > 0 else None)
    lses, outputs = {}, {}
    # Before the fork: a packing's first call builds the covered rows on the current stream,
    # and the side stream's lists read them (without_covered_tiles), so they must be queued
    # before the point the side stream waits for.
    covered = window_covered(cu_seqlens, sequences, config, queries)
    # The gated sum: one pass over the branch outputs on sm90; elsewhere a float32 sum that
    # frees each output as it is added (kernels/gated_sum.py), unless they are kept. Outputs
    # wait here until it exists and, beside the side stream, until the join.
    gates, summed_gates, out, waiting = None, None, None, {}

    def start_sum() -> None:
        nonlocal gates, summed_gates, out
        gates = gate_weights(q, W_gate, config.branches)
        summed_gates = folded_gates(gates, covered)
        out = GatedSum(summed_gates, like=q,
                       keep_terms=keep_outputs or not combine)

    def add_waiting() -> None:
        for index in sorted(waiting):
            out.add(index, waiting.pop(index))

    def run(branch: Branch, keys: Tensor, values: Tensor) -> None:
        term, lses[branch.index] = branch.forward(q, keys, values)
        if keep_outputs:
            outputs[branch.index] = term
        waiting[branch.index] = term
        if out is not None and not beside.on:
            add_waiting()

    # Compression, selection and the selected branch on a high-priority stream beside the
    # window and the compressed branch (nsa/streams.py), forked before the window's launch and
    # joined before the outputs are summed.
    beside = Beside(q, beside_applies(q, sequences.max_seqlen, window is not None,
                                      SELECTION_STREAM))
    # The branches whose keys the selection does not choose are launched before it: from an
    # idle GPU their kernels run while the host compresses, selects blocks and builds the
    # selected branch's lists, which otherwise the GPU waited for (`profile_kernels --gaps
    # --from-idle`). The window reads q, k and v alone, so it goes first, before the
    # compression and before the rest of the side stream's set-up (host work only: what the
    # side stream reads must be queued before the fork).
    if window is not None:
        with beside.beside_side():
            run(window, k, v)
    with beside:
        with beside.side():
            cu_seqlens_cmp, k_cmp_scored, v_cmp = compress_keys(k, v, W_k, W_v, cu_seqlens,
                                                                sequences, config)
            k_cmp, v_cmp = k_cmp_scored.to(k.dtype), v_cmp.to(v.dtype)
        if not beside.on:
            start_sum()
            add_waiting()
        early = (unselected_branches(cu_seqlens, cu_seqlens_cmp, sequences, config, queries,
                                     window) if UNSELECTED_FIRST else {})
        if COMPRESSED in early:
            beside.wait_for_side()  # for k_cmp, v_cmp
            with beside.beside_side():
                run(early[COMPRESSED], k_cmp, v_cmp)
        with beside.side():
            selection = select_for_branches(q, k_cmp_scored, cu_seqlens, cu_seqlens_cmp,
                                            sequences, config, queries)
            del k_cmp_scored
            branches = describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences,
                                         config, queries, early or None)
            for branch in branches:
                if branch.index not in early:
                    run(branch, *((k_cmp, v_cmp) if branch.reads_compressed else (k, v)))
        if beside.on:
            start_sum()  # on the current stream while the side stream runs
    add_waiting()
    return (out.result() if combine else out, branches, cu_seqlens_cmp,
            [lses[branch.index] for branch in branches],
            KeptForBackward((k_cmp, v_cmp),
                            tuple(outputs[branch.index] for branch in branches if keep_outputs),
                            gates if keep_outputs else None,
                            summed_gates if keep_outputs and covered is not None else None))


def compress_and_plan(q: Tensor, k: Tensor, v: Tensor | None, W_k: Tensor | None,
                      W_v: Tensor | None, cu_seqlens: Tensor, sequences: PackedSequences,
                      config: NSAConfig, queries: QueryRows | None = None
                      ) -> tuple[list[Branch], Tensor, Tensor, Tensor | None]:
    """Compressed keys and values, selection and the branches: (branches, the compressed
    cu_seqlens, k_cmp and v_cmp in the compute dtype, k_cmp the one the selection scores read;
    v None gives v_cmp None). Deterministic, so a later call plans the same branches
    (nsa/ops.py's backward)."""
    cu_seqlens_cmp, k_cmp, v_cmp = compress_keys(k, v, W_k, W_v, cu_seqlens, sequences, config)
    branches = _plan_branches(q, k_cmp, cu_seqlens, cu_seqlens_cmp, sequences, config, queries)
    return branches, cu_seqlens_cmp, k_cmp, v_cmp


def compress_keys(k: Tensor, v: Tensor | None, W_k: Tensor | None, W_v: Tensor | None,
                  cu_seqlens: Tensor, sequences: PackedSequences, config: NSAConfig
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(the compressed cu_seqlens, k_cmp, v_cmp) in the compute dtype; v None gives v_cmp
    None."""
    # A function of the host bounds and l: kept across calls (sparsity/host_cache.py)
    cu_seqlens_cmp = cached(("compressed cu_seqlens", sequences.cu_seqlens,
                             config.compress_block_size), cu_seqlens,
                            lambda: compressed_cu_seqlens(cu_seqlens, config.compress_block_size))
    starts = compressed_starts(cu_seqlens, cu_seqlens_cmp, sequences, config)
    xs, weights = ((k,), (W_k,)) if v is None else ((k, v), (W_k, W_v))
    k_cmp, *v_cmp = compress_pair(xs, starts, config.compress_block_size, weights)
    return cu_seqlens_cmp, k_cmp, v_cmp[0] if v_cmp else None


def _gradients(ctx, saved: tuple, dout: Tensor) -> tuple:
    """(dq, dk, dv, dW_k, dW_v, dW_gate) of NSAFunction, None for absent weights, from its
    saved tensors."""
    (q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, k_cmp, v_cmp, gates, summed_gates,
     *rest) = saved
    lses, outputs = rest[:ctx.num_branches], tuple(rest[ctx.num_branches:])
    return packed_gradients(dout, q, k, v, W_k, W_v, W_gate, cu_seqlens, cu_seqlens_cmp, lses,
                            ctx.branches, ctx.sequences, ctx.config,
                            lambda: _transposed_lists(ctx),
                            KeptForBackward((k_cmp, v_cmp), outputs, gates, summed_gates))


def packed_gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, W_k: Tensor | None,
                     W_v: Tensor | None, W_gate: Tensor | None, cu_seqlens: Tensor,
                     cu_seqlens_cmp: Tensor, lses, branches: list[Branch],
                     sequences: PackedSequences, config: NSAConfig,
                     build_transposed: Callable[[], dict], kept: KeptForBackward | None = None,
                     convert_dkv: bool = True) -> tuple:
    """(dq, dk, dv, dW_k, dW_v, dW_gate) of `packed_forward`, None for absent weights, given
    what it returned; `build_transposed()` returns the lists' transposes as `transposed_lists`
    builds them (called once, beside the gate pass where the side stream applies: nothing here
    reads them before the branches' loop). kept: what the forward
    kept (None: compress and recompute every branch here). convert_dkv=False returns, in
    the place of dk and of dv both, their `KeyValueGradients` as the branches left them, for
    the caller to finish (nsa/captured.py finishes outside its graph, into the tensors it
    returns).

    Memory is what this is laid out for (1M tokens must train on one 80 GB GPU): one branch
    is recomputed at a time, and besides the inputs only these gradients stay alive between
    branches: dq in q's dtype, each branch's dq added as it comes (rounded once per branch;
    the branches on the fused dQ add into one float32 accumulator, `DqSums`, converted into dq
    at the end: it then lives from the first such branch to the end), and dk, dv in the
    compute dtype, which the first attention branch to reach them writes (`UnwrittenDkvSums`:
    never zeroed where its kernel stores them) and the others add into (the sm90 kernel adds
    its float32 partial sums there itself); the compressed branch's gradient stays per
    compressed token until the final conversion reads it row by row (`KeyValueGradients`,
    switch FINISH_COMPRESSED_DKV). On the sm90 kernel a branch needs neither its output nor
    g_b * dO in the attention backward (the kernel folds the gate into lse,
    `kernels.sm90.backward.gate_folded_lse`): the recomputing forward writes only the gate
    gradient <dO, o_b> (`fused_gate_pass`), and g_b * dO is never written. With kept outputs
    nothing is recomputed: on the kernel one pass reads dO and every o_b for all the gate
    gradients (`branches_gate_gradients`), elsewhere a pass per branch."""
    dtype = compute_dtype(q.dtype)
    dout = dout.contiguous()
    gates = kept.gates if kept is not None and kept.gates is not None else \
        gate_weights(q, W_gate, config.branches)
    # The branch outputs were summed with the folded gates (nsa/window_covered.py): their
    # passes and the kernels' folded lse read those, gate_backward the gates themselves.
    covered = _window_covered_of(branches)
    summed_gates = (kept.summed_gates if kept is not None and kept.summed_gates is not None
                    else folded_gates(gates, covered)).contiguous()
    d_gates = torch.zeros(*q.shape[:2], NUM_BRANCHES, dtype=dtype, device=q.device)
    dq = dk = dv = None
    compressed_rows = None  # the compressed branch's (dk, dv) per token (`KeyValueGradients`)
    dW_k = dW_v = dW_gate = None
    outputs = kept.outputs if kept is not None else ()
    kept_all = len(outputs) == len(branches)
    # The branches whose kernels fuse dQ (compressed keys from 32K tokens, the window from
    # 4096 keys; both while the accumulator is within kernels.sm90.spec.
    # FUSED_DQ_MAX_ACCUMULATOR_BYTES: up to 256K tokens at H=32, D=128) add into one float32
    # accumulator. With the outputs kept (memory is not tight) on the sm90 kernels the
    # selected branch runs last and its dQ kernel adds the sums into its dQ; when
    # recomputing, its order stays and the sums are converted at the end. Elsewhere (the
    # fallback, deterministic mode: no fused dQ) the order stays, so kept and recomputed
    # outputs give the same bits there.
    consumes = (kept_all and SELECTED_CONSUMES_DQ_SUMS and SHARED_DQ_SUMS
                and not config.deterministic and not kernels_unavailable(q.device))
    order = backward_order(branches, selected_last=consumes)
    # The transposes on the forward's side stream (nsa/streams.py: the same rule for when),
    # joined before the loop, whose kernels are the first to read them; the plans reference
    # them on the host only.
    lists_beside = Beside(q, LISTS_BESIDE_GATE_PASS and beside_applies(
        q, sequences.max_seqlen, True, SELECTION_STREAM))
    with lists_beside:
        with lists_beside.side():
            transposed = build_transposed()
        options = {branch.index: dict(deterministic=config.deterministic,
                                      block_sparse_transposed=transposed[branch.index])
                   for branch in branches}
        # The plans of the branches on k and v (the compressed keys come in the loop): whether
        # one of them fuses dQ decides whether the first call on the dQ kernel opens the sums.
        plans = {position: _plan_backward(branches[position], q, k, v, options)
                 for position in order if not branches[position].reads_compressed}
        stores_first = (consumes and DQ_KERNEL_OPENS_SUMS
                        and any(plan is not None and plan.fuses_dq for plan in plans.values()))
        dq_sums = (DqSums(consumes=consumes, stores_first=stores_first) if SHARED_DQ_SUMS
                   else None)
        # With every branch's output kept, their gate gradients come from one pass over dO.
        gates_written = kept_all and branches_gate_gradients(dout, outputs, branches, d_gates)
    branch: Branch
    for position in order:
        branch, lse = branches[position], lses[position]
        if branch.reads_compressed:
            starts = compressed_starts(cu_seqlens, cu_seqlens_cmp, sequences, config)
            if kept is not None and kept.compressed is not None:
                keys, values = kept.compressed
            else:
                keys, values = (x_cmp.to(x.dtype) for x_cmp, x in zip(
                    compress_pair((k, v), starts, config.compress_block_size, (W_k, W_v)),
                    (k, v)))
            accumulators = None  # the compressed keys' dk, dv: compressed_row_gradients below
        else:
            keys, values = k, v
            accumulators = (dk, dv)
            if dk is None:  # this branch writes them first: no zeroing where it stores
                dk, dv = (torch.empty(x.shape, dtype=dtype, device=x.device) for x in (k, v))
                accumulators = UnwrittenDkvSums((dk, dv))
        plan = (plans[position] if position in plans
                else _plan_backward(branch, q, keys, values, options))
        on_kernel = plan is not None
        step = None
        if position < len(outputs):
            step = gate_pass(branch.index, dout, outputs[position], summed_gates, d_gates, lse,
                             on_kernel=on_kernel, written=gates_written)
        elif on_kernel:
            step = fused_gate_pass(branch, dout, q, keys, values, summed_gates, d_gates, lse,
                                   plan)
        if step is None:
            branch_out, _ = branch.forward(q, keys, values)
            step = gate_pass(branch.index, dout, branch_out, summed_gates, d_gates, lse,
                             on_kernel=on_kernel)
            del branch_out  # kept by `step` only where the fallback reads it
        # dq after the first branch: the dQ kernel adds into it as it writes.
        dq, dk_b, dv_b = branch.backward(step.dout, q, keys, values, step.out, step.lse,
                                         dout_dot_out=step.dout_dot_out, lse_gate=step.lse_gate,
                                         dq_accumulator=dq, dkv_accumulators=accumulators,
                                         plan=plan, dq_sums=dq_sums,
                                         **options[branch.index])
        del step, keys, values
        if branch.reads_compressed:
            # dk_cmp, dv_cmp flow back through the projection and the mean pooling.
            l = config.compress_block_size
            # A function of the host bounds and l: kept across calls (sparsity/host_cache.py)
            row_tokens = cached(("compressed row tokens", sequences.cu_seqlens, l), cu_seqlens,
                                lambda: compressed_row_tokens(starts, l, k.shape[0]))
            (dk_rows, dW_k), (dv_rows, dW_v) = (
                compressed_row_gradients(d_b, x, starts, l, W)
                for d_b, x, W in ((dk_b, k, W_k), (dv_b, v, W_v)))
            if FINISH_COMPRESSED_DKV:  # read row by row where dk, dv are converted
                compressed_rows = (dk_rows, dv_rows, row_tokens)
            else:  # expanded to the rows now
                dk_x, dv_x = (rows.index_select(0, row_tokens) for rows in (dk_rows, dv_rows))
                dk = dk_x if dk is None else dk.add_(dk_x)
                dv = dv_x if dv is None else dv.add_(dv_x)
                del dk_x, dv_x
            del starts, row_tokens, dk_rows, dv_rows
        del dk_b, dv_b

    if dq_sums is not None:
        dq = dq_sums.finish(into=dq)
    if dq is None:  # no branch ran: nsa() refuses such a call, this keeps the function total
        dq = torch.zeros_like(q)
    if W_gate is not None:
        unfold_gate_gradients(d_gates, covered)
        dW_gate = gate_backward(q, W_gate, gates, d_gates, dq).to(W_gate.dtype)
    if dW_k is not None:
        dW_k = dW_k.to(W_k.dtype)
    if dW_v is not None:
        dW_v = dW_v.to(W_v.dtype)
    key_grads = KeyValueGradients(None if dk is None else (dk, dv), compressed_rows)
    if not convert_dkv:
        return dq, key_grads, key_grads, dW_k, dW_v, dW_gate
    return (dq, *key_grads.finish(k, v), dW_k, dW_v, dW_gate)


@dataclass
class KeyValueGradients:
    """dk and dv as nsa()'s backward leaves them before their conversion to the inputs' dtype:
    the attention branches' sums in the compute dtype (None: no such branch ran) and the
    compressed branch's gradients per compressed token, (dk rows, dv rows, row tokens) of
    `compressed_row_gradients` and `compressed_row_tokens` (None: none, or added already)."""
    sums: tuple[Tensor, Tensor] | None
    compressed_rows: tuple[Tensor, Tensor, Tensor] | None = None

    def finish(self, k: Tensor, v: Tensor, copy: bool = False) -> tuple[Tensor, Tensor]:
        """(dk, dv) like k and v: the sums and the compressed rows' expansion added and rounded
        once (one pass: `kernels.dkv_sums.finish_dkv`). copy: new tensors even where the sums
        are in the inputs' dtype already (float32 inputs), as a caller owning them needs."""
        if self.compressed_rows is None:
            if self.sums is None:
                return torch.zeros_like(k), torch.zeros_like(v)
            return tuple(g.to(x.dtype, copy=copy) for g, x in zip(self.sums, (k, v)))
        *rows, row_tokens = self.compressed_rows
        if self.sums is None:
            return tuple(r.index_select(0, row_tokens).to(x.dtype) for r, x in zip(rows, (k, v)))
        return finish_dkv(self.sums, tuple(rows), row_tokens, k.dtype)


def _plan_backward(branch: Branch, q: Tensor, keys: Tensor, values: Tensor, options: dict):
    """The branch's `Branch.plan_backward` with its options (`packed_gradients`); None without
    rows (the kernel path's checks would stand dO in for the absent output, and an empty dO
    may have any strides)."""
    if q.shape[0] == 0:
        return None
    return branch.plan_backward(q, keys, values, **options[branch.index])


def backward_order(branches: list[Branch], selected_last: bool) -> list[int]:
    """The positions of `branches` in the order their backward runs: as given, or with the
    selected branch last (its dQ kernel then sees every fused branch's sums)."""
    order = list(range(len(branches)))
    if selected_last:
        order.sort(key=lambda position: branches[position].index == SELECTED)
    return order


@dataclass
class BranchBackwardInputs:
    """What a branch's attention backward reads after `fused_gate_pass` or `gate_pass`: on the
    sm90 kernel dO itself, no output, the branch's lse with its gate to fold into it
    (`lse_gate`) and <dO, o_b> as its dO.O; elsewhere g_b * dO with the branch output and its
    lse."""
    dout: Tensor
    out: Tensor | None
    lse: Tensor
    dout_dot_out: Tensor | None
    lse_gate: tuple[Tensor, int] | None = None


def gate_pass(index: int, dout: Tensor, branch_out: Tensor, gates: Tensor, d_gates: Tensor,
              lse: Tensor, *, on_kernel: bool, written: bool = False) -> BranchBackwardInputs:
    """Branch `index`'s gate gradient dL/dg_b = <dO, o_b> (per row and head) into d_gates, and
    what its attention backward reads. out = sum_b g_b o_b, so dL/do_b = g_b dO: written only
    off the kernel. A zero dO contributes exactly zero, even against a non-finite output of a
    later row (its NaN must not reach dW_gate). written: d_gates holds the branch's column
    already (`branches_gate_gradients`)."""
    if on_kernel:
        if not written:
            gate_gradient(dout, branch_out, index, d_gates)
        return _folded_inputs(index, dout, gates, d_gates[..., index], lse)
    branch_dout = gated_sum_backward(dout, branch_out, gates, index, d_gates)
    return BranchBackwardInputs(branch_dout, branch_out, lse, None)


def branches_gate_gradients(dout: Tensor, outputs, branches: list[Branch],
                            d_gates: Tensor) -> bool:
    """Every branch's gate gradient <dO, o_b> from its kept output into d_gates in one pass
    that reads dO once (a pass per branch read it once each: 2 GiB at 256K tokens, H=32).
    False, writing nothing, where that pass is not the sm90 kernel: there each branch's
    `gate_pass` computes its own (off the kernel it also writes g_b * dO)."""
    if not SHARED_GATE_PASS or not backward_runs_on_sm90(dout, d_gates):
        return False
    gate_gradients(dout, outputs, [branch.index for branch in branches], d_gates)
    return True


def fused_gate_pass(branch: Branch, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    gates: Tensor, d_gates: Tensor, lse: Tensor,
                    plan) -> BranchBackwardInputs | None:
    """`gate_pass` on the kernel without the branch output: the recomputing forward writes
    <dO, o_b> per row and head from its float32 accumulator instead of o_b (2 x T x H x D
    bytes neither written nor read back). None where the forward kernel does not run.
    plan: the branch's `Branch.plan_backward` for these q, k, v."""
    row_dots = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    if not branch.output_row_dots(dout, q, k, v, row_dots, plan=plan):
        return None
    d_gates[..., branch.index] = row_dots.t()
    # The (H, T) row dots themselves as dO.O: the row-statistics kernel reads them so.
    return _folded_inputs(branch.index, dout, gates, row_dots.t(), lse)


def _folded_inputs(index: int, dout: Tensor, gates: Tensor, row_dots: Tensor,
                   lse: Tensor) -> BranchBackwardInputs:
    """The kernel's inputs once <dO, o_b> is known ((T, H) row_dots): dO itself, no output,
    the branch's lse with its gate to fold in (`kernels.sm90.backward.gate_folded_lse`: the
    plain backward on dO with lse - log g and <dO, o_b> as dO.O is the backward of g_b o_b),
    the gate gradient as dO.O."""
    return BranchBackwardInputs(dout, None, lse, row_dots, (gates, index))


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


def compressed_starts(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, sequences: PackedSequences,
                      config: NSAConfig) -> Tensor:
    """The first row of each compression block (`compressed_block_starts`), sized from host
    values; kept across calls with the same bounds (sparsity/host_cache.py: cu_seqlens_cmp is
    a function of them and l)."""
    l = config.compress_block_size
    num_compressed = sequences.compressed_cu_seqlens(l)[-1]
    return cached(("compressed block starts", sequences.cu_seqlens, l), cu_seqlens,
                  lambda: compressed_block_starts(cu_seqlens, cu_seqlens_cmp, l, num_compressed))


def _plan_branches(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                   sequences: PackedSequences, config: NSAConfig,
                   queries: QueryRows | None = None) -> list[Branch]:
    """Select blocks (scored against k_cmp in the compute dtype); describe the branches that run."""
    selection = select_for_branches(q, k_cmp, cu_seqlens, cu_seqlens_cmp, sequences, config,
                                    queries)
    return describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences, config, queries)


def select_for_branches(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                        sequences: PackedSequences, config: NSAConfig,
                        queries: QueryRows | None = None):
    """`select_blocks` as nsa() calls it: the host bounds handed over (no device read), and the
    selected branch's lists written by the selection kernel where it runs.
    tools/profile_nsa.py times this stage."""
    host_bounds = (sequences.cu_seqlens,
                   sequences.compressed_cu_seqlens(config.compress_block_size))
    return select_blocks(q, k_cmp, cu_seqlens, cu_seqlens_cmp, host_bounds=host_bounds,
                         write_selected_lists=True, queries=queries, **config.selection_kwargs())


def describe_branches(selection, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                      sequences: PackedSequences, config: NSAConfig,
                      queries: QueryRows | None = None,
                      unselected: dict[int, Branch] | None = None) -> list[Branch]:
    """The branches that run, in branch order, their block-sparse lists built from `selection`
    (`select_blocks`' result); unselected: those `unselected_branches` built already.
    tools/profile_nsa_forward.py times the stages as they run here."""
    branches = dict(unselected if unselected is not None else unselected_branches(
        cu_seqlens, cu_seqlens_cmp, sequences, config, queries))
    scale, max_seqlen, host = config.softmax_scale, sequences.max_seqlen, sequences.cu_seqlens
    if COMPRESSED not in branches:
        branches[COMPRESSED] = _compressed_branch(cu_seqlens, cu_seqlens_cmp, sequences, config,
                                                  queries, selection.cmp_selected)
    branches[SELECTED] = selected_branch(
        cu_seqlens, selection.selected, selected_block_size=config.selected_block_size,
        softmax_scale=scale, causal=config.causal, q_tile=config.q_tile,
        max_seqlen=max_seqlen, host_cu_seqlens=host, block_sparse=selection.selected_lists,
        queries=queries)
    covered = window_covered(cu_seqlens, sequences, config, queries)
    if covered is not None:
        selected = branches[SELECTED]
        lists = without_covered_tiles(selected.kernel_kwargs["block_sparse"], covered)
        branches[SELECTED] = dataclasses.replace(
            selected, kernel_kwargs=dict(selected.kernel_kwargs, block_sparse=lists),
            window_covered=covered)
    return [branches[index] for index in sorted(branches)]


def window_covered(cu_seqlens: Tensor, sequences: PackedSequences, config: NSAConfig,
                   queries: QueryRows | None = None) -> WindowCoveredRows | None:
    """The query tiles whose selected output the window's stands for in this call
    (nsa/window_covered.py); None where there are none, with WINDOW_COVERS_SELECTED off, or on
    `QueryRows` (rows that start inside their documents)."""
    if not WINDOW_COVERS_SELECTED or queries is not None:
        return None
    return window_covered_rows(cu_seqlens, sequences.cu_seqlens, config)


def _window_covered_of(branches: list[Branch]) -> WindowCoveredRows | None:
    """What the selected branch of `branches` left to the window (`describe_branches`)."""
    return next((branch.window_covered for branch in branches if branch.index == SELECTED),
                None)


def unselected_branches(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, sequences: PackedSequences,
                        config: NSAConfig, queries: QueryRows | None = None,
                        window: Branch | None = None) -> dict[int, Branch]:
    """The branches whose keys the selection does not choose, by index: the compressed branch
    over all of its keys (not with `num_cmp_selected_blocks`) and the window (`window`, where
    `planned_window_branch` gave it already)."""
    branches = {}
    if config.num_cmp_selected_blocks is None:
        branches[COMPRESSED] = _compressed_branch(cu_seqlens, cu_seqlens_cmp, sequences, config,
                                                  queries, None)
    if config.window_size > 0:
        branches[WINDOW] = (window if window is not None else
                            planned_window_branch(cu_seqlens, sequences, config, queries))
    return branches


def planned_window_branch(cu_seqlens: Tensor, sequences: PackedSequences, config: NSAConfig,
                          queries: QueryRows | None = None) -> Branch:
    """The window branch (config.window_size > 0): it needs neither the compression nor the
    selection."""
    return window_branch(cu_seqlens, window_size=config.window_size,
                         softmax_scale=config.softmax_scale, max_seqlen=sequences.max_seqlen,
                         host_cu_seqlens=sequences.cu_seqlens, queries=queries)


def _compressed_branch(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, sequences: PackedSequences,
                       config: NSAConfig, queries: QueryRows | None, cmp_selected) -> Branch:
    host_cmp = sequences.compressed_cu_seqlens(config.compress_block_size)
    return compressed_branch(
        cu_seqlens, cu_seqlens_cmp, compress_block_size=config.compress_block_size,
        softmax_scale=config.softmax_scale, causal=config.causal, cmp_selected=cmp_selected,
        q_tile=config.q_tile, cmp_kv_block=config.cmp_kv_block,
        max_seqlen=sequences.max_seqlen, host_cu_seqlens=(sequences.cu_seqlens, host_cmp),
        queries=queries)
