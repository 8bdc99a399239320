"""Compression of keys and values: the mean of each complete block of l tokens, per sequence.

One compressed token per complete block (a sequence of n rows has n // l of them, the incomplete
tail is not compressed), optionally projected per KV head by W (Hkv, D, D): x_cmp = mean @ W[h].
Everything runs in float32 (float64 for float64 inputs): the selection scores read these values,
and the branch kernel gets them cast back to the input dtype. The means are
`kernels.row_means` (one CuTe DSL pass over K and V together on sm90).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.row_means import compute_dtype, row_means

__all__ = ["compressed_cu_seqlens", "compressed_block_starts", "compressed_row_tokens",
           "compress", "compress_pair", "compress_backward", "compressed_row_gradients",
           "compress_kv", "compute_dtype"]


def compressed_cu_seqlens(cu_seqlens: Tensor, compress_block_size: int) -> Tensor:
    """(S+1,) int32: cumulative counts of compressed tokens, floor(len_s / l) per sequence."""
    counts = cu_seqlens.diff() // compress_block_size
    return torch.cat([cu_seqlens.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def compressed_block_starts(cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                            compress_block_size: int, num_compressed: int) -> Tensor:
    """(Tc,) int64: the first packed row of each compressed token's block."""
    device = cu_seqlens.device
    token = torch.arange(num_compressed, device=device)
    sequence = torch.searchsorted(cu_seqlens_cmp[1:].to(torch.int64), token, right=True)
    return cu_seqlens.to(torch.int64)[sequence] + \
        (token - cu_seqlens_cmp.to(torch.int64)[sequence]) * compress_block_size


def compress(x: Tensor, block_starts: Tensor, block_size: int,
             W: Tensor | None = None) -> Tensor:
    """(Tc, Hkv, D) in compute_dtype: the mean of x over each block, then @ W[h] per head."""
    return compress_pair((x,), block_starts, block_size, (W,))[0]


def compress_pair(xs: tuple[Tensor, ...], block_starts: Tensor, block_size: int,
                  weights: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """`compress` of one or two tensors over the same blocks (K and V: one pass on sm90)."""
    pooled = row_means(xs, block_starts, None, count=block_size)
    return tuple(p if W is None else torch.einsum("thd,hde->the", p, W.to(p.dtype))
                 for p, W in zip(pooled, weights))


def compressed_row_tokens(block_starts: Tensor, block_size: int, num_rows: int) -> Tensor:
    """(T,) int64: the compressed token each packed row feeds; Tc (one past the last token)
    for the rows of a sequence's incomplete tail block."""
    num_compressed = block_starts.shape[0]
    tokens = torch.full((num_rows,), num_compressed, dtype=torch.int64,
                        device=block_starts.device)
    block_rows = block_starts[:, None] + torch.arange(block_size, device=block_starts.device)
    tokens[block_rows.flatten()] = torch.arange(
        num_compressed, device=block_starts.device).repeat_interleave(block_size)
    return tokens


def compress_backward(d_compressed: Tensor, x: Tensor, block_starts: Tensor, block_size: int,
                      W: Tensor | None = None, row_tokens: Tensor | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """Gradients of `compress` for x (compute_dtype, shape of x) and W (None without W).

    Blocks do not overlap and each row of a block carries 1/l of the block's gradient, rows
    of no block none: one gather of `compressed_row_gradients` by `row_tokens`
    (`compressed_row_tokens`, computed here when None).
    """
    per_token, dW = compressed_row_gradients(d_compressed, x, block_starts, block_size, W)
    if row_tokens is None:
        row_tokens = compressed_row_tokens(block_starts, block_size, x.shape[0])
    return per_token.index_select(0, row_tokens), dW


def compressed_row_gradients(d_compressed: Tensor, x: Tensor, block_starts: Tensor,
                             block_size: int, W: Tensor | None = None
                             ) -> tuple[Tensor, Tensor | None]:
    """The gradient each row of a compressed token's block gets, per token, and W's: (Tc + 1,
    Hkv, D) in compute_dtype, 1/l of the token's gradient (through W where given), the last
    row zeros (the token of rows in no block: `compressed_row_tokens`); dW or None. Expanded
    to the rows by `compress_backward`, or where nsa()'s backward converts dk and dv
    (`kernels.dkv_sums.finish_dkv`). A token whose gradient is zero adds nothing to dW,
    whatever its block holds: a NaN in a block that no row sees yet must not reach dW through
    0 * NaN."""
    dtype = compute_dtype(x.dtype)
    d_compressed = d_compressed.to(dtype)
    dW = None
    if W is not None:
        (pooled,) = row_means((x,), block_starts, None, count=block_size)
        pooled.masked_fill_(~(d_compressed != 0).any(dim=-1, keepdim=True), 0)
        dW = torch.einsum("thd,the->hde", pooled, d_compressed)
        d_compressed = torch.einsum("the,hde->thd", d_compressed, W.to(dtype))
    return torch.cat([d_compressed / block_size, d_compressed.new_zeros(1, *x.shape[1:])]), dW


def compress_kv(k: Tensor, v: Tensor, cu_seqlens: Tensor, compress_block_size: int,
                W_k: Tensor | None = None, W_v: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """k_cmp, v_cmp (Tc, Hkv, D) in compute_dtype and cu_seqlens_cmp (S+1,) int32."""
    cu_cmp = compressed_cu_seqlens(cu_seqlens, compress_block_size)
    starts = compressed_block_starts(cu_seqlens, cu_cmp, compress_block_size, int(cu_cmp[-1]))
    k_cmp, v_cmp = compress_pair((k, v), starts, compress_block_size, (W_k, W_v))
    return k_cmp, v_cmp, cu_cmp
