"""Where a call runs: the sm90 kernel that computes it, or the torch path and why.

Every entry point asks here: the attention functions of `kernels.interface` (and
`which_backend`, which names the answer), the backward's list transpose, and the front files of
the smaller kernels (`kernels.row_means`, `kernels.selection`). One order of questions for all:

1. the device (`kernels.device.kernels_unavailable`: ``NSA_CUTE_DISABLE=1``, not an sm_90 GPU);
2. the kernel module imports (``kernels.sm90.<name>``; only a failed import sends a call to the
   torch path, an error raised by a kernel is never swallowed);
3. for attention, the shapes fit the kernels' 32-bit index arithmetic
   (``kernels.sm90.limits.int32_limits_reason``);
4. the module's own ``can_run`` on the call's arguments (dtype, head dim, strides, tiles).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from .device import kernels_unavailable
from .validate import AttentionProblem, block_offsets

Choice = tuple[ModuleType | None, str]  # the kernel module, or None and why not


def sm90_module(name: str, device: torch.device) -> Choice:
    """``kernels.sm90.<name>`` where kernels run on `device` and it imports; else None and why
    (steps 1 and 2 of the module docstring)."""
    unsupported = kernels_unavailable(device)
    if unsupported:
        return None, unsupported
    try:
        return importlib.import_module(f"kernels.sm90.{name}"), ""
    except ImportError as error:  # not built for this install; kernel bugs still raise
        return None, f"kernels.sm90.{name} unavailable ({error})"


def attention_kernel(direction: str, q, k, v, kwargs: dict,
                     problem: AttentionProblem | None = None) -> Choice:
    """The attention kernel module (``kernels.sm90.forward`` or ``.backward``) that runs a
    validated call with these normalised keyword arguments (`normalised_kwargs`), or None and
    the reason the fallback runs.

    For the backward with block sparsity, fills ``kwargs["block_sparse_transposed"]`` when a
    kernel module is available and the caller did not pass one (built here, per call; callers
    that run several backward calls over the same lists pass it instead).
    """
    kernel, reason = sm90_module(direction, q.device)
    if kernel is None:
        return None, reason
    from kernels.sm90.limits import int32_limits_reason

    # Shapes the kernels' 32-bit index arithmetic or launch grid cannot hold go to the fallback
    # (which has no such limit), before any list is transposed for them.
    too_large = int32_limits_reason(q, k, backward=direction == "backward", **kwargs)
    if too_large:
        return None, f"kernels.sm90.{direction}: {too_large}"
    if (direction == "backward" and kwargs.get("block_sparse") is not None
            and kwargs.get("block_sparse_transposed") is None):
        kwargs["block_sparse_transposed"] = _transpose(kwargs["block_sparse"], problem,
                                                       kwargs["cu_seqlens_k"])
    ok, reason = kernel.can_run(q, k, v, **kwargs)
    if not ok:
        return None, f"kernels.sm90.{direction}: {reason}"
    return kernel, ""


def normalised_kwargs(problem: AttentionProblem, cu_seqlens_q, cu_seqlens_k,
                      block_sparse) -> dict:
    """The keyword arguments the kernel modules take for a validated call: the scale resolved,
    ``max_seqlen_*`` filled in, ``window_size`` a tuple of ints; ``q_start_positions`` only
    where a sequence's queries start past position 0."""
    kwargs = dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k,
        softmax_scale=problem.softmax_scale, causal=problem.causal,
        compress_factor=problem.compress_factor, window_size=problem.window_size,
        block_sparse=block_sparse,
    )
    if problem.q_start_positions is not None:
        kwargs["q_start_positions"] = problem.q_start_positions
    return kwargs


def transpose_block_sparse_trusted(block_sparse, *, cu_seqlens_k, host_cu_seqlens_k,
                                   host_cu_seqlens_q=None):
    """The ``block_sparse_transposed`` (a ``sparsity.BlockSparseCSR``) that the backward builds
    for packed varlen lists over ``cu_seqlens_k``, for internal callers that run several backward
    calls over the same lists (nsa) and pass it to ``attention_backward_trusted``. Trusts what
    that function trusts: the lists come from ``sparsity``'s builders, ``host_cu_seqlens_k`` are
    the checked values of ``cu_seqlens_k``. Reads nothing from the device.
    ``host_cu_seqlens_q``: the query bounds that the lists' row blocks were built from; with
    them the transpose's per-tile layout is kept across calls (sparsity/host_cache.py)."""
    num_kv_blocks = block_offsets(host_cu_seqlens_k, block_sparse.col_block_size)[-1]
    layout_key = None
    if host_cu_seqlens_q is not None:
        layout_key = (tuple(host_cu_seqlens_q), tuple(host_cu_seqlens_k))
    return _transpose_csr(block_sparse, num_kv_blocks, cu_seqlens_k=cu_seqlens_k,
                          layout_key=layout_key)


def _transpose(block_sparse, problem: AttentionProblem, cu_seqlens_k):
    """The backward layout (rows = KV blocks) of forward-layout lists that the call's checks have
    passed."""
    num_kv_blocks = problem.key_block_offsets(block_sparse.col_block_size)[-1]
    if cu_seqlens_k is not None:
        return _transpose_csr(block_sparse, num_kv_blocks, cu_seqlens_k=cu_seqlens_k)
    # Padded: B sequences of max_seqlen_k keys. The offsets are made on the device (the host
    # holds them too, but a host list copied to the GPU waits for the stream as a read would),
    # once per shape; so is the transpose's layout, a function of the shape alone (the lists'
    # row blocks of a padded call are uniform too, `validate`).
    from kernels.sm90.launch import uniform_cu_seqlens

    per_sequence = -(-problem.max_seqlen_k // block_sparse.col_block_size)
    offsets = uniform_cu_seqlens(problem.num_seqs, per_sequence, block_sparse.full_count.device)
    return _transpose_csr(block_sparse, num_kv_blocks, col_block_offsets=offsets,
                          layout_key=("padded", problem.num_seqs, problem.max_seqlen_q,
                                      problem.max_seqlen_k))


def _transpose_csr(block_sparse, num_kv_blocks: int, **kv_blocks):
    from sparsity import transpose_block_sparse_csr

    # check=False: the caller checked (or trusts) the lists and the sequences; the checks would
    # read the device. The host count of KV blocks sizes the result without a read.
    return transpose_block_sparse_csr(block_sparse, **kv_blocks, num_col_blocks=num_kv_blocks,
                                      check=False, sort_keys=_sort_keys_kernel(block_sparse))


def _sort_keys_kernel(block_sparse):
    """The sm90 kernel that writes the transpose's sort keys in one launch
    (kernels/sm90/list_layout.py), where it runs; None: sparsity's torch ops."""
    device = block_sparse.full_count.device
    slots = block_sparse.full_index.numel() + block_sparse.mask_index.numel()
    if (min(block_sparse.full_index.shape[-1], block_sparse.mask_index.shape[-1]) < 1
            or slots >= 2**31 - 1024  # its int32 slot index, plus a CTA of threads
            or device.type != "cuda"):  # (asked apart: tests fake the device on the CPU)
        return None
    list_layout, _ = sm90_module("list_layout", device)
    return None if list_layout is None else list_layout.transpose_keys
