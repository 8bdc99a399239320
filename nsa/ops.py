"""nsa()'s forward and backward as `torch.library` custom ops, for torch.compile.

torch.compile cannot trace NSAFunction: selection reads the device, the block-list builders size
their tensors from values, and the kernels are opaque launches. So under compile nsa() calls two
ops, `nsa_cute::nsa_forward` and `nsa_cute::nsa_backward`, each opaque to the compiler (inside
them anything goes, host reads included), with fake implementations that give their output
shapes from the input shapes alone, and the backward registered as the forward's autograd.

Custom ops take tensors and primitives only, so NSAConfig travels as its fields and the
sequence bounds as a list of ints (`host_cu_seqlens`, what nsa() checked); both ops rebuild the
objects inside. The forward returns each branch's lse besides out (an absent window branch's is
an empty tensor) and each branch's output where nsa/memory_policy.py keeps them (else empty
tensors), all sized by q's shape (the rule depends on shapes only, so the fake agrees). The
backward recomputes compression and selection before NSAFunction's backward: the block-sparse
lists' sizes depend on values, so they cannot cross the op boundary, and selection is
deterministic, so the recomputed lists are the ones the forward used. That costs one selection
more per step than eager nsa(), which keeps the lists.

Eager nsa() does not use these ops (it keeps NSAFunction, its list cache and its double-backward
refusal); they compute the same values with the same code (`nsa.function.packed_forward`,
`packed_gradients`).
"""
from typing import Optional

import torch
from torch import Tensor

from nsa.compression import compute_dtype
from nsa.config import NSAConfig
from nsa.function import (KeptForBackward, compress_and_plan, packed_forward, packed_gradients,
                          transposed_lists)
from nsa.memory_policy import keeps_branch_outputs
from nsa.validation import PackedSequences

NAMESPACE = "nsa_cute"


def config_arguments(config: NSAConfig) -> tuple:
    """NSAConfig's fields in the order the ops take them (after max_seqlen)."""
    return (config.compress_block_size, config.selected_block_size, config.num_selected_blocks,
            config.window_size, config.causal, config.softmax_scale,
            config.num_cmp_selected_blocks, config.q_tile, config.cmp_kv_block,
            config.deterministic)


def _config(compress_block_size, selected_block_size, num_selected_blocks, window_size, causal,
            softmax_scale, num_cmp_selected_blocks, q_tile, cmp_kv_block,
            deterministic) -> NSAConfig:
    return NSAConfig(compress_block_size=compress_block_size,
                     selected_block_size=selected_block_size,
                     num_selected_blocks=num_selected_blocks, window_size=window_size,
                     causal=causal, softmax_scale=softmax_scale,
                     num_cmp_selected_blocks=num_cmp_selected_blocks, q_tile=q_tile,
                     cmp_kv_block=cmp_kv_block, deterministic=deterministic)


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The kernels' lse dtype: float32, float64 for float64 inputs (docs/interfaces.md)."""
    return compute_dtype(q.dtype)


def _contiguous(*tensors):
    """The compiler may hand an op other strides than eager's; the kernels want contiguous."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _absent(q: Tensor) -> Tensor:
    """Stands for a missing tensor output (an op cannot return None)."""
    return q.new_empty(0)


# --- forward -------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::nsa_forward", mutates_args=())
def nsa_forward(q: Tensor, k: Tensor, v: Tensor, W_k: Optional[Tensor], W_v: Optional[Tensor],
                W_gate: Optional[Tensor], cu_seqlens: Tensor, host_cu_seqlens: list[int],
                max_seqlen: int, compress_block_size: int, selected_block_size: int,
                num_selected_blocks: int, window_size: int, causal: bool,
                softmax_scale: float, num_cmp_selected_blocks: Optional[int], q_tile: int,
                cmp_kv_block: int, deterministic: bool, recompute: Optional[bool]
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out (T, H, D), lse of the compressed, selected and window branches (H, T) each; the
    window's is empty when window_size is 0; the three branch outputs (T, H, D) where they are
    kept for the backward, else empty). Packed, contiguous, validated inputs."""
    config = _config(compress_block_size, selected_block_size, num_selected_blocks, window_size,
                     causal, softmax_scale, num_cmp_selected_blocks, q_tile, cmp_kv_block,
                     deterministic)
    sequences = PackedSequences(tuple(host_cu_seqlens), max_seqlen)
    q, k, v, W_k, W_v, W_gate = _contiguous(q, k, v, W_k, W_v, W_gate)
    keep = keeps_branch_outputs(q, sum(config.branches), recompute)
    with torch.no_grad():
        out, _, _, lses, kept = packed_forward(q, k, v, W_k, W_v, W_gate, cu_seqlens, sequences,
                                               config, keep)
    if len(lses) < 3:
        lses.append(q.new_empty(0, dtype=_lse_dtype(q)))
    outputs = list(kept.outputs) + [_absent(q) for _ in range(3 - len(kept.outputs))]
    return (out, *lses, *outputs)


@nsa_forward.register_fake
def _nsa_forward_fake(q, k, v, W_k, W_v, W_gate, cu_seqlens, host_cu_seqlens, max_seqlen,
                      compress_block_size, selected_block_size, num_selected_blocks,
                      window_size, causal, softmax_scale, num_cmp_selected_blocks, q_tile,
                      cmp_kv_block, deterministic, recompute):
    rows, heads = q.shape[0], q.shape[1]
    lse = q.new_empty((heads, rows), dtype=_lse_dtype(q))
    window_lse = lse.new_empty((heads, rows) if window_size > 0 else (0,))
    num_branches = 3 if window_size > 0 else 2
    kept = num_branches if keeps_branch_outputs(q, num_branches, recompute) else 0
    outputs = [q.new_empty(q.shape) for _ in range(kept)] + [_absent(q) for _ in range(3 - kept)]
    return (q.new_empty(q.shape), lse, lse.new_empty(lse.shape), window_lse, *outputs)


# --- backward ------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::nsa_backward", mutates_args=())
def nsa_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, W_k: Optional[Tensor],
                 W_v: Optional[Tensor], W_gate: Optional[Tensor], cu_seqlens: Tensor,
                 lse_compressed: Tensor, lse_selected: Tensor, lse_window: Tensor,
                 out_compressed: Tensor, out_selected: Tensor, out_window: Tensor,
                 host_cu_seqlens: list[int], max_seqlen: int, compress_block_size: int,
                 selected_block_size: int, num_selected_blocks: int, window_size: int,
                 causal: bool, softmax_scale: float, num_cmp_selected_blocks: Optional[int],
                 q_tile: int, cmp_kv_block: int, deterministic: bool, recompute: Optional[bool]
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dW_k, dW_v, dW_gate) of nsa_forward's out; an absent weight's gradient is
    an empty tensor. out_*: the branch outputs nsa_forward kept (empty: recomputed here)."""
    config = _config(compress_block_size, selected_block_size, num_selected_blocks, window_size,
                     causal, softmax_scale, num_cmp_selected_blocks, q_tile, cmp_kv_block,
                     deterministic)
    sequences = PackedSequences(tuple(host_cu_seqlens), max_seqlen)
    q, k, v, W_k, W_v, W_gate = _contiguous(q, k, v, W_k, W_v, W_gate)
    lse_compressed, lse_selected, lse_window = _contiguous(lse_compressed, lse_selected,
                                                           lse_window)
    with torch.no_grad():
        # The forward's selection again (see the module's docstring): the same k_cmp in the
        # compute dtype, so the same scores and lists.
        branches, cu_seqlens_cmp = compress_and_plan(q, k, None, W_k, None, cu_seqlens,
                                                     sequences, config)[:2]
        lses = (lse_compressed, lse_selected, lse_window)[:len(branches)]
        outputs = _contiguous(out_compressed, out_selected, out_window)[:len(branches)]
        kept = KeptForBackward(None, outputs) if outputs[0].shape == q.shape else None
        grads = packed_gradients(dout.contiguous(), q, k, v, W_k, W_v, W_gate, cu_seqlens,
                                 cu_seqlens_cmp, lses, branches, sequences, config,
                                 lambda: transposed_lists(branches), kept)
    return tuple(_absent(q) if g is None else g for g in grads)


@nsa_backward.register_fake
def _nsa_backward_fake(dout, q, k, v, W_k, W_v, W_gate, cu_seqlens, lse_compressed,
                       lse_selected, lse_window, out_compressed, out_selected, out_window,
                       *_primitives):
    weights = tuple(_absent(q) if W is None else W.new_empty(W.shape) for W in (W_k, W_v, W_gate))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *weights)


# --- autograd: nsa_forward's gradient is nsa_backward --------------------------------------------

_TENSOR_INPUTS = 7  # q, k, v, W_k, W_v, W_gate, cu_seqlens: nsa_forward's leading arguments


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS], *output[1:])
    ctx.primitives = inputs[_TENSOR_INPUTS:]
    ctx.has_weight = tuple(W is not None for W in inputs[3:6])


def _backward(ctx, dout, *_lse_grads):
    # The lses are constants (as the kernels' entry points return them): no gradient flows
    # through them, so their incoming gradients are ignored.
    grads = nsa_backward(dout, *ctx.saved_tensors, *ctx.primitives)
    dq, dk, dv, *d_weights = grads
    d_weights = [g if present else None for g, present in zip(d_weights, ctx.has_weight)]
    return (dq, dk, dv, *d_weights) + (None,) * (1 + len(ctx.primitives))


nsa_forward.register_autograd(_backward, setup_context=_setup_context)
