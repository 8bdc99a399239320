"""nsa() across GPUs: context parallelism on torch.distributed.

Each rank of a context-parallel group holds a shard of the tokens (a contiguous range, or two
mirrored chunks with layout="zigzag"); `nsa_context_parallel` returns the rank's shard of nsa()'s
output, and gradients flow back to the shards (and to the rank's share of the replicated
weights). docs/context_parallel.md describes the layouts, the modes, the gradient convention for
W_k, W_v and W_gate, and the cross-rank checks.

Modules, one job each: `groups` (a ProcessGroup or a DeviceMesh dimension), `sharding` (the
layout: split and gather tokens), `agreement` (the one collective that checks every rank called
alike), `exchange` (the differentiable all-to-all between sequence shards and head shards),
`sequence_mode` (each rank keeping its query rows), `context_parallel` (the entry point and the
choice of mode).
"""
from nsa.distributed.agreement import MODES
from nsa.distributed.context_parallel import choose_mode, nsa_context_parallel
from nsa.distributed.groups import ContextParallelGroup, resolve_group
from nsa.distributed.sharding import (LAYOUTS, shard_bounds, shard_indices, shard_ranges,
                                      shard_sequence, unshard_sequence)

__all__ = ["LAYOUTS", "MODES", "ContextParallelGroup", "choose_mode", "nsa_context_parallel",
           "resolve_group", "shard_bounds", "shard_indices", "shard_ranges", "shard_sequence",
           "unshard_sequence"]
