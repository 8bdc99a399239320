"""Native Sparse Attention: compressed, selected and sliding-window branches, gated.

`nsa` is the differentiable entry point (across GPUs with `context_parallel_group`, see
`nsa.distributed`); `nsa_reference` the plain PyTorch oracle it is tested against;
`NSAFunction` the autograd Function on packed tensors; `NSAAttention` the model layer (hidden
states in and out) and `NSAAttentionReference` its plain-torch twin; `SELECTION_Q_TILE` the
query rows that share one block selection; `release_captured_plans` frees the CUDA graphs that
eager calls replay (nsa/captured.py). docs/interfaces.md and nsa/reference.py state the
exact rules; docs/model.md the layer.
"""
from nsa.api import nsa
from nsa.captured import release_captured_plans
from nsa.function import NSAFunction
from nsa.reference import nsa_reference
from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE
from nsa.layer import NSAAttention, NSAAttentionReference  # after nsa.api: the layer calls it

__all__ = ["CMP_KV_BLOCK", "NSAAttention", "NSAAttentionReference", "NSAFunction",
           "SELECTION_Q_TILE", "nsa", "nsa_reference",
           "release_captured_plans"]
