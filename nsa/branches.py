"""The three attention branches of NSA as calls of the `kernels` entry points.

A `Branch` is the keyword arguments of kernels.attention_forward/backward for one branch (the
sequences, the mask and the block-sparse lists), built once per nsa() call and replayed in the
backward. The public functions below run one branch alone with the signatures of their
`nsa.reference` counterparts, so the tests compare them piece by piece.

Inside nsa() a branch also carries the host values of its cu_seqlens, which nsa() read and
checked once, and calls the kernels' trusted entry points: the same checks without reading the
device again (nine attention calls per layer would otherwise stall a GPU each time). Its lists
come from `sparsity`'s builders, which check their inputs themselves.

The sm90 backward walks KV blocks and needs the lists transposed (`Branch.transposed_lists`);
nsa() builds them once per call and passes them to each branch's backward, rather than letting
every backward call build its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

import kernels
from kernels.device import kernels_unavailable
from kernels.interface import (KernelBackward, add_into_accumulators,
                               attention_backward_trusted, attention_forward_trusted,
                               plan_backward_trusted,
                               transpose_block_sparse_trusted)
from sparsity import (BlockSparseTensors, QueryRows, build_compressed_block_sparse,
                      build_compressed_block_sparse_trusted, build_selected_block_sparse,
                      build_selected_block_sparse_trusted)
from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE

COMPRESSED, SELECTED, WINDOW = 0, 1, 2  # branch order, also the gate order of W_gate (H, 3, D)

HostBounds = tuple[int, ...]  # the values of a (S+1,) cu_seqlens tensor, on the host


@dataclass(frozen=True, eq=False)
class Branch:
    """One branch: reads the compressed keys/values or the original ones, with these kernel
    keyword arguments (cu_seqlens_*, max_seqlen_*, softmax_scale, causal, compress_factor,
    window_size, block_sparse)."""

    index: int  # COMPRESSED, SELECTED or WINDOW
    kernel_kwargs: dict
    # The values of kernel_kwargs' (cu_seqlens_q, cu_seqlens_k) as nsa() checked them; None: the
    # kernels check (and read) them on every call.
    host_cu_seqlens: tuple[HostBounds, HostBounds] | None = None
    # The selected branch inside nsa(): the query tiles left out of its lists because the
    # window's output stands for theirs (an nsa.window_covered.WindowCoveredRows); None: none.
    window_covered: object | None = None

    @property
    def reads_compressed(self) -> bool:
        return self.index == COMPRESSED

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(out, lse) of this branch; k, v are the compressed ones for the compressed branch."""
        if self.host_cu_seqlens is None:
            return kernels.attention_forward(q, k, v, **self.kernel_kwargs)
        return attention_forward_trusted(q, k, v, host_cu_seqlens=self.host_cu_seqlens,
                                         **self.kernel_kwargs)

    def output_row_dots(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                        into: Tensor, plan: KernelBackward) -> bool:
        """rowsum(dout * o) per row and head of this branch's output o into `into` ((H, T)
        contiguous float32) without writing o, on the sm90 forward kernel of `plan` (this
        branch's `plan_backward` for these q, k, v); False (nothing written) where that kernel
        does not run (the caller then recomputes o with `forward`)."""
        _check_planned(plan, q, k, v)
        return plan.row_dots(dout, into)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None,
                 lse: Tensor, *, deterministic: bool = False, block_sparse_transposed=None,
                 dout_dot_out: Tensor | None = None, lse_gate: tuple[Tensor, int] | None = None,
                 dq_accumulator: Tensor | None = None,
                 dkv_accumulators: tuple[Tensor, Tensor] | None = None,
                 plan: KernelBackward | None = None,
                 dq_sums=None) -> tuple[Tensor | None, Tensor, Tensor]:
        """(dq, dk, dv), dk and dv summed over each KV group. block_sparse_transposed: this
        branch's `transposed_lists()`, or None (the kernels build them when they need them).
        plan: this branch's `plan_backward` for these q, k, v and options: the call then goes
        straight to its kernel with dout_dot_out, rowsum(dout * out) (T, H) in place of out,
        and lse_gate (gates, b), the gate the kernel folds into lse (only a plan takes these
        two). Without a plan, out is read. dq_accumulator: a tensor like q that dq is added
        into; dkv_accumulators: (dk_sum, dv_sum) float32 tensors that dk and dv are added into
        (both returned as the results). dq_sums (with a plan; a
        `kernels.sm90.backward.DqSums`): where the kernel fuses dQ, it adds into these float32
        sums shared with the other branches and returns dq_accumulator as dq (None without
        one); the caller converts the sums once (`DqSums.finish`)."""
        if plan is not None:
            _check_planned(plan, q, k, v)
            return plan.backward(dout, lse, dout_dot_out=dout_dot_out, lse_gate=lse_gate,
                                 dq_accumulator=dq_accumulator,
                                 dkv_accumulators=dkv_accumulators, dq_sums=dq_sums)
        if dout_dot_out is not None or lse_gate is not None:
            raise ValueError("dout_dot_out, lse_gate: only a planned backward takes them "
                             "(Branch.plan_backward)")
        kwargs = dict(self.kernel_kwargs, deterministic=deterministic,
                      block_sparse_transposed=block_sparse_transposed)
        if self.host_cu_seqlens is None:
            return add_into_accumulators(
                kernels.attention_backward(dout, q, k, v, out, lse, **kwargs), dq_accumulator,
                dkv_accumulators)
        return attention_backward_trusted(dout, q, k, v, out, lse,
                                          host_cu_seqlens=self.host_cu_seqlens,
                                          dq_accumulator=dq_accumulator,
                                          dkv_accumulators=dkv_accumulators, **kwargs)

    def plan_backward(self, q: Tensor, k: Tensor, v: Tensor, *, deterministic: bool = False,
                      block_sparse_transposed=None) -> KernelBackward | None:
        """This branch's backward on the sm90 kernels for these q, k, v, checked and dispatched
        once (`kernels.interface.plan_backward_trusted`), for `output_row_dots` and `backward`;
        None where the backward kernel does not run or without the host bounds."""
        if self.host_cu_seqlens is None:
            return None
        return plan_backward_trusted(q, k, v, host_cu_seqlens=self.host_cu_seqlens,
                                     deterministic=deterministic,
                                     block_sparse_transposed=block_sparse_transposed,
                                     **self.kernel_kwargs)

    def transposed_lists(self):
        """This branch's block-sparse lists in the backward's layout (a sparsity.BlockSparseCSR)
        when the sm90 backward will read them, built without reading the device. None without
        lists, where no kernel runs (the fallback reads the forward lists: building them would
        be wasted work), or without the host bounds (the kernels then build them per call)."""
        block_sparse = self.kernel_kwargs.get("block_sparse")
        if (block_sparse is None or self.host_cu_seqlens is None
                or kernels_unavailable(block_sparse.full_count.device)):
            return None
        return transpose_block_sparse_trusted(block_sparse,
                                              cu_seqlens_k=self.kernel_kwargs["cu_seqlens_k"],
                                              host_cu_seqlens_k=self.host_cu_seqlens[1],
                                              host_cu_seqlens_q=self.host_cu_seqlens[0])


def _check_planned(plan: KernelBackward, q: Tensor, k: Tensor, v: Tensor) -> None:
    """A plan runs the tensors it was made for: refuse others rather than compute their
    gradients from the planned ones."""
    if q is not plan.q or k is not plan.k or v is not plan.v:
        raise ValueError("plan: made for other q, k, v tensors (Branch.plan_backward)")


def compressed_branch(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, *, compress_block_size: int,
                      softmax_scale: float, causal: bool, cmp_selected: Tensor | None = None,
                      q_tile: int = SELECTION_Q_TILE, cmp_kv_block: int = CMP_KV_BLOCK,
                      max_seqlen: int | None = None,
                      host_cu_seqlens: tuple[HostBounds, HostBounds] | None = None,
                      queries: QueryRows | None = None) -> Branch:
    """Attention to the compressed tokens: causal with compress_factor = l; block-sparse over
    blocks of cmp_kv_block compressed tokens when cmp_selected (R, Hkv, n) is given.
    host_cu_seqlens: the checked values of (cu_seqlens, cu_seqlens_cmp), if the caller has them.
    queries: q holds each sequence's rows from a position on (`QueryRows`; with host bounds)."""
    block_sparse = None
    if cmp_selected is not None:
        block_sparse = _compressed_block_sparse(cu_seqlens, cu_seqlens_cmp, cmp_selected,
                                                compress_block_size, q_tile, cmp_kv_block, causal,
                                                host_cu_seqlens, queries)
    max_seqlen_cmp = None if max_seqlen is None else max_seqlen // compress_block_size
    kwargs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens_cmp, max_seqlen_q=max_seqlen,
                  max_seqlen_k=max_seqlen_cmp, softmax_scale=softmax_scale, causal=causal,
                  compress_factor=compress_block_size, block_sparse=block_sparse)
    return Branch(COMPRESSED, *_on_query_rows(kwargs, host_cu_seqlens, queries))


def selected_branch(cu_seqlens: Tensor, selected: Tensor, *, selected_block_size: int,
                    softmax_scale: float, causal: bool, q_tile: int = SELECTION_Q_TILE,
                    max_seqlen: int | None = None,
                    host_cu_seqlens: HostBounds | None = None,
                    block_sparse: BlockSparseTensors | None = None,
                    queries: QueryRows | None = None) -> Branch:
    """Attention to the selected blocks (R, Hkv, k): kernel tiles of q_tile rows and
    selected_block_size keys, causal inside the diagonal blocks.
    host_cu_seqlens: the checked values of cu_seqlens, if the caller has them: then the lists
    are built without reading the device (padded to host bounds, not to the longest list).
    block_sparse: those lists, when the caller has them already (nsa()'s selection kernel
    writes them with `selected`); trusted like host_cu_seqlens, which it requires.
    queries: q holds each sequence's rows from a position on (`QueryRows`; with host bounds)."""
    if queries is not None and host_cu_seqlens is None:
        raise ValueError("queries: trusted calls only (pass host_cu_seqlens)")
    if block_sparse is not None:
        if host_cu_seqlens is None:
            raise ValueError("block_sparse: given lists need host_cu_seqlens (trusted calls)")
    elif host_cu_seqlens is None:
        block_sparse = build_selected_block_sparse(
            selected, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, q_tile=q_tile,
            selected_block_size=selected_block_size, kv_block=selected_block_size, causal=causal)
    else:
        block_sparse = build_selected_block_sparse_trusted(
            selected, cu_seqlens=cu_seqlens, host_cu_seqlens=host_cu_seqlens, q_tile=q_tile,
            selected_block_size=selected_block_size, kv_block=selected_block_size, causal=causal,
            queries=queries)
    kwargs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                  max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=causal,
                  block_sparse=block_sparse)
    return Branch(SELECTED, *_on_query_rows(kwargs, _self_attention(host_cu_seqlens), queries))


def window_branch(cu_seqlens: Tensor, *, window_size: int, softmax_scale: float,
                  max_seqlen: int | None = None,
                  host_cu_seqlens: HostBounds | None = None,
                  queries: QueryRows | None = None) -> Branch:
    """Sliding window: row i sees keys i - window_size < j <= i.
    host_cu_seqlens: the checked values of cu_seqlens, if the caller has them.
    queries: q holds each sequence's rows from a position on (`QueryRows`; with host bounds)."""
    kwargs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                  max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=True,
                  window_size=(window_size - 1, 0))
    return Branch(WINDOW, *_on_query_rows(kwargs, _self_attention(host_cu_seqlens), queries))


def _self_attention(host_cu_seqlens: HostBounds | None) -> tuple[HostBounds, HostBounds] | None:
    return None if host_cu_seqlens is None else (host_cu_seqlens, host_cu_seqlens)


def _on_query_rows(kwargs: dict, host_cu_seqlens, queries: QueryRows | None) -> tuple:
    """A branch's (kernel kwargs, host bounds), with q holding `queries`' rows instead of the
    keys' own: their bounds, their longest sequence and their first positions."""
    if queries is None:
        return kwargs, host_cu_seqlens
    if host_cu_seqlens is None:
        raise ValueError("queries: trusted calls only (pass host_cu_seqlens)")
    bounds = queries.host_cu_seqlens
    kwargs = dict(kwargs, cu_seqlens_q=queries.cu_seqlens,
                  max_seqlen_q=max((b - a for a, b in zip(bounds, bounds[1:])), default=0),
                  q_start_positions=queries.start_positions)
    return kwargs, (bounds, host_cu_seqlens[1])


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor,
                         cu_seqlens_cmp: Tensor, *, compress_block_size: int,
                         softmax_scale: float, causal: bool = True,
                         cmp_selected: Tensor | None = None, q_tile: int = SELECTION_Q_TILE,
                         cmp_kv_block: int = CMP_KV_BLOCK) -> Tensor:
    """The compressed branch alone; see nsa.reference.compressed_attention_reference."""
    branch = compressed_branch(cu_seqlens, cu_seqlens_cmp, compress_block_size=compress_block_size,
                               softmax_scale=softmax_scale, causal=causal,
                               cmp_selected=cmp_selected, q_tile=q_tile, cmp_kv_block=cmp_kv_block)
    return branch.forward(q, k_cmp, v_cmp)[0]


def selected_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, selected: Tensor, *,
                       selected_block_size: int, softmax_scale: float, causal: bool = True,
                       q_tile: int = SELECTION_Q_TILE) -> Tensor:
    """The selected branch alone; see nsa.reference.selected_attention_reference."""
    branch = selected_branch(cu_seqlens, selected, selected_block_size=selected_block_size,
                             softmax_scale=softmax_scale, causal=causal, q_tile=q_tile)
    return branch.forward(q, k, v)[0]


def window_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, window_size: int,
                     softmax_scale: float) -> Tensor:
    """The window branch alone; see nsa.reference.window_attention_reference."""
    branch = window_branch(cu_seqlens, window_size=window_size, softmax_scale=softmax_scale)
    return branch.forward(q, k, v)[0]


def _compressed_block_sparse(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, cmp_selected: Tensor,
                             compress_block_size: int, q_tile: int, cmp_kv_block: int,
                             causal: bool, host_cu_seqlens=None,
                             queries: QueryRows | None = None) -> BlockSparseTensors:
    if causal and host_cu_seqlens is not None:  # no device read (CUDA graphs)
        # The query rows: the keys' own (every row from position 0), or `queries`'.
        cu_q, host_q, starts = ((cu_seqlens, host_cu_seqlens[0], None) if queries is None else
                                (queries.cu_seqlens, queries.host_cu_seqlens,
                                 queries.start_positions))
        return build_compressed_block_sparse_trusted(
            cmp_selected, cu_seqlens_q=cu_q, cu_seqlens_k_cmp=cu_seqlens_cmp,
            host_cu_seqlens_q=host_q, compress_factor=compress_block_size, q_tile=q_tile,
            kv_block=cmp_kv_block, start_positions=starts)
    if queries is not None:
        raise ValueError("queries: causal trusted calls only (pass host_cu_seqlens)")
    if causal:
        # Adds block 0 and the diagonal blocks (already in cmp_selected) and classifies them
        # under the compressed causal mask.
        return build_compressed_block_sparse(
            cu_seqlens_q=cu_seqlens, cu_seqlens_k_cmp=cu_seqlens_cmp,
            compress_factor=compress_block_size, q_tile=q_tile, kv_block=cmp_kv_block,
            selected=cmp_selected)
    # Non-causal there is no compressed mask: every listed block is simply attended whole.
    return build_selected_block_sparse(
        cmp_selected, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens_cmp, q_tile=q_tile,
        selected_block_size=cmp_kv_block, kv_block=cmp_kv_block, causal=False)
