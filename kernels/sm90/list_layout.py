"""The backward's list layout in one launch each, instead of tens of small torch ops per call.

nsa()'s eager backward at 16K tokens is bound by host time (docs/history.md, "nsa()'s eager
backward, host time", 2026-11-27): every torch op costs the host ~20-25 us, and building the
transposed lists and the split-list work units took ~65 of them per step. Two elementwise
kernels replace them:

- `TransposeKeys`: the sort key of every slot of the forward lists
  (`sparsity.csr._sort_keys`' torch ops): ((global KV block * Hs + head) * 2 + kind) * span +
  the tile's local index, or `unlisted` for a slot past its list's count or outside its
  sequence; int32 where every key fits (`sparsity.csr.sort_key_dtype`: half the radix passes
  of the sort), else int64. The transpose is then one torch sort and a search
  (sparsity/csr.py).
- `WorkUnits`: the (sequence, KV block, list head, first entry, end entry) chunks of
  `BwdSpec.split_lists` (`kernels.sm90.backward.work_units`' torch ops): one thread per list
  writes its chunks at the list's place in the running count of chunks (one torch cumsum, over
  the lists in CSR order or taken head by head).

One thread per slot or list, 256 per CTA; both are equal to their torch versions bit for bit
(tests/kernels/test_sm90_backward_units.py
`test_list_layout_kernels_equal_their_torch_ops`, GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from kernels.sm90.tile_scheduler import last_offset_at_most

THREADS = 256
# The kind ranks of the CSR's sort keys: a group's mask entries before its full ones
# (sparsity/csr.py `_MASK_RANK`, `_FULL_RANK`).
MASK_RANK, FULL_RANK = 0, 1


@dataclass(frozen=True)
class ListLayoutSpec:
    """The compile key of both kernels: the threads per CTA, and `TransposeKeys`' key width."""
    threads: int = THREADS
    key_bits: int = 64  # TransposeKeys writes int64 keys, or int32 (32) where they fit


class TransposeKeys:
    """Called with the forward lists (full count (R, Hs), full index (R, Hs, Kf), mask count,
    mask index (R, Hs, Km), int32), each tile's geometry ((R,) int64: local tile index, first
    global KV block of its sequence, KV blocks of its sequence), span and unlisted (int64) and
    the keys out (R * Hs * (Kf + Km),) int64 (int32 with `key_bits` 32: the caller's bounds
    keep every key below 2**31), slot (r, h, j) at (r * Hs + h) * (Kf + Km) + j, the full slots
    first."""

    def __init__(self, spec: ListLayoutSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, full_count: cute.Tensor, full_index: cute.Tensor,
                 mask_count: cute.Tensor, mask_index: cute.Tensor, local_tile: cute.Tensor,
                 first_col: cute.Tensor, columns: cute.Tensor, span: Int64, unlisted: Int64,
                 keys: cute.Tensor, stream):
        total = cute.size(keys.shape[0])
        self.kernel(full_count, full_index, mask_count, mask_index, local_tile, first_col,
                    columns, span, unlisted, keys).launch(
            grid=[cute.ceil_div(total, self.spec.threads), 1, 1],
            block=[self.spec.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, full_count: cute.Tensor, full_index: cute.Tensor, mask_count: cute.Tensor,
               mask_index: cute.Tensor, local_tile: cute.Tensor, first_col: cute.Tensor,
               columns: cute.Tensor, span: Int64, unlisted: Int64, keys: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        slot = cta * self.spec.threads + tidx
        if slot < cute.size(keys.shape[0]):
            heads = cute.size(full_count.shape[1])
            full_width = cute.size(full_index.shape[2])
            width = full_width + cute.size(mask_index.shape[2])
            j = slot % width
            row = slot // width // heads
            head = slot // width % heads
            block = Int32(-1)  # stays -1 for a slot past its list's count
            rank = Int64(FULL_RANK)
            if j < full_width:
                if j < full_count[row, head]:
                    block = full_index[row, head, j]
            else:
                rank = Int64(MASK_RANK)
                if j - full_width < mask_count[row, head]:
                    block = mask_index[row, head, j - full_width]
            key = unlisted
            # A block outside its sequence (trusted lists the checked build would refuse) is
            # left out, as the torch keys do.
            if (block >= 0) & (Int64(block) < columns[row]):
                group = (first_col[row] + Int64(block)) * Int64(heads) + Int64(head)
                key = (group * Int64(2) + rank) * span + local_tile[row]
            if const_expr(self.spec.key_bits == 32):
                keys[slot] = Int32(key)
            else:
                keys[slot] = key


class WorkUnits:
    """Called with the CSR's offsets (G + 1,) int32 (G = KV blocks x list heads), the running
    count of each list's chunks (G,) int64 (inclusive; in whatever order the units are to run:
    a list's units start at its count minus its chunks), the KV blocks' sequence offsets
    (S + 1,) int32, the list heads, the chunk, and the units out (U, 5) int32, zeroed: units
    past the real ones stay (0, 0, 0, 0, 0), empty (first = end), and their CTAs exit."""

    def __init__(self, spec: ListLayoutSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, offsets: cute.Tensor, chunk_ends: cute.Tensor,
                 kv_block_offsets: cute.Tensor, heads: Int32, chunk: Int32, units: cute.Tensor,
                 stream):
        lists = cute.size(chunk_ends.shape[0])
        self.kernel(offsets, chunk_ends, kv_block_offsets, heads, chunk, units).launch(
            grid=[cute.ceil_div(lists, self.spec.threads), 1, 1],
            block=[self.spec.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, offsets: cute.Tensor, chunk_ends: cute.Tensor,
               kv_block_offsets: cute.Tensor, heads: Int32, chunk: Int32, units: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        group = cta * self.spec.threads + tidx
        if group < cute.size(chunk_ends.shape[0]):
            first_entry = offsets[group]
            end_entry = offsets[group + 1]
            chunks = (end_entry - first_entry + chunk - 1) // chunk
            first_unit = Int32(chunk_ends[group]) - chunks
            kv_row = group // heads
            lo = block_sequence(kv_block_offsets, kv_row)
            block_in_sequence = kv_row - kv_block_offsets[lo]
            for c in cutlass.range(chunks):
                unit = first_unit + c
                first = first_entry + c * chunk
                units[unit, 0] = lo
                units[unit, 1] = block_in_sequence
                units[unit, 2] = group % heads
                units[unit, 3] = first
                units[unit, 4] = cutlass.min(first + chunk, end_entry)


@cute.jit
def block_sequence(kv_block_offsets: cute.Tensor, kv_row: Int32) -> Int32:
    """The sequence of global KV block `kv_row`: the last s with kv_block_offsets[s] <= kv_row
    (empty sequences share their offset with the next one, which owns the block); a bisection
    over the (S + 1,) offsets."""
    return last_offset_at_most(kv_block_offsets, kv_row, cute.size(kv_block_offsets.shape[0]) - 2)


# ------------------------------------------------------------------------------------------------
# Fakes for CPU builds, and the torch side.
# ------------------------------------------------------------------------------------------------


def _fake_int_vector(dtype, length=None):
    from cutlass.cute.runtime import make_fake_compact_tensor

    length = cute.sym_int() if length is None else length
    return make_fake_compact_tensor(dtype, (length,), assumed_align=4)


def fake_transpose_keys_arguments(spec: ListLayoutSpec):
    from cutlass.cute.runtime import make_fake_tensor

    rows, heads = cute.sym_int(), cute.sym_int()

    def counts():
        return make_fake_tensor(Int32, (rows, heads), stride=(cute.sym_int(), 1),
                                assumed_align=4)

    def index():
        return make_fake_tensor(Int32, (rows, heads, cute.sym_int()),
                                stride=(cute.sym_int(), cute.sym_int(), 1), assumed_align=4)

    key_type = Int32 if spec.key_bits == 32 else Int64
    return (counts(), index(), counts(), index(), _fake_int_vector(Int64, rows),
            _fake_int_vector(Int64, rows), _fake_int_vector(Int64, rows), Int64(1), Int64(0),
            _fake_int_vector(key_type))


def fake_work_units_arguments(spec: ListLayoutSpec):
    from cutlass.cute.runtime import make_fake_compact_tensor

    units = make_fake_compact_tensor(Int32, (cute.sym_int(), 5), stride_order=(1, 0),
                                     assumed_align=4)
    return (_fake_int_vector(Int32), _fake_int_vector(Int64), _fake_int_vector(Int32),
            Int32(1), Int32(1), units)


def compile_on_fake_tensors(kernel: str, key_bits: int = 64):
    """`TransposeKeys` (with `key_bits`) or `WorkUnits` (by name) built for sm_90a without a
    GPU."""
    from cutlass.cute.runtime import make_fake_stream

    spec = ListLayoutSpec(key_bits=key_bits)
    kernel_class, fakes = {"transpose_keys": (TransposeKeys, fake_transpose_keys_arguments),
                           "work_units": (WorkUnits, fake_work_units_arguments)}[kernel]
    return cute.compile(kernel_class(spec), *fakes(spec), make_fake_stream())


def transpose_keys(bs, geometry, span: int, unlisted: int):
    """`sparsity.csr._sort_keys(bs, geometry, span, unlisted, check=False)` in one launch: the
    flat keys of bs's slots in `sparsity.csr.sort_key_dtype(unlisted)` (lists of width >= 1
    each, on an sm90 GPU)."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream
    from sparsity.csr import sort_key_dtype

    rows, heads = bs.full_count.shape
    width = bs.full_index.shape[-1] + bs.mask_index.shape[-1]
    dtype = sort_key_dtype(unlisted)
    keys = torch.empty(rows * heads * width, dtype=dtype, device=bs.full_count.device)
    if keys.numel() == 0:
        return keys
    local_tile, first_col, columns = (x.reshape(-1) for x in geometry)
    spec = ListLayoutSpec(key_bits=32 if dtype == torch.int32 else 64)
    launch_on_current_stream(
        TransposeKeys, spec, fake_transpose_keys_arguments,
        (bs.full_count, bs.full_index, bs.mask_count, bs.mask_index, local_tile, first_col,
         columns, span, unlisted, keys), keys.device)
    return keys


def work_units(csr, chunk: int, head_major: bool = False):
    """`kernels.sm90.backward.work_units(csr, chunk, head_major)` in one launch (and a cumsum):
    (U, 5) int32, U = lists + capacity // chunk; the real units equal the torch version's, the
    rest are all zero (empty)."""
    import torch

    from kernels.sm90.launch import launch_on_current_stream

    offsets = csr.offsets
    num_lists = offsets.numel() - 1
    units = torch.zeros(num_lists + csr.index.numel() // chunk, 5, dtype=torch.int32,
                        device=offsets.device)
    if num_lists == 0:
        return units
    chunks = torch.div(offsets.diff() + (chunk - 1), chunk, rounding_mode="floor")
    if head_major:  # the running count over the lists taken head by head, kept in CSR order
        heads = csr.num_heads
        chunk_ends = chunks.view(-1, heads).t().reshape(-1).cumsum(0).view(heads, -1).t()
        chunk_ends = chunk_ends.reshape(-1)
    else:
        chunk_ends = torch.cumsum(chunks, 0)
    launch_on_current_stream(
        WorkUnits, ListLayoutSpec(), fake_work_units_arguments,
        (offsets, chunk_ends, csr.row_block_offsets, csr.num_heads, chunk, units),
        offsets.device)
    return units
