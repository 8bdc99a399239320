"""The compile key of the sm90 forward kernel.

Everything that changes the generated code lives in `FwdSpec`; everything else (sequence
lengths, head counts, window sizes, the compress factor, the softmax scale, the block-sparse
lists) is a runtime
argument, so one compiled kernel serves every sequence length and batch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FwdSpec:
    dtype: str                 # "bfloat16" | "float16"
    head_dim: int              # 64 | 128 (q, k and v share it)
    causal: bool
    has_window_left: bool      # window sizes themselves are runtime Int32
    has_window_right: bool
    block_sparse: bool         # iterate compact full/mask lists instead of a block range
    compressed: bool = False   # compress_factor may exceed 1 (its value is a runtime argument)
    tile_m: int = 128          # query rows per CTA (two consumer warpgroups of 64 rows)
    tile_n: int = 128          # keys per KV tile; the block-sparse column block size
    num_stages: int = 2        # K and V pipeline depth
    q_stages: int = 1          # Q buffers: 2 lets a persistent CTA load the next tile's Q early
    persistent: bool = False   # one CTA per SM walking tiles (kernels/sm90/tile_scheduler.py)
    heads_fastest: bool = False  # tile order: a GQA group's heads side by side (L2 sharing)

    @property
    def masks_rows(self) -> bool:
        """Whether any in-tile mask beyond the sequence end exists."""
        return self.causal or self.has_window_left or self.has_window_right
