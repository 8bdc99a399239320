"""Shared inputs and comparisons for the nsa tests (small sizes: everything runs on CPU)."""
from __future__ import annotations

import torch

# Small NSA geometry used throughout: many tiles, blocks and compressed tokens at tiny lengths.
# 16-row selection tiles, blocks of 4 compressed / 8 selected tokens, 6 selected blocks
# (>= 1 + 16/8), a 12-token window, sparse compressed blocks of 4 compressed tokens.
SMALL = dict(compress_block_size=4, selected_block_size=8, num_selected_blocks=6, window_size=12,
             _q_tile=16, _cmp_kv_block=4)


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def random_inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, *, seed: int,
                  dtype=torch.float64, weights: bool = True) -> dict:
    """Packed q, k, v and projection/gate weights with realistic magnitudes (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    inputs = dict(q=randn(total, heads, head_dim), k=randn(total, kv_heads, head_dim),
                  v=randn(total, kv_heads, head_dim), cu_seqlens=cu_seqlens_of(lengths))
    if weights:
        scale = head_dim ** -0.5
        inputs.update(W_k=randn(kv_heads, head_dim, head_dim, scale=scale),
                      W_v=randn(kv_heads, head_dim, head_dim, scale=scale),
                      W_gate=randn(heads, 3, head_dim, scale=scale))
    return inputs


TENSOR_INPUTS = ("q", "k", "v", "W_k", "W_v", "W_gate")


def random_cuda_inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int,
                       device="cuda") -> dict:
    """random_inputs (float64) with every tensor on `device`."""
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t)
            for n, t in random_inputs(lengths, heads, kv_heads, head_dim, seed=seed).items()}


def bf16_reference_inputs(x: dict) -> dict:
    """The float64 reference's inputs: x's floating tensors rounded to bf16 first (the values
    the fast path sees), then made differentiable in float64."""
    return differentiable({n: (t.detach().bfloat16() if isinstance(t, torch.Tensor)
                               and t.is_floating_point() else t) for n, t in x.items()},
                          torch.float64)

# The GPU tests' packing: three documents, one short (2277 rows).
GPU_LENGTHS = [1500, 77, 700]


def gpu_inputs(names, layout: str, seed: int) -> tuple[dict, dict]:
    """The `names` tensors of random_inputs(GPU_LENGTHS, H=8, Hkv=2, D=128) as bf16 CUDA
    tensors requiring grad, and nsa()'s sequence arguments: packed with cu_seqlens, its host
    values and max_seqlen ("varlen"), or the first 2 x 1100 rows as a padded batch ("padded",
    none needed)."""
    x = random_inputs(GPU_LENGTHS, heads=8, kv_heads=2, head_dim=128, seed=seed)
    tensors = {n: x[n].cuda().bfloat16() for n in names}
    if layout == "padded":
        rows = 1100  # two sequences of 1100 rows out of the 2277 packed ones
        tensors.update({n: tensors[n][:2 * rows].reshape(2, rows, *tensors[n].shape[1:])
                        for n in ("q", "k", "v")})
        extra = {}
    else:
        cu = x["cu_seqlens"].cuda()
        extra = dict(cu_seqlens=cu, host_cu_seqlens=tuple(cu.tolist()),
                     max_seqlen=max(GPU_LENGTHS))
    for t in tensors.values():
        t.requires_grad_()
    return tensors, extra


def differentiable(inputs: dict, dtype) -> dict:
    """A copy with every float tensor cast to dtype and requiring grad."""
    return {name: (x.detach().to(dtype).requires_grad_() if name in TENSOR_INPUTS and x is not None
                   else x) for name, x in inputs.items()}


def grads_of(out: torch.Tensor, inputs: dict, dout: torch.Tensor) -> dict:
    names = [n for n in TENSOR_INPUTS if inputs.get(n) is not None]
    grads = torch.autograd.grad(out, [inputs[n] for n in names], dout.to(out.dtype))
    return dict(zip(names, grads))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    expected = expected.detach().double()
    return float((actual.detach().double() - expected).norm() / expected.norm())
