"""Flash attention with causal x compress_factor, sliding-window, block-sparse, varlen and GQA
masking: CuTe DSL kernels for sm_90 (``kernels.sm90``) behind torch entry points, and a plain
torch fallback computing the same function everywhere else. docs/interfaces.md defines it."""
from .autograd import flash_attn_func, flash_attn_varlen_func
from .interface import attention_backward, attention_forward, which_backend
from .masked import PreparedMask, prepare_mask

__all__ = [
    "attention_backward",
    "attention_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "PreparedMask",
    "prepare_mask",
    "which_backend",
]
