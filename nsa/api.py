"""nsa(): Native Sparse Attention, the public entry point."""
from __future__ import annotations

import torch
from torch import Tensor

from nsa import captured
from nsa import ops as nsa_ops
from nsa.config import NSAConfig
from nsa.function import NSAFunction
from nsa.memory_policy import keeps_branch_outputs
from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE
from nsa.validation import PackedSequences, validate_nsa_call
from sparsity.host_cache import cached


def nsa(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None, compress_block_size: int = 64,
        selected_block_size: int = 64, num_selected_blocks: int = 16, window_size: int = 512,
        W_k: Tensor | None = None, W_v: Tensor | None = None, W_gate: Tensor | None = None,
        causal: bool = True, softmax_scale: float | None = None,
        num_cmp_selected_blocks: int | None = None, deterministic: bool = False,
        host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
        recompute: bool | None = None, capture: bool | None = None,
        context_parallel_group=None,
        context_parallel_mode: str = "auto", context_parallel_layout: str = "contiguous",
        _q_tile: int = SELECTION_Q_TILE, _cmp_kv_block: int = CMP_KV_BLOCK) -> Tensor:
    """Native Sparse Attention: compressed + selected + sliding-window branches, gated.

    Layouts: padded q (B, N, H, D), k, v (B, N, Hkv, D); or packed varlen q (T, H, D),
    k, v (T, Hkv, D) with cu_seqlens (S+1,) int32 (and optionally max_seqlen). H % Hkv == 0.
    Returns out with q's shape and dtype; differentiable in q, k, v, W_k, W_v, W_gate.

    compress_block_size (l): tokens per compressed token (mean of K/V, then @ W_k / W_v
        (Hkv, D, D) per KV head when given).
    selected_block_size (l'), num_selected_blocks: the selected branch attends to
        num_selected_blocks blocks of l' keys per 128-row query tile and KV group, chosen by the
        causal selection rule of docs/interfaces.md (nsa/reference.py states it too). l' must be
        a multiple of l; num_selected_blocks at least 1 + the most blocks a tile overlaps
        (1 + 128 / l' when l' divides 128): block 0 and the tile's own blocks are always selected.
        A num_selected_blocks above the longest sequence's block count, ceil(max_seqlen / l'),
        is clipped to that count (or to the minimum above, if larger): no tile has more blocks
        to select, so the result is the same, and the per-tile lists are only as wide as needed.
        One value thus serves batches of mixed lengths.
    window_size (w): the window branch attends to keys i - w < j <= i; 0 switches it off.
    W_gate (H, 3, D): gates g = sigmoid(q . W_gate[h, b]) for (compressed, selected, window);
        without it each running branch is weighted equally.
    causal: with True (the default) row i depends on rows <= i of its sequence only.
    softmax_scale: defaults to D ** -0.5; else positive and finite in float32.
    max_seqlen: at least the longest sequence and at most 2**31 - 1 (cu_seqlens is int32).
    Tensors must hold values: one on the meta device is refused (ValueError naming it).
    Second-order gradients are not supported: differentiating nsa()'s gradients again (after
        torch.autograd.grad(..., create_graph=True)) raises a RuntimeError.
    num_cmp_selected_blocks: None = dense compressed branch; an int n makes it block-sparse over
        blocks of 128 compressed tokens (block 0, the diagonal ones, the n best scored).
    deterministic: True makes the backward bit-identical from run to run (the attention
        kernels sum dQ in a fixed order; slower). False (the default) is the fast mode, whose
        gradients may differ in the last bits between runs. The forward is deterministic either
        way.
    host_cu_seqlens: cu_seqlens's values on the host (a tuple or list of S+1 ints), for callers
        that have them (a data loader packing sequences builds them on the host): nsa() then
        reads no tensor's values while checking (no wait on the GPU), and uses these instead of
        reading cu_seqlens. They must equal cu_seqlens's values; only their form is checked
        (start 0, non-decreasing, end T, one per entry of cu_seqlens), never against the tensor,
        which would read it. Required with cu_seqlens under torch.compile (a ValueError naming it
        otherwise); padded inputs need nothing (their bounds come from the shape), and passing
        it without cu_seqlens is a ValueError.
    recompute: how the backward gets each branch's output (for its gate gradient): True
        recomputes each branch's forward (the least memory: what 1M tokens need on one GPU),
        False keeps the outputs the forward wrote (three q-sized tensors until the backward),
        None (the default) keeps them when they take at most 1/8 of the device's memory (a
        fixed 4 GiB off CUDA), see nsa/memory_policy.py. The result is the same either way.
    capture: whether an eager call may run from a captured plan, CUDA graphs of its forward and
        backward replayed for every later call with the same shapes, dtypes, config and packing
        (the host's work becomes a few copies and one graph launch per direction; results are
        the eager call's). None (the default) captures on an sm_90 GPU up to 16K tokens at
        H=32 (query rows x heads <= 2**19, a forward without backward too), where the host
        time exceeds the device work; True captures any CUDA call; False never. The first calls
        of a signature run eagerly (the warm-up); plans hold at most 1/8 of the device's
        memory; a backward through a retained graph after its plan was reused raises (pass
        False there). nsa/captured.py states the rules; `nsa.release_captured_plans()` frees
        them.
    context_parallel_group: run across the ranks of this torch.distributed group (a
        ProcessGroup, a 1-D DeviceMesh, or (mesh, dim name)): q, k, v are then this rank's
        token shard (packed inputs with the whole sequence's cu_seqlens, the same on
        every rank) and the result is this rank's shard of the output; a collective call
        (`nsa.distributed.nsa_context_parallel`, docs/context_parallel.md). None (the default)
        runs on this process alone.
    context_parallel_mode: "auto", "heads" or "sequence" with context_parallel_group.
    context_parallel_layout: "contiguous" or "zigzag", how the tokens are sharded
        (nsa.distributed.sharding) with context_parallel_group.
    torch.compile: nsa() compiles with fullgraph=True, forward and backward. While compiling it
        calls the custom ops `torch.ops.nsa_cute.nsa_forward` / `nsa_backward` (nsa/ops.py),
        opaque to the compiler, which compute what eager nsa() computes (the backward also
        recomputes the block selection, which eager nsa() keeps from the forward).
    _q_tile, _cmp_kv_block: test-only overrides of SELECTION_Q_TILE and CMP_KV_BLOCK, so tests
        can exercise many tiles at tiny sizes. The kernels are built for the defaults.
    """
    if context_parallel_group is not None:
        from nsa.distributed import nsa_context_parallel

        return nsa_context_parallel(
            q, k, v, group=context_parallel_group, cu_seqlens=cu_seqlens,
            host_cu_seqlens=host_cu_seqlens, mode=context_parallel_mode,
            layout=context_parallel_layout, W_k=W_k, W_v=W_v,
            W_gate=W_gate, max_seqlen=max_seqlen, compress_block_size=compress_block_size,
            selected_block_size=selected_block_size, num_selected_blocks=num_selected_blocks,
            window_size=window_size, causal=causal, softmax_scale=softmax_scale,
            num_cmp_selected_blocks=num_cmp_selected_blocks, deterministic=deterministic,
            recompute=recompute, capture=capture, _q_tile=_q_tile, _cmp_kv_block=_cmp_kv_block)
    config, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        compress_block_size=compress_block_size, selected_block_size=selected_block_size,
        num_selected_blocks=num_selected_blocks, window_size=window_size, W_k=W_k, W_v=W_v,
        W_gate=W_gate, causal=causal, softmax_scale=softmax_scale,
        num_cmp_selected_blocks=num_cmp_selected_blocks, q_tile=_q_tile,
        cmp_kv_block=_cmp_kv_block, deterministic=deterministic,
        host_cu_seqlens=host_cu_seqlens, recompute=recompute, capture=capture)
    weights = tuple(None if W is None else W.contiguous() for W in (W_k, W_v, W_gate))
    # The checks read cu_seqlens once (or took host_cu_seqlens); its values travel with the call
    # from here on.
    if cu_seqlens is not None:
        return _packed_nsa(q.contiguous(), k.contiguous(), v.contiguous(), *weights, cu_seqlens,
                           config, sequences, recompute, capture)
    # A padded batch is B sequences of N rows, packed (an empty batch as one empty sequence);
    # built on the device, so nothing waits on it (sequences.cu_seqlens holds the same values),
    # and kept across calls of the same shape (two launches an eager call need not make).
    batch, seqlen = q.shape[:2]
    # (arange, not a host copy: a capture that misses the cache builds it inside its graph;
    # torch.compile traces the build itself, the cache being host state)
    def padded_bounds():
        return torch.arange(max(batch, 1) + 1, dtype=torch.int32, device=q.device) * \
            (seqlen if batch else 0)
    cu_seqlens = (padded_bounds() if torch.compiler.is_compiling() else
                  cached(("padded cu_seqlens", sequences.cu_seqlens), q, padded_bounds))
    packed = (x.reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v))
    out = _packed_nsa(*packed, *weights, cu_seqlens, config, sequences, recompute, capture)
    return out.view(q.shape)


def _packed_nsa(q, k, v, W_k, W_v, W_gate, cu_seqlens: Tensor, config: NSAConfig,
                sequences: PackedSequences, recompute: bool | None,
                capture: bool | None = None) -> Tensor:
    """nsa() on packed, checked tensors: NSAFunction eagerly (or its captured plan,
    nsa/captured.py), the custom ops under torch.compile (which cannot trace NSAFunction's
    device reads and value-sized lists)."""
    if torch.compiler.is_compiling():
        return nsa_ops.nsa_forward(q, k, v, W_k, W_v, W_gate, cu_seqlens,
                                   list(sequences.cu_seqlens), sequences.max_seqlen,
                                   *nsa_ops.config_arguments(config), recompute)[0]
    # Kept only for a backward that can happen (no graph under no_grad or without grads).
    differentiable = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, W_k, W_v, W_gate))
    keep_outputs = differentiable and keeps_branch_outputs(q, sum(config.branches), recompute)

    def eager():
        return NSAFunction.apply(q, k, v, W_k, W_v, W_gate, cu_seqlens, sequences.max_seqlen,
                                 config, sequences.cu_seqlens, keep_outputs)
    if not captured.capture_applies(q, capture, differentiable):
        return eager()
    return captured.run((q, k, v, W_k, W_v, W_gate), cu_seqlens, config, sequences, keep_outputs,
                        differentiable, eager)
