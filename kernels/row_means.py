"""row_means: the float32 mean of runs of consecutive rows, NSA's pooling.

nsa()'s compression (the mean of each complete block of l rows of K and V) and selection's
scoring queries (per query tile, the mean of q over the rows ending at its anchor) are both
"mean of x[start : start + n]" for a list of runs. One CuTe DSL pass on sm90
(`kernels.sm90.row_means`: each row read once, only the means written); elsewhere torch gathers
the rows in chunks of at most GATHER_CHUNK_ELEMENTS elements, zeroes those past a run's end and
sums. Both sum in float32 (float64 for float64 input) and divide once by the run's length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import sm90_module

# Upper bound on the elements (rows x row length) the torch path gathers at once.
GATHER_CHUNK_ELEMENTS = 1 << 26


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision inputs, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def row_means(xs: tuple[Tensor, ...], starts: Tensor, counts: Tensor | None, *,
              count: int) -> tuple[Tensor, ...]:
    """Per x in xs (one or two (T, ...) tensors of one shape and dtype): (R, *x.shape[1:]) in
    compute_dtype, out[r] = the mean of x[starts[r] : starts[r] + n_r], n_r = counts[r] or
    `count` when counts is None (then with counts: `count` bounds every counts[r]); a run of no
    rows gives 0. starts, counts: (R,) integer tensors on x's device, every run inside
    [0, T). Trusted arguments: the callers (nsa.compression, nsa.selection) derive the runs
    from checked sequence bounds."""
    if len(xs) not in (1, 2) or any(x.shape != xs[0].shape or x.dtype != xs[0].dtype
                                     for x in xs):
        raise ValueError(f"xs: expected one or two tensors of one shape and dtype, got "
                         f"{[(tuple(x.shape), x.dtype) for x in xs]}")
    if starts.dim() != 1 or (counts is not None and counts.shape != starts.shape):
        raise ValueError(f"starts, counts: expected (R,) tensors, got {tuple(starts.shape)} and "
                         f"{None if counts is None else tuple(counts.shape)}")
    rows = [x.flatten(1) if x.dim() > 1 else x[:, None] for x in xs]
    kernel = _kernel_for(rows) if starts.numel() else None
    if kernel is not None:
        means = kernel.run(rows, starts, counts, count)
    else:
        means = [_torch_row_means(x, starts, counts, count) for x in rows]
    return tuple(m.view(starts.shape[0], *x.shape[1:]) for m, x in zip(means, xs))


def runs_on_sm90(rows: list[Tensor]) -> bool:
    """Whether row_means runs the sm90 kernel for these (T, W) rows (tools/profile_nsa.py
    names the backend with it)."""
    return _kernel_for(rows) is not None


def _kernel_for(rows: list[Tensor]):
    """``kernels.sm90.row_means`` where it averages these (T, W) rows, else None."""
    kernel, _ = sm90_module("row_means", rows[0].device)
    if kernel is None or not all(kernel.can_run(x) for x in rows):
        return None
    return kernel


def _torch_row_means(x: Tensor, starts: Tensor, counts: Tensor | None, count: int) -> Tensor:
    """(R, W) in compute_dtype for x (T, W): the gather, chunked over runs."""
    dtype = compute_dtype(x.dtype)
    num_runs, width = starts.shape[0], x.shape[1]
    if num_runs == 0 or count == 0:
        return torch.zeros(num_runs, width, dtype=dtype, device=x.device)
    offset = torch.arange(count, device=x.device)
    per_chunk = max(1, GATHER_CHUNK_ELEMENTS // (count * max(width, 1)))
    sums = []
    for first in range(0, num_runs, per_chunk):
        run_starts = starts[first:first + per_chunk].to(torch.int64)
        rows = (run_starts[:, None] + offset).clamp_(0, max(x.shape[0] - 1, 0))
        gathered = x.index_select(0, rows.flatten()).unflatten(0, rows.shape)
        if counts is None:
            sums.append(gathered.to(dtype).mean(dim=1))
            continue
        run_counts = counts[first:first + per_chunk].to(torch.int64)
        gathered.masked_fill_(~(offset < run_counts[:, None])[..., None], 0)
        # A run of no rows: 0 / 1 = 0, never 0 / 0.
        sums.append(gathered.sum(dim=1, dtype=dtype) / run_counts.clamp_min(1)[:, None])
    return sums[0] if len(sums) == 1 else torch.cat(sums)
