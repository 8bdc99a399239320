"""Torch entry to the sm90 forward kernel: `can_run` decides, `run` launches.

Both take the keyword arguments of `kernels.attention_forward`, already validated and
normalised by `kernels.validate`. A padded batch is passed to the kernel as B equal-length
packed sequences (a free reshape), so the kernel has a single, varlen, code path.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from kernels.device import is_sm90, persistent_grid_sms
from kernels.sm90.launch import (aligned_rows, has_aligned_rows, launch_compiled,
                                 query_positions, uniform_cu_seqlens)
from kernels.sm90.limits import require_int32_limits

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256)
TILE_M = 128
SPARSE_TILE_N = (64, 128)


def unsupported_inputs(q, k, v, head_dims, kernel: str = "kernel") -> str:
    """Why no sm90 kernel takes these tensors (device, CuTe DSL, dtype, head dim, strides);
    empty when one may. Shared by the forward's and the backward's `can_run`."""
    if not is_sm90(q.device):
        return "needs an sm_90 GPU"
    try:
        import cutlass  # noqa: F401  (nvidia-cutlass-dsl)
    except ImportError as error:
        return f"CuTe DSL unavailable ({error})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} ({kernel} takes bfloat16/float16)"
    head_dim = q.shape[-1]
    if head_dim not in head_dims or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return f"head dim {head_dim} ({kernel} takes {head_dims})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not has_aligned_rows(t):
            return f"{name} needs a contiguous last dim and 16-byte aligned rows"
    return ""


def can_run(q, k, v, *, block_sparse=None, causal=False, window_size=(-1, -1),
            compress_factor=1, max_seqlen_k=None, **_) -> tuple[bool, str]:
    """(ok, reason): whether the sm90 kernel computes this case."""
    reason = unsupported_inputs(q, k, v, SUPPORTED_HEAD_DIMS)
    if reason:
        return False, reason
    if block_sparse is not None:
        if block_sparse.row_block_size != TILE_M:
            return False, f"block-sparse row_block_size {block_sparse.row_block_size} != {TILE_M}"
        if block_sparse.col_block_size not in SPARSE_TILE_N:
            return False, (f"block-sparse col_block_size {block_sparse.col_block_size} not in "
                           f"{SPARSE_TILE_N}")
    if q.dim() == 4:  # padded batch: every key sequence is k.shape[1] long (as `run` takes it)
        max_seqlen_k = k.shape[1]
    try:  # the tiles of some cases do not fit shared memory (wide heads with 128-key blocks)
        _spec_for(q, causal, window_size, block_sparse, compress_factor, max_seqlen_k)
    except ValueError as error:
        return False, str(error)
    return True, "sm90 CuTe DSL kernel"


def _spec_for(q, causal, window_size, block_sparse, compress_factor=1, max_seqlen_k=None):
    """The dispatched spec (`choose_spec`, cached: `can_run` and `run` ask for the same one)."""
    from kernels.sm90.spec import choose_spec

    return choose_spec(
        dtype=str(q.dtype).removeprefix("torch."), head_dim=q.shape[-1], causal=causal,
        window_size=window_size, compress_factor=compress_factor,
        sparse_block_size=block_sparse.col_block_size if block_sparse is not None else None,
        sparse_list_capacity=(block_sparse.full_index.shape[-1] + block_sparse.mask_index.shape[-1]
                              if block_sparse is not None else None),
        tile_m=TILE_M, max_seqlen_k=max_seqlen_k)


# The score mods' consumer warpgroups take turns issuing wgmma (`FwdSpec.pingpong`) also
# where the spec without them would not (a grid over long lists). False: the A/B's switch.
PINGPONG = True
# A bias one slab of which serves several query heads (a (1, 1, N, N) bias; one per KV head):
# the CTAs running together take the heads of one query tile (`FwdSpec.heads_fastest`), so
# the heads meet each bias tile in L2 rather than one head's pass over the whole bias after
# another (a 16-bit 16K x 16K bias is 512 MiB). H200, 2026-11-29, 16K, H=16, one shared bf16
# bias: forward -2% to -5% on causal windows 512-16384, +2% on a 10% tile mask, window 32
# +1% (its bias reads are not bandwidth-bound); kept for the windows.
SHARED_BIAS_HEADS_TOGETHER = True
# The backward's work units likewise, KV tile by KV tile with the heads innermost
# (`kernels.sm90.backward.run(head_major_units=False)`): the heads of one KV tile read the
# same bias tiles and add dS into the same float32 dbias sums at about the same time, in L2.
# Same run: backward -10% to -14% (window 32 1.170 -> 1.035 ms, 16384 11.37 -> 9.75, 10%
# tiles 3.096 -> 2.874).
SHARED_BIAS_UNITS_KV_MAJOR = True
# A 16-bit bias whose rows start 16 bytes apart is TMA-loaded tile by tile into the K stage
# (`FwdSpec.score_bias_tma`), one CTA per query tile with the output staged in the Q buffer
# (the bias's two stages take the output buffer's and the second Q buffer's room). False:
# each thread reads its cells' pairs from global memory. A switch for the A/B.
BIAS_TMA = True


@dataclasses.dataclass(frozen=True)
class ScoreModTensors:
    """A user mask and additive bias as the kernel reads them (kernels/sm90/score_mod.py):
    (slabs, Nq, Nk) cells, one slab per broadcast (batch, head) pair, and the (B, H, 2) int32
    table of each (batch, query head)'s mask slab and bias slab."""

    mask: torch.Tensor | None  # uint8, nonzero = attend
    bias: torch.Tensor | None  # float16 / bfloat16 / float32
    slabs: torch.Tensor
    bias_shared: bool = False  # a bias slab serves several query heads

    @property
    def head_major_units(self) -> bool:
        """The backward's `head_major_units` (SHARED_BIAS_UNITS_KV_MAJOR)."""
        return not (SHARED_BIAS_UNITS_KV_MAJOR and self.bias_shared)

    @property
    def bias_dtype(self) -> str:
        """The bias's dtype by name ("" without a bias): the specs' `score_bias`."""
        return "" if self.bias is None else str(self.bias.dtype).removeprefix("torch.")

    def spec(self, spec):
        """Forward `spec` with the score mods, without the narrowed first tile or overlapped
        tiles (the mods hook into the plain KV loops); the consumer warpgroups take turns
        issuing their products (`pingpong`, switch PINGPONG) so that one's bias and mask
        reads and softmax run under the other's products; a bias shared by query heads puts
        their tiles side by side (`heads_fastest`, switch SHARED_BIAS_HEADS_TOGETHER); a
        16-bit bias with 16-byte aligned rows comes by TMA with K (`score_bias_tma`, switch
        BIAS_TMA)."""
        spec = dataclasses.replace(spec, score_mask=self.mask is not None,
                                   score_bias=self.bias_dtype, overlap_tiles=False,
                                   narrow_first_tile=False, score_pairs=self.even_strides,
                                   pingpong=spec.pingpong or (PINGPONG and spec.tile_m > 64),
                                   heads_fastest=spec.heads_fastest
                                   or (SHARED_BIAS_HEADS_TOGETHER and self.bias_shared))
        if BIAS_TMA and self.bias is not None and self.bias.element_size() == 2 and (
                has_aligned_rows(self.bias)):
            staged = dataclasses.replace(spec, score_bias_tma=True, persistent=False,
                                         q_stages=1, store_warp=False, defer_store=False,
                                         o_in_q=True)
            if staged.fits_in_smem():
                return staged
        return spec

    @property
    def even_strides(self) -> bool:
        """Whether the mask's and bias's slabs and rows start an even number of elements
        apart (`FwdSpec.score_pairs`)."""
        return all(x is None or (x.stride(0) % 2 == 0 and x.stride(1) % 2 == 0)
                   for x in (self.mask, self.bias))


def _typed_scalars(scalars):
    """(max_seqlen_q, softmax_scale, compress_factor, window left, window right, SM count) as
    DSL types."""
    import cutlass

    max_seqlen_q, scale, compress_factor, left, right, num_sms = scalars
    return (cutlass.Int32(max_seqlen_q), cutlass.Float32(scale), cutlass.Int32(compress_factor),
            cutlass.Int32(left), cutlass.Int32(right), cutlass.Int32(num_sms))


def _check_row_dot(q, row_dot_with, row_dot_into) -> None:
    if q.dim() != 3:
        raise ValueError(f"row_dot_into: packed (T, H, D) inputs only, got q of shape "
                         f"{tuple(q.shape)}")
    if (row_dot_with is None or row_dot_with.shape != q.shape or row_dot_with.dtype != q.dtype
            or row_dot_with.device != q.device):
        got = ("nothing" if row_dot_with is None else
               f"{tuple(row_dot_with.shape)} {row_dot_with.dtype} on {row_dot_with.device}")
        raise ValueError(f"row_dot_with: expected a {tuple(q.shape)} {q.dtype} tensor on "
                         f"{q.device} like q (with row_dot_into), got {got}")
    expected = (q.shape[1], q.shape[0])
    if (row_dot_into is None or tuple(row_dot_into.shape) != expected
            or row_dot_into.dtype != torch.float32 or not row_dot_into.is_contiguous()
            or row_dot_into.device != q.device):
        got = ("nothing" if row_dot_into is None else
               f"{tuple(row_dot_into.shape)} {row_dot_into.dtype} on {row_dot_into.device}")
        raise ValueError(f"row_dot_into: expected a contiguous {expected} float32 tensor on "
                         f"{q.device} (with row_dot_with), got {got}")


def _launch(spec, tensors, scalars, optional):
    from kernels.sm90.compile import compiled_forward

    launch_compiled(compiled_forward, spec, tensors, scalars, _typed_scalars, optional)


def run(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, spec_overrides=None, trace=False, row_dot_with=None, row_dot_into=None,
    q_start_positions=None, score_mods: "ScoreModTensors | None" = None,
):
    """(out, lse) of the sm90 kernel. `spec_overrides` (a dict of `FwdSpec` fields) replaces the
    dispatcher's compile-time choices; tools/tune_sm90_forward.py uses it to time variants.
    `trace=True` launches the traced build and returns (out, lse, per-tile timestamps), see
    kernels/sm90/trace.py. With `spec_overrides={"screen_masked_v": True}` it returns (out, lse,
    flag): flag[0] is 1 when a masked KV tile held a non-finite V value (kernels/sm90/screen.py).

    `row_dot_with` (like q, packed) and `row_dot_into` (a contiguous (H, T) float32 tensor): the
    kernel writes rowsum(row_dot_with * out) per row and head into row_dot_into, computed from
    its float32 accumulator, instead of out and lse (`FwdSpec.row_dot_output`), and returns
    None. nsa()'s backward takes a recomputed branch's gate gradient so.

    `q_start_positions` (packed; host ints, one per sequence): the position of each sequence's
    first query row (`FwdSpec.q_positions`).

    `score_mods` (padded inputs with `block_sparse` lists built from them,
    `kernels.masked.sm90_forward`): a user mask and/or additive bias
    (`kernels/sm90/score_mod.py`)."""
    # The public entry points send these to the fallback (can_run); a direct call must not
    # compile an untested variant.
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not supported by the sm90 kernel (bfloat16 or "
                         f"float16; kernels.flash_attn_func falls back to torch for others)")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim {q.shape[-1]} is not supported by the sm90 kernel (one "
                         f"of {SUPPORTED_HEAD_DIMS}; kernels.flash_attn_func falls back to torch "
                         f"for others)")
    padded = q.dim() == 4
    row_dot = row_dot_into is not None or row_dot_with is not None
    if row_dot:
        _check_row_dot(q, row_dot_with, row_dot_into)
    if padded:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k = k.shape[1]
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        cu_seqlens_q = uniform_cu_seqlens(batch, seqlen_q, q.device)
        cu_seqlens_k = uniform_cu_seqlens(batch, seqlen_k, q.device)
        max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
    total_q, num_heads, head_dim = q.shape
    require_int32_limits("kernels.sm90.forward.run", q, k, cu_seqlens_q=cu_seqlens_q,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         compress_factor=compress_factor, window_size=window_size,
                         block_sparse=block_sparse)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if row_dot:  # the kernel reads dO where it would write O, writes row dots for lse
        out, lse = aligned_rows(row_dot_with), row_dot_into
    else:
        out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)

    spec = _spec_for(q, causal, window_size, block_sparse, compress_factor, max_seqlen_k)
    if spec_overrides:
        spec = dataclasses.replace(spec, **spec_overrides)
        if not spec.fits_in_smem():
            raise ValueError(f"spec_overrides: {spec_overrides} needs {spec.smem_bytes} bytes of "
                             f"shared memory per CTA, more than an SM holds")
        if block_sparse is not None and (spec.tile_m, spec.tile_n) != (
                block_sparse.row_block_size, block_sparse.col_block_size):
            raise ValueError(f"spec_overrides: tile {spec.tile_m}x{spec.tile_n} differs from the "
                             f"block-sparse blocks {block_sparse.row_block_size}x"
                             f"{block_sparse.col_block_size}")
    if row_dot:
        spec = spec.writing_row_dots()
    score_tensors = (None,) * 3
    if score_mods is not None:
        if not padded or block_sparse is None or row_dot:
            raise ValueError("score_mods: padded inputs with the block-sparse lists of the mask "
                             "(kernels.masked.sm90_forward), no row dots")
        spec = score_mods.spec(spec)
        score_tensors = (score_mods.mask, score_mods.bias, score_mods.slabs)
    positions = None
    if q_start_positions is not None:
        spec = dataclasses.replace(spec, q_positions=True)
        positions = query_positions(tuple(q_start_positions), q.device)
    trace_buffer = None
    screen_flag = (torch.zeros(1, dtype=torch.int32, device=q.device)
                   if spec.screen_masked_v else None)
    if trace:
        from kernels.sm90.trace import trace_shape

        spec = dataclasses.replace(spec, trace=True)
        num_tiles = (-(-max_seqlen_q // spec.tile_m) * num_heads
                     * (cu_seqlens_q.numel() - 1))
        num_ctas = num_tiles
        if spec.persistent:
            num_ctas = min(num_tiles, persistent_grid_sms(q.device) * spec.ctas_per_sm)
        trace_buffer = torch.zeros(trace_shape(num_ctas, spec.tile_m, num_tiles),
                                   dtype=torch.int64, device=q.device)
    if max_seqlen_q > 0 and total_q > 0:
        scalars = (max_seqlen_q, softmax_scale, compress_factor, max(window_size[0], 0),
                   max(window_size[1], 0), persistent_grid_sms(q.device))
        tensors = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        optional = (None,) * 5
        if block_sparse is not None:
            bs = block_sparse
            optional = (bs.full_count, bs.full_index, bs.mask_count, bs.mask_index,
                        bs.row_block_offsets)
        _launch(spec, tensors, scalars,
                (*optional, trace_buffer, screen_flag, positions, *score_tensors))
    if row_dot:
        return None
    if padded:
        out = out.view(batch, seqlen_q, num_heads, head_dim)
        lse = lse.view(num_heads, batch, seqlen_q).permute(1, 0, 2).contiguous()
    if trace:
        return out, lse, trace_buffer
    if screen_flag is not None:
        return out, lse, screen_flag
    return out, lse
