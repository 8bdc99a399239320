"""The split-list backward's dK and dV outside the work units that store them.

Work units of `BwdSpec.split_lists` (chunks of the transposed lists) add float32 dK/dV
partials into accumulators that the units of one KV tile share. Zeroing those accumulators
whole and converting them whole cost 0.19 ms of a 1.5 ms masked backward at 16K, H=16, window
32 (H200, 2026-11-29), and the reductions themselves wrote twice the bytes of a store. Most
lists fit one unit (every list of a window-like mask, most of NSA's), and where one list serves
the KV head (list heads = KV heads) that unit alone adds into the tile: with
`BwdSpec.owned_dkv_stores` it stores dK and dV itself, in the input dtype, from registers. This
kernel does the rest, one CTA per (KV tile, KV head), from the transposed lists' offsets:

- "zero" (before the backward): the float32 partials of the tiles several units share;
- "finish" (after it): dK and dV of those tiles converted from the partials, zeros in the tiles
  no list visits; the tiles an owning unit stored are left as they are.

A tile's state follows the backward's own rule (`tile_state`): no entry in the lists that
serve its KV head: zeros; one list per KV head of at most `chunk` entries (one unit, which owns
the tile): stored by the backward; otherwise summed.

Masked backward, NVIDIA H200, 2026-11-29, 16K, H=16, D=128, a bias with its gradient
(`tools/bench_masked.py`, the switch `kernels.sm90.backward.OWNED_DKV_STORES` off / on in one
process): window 32 1.467 -> 1.223 ms, 512 1.921 -> 1.671, 2048 3.732 -> 3.451, 16384 11.59 ->
11.32, 10% of the tiles 3.434 -> 3.147, the same mask alone 1.558 -> 1.406.

Layout: offsets (Rk * Hs + 1,) int32 (the CSR of the transposed lists, Hs list heads per KV
block, Hs = Hkv or H), the KV blocks' sequence offsets (S + 1,) and cu_seqlens_k (S + 1,)
int32; sums (Tk, Hkv, D) float32 and out (Tk, Hkv, D) in the input dtype, for dK and dV each,
rows 16 bytes apart. The grid is (Rk, Hkv) with Rk the host's bound on the KV blocks; a CTA past
the real ones exits. Its threads take a 4-element vector each, rows of the tile in turn.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.dtypes import CUTLASS_DTYPES
from kernels.sm90.layouts import with_row_strides_divisible
from kernels.sm90.list_layout import block_sequence

THREADS = 256
VECTOR = 4  # elements per thread and row: 16 bytes of float32
MODES = ("zero", "finish")
DTYPES = tuple(CUTLASS_DTYPES)
# A tile's state (`tile_state`).
UNLISTED, OWNED, SUMMED = 0, 1, 2


@dataclass(frozen=True)
class DkvTilesSpec:
    """The compile key: the pass, dK/dV's element type, the head dim and the KV tile (the
    lists' KV block: 64 or 128 keys)."""
    mode: str
    dtype: str
    head_dim: int
    tile_n: int

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} (expected one of {MODES})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} (expected one of {DTYPES})")
        if self.head_dim % VECTOR or THREADS % (self.head_dim // VECTOR):
            raise ValueError(f"head_dim {self.head_dim}: a multiple of {VECTOR} dividing "
                             f"{THREADS * VECTOR}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"tile_n {self.tile_n} (expected 64 or 128)")

    @property
    def rows_per_pass(self) -> int:
        return THREADS * VECTOR // self.head_dim


class DkvTilesSm90:
    """The kernel for one `DkvTilesSpec`; called with (offsets, KV block offsets, cu_seqlens_k,
    list heads, chunk, dK sums, dV sums, dK, dV)."""

    def __init__(self, spec: DkvTilesSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, offsets: cute.Tensor, kv_block_offsets: cute.Tensor,
                 cu_seqlens_k: cute.Tensor, list_heads: Int32, chunk: Int32,
                 dk_sums: cute.Tensor, dv_sums: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor,
                 stream):
        tensors = tuple(with_row_strides_divisible(t, VECTOR) for t in (dk_sums, dv_sums, dk, dv))
        kv_rows = (cute.size(offsets.shape[0]) - 1) // list_heads
        self.kernel(offsets, kv_block_offsets, cu_seqlens_k, list_heads, chunk, *tensors).launch(
            grid=[kv_rows, cute.size(dk.shape[1]), 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, offsets: cute.Tensor, kv_block_offsets: cute.Tensor,
               cu_seqlens_k: cute.Tensor, list_heads: Int32, chunk: Int32,
               dk_sums: cute.Tensor, dv_sums: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        kv_row, head_kv, _ = cute.arch.block_idx()
        num_seqs = cute.size(kv_block_offsets.shape[0]) - 1
        if kv_row < kv_block_offsets[num_seqs]:
            state = tile_state(offsets, kv_row, head_kv, list_heads,
                               cute.size(dk.shape[1]), chunk)
            lo = block_sequence(kv_block_offsets, kv_row)
            first_row = cu_seqlens_k[lo] + (kv_row - kv_block_offsets[lo]) * self.spec.tile_n
            end_row = cu_seqlens_k[lo + 1]
            vectors_per_row = self.spec.head_dim // VECTOR
            vector = tidx % vectors_per_row
            for p in cutlass.range_constexpr(self.spec.tile_n // self.spec.rows_per_pass):
                row = first_row + p * self.spec.rows_per_pass + tidx // vectors_per_row
                if row < end_row:
                    for sums, out in ((dk_sums, dk), (dv_sums, dv)):
                        self.row_vector(state, sums, out, row, head_kv, vector)

    @cute.jit
    def row_vector(self, state: Int32, sums: cute.Tensor, out: cute.Tensor, row: Int32,
                   head: Int32, vector: Int32):
        """One thread's 4 cells of one row of one tensor."""
        if const_expr(self.spec.mode == "zero"):
            if state == SUMMED:
                zeros = cute.make_rmem_tensor((VECTOR,), Float32)
                zeros.fill(0.0)
                cute.local_tile(sums[row, head, None], (VECTOR,), (vector,)).store(zeros.load())
        else:
            if state != OWNED:
                cells = cute.make_rmem_tensor((VECTOR,), CUTLASS_DTYPES[self.spec.dtype])
                cells.fill(0.0)
                if state == SUMMED:
                    summed = cute.make_rmem_tensor((VECTOR,), Float32)
                    summed.store(cute.local_tile(sums[row, head, None], (VECTOR,),
                                                 (vector,)).load())
                    cells.store(summed.load().to(cells.element_type))
                cute.local_tile(out[row, head, None], (VECTOR,), (vector,)).store(cells.load())


@cute.jit
def unit_owns_tile(offsets: cute.Tensor, kv_row: Int32, list_head: Int32, list_heads: Int32,
                   num_kv_heads: Int32, entry_lo: Int32, entry_hi: Int32):
    """Whether the work unit [entry_lo, entry_hi) of list (kv_row, list_head) is the only one
    adding into its KV tile's dK/dV: one list per KV head, walked whole by this unit. The
    backward's side of `tile_state`."""
    row = kv_row * list_heads + list_head
    return ((list_heads == num_kv_heads) & (entry_lo == offsets[row])
            & (entry_hi == offsets[row + 1]))


@cute.jit
def tile_state(offsets: cute.Tensor, kv_row: Int32, head_kv: Int32, list_heads: Int32,
               num_kv_heads: Int32, chunk: Int32) -> Int32:
    """UNLISTED, OWNED or SUMMED (module docstring) for KV head `head_kv` of KV block `kv_row`:
    its lists are list heads [head_kv * Hs / Hkv, +Hs / Hkv), consecutive in the CSR; a list of
    at most `chunk` entries is one work unit (`kernels.sm90.backward.work_units`)."""
    lists_per_kv_head = list_heads // num_kv_heads
    first = kv_row * list_heads + head_kv * lists_per_kv_head
    entries = offsets[first + lists_per_kv_head] - offsets[first]
    state = Int32(SUMMED)
    if entries == 0:
        state = Int32(UNLISTED)
    elif (lists_per_kv_head == 1) & (entries <= chunk):
        state = Int32(OWNED)
    return state


def fake_arguments(spec: DkvTilesSpec):
    """Fake arguments for a CPU build (CUTE_DSL_ARCH=sm_90a), as the launcher passes them."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    # Its own int32 vectors: kernels.sm90.compile imports the backward, which imports this.
    def vector():
        return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)

    keys, heads = cute.sym_int(), cute.sym_int()

    def rows(dtype):
        return make_fake_tensor(dtype, (keys, heads, spec.head_dim),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)

    dtype = CUTLASS_DTYPES[spec.dtype]
    # offsets, KV block offsets, cu_seqlens_k, list heads, chunk, sums, outputs
    return (vector(), vector(), vector(), Int32(1), Int32(1),
            rows(Float32), rows(Float32), rows(dtype), rows(dtype))


def compile_on_fake_tensors(spec: DkvTilesSpec):
    """`spec` built for sm_90a without a GPU; for build checks."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(DkvTilesSm90(spec), *fake_arguments(spec), make_fake_stream())


# ------------------------------------------------------------------------------------------------
# Torch side (kernels/sm90/backward.py): the launch. Its tensors are the backward's own,
# contiguous (Tk, Hkv, D) of a supported head dim.
# ------------------------------------------------------------------------------------------------


def run(mode: str, csr, chunk: int, cu_seqlens_k, tile_n: int, sums, out) -> None:
    """The `mode` pass over (dK sums, dV sums) and (dK, dV) of a split-list backward whose
    units are chunks of at most `chunk` entries of `csr` (a `sparsity.BlockSparseCSR`)."""
    from kernels.sm90.launch import launch_on_current_stream

    if csr.offsets.numel() <= 1:  # no lists: every tile is unlisted
        if mode == "finish":
            for t in out:
                t.zero_()
        return
    spec = DkvTilesSpec(mode, str(out[0].dtype).removeprefix("torch."), out[0].shape[-1],
                        tile_n)
    args = (csr.offsets, csr.row_block_offsets, cu_seqlens_k, csr.num_heads, chunk, *sums,
            *out)
    launch_on_current_stream(DkvTilesSm90, spec, fake_arguments, args, out[0].device)
