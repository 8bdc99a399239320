"""Native Sparse Attention: compressed, selected and sliding-window branches, gated.

`nsa` is the differentiable entry point; `nsa_reference` the plain PyTorch oracle it is tested
against; `NSAFunction` the autograd Function on packed tensors; `SELECTION_Q_TILE` the query rows
that share one block selection. docs/interfaces.md and nsa/reference.py state the exact rules.
"""
from nsa.api import nsa
from nsa.function import NSAFunction
from nsa.reference import nsa_reference
from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE

__all__ = ["CMP_KV_BLOCK", "NSAFunction", "SELECTION_Q_TILE", "nsa", "nsa_reference"]
