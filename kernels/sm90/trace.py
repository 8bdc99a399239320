"""Per-tile phase timestamps of the sm90 forward kernel (a diagnostic build, `FwdSpec.trace`).

ncu tells how the warps stall on average; it does not tell which phase of a work tile the time
goes to. A traced build writes the SM's cycle counter (clock64) at fixed points of every tile
into an int64 buffer of shape (CTAs, roles, tiles per CTA, slots): role 0 is the producer warp,
role 1 + w consumer warpgroup w; events a tile does not pass stay 0.
`tools/trace_sm90_forward.py` turns the buffer into a table.

The untraced kernel has no trace argument at all (the switch is compile-time), so it is
unchanged by this module.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# Consumer warpgroup events, in program order. The last slot holds the tile's KV tile count.
CONSUMER_EVENTS = (
    "start",          # consume_tile entered
    "work",           # tile coordinates, sequence bounds and KV range computed
    "q_ready",        # the tile's Q is in smem
    "k0_ready",       # the first K tile is in smem (its Q K^T is issued next)
    "prev_stored",    # `defer_store`: the previous tile's output stored under that Q K^T
    "s0_done",        # first S = Q K^T finished
    "softmax0_done",  # its mask + softmax done, P in registers
    "loop_done",      # every later KV tile done (S, softmax, P V of the previous one)
    "v_last_ready",   # the last V tile is in smem (its P V is issued next)
    "pv_last_done",   # the last P V finished
    "finalized",      # O normalised, lse computed
    "stored",         # O in smem and its TMA store issued (or stored from registers); with
                      # `defer_store` this comes in the next tile, as "prev_stored"
)
PRODUCER_EVENTS = (
    "start",       # produce_tile entered
    "work",        # tile bounds computed
    "q_issued",    # a Q buffer was free and its load issued
    "k0_issued",   # a K buffer was free and the first K load issued
    "done",        # every K/V load of the tile issued
)
NUM_SLOTS = max(len(CONSUMER_EVENTS), len(PRODUCER_EVENTS)) + 1
KV_TILES_SLOT = NUM_SLOTS - 1


def trace_shape(num_ctas: int, tile_m: int, num_tiles: int) -> tuple[int, int, int, int]:
    """Shape of the buffer a launch of `num_ctas` CTAs over `num_tiles` tiles fills."""
    return (num_ctas, 1 + tile_m // 64, math.ceil(num_tiles / num_ctas), NUM_SLOTS)


def marker(m_trace, role, iteration, leader, events: tuple[str, ...]):
    """mark(name) stamps event `name` of this role's tile `iteration`; mark("kv_tiles", n)
    records the tile's KV tile count. Only `leader` (one thread of the role) writes. Untraced,
    mark emits nothing."""
    def mark(name: str, value=None):
        if m_trace is not None:
            slot = KV_TILES_SLOT if name == "kv_tiles" else events.index(name)
            _stamp(m_trace, role, iteration, leader, slot, value)
    return mark


@cute.jit
def _stamp(m_trace, role: Int32, iteration: Int32, leader, slot: cutlass.Constexpr[int],
           value=None):
    """Write clock64 (or `value`) at [this CTA, role, iteration, slot]."""
    if leader:
        cta, _, _ = cute.arch.block_idx()
        if iteration < cute.size(m_trace.shape[2]):
            if const_expr(value is None):
                m_trace[cta, role, iteration, slot] = cute.arch.clock64()
            else:
                m_trace[cta, role, iteration, slot] = cutlass.Int64(value)
