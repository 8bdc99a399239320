"""Rows whose selected branch is their window branch: nsa() runs the window alone for them.

Near a document's start the two branches attend to the same keys. The window branch's row i
(0-based in its document) sees keys max(0, i - w + 1)..i: all of [0, i] when i < w. The
selected branch's row i sees the blocks selected for its query tile, causally; a tile (rows
[a, e), docs/interfaces.md's rule) forces block 0 and the blocks overlapping its rows and ranks
the blocks complete before a, so where its rows' blocks number at most n (e <= n l') every one
of them is selected and row i sees all of [0, i] too. So on every row of a tile with
e <= min(w, n l') the two branches are the same softmax over the same keys and values: the
selected output equals the window's (as a value; the kernels round their own ways).

nsa() then leaves those tiles out of the selected branch's lists (their rows see nothing
there: output 0, lse -inf, no work in its forward or backward) and gives their selected gate
to the window, whose output stands for both:

    out = g_c o_c + (g_w + g_s) o_w + 0 * o_s   on those rows (`folded_gates`)

The gate gradients follow from that: dL/dg_w = <dO, o_w> as before, and dL/dg_s = <dO, o_s> =
<dO, o_w> on those rows (`unfold_gate_gradients`). At the defaults (w = 512, n l' = 1024) that
is every row of documents up to 512 tokens and the first 512 of longer ones: 6% of the selected
branch's pairs in the log-normal packing of tools/packed_workloads.py, 25% with 1K documents,
all of them with 256-token documents.

Causal NSA with a window only, where the covered rows hold at least MIN_COVERED_PAIR_SHARE of
the selected pairs (packed documents; not a long single sequence); not on `QueryRows` calls
(context parallelism's sequence mode, whose rows start inside their documents). Switch:
nsa.function.WINDOW_COVERS_SELECTED.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from nsa.branches import SELECTED, WINDOW
from nsa.config import NSAConfig
from sparsity import BlockSparseTensors
from sparsity.host_cache import cached


@dataclass(frozen=True, eq=False)
class WindowCoveredRows:
    """The selected branch's list rows (query tiles) that the window stands for, and their
    query rows."""

    tiles: Tensor  # (C,) int64: row blocks of the selected lists
    rows: Tensor  # (R,) int64: the query rows of those tiles, ascending


def _cover(config: NSAConfig) -> int:
    """The rows from a document's start the window may stand for: min(w, n l')."""
    return min(config.window_size, config.num_selected_blocks * config.selected_block_size)


def _covered_row_count(length: int, cover: int, tile: int) -> int:
    """A document's covered rows: all of it up to the cover, else its whole tiles within it
    (`_covered_rows` computes the same on the device, from cu_seqlens)."""
    return length if length <= cover else cover // tile * tile


def covered_tile_counts(host_cu_seqlens: tuple[int, ...], config: NSAConfig) -> list[int]:
    """Per sequence, how many of its first query tiles (config.q_tile rows) the window covers:
    those whose rows [a, e) have e <= min(window_size, num_selected_blocks x
    selected_block_size); 0 everywhere where the rule does not apply."""
    if not config.causal or config.window_size <= 0:
        return [0] * (len(host_cu_seqlens) - 1)
    cover, tile = _cover(config), config.q_tile
    return [-(-_covered_row_count(end - start, cover, tile) // tile)
            for start, end in zip(host_cu_seqlens, host_cu_seqlens[1:])]


def covered_pair_share(host_cu_seqlens: tuple[int, ...], config: NSAConfig) -> float:
    """The covered rows' share of the selected branch's attended pairs (row i attends to
    min(i + 1, n l') keys: the benchmark's pair rule, tools/packed_workloads.py)."""
    span, tile = config.num_selected_blocks * config.selected_block_size, config.q_tile
    counts = covered_tile_counts(host_cu_seqlens, config)
    covered = total = 0
    for count, start, end in zip(counts, host_cu_seqlens, host_cu_seqlens[1:]):
        length = end - start
        rows, seen = min(length, count * tile), min(length, span)
        covered += rows * (rows + 1) // 2
        total += seen * (seen + 1) // 2 + (length - seen) * span
    return covered / total if total else 0.0


# Below this share of the selected pairs nsa() does not fold: folding and unfolding the gates
# (T x H x 3 floats; 0.03-0.05 ms of kernel time a step at 64K tokens, H=32, H200) costs about
# what a single 64K sequence's 0.2% of the pairs saves, and at 1M tokens the folded copy would
# add 0.4 GB to the peak for nothing.
MIN_COVERED_PAIR_SHARE = 0.01


def window_covered_rows(cu_seqlens: Tensor, host_cu_seqlens: tuple[int, ...],
                        config: NSAConfig) -> WindowCoveredRows | None:
    """The tiles and rows the window covers in this packing; None where there are none or
    they hold less than MIN_COVERED_PAIR_SHARE of the selected pairs. Made on the device from
    cu_seqlens (a CUDA-graph capture may build it: no host-to-device copy) and kept across
    calls, the answer too, as a function of the host bounds and the config
    (sparsity/host_cache.py)."""
    if not config.causal or config.window_size <= 0:
        return None
    key = ("window-covered rows", tuple(host_cu_seqlens), config.q_tile, config.window_size,
           config.num_selected_blocks, config.selected_block_size)
    return cached(key, cu_seqlens, lambda: _covered_rows(cu_seqlens, host_cu_seqlens, config))


def _covered_rows(cu_seqlens: Tensor, host_cu_seqlens: tuple[int, ...],
                  config: NSAConfig) -> WindowCoveredRows | None:
    counts = covered_tile_counts(host_cu_seqlens, config)
    if not any(counts) or covered_pair_share(host_cu_seqlens, config) < MIN_COVERED_PAIR_SHARE:
        return None
    cover, tile = _cover(config), config.q_tile
    cu = cu_seqlens.to(torch.int64)
    lengths = cu.diff()
    # Covered rows per sequence: all of a document up to the cover, else whole tiles; their
    # count is the host bounds', so the indices are made without reading the device.
    limit = torch.where(lengths <= cover, lengths, cover // tile * tile)
    row_count = sum(_covered_row_count(end - start, cover, tile)
                    for start, end in zip(host_cu_seqlens, host_cu_seqlens[1:]))
    limit_end = limit.cumsum(0)
    nth = torch.arange(row_count, device=cu.device)
    sequence = torch.searchsorted(limit_end, nth, right=True)
    rows = cu[sequence] + nth - (limit_end[sequence] - limit[sequence])
    tiles_before = ((lengths + tile - 1) // tile).cumsum(0)
    covered = (limit + tile - 1) // tile
    covered_end = covered.cumsum(0)
    entry = torch.arange(sum(counts), device=cu.device)
    owner = torch.searchsorted(covered_end, entry, right=True)
    first_tile = tiles_before[owner] - (lengths[owner] + tile - 1) // tile
    tiles = first_tile + entry - (covered_end[owner] - covered[owner])
    return WindowCoveredRows(tiles, rows)


def without_covered_tiles(lists: BlockSparseTensors, covered: WindowCoveredRows
                          ) -> BlockSparseTensors:
    """`lists` with the covered tiles' entries removed (counts 0, indices -1): new count and
    index tensors, the given ones untouched."""
    tiles = covered.tiles
    return dataclasses.replace(
        lists, full_count=lists.full_count.index_fill(0, tiles, 0),
        full_index=lists.full_index.index_fill(0, tiles, -1),
        mask_count=lists.mask_count.index_fill(0, tiles, 0),
        mask_index=lists.mask_index.index_fill(0, tiles, -1))


def folded_gates(gates: Tensor, covered: WindowCoveredRows | None) -> Tensor:
    """The (T, H, 3) gates nsa() sums and differentiates the branch outputs with: on covered
    rows the window's gate is g_w + g_s and the selected branch's 0; `gates` itself where
    nothing is covered. A contiguous copy of the gates, then the covered rows alone are
    gathered, changed and put back. The forward keeps the result for the backward's passes
    (`KeptForBackward.summed_gates`), so a step folds once where the outputs are kept.
    Kernel time of a step's fold and unfold (H=32, H200, torch.profiler; docs/history.md):
    64K tokens packed 33-46 us, against 60-76 us when one broadcasting expression over every
    row (gates + m g_s (0, -1, 1), torch's generic strided kernel) folded in the forward and
    again in the backward; at 8K tokens (512 rows covered) 15.6-17.2 us against 12.9-13.2,
    the index kernels' fixed costs."""
    if covered is None:
        return gates
    # A new tensor: gates may be the mean gates' expanded view, or kept for gate_backward.
    folded = gates.clone(memory_format=torch.contiguous_format)
    moved = folded.index_select(0, covered.rows)
    moved[..., WINDOW].add_(moved[..., SELECTED])
    moved[..., SELECTED].zero_()
    return folded.index_copy_(0, covered.rows, moved)


def unfold_gate_gradients(d_gates: Tensor, covered: WindowCoveredRows | None) -> None:
    """d_gates (T, H, 3), the gradients with respect to `folded_gates`, made those with respect
    to the gates, in place: on covered rows dL/dg_s = dL/dg_w (the window's output stands for
    the selected branch's there); the other columns and rows are the same."""
    if covered is None:
        return
    d_gates[..., SELECTED].index_copy_(
        0, covered.rows, d_gates[..., WINDOW].index_select(0, covered.rows))
