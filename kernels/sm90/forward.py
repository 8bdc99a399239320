"""Torch entry to the sm90 forward kernel: `can_run` decides, `run` launches.

Both take the keyword arguments of `kernels.attention_forward`, already validated and
normalised by `kernels.validate`. A padded batch is passed to the kernel as B equal-length
packed sequences (a free reshape), so the kernel has a single, varlen, code path.
"""
from __future__ import annotations

import functools
import math

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
TILE_M = 128
SPARSE_TILE_N = (64, 128)


def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def can_run(q, k, v, *, block_sparse=None, **_) -> tuple[bool, str]:
    """(ok, reason): whether the sm90 kernel computes this case."""
    if not q.is_cuda or not _is_sm90(q.device):
        return False, "needs an sm_90 GPU"
    try:
        import cutlass  # noqa: F401  (nvidia-cutlass-dsl)
    except ImportError as error:
        return False, f"CuTe DSL unavailable ({error})"
    if q.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {q.dtype} (kernel takes bfloat16/float16)"
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return False, f"head dim {head_dim} (kernel takes {SUPPORTED_HEAD_DIMS})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return False, f"{name} needs a contiguous last dim and 16-byte aligned rows"
    if block_sparse is not None:
        if block_sparse.row_block_size != TILE_M:
            return False, f"block-sparse row_block_size {block_sparse.row_block_size} != {TILE_M}"
        if block_sparse.col_block_size not in SPARSE_TILE_N:
            return False, f"block-sparse col_block_size {block_sparse.col_block_size} not in {SPARSE_TILE_N}"
    return True, "sm90 CuTe DSL kernel"


def _spec_for(q, causal, window_size, block_sparse):
    from kernels.sm90.spec import FwdSpec

    left, right = window_size
    return FwdSpec(
        dtype=str(q.dtype).removeprefix("torch."),
        head_dim=q.shape[-1],
        causal=bool(causal),
        has_window_left=left >= 0,
        has_window_right=right >= 0 and not causal,
        block_sparse=block_sparse is not None,
        tile_m=TILE_M,
        tile_n=block_sparse.col_block_size if block_sparse is not None else 128,
    )


@functools.lru_cache(maxsize=64)
def _uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seqlen


def _as_cute(t: torch.Tensor, leading_dim: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16 if t.element_size() == 2 else 4).mark_layout_dynamic(
        leading_dim=leading_dim)


def run(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None,
):
    import cuda.bindings.driver as cuda
    import cutlass

    from kernels.sm90.compile import compiled_forward

    padded = q.dim() == 4
    if padded:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k = k.shape[1]
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        cu_seqlens_q = _uniform_cu_seqlens(batch, seqlen_q, q.device)
        cu_seqlens_k = _uniform_cu_seqlens(batch, seqlen_k, q.device)
        max_seqlen_q = seqlen_q
    total_q, num_heads, head_dim = q.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)

    spec = _spec_for(q, causal, window_size, block_sparse)
    sparse_args = (None,) * 5
    if block_sparse is not None:
        bs = block_sparse
        sparse_args = (
            _as_cute(bs.full_count, 1), _as_cute(bs.full_index, 2),
            _as_cute(bs.mask_count, 1), _as_cute(bs.mask_index, 2),
            _as_cute(bs.row_block_offsets, 0),
        )
    left, right = window_size
    if max_seqlen_q > 0 and total_q > 0:
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        args = (
            _as_cute(q, 2), _as_cute(k, 2), _as_cute(v, 2), _as_cute(out, 2), _as_cute(lse, 1),
            _as_cute(cu_seqlens_q, 0), _as_cute(cu_seqlens_k, 0),
            cutlass.Int32(max_seqlen_q), cutlass.Float32(softmax_scale),
            cutlass.Int32(compress_factor), cutlass.Int32(max(left, 0)),
            cutlass.Int32(max(right, 0)), *sparse_args, stream,
        )
        compiled_forward(spec, args)(*args)
    if padded:
        out = out.view(batch, seqlen_q, num_heads, head_dim)
        lse = lse.view(num_heads, batch, seqlen_q).permute(1, 0, 2).contiguous()
    return out, lse
