"""The sm90 kernels' index limits: which calls their 32-bit arithmetic and launch grids hold.

The dispatcher (`kernels.dispatch`) asks `int32_limits_reason` before it picks a kernel, and
sends the calls it names to the torch fallback, which has no such limit; the launchers'
`run` refuses them with `require_int32_limits` when called directly. Reads shapes only:
nothing from the device, so meta tensors work.
"""
from __future__ import annotations

from kernels.sm90.spec import QUERY_SLOT_ROWS  # the backward's query-tile rows
from kernels.sm90.spec import list_shape, splits_lists
from kernels.validate import INT32_MAX

# CUDA's limit on a launch grid's y and z extents (x may reach INT32_MAX).
GRID_YZ_MAX = 65535
# kernels/sm90/block_range.py stands for "no bound" with 2**30 (key_limit_right without causal or
# a right window; row_limit_high without a left window): keys and rows at or past it are never
# visited, so a sequence must be shorter.
KERNEL_UNBOUNDED = 2**30
# Rows per forward work tile (forward.py TILE_M), and the widest key tile of
# either direction.
_FORWARD_TILE_M, _WIDEST_TILE = 128, 128


def require_int32_limits(caller: str, q, k, **kwargs) -> None:
    """ValueError naming the limit when `int32_limits_reason` finds one: for direct calls of a
    kernel module's ``run`` (the public entry points send such calls to the fallback)."""
    reason = int32_limits_reason(q, k, **kwargs)
    if reason:
        raise ValueError(f"{caller}: {reason}; kernels.flash_attn_func / attention_forward send "
                         "such calls to the torch fallback")


def int32_limits_reason(q, k, *, backward: bool = False, cu_seqlens_q=None, max_seqlen_q=None,
                        max_seqlen_k=None, compress_factor: int = 1, window_size=(-1, -1),
                        block_sparse=None, deterministic: bool = False, causal: bool = False,
                        q_start_positions=None, **_) -> str:
    """Why the sm90 kernels' 32-bit index arithmetic (or their launch grid) cannot hold this
    call; "" when it can. The fallback has none of these limits.

    Takes the normalised keyword arguments a kernel module's ``can_run`` receives (``max_seqlen_*``
    filled in, also for padded inputs), and reads shapes only: nothing from the device, so meta
    tensors work. Each limit names where it comes from:

    - rows: packed rows of q and k (``B * N`` for padded inputs) are int32 (``cu_seqlens``, the
      kernels' row offsets); extents of the kernels' tensors are Int32 (strides are 64-bit);
    - ``max_seqlen_q/k`` < 2**30: ``block_range.py``'s stand-in for an unbounded key or row range;
    - positions: ``(key + 1) * compress_factor`` and ``row + window`` of a tile's last key or row
      (past its sequence's first position, ``q_start_positions``) are Int32 (``block_range.py``,
      ``mask.py``);
    - forward: ``ceil(max_seqlen_q / 128) * H * S`` work tiles are counted in Int32
      (``tile_scheduler.py``) and are the grid's x extent when not persistent;
    - backward: the row statistics and the dQ accumulator have ``P = 64 * (Tq // 64 + S)`` slots
      (``backward.py`` ``QueryTiles``), an Int32 extent; the grid is ``(KV tiles, Hkv, S)`` unless
      block-sparse lists are split into work units, and CUDA caps y and z at 65535; the lists'
      transpose (``sparsity.BlockSparseCSR``) has int32 offsets up to its capacity
      ``R * Hs * (Kf + Km)``.
    """
    padded = q.dim() == 4
    rows_q = q.shape[0] * q.shape[1] if padded else q.shape[0]
    rows_k = k.shape[0] * k.shape[1] if padded else k.shape[0]
    num_seqs = q.shape[0] if padded else cu_seqlens_q.numel() - 1
    max_q = q.shape[1] if padded else max_seqlen_q
    max_k = k.shape[1] if padded else max_seqlen_k
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    for name, rows in (("q", rows_q), ("k", rows_k)):
        if rows > INT32_MAX:
            return f"{rows} rows of {name} exceed the kernels' int32 row offsets (2**31 - 1)"
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if value >= KERNEL_UNBOUNDED:
            return (f"{name} = {value} reaches 2**30, the kernels' stand-in for an unbounded "
                    "range (kernels/sm90/block_range.py)")
    window = max(window_size[0], window_size[1], 0)
    first_position = max(q_start_positions or (0,))
    reach = max(first_position + max_q + _FORWARD_TILE_M,
                (max_k + _WIDEST_TILE) * compress_factor) + window + 1
    if reach > INT32_MAX:
        return (f"token positions up to {reach} (max_seqlen_k {max_k} x compress_factor "
                f"{compress_factor}, max_seqlen_q {max_q} from position {first_position}, "
                f"window {window}) exceed the kernels' Int32 mask arithmetic")
    if not backward:
        tiles = -(-max_q // _FORWARD_TILE_M) * num_heads * num_seqs
        if tiles > INT32_MAX:
            return (f"{tiles} forward work tiles (ceil(max_seqlen_q / {_FORWARD_TILE_M}) x H x S)"
                    " exceed the kernel's Int32 tile count")
        return ""
    slots = QUERY_SLOT_ROWS * (rows_q // QUERY_SLOT_ROWS + num_seqs)
    if slots > INT32_MAX:
        return (f"{slots} query-tile slots (64 x (Tq // 64 + S)) of the backward's dQ "
                "accumulator exceed its Int32 extent")
    # As kernels/sm90/spec.py `choose_backward_spec` decides: block-sparse lists that are split
    # into work units run a one-dimensional grid.
    split = block_sparse is not None and splits_lists(
        block_sparse.col_block_size, q.shape[-1], deterministic, causal, window_size,
        compress_factor, list_shape(block_sparse, num_heads, num_kv_heads))
    if not split and (num_seqs > GRID_YZ_MAX or num_kv_heads > GRID_YZ_MAX):
        return (f"the backward's grid (KV tiles, Hkv = {num_kv_heads}, S = {num_seqs}) "
                f"exceeds CUDA's limit of {GRID_YZ_MAX} on its y and z extents")
    if block_sparse is not None:  # the transpose's offsets, split or not
        capacity = block_sparse.full_index.numel() + block_sparse.mask_index.numel()
        if capacity > INT32_MAX:
            return (f"the transposed block-sparse lists' capacity ({capacity} entries) exceeds "
                    "their int32 offsets")
    return ""
