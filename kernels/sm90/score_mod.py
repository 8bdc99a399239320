"""A user mask and an additive bias applied to a score tile in registers, and the bias's
gradient (the kernels' side of `kernels.masked`'s function).

The scores the kernel holds are raw Q K^T; its softmax multiplies them by softmax_scale (in the
log2 domain). So the bias enters as bias / softmax_scale, and a False mask cell as -inf:

    S_kernel = Q K^T + attn_bias / softmax_scale,   -inf where attn_mask is False

Both tensors come as (slabs, Nq, Nk) (a padded call's rows and keys, every broadcast (batch,
head) pair one slab) with a (B, H, 2) int32 table of each (batch, query head)'s slab of the mask
and of the bias: the broadcast rules stay on the host (`kernels/masked.py`), the kernel reads
one slab index per tile. Each thread reads the cells of its own fragment straight from global
memory (L2 serves the neighbours' reads of the same lines); the forward's fragment holds a row's
keys in adjacent pairs, read as one load where the rows start an even number of elements apart
(`FwdSpec.score_pairs`). The mask is read only in the tiles the lists call "mask" tiles (some
cell hidden); "full" tiles skip it. The bias is read in every visited tile. The backward reads
both on S^T, where a thread's cells lie along 16-32 query rows, so it copies a 16-bit bias's
tile to shared memory first where it can (`BwdSpec.score_stage_bias`), and sums dS into a
float32 dbias with one reduction per cell; where every bias slab serves one batch entry and
query head, each cell takes one dS, which it stores into the gradient itself, in the bias's
dtype (`BwdSpec.score_dbias_stores`: no float32 temporary of the bias's size).
"""
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from kernels.sm90.layouts import acc_mn_view, with_row_strides_divisible

# Elements of a 16-bit bias per cp.async of the backward's staged tile (16 bytes).
_STAGED_CHUNK = 8
# Keys of the staged tile each consumer warpgroup of the backward copies and reads (its half).
_KEYS_PER_WARPGROUP = 64
_WARPGROUP = 128
# The tiles of the float32 dbias sums with `ScoreMods.dbias_tiles` (kernels.masked's tiles).
SUMS_TILE = 128


def score_mods_of(spec, mask, bias, slabs, softmax_scale, dbias=None, staged_bias=None,
                  dbias_slots=None):
    """The kernel's `ScoreMods` for `spec` (`FwdSpec` or `BwdSpec`; None without score mods).
    An absent tensor's field holds the slab table: the DSL carries tensors, and the Constexpr
    flags keep it unread. Plain Python on compile-time values, called while a kernel traces."""
    if not spec.score_mods:
        return None
    bias_grad = getattr(spec, "score_bias_grad", False)
    pairs = getattr(spec, "score_pairs", False)
    if pairs:  # the launcher admits only even strides with the flag (`FwdSpec.score_pairs`):
        # every row starts two elements apart, so an even key's pair is one aligned load
        mask, bias = (with_row_strides_divisible(t, 2) if t is not None else None
                      for t in (mask, bias))
    if getattr(spec, "score_stage_bias", False):  # its rows 16 bytes apart: 16-byte copies
        bias = with_row_strides_divisible(bias, _STAGED_CHUNK)
    return ScoreMods(spec.score_mask, bool(spec.score_bias),
                     mask if spec.score_mask else slabs, bias if spec.score_bias else slabs,
                     slabs, Float32(1.0) / softmax_scale, bias_grad,
                     dbias if bias_grad else slabs, pairs=pairs, staged_bias=staged_bias,
                     dbias_stores=getattr(spec, "score_dbias_stores", False),
                     dbias_tiles=getattr(spec, "score_dbias_tiles", False),
                     dbias_slots=dbias_slots if getattr(spec, "score_dbias_tiles", False)
                     else slabs)


@cute.jit
def slab_rows(cells: cute.Tensor, slab: Int32) -> cute.Tensor:
    """Slab `slab` of (slabs, Nq, Nk) cells as an (Nq, Nk) view whose row stride is 32-bit: the
    slab's start is one 64-bit address (slabs of a per-head 16K x 16K bias span 2**32 cells),
    each row's offset from it 32-bit (the launcher admits slabs of fewer than 2**31 cells)."""
    rows = cells[slab, None, None]
    return cute.make_tensor(rows.iterator, cute.make_layout(
        rows.shape, stride=(Int32(rows.stride[0]), rows.stride[1])))


@dataclass(frozen=True)
class ScoreMods:
    has_mask: cutlass.Constexpr[bool]
    has_bias: cutlass.Constexpr[bool]
    mask: cute.Tensor      # (slabs, Nq, Nk) uint8, nonzero = attend (a stand-in if not has_mask)
    bias: cute.Tensor      # (slabs, Nq, Nk) float16/bfloat16/float32 (a stand-in if not has_bias)
    slabs: cute.Tensor     # (B, H, 2) int32: the (batch, head)'s mask slab, bias slab
    bias_scale: Float32    # 1 / softmax_scale
    has_bias_grad: cutlass.Constexpr[bool] = False
    dbias: cute.Tensor = None  # (slabs, Nq, Nk) float32 sums of dS (the backward, has_bias_grad)
    mask_slab: Int32 = 0   # this tile's (`for_tile`)
    bias_slab: Int32 = 0
    pairs: cutlass.Constexpr[bool] = False  # the forward reads adjacent key pairs as one load
    # The backward's (tile_m, tile_n) smem copy of the step's bias tile (`stage_bias`), None
    # where it reads the bias from global memory; and the named barrier of this thread's
    # warpgroup that says its half was copied.
    staged_bias: cute.Tensor = None
    staged_barrier: Int32 = 0
    # dbias holds the gradient itself, in the bias's dtype, and each cell takes one dS (a slab
    # per batch entry and query head: nothing to sum): stores instead of float32 reductions.
    dbias_stores: cutlass.Constexpr[bool] = False
    # The float32 sums hold the visited tiles alone: dbias is (slots, TILE, TILE) and
    # dbias_slots[slab, tile row, tile column] the slot of a (TILE x TILE) tile of the cells.
    dbias_tiles: cutlass.Constexpr[bool] = False
    dbias_slots: cute.Tensor = None
    dbias_slot: Int32 = 0  # the step's slot (`with_dbias_slot`)
    # The forward's bias tiles in smem, one per K stage (`FwdSpec.score_bias_tma`), as this
    # thread's partition of them in the score accumulator's layout (`with_bias_tiles`).
    bias_tiles: cute.Tensor = None

    @cute.jit
    def for_tile(self, batch: Int32, head: Int32) -> "ScoreMods":
        """The mods of the work tile of (batch, query head)."""
        return replace(self, mask_slab=self.slabs[batch, head, 0],
                       bias_slab=self.slabs[batch, head, 1])

    @cute.jit
    def with_bias_tiles(self, tiles: cute.Tensor) -> "ScoreMods":
        """The mods reading the bias from `tiles` (the forward's TMA-loaded bias buffers as
        the thread's partition of the score tile, the K stage last) instead of from global
        memory."""
        return replace(self, bias_tiles=tiles)

    @cute.jit
    def with_dbias_slot(self, t_coord: cute.Tensor, m_block: Int32, n_block: Int32,
                        tile_m: cutlass.Constexpr[int],
                        tile_n: cutlass.Constexpr[int]) -> "ScoreMods":
        """The mods with the slot of the visited tiles' sums that this thread's fragment of
        the backward's step (m_block, n_block) adds into (`dbias_tiles`). Read at the step's
        start: the load's latency runs under the products instead of on the dS path."""
        mods = self
        if const_expr(self.dbias_tiles):
            c_mn = acc_mn_view(t_coord)
            tile_row = (m_block * tile_m + self.row_of(c_mn, 0, True)) // SUMS_TILE
            tile_col = (n_block * tile_n + self.key_of(c_mn, 0, True)) // SUMS_TILE
            mods = replace(self, dbias_slot=self.dbias_slots[self.bias_slab, tile_row, tile_col])
        return mods

    @cute.jit
    def apply(self, acc_s: cute.Tensor, t_coord: cute.Tensor, m_block: Int32, n_block: Int32,
              tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int], seqlen_q: Int32,
              seqlen_k: Int32, read_mask, keys_as_rows: cutlass.Constexpr[bool] = False,
              bias_stage=None):
        """Add the bias to, and apply the mask (where `read_mask`, a Boolean or a Python bool)
        to, one thread's fragment of the score tile (m_block, n_block): S (rows x keys), or
        with `keys_as_rows` the backward's S^T. Rows past the sequence read its last row (their
        scores are never stored), keys past it its last key (they are masked after). With
        `bias_tiles` the bias comes from stage `bias_stage` of them (cells past the bias's
        rows or keys are TMA's zeros: never stored, or masked after)."""
        s_mn = acc_mn_view(acc_s)
        c_mn = acc_mn_view(t_coord)
        # A tile inside the keys reads each query row's cells at constant offsets from one
        # address (no per-cell clamp): one load instruction per cell, no address arithmetic.
        inside = (n_block + 1) * tile_n <= seqlen_k
        if const_expr(self.has_bias and self.bias_tiles is not None):
            tile = cute.make_rmem_tensor(acc_s.layout, self.bias.element_type)
            tile.store(self.bias_tiles[None, None, None, bias_stage].load())
            b_mn = acc_mn_view(tile)
            for i in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    s_mn[i, j] = s_mn[i, j] + Float32(b_mn[i, j]) * self.bias_scale
        elif const_expr(self.has_bias):
            if inside:
                if const_expr(self.staged_bias is not None and keys_as_rows):
                    # This thread's copies, then its warpgroup's: the half it reads is there.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier(barrier_id=self.staged_barrier,
                                      number_of_threads=_WARPGROUP)
                    self.visit_staged(s_mn, c_mn)
                else:
                    self.visit(s_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q,
                               seqlen_k, keys_as_rows, False, "bias")
            else:
                self.visit(s_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k,
                           keys_as_rows, True, "bias")
        if const_expr(self.has_mask):
            if read_mask:
                if inside:
                    self.visit(s_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q,
                               seqlen_k, keys_as_rows, False, "mask")
                else:
                    self.visit(s_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q,
                               seqlen_k, keys_as_rows, True, "mask")

    @cute.jit
    def stage_bias(self, thread: Int32, barrier: Int32, m_block: Int32, n_block: Int32,
                   tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                   seqlen_q: Int32, seqlen_k: Int32) -> "ScoreMods":
        """Start copying the step's bias tile (m_block, n_block) to `staged_bias` (the
        backward, `BwdSpec.score_stage_bias`): each consumer warpgroup its own 64 keys, 16 bytes
        per cp.async, rows past the sequence read as its last row (as `visit` reads them). Only
        for a KV tile inside the keys (a CTA keeps its KV tile for every step; one whose tile
        crosses the keys' end reads cell by cell). `apply` waits for the copies. Returns the
        mods with the warpgroup's barrier (`barrier` + its index)."""
        wg = thread // _WARPGROUP
        if (n_block + 1) * tile_n <= seqlen_k:
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.bias.element_type,
                                       num_bits_per_copy=8 * 2 * _STAGED_CHUNK)
            cells = self.bias[self.bias_slab, None, None]
            chunks_per_row = _KEYS_PER_WARPGROUP // _STAGED_CHUNK
            first_chunk = (n_block * tile_n + wg * _KEYS_PER_WARPGROUP) // _STAGED_CHUNK
            for i in cutlass.range_constexpr(tile_m * chunks_per_row // _WARPGROUP):
                chunk = i * _WARPGROUP + thread % _WARPGROUP
                row_in_tile, chunk_in_row = chunk // chunks_per_row, chunk % chunks_per_row
                row = cutlass.min(m_block * tile_m + row_in_tile, seqlen_q - 1)
                cute.copy(atom, cute.local_tile(cells[row, None], (_STAGED_CHUNK,),
                                                (first_chunk + chunk_in_row,)),
                          cute.local_tile(self.staged_bias[row_in_tile, None], (_STAGED_CHUNK,),
                                          (wg * chunks_per_row + chunk_in_row,)))
            cute.arch.cp_async_commit_group()
        return replace(self, staged_barrier=barrier + wg)

    @cute.jit
    def visit_staged(self, s_mn: cute.Tensor, c_mn: cute.Tensor):
        """Add the staged bias tile to the backward's S^T fragment: every cell an smem read at
        a compile-time offset from this thread's first query row and key."""
        first_key = self.key_of(c_mn, 0, True)
        first_row = self.row_of(c_mn, 0, True)
        for i in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            line = self.staged_bias[first_row + (self.row_of(c_mn, i, True) - first_row), None]
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                key = first_key + (self.key_of(c_mn, j, True) - first_key)
                s_mn[j, i] = s_mn[j, i] + Float32(line[key]) * self.bias_scale

    @cute.jit
    def add_bias_gradient(self, ds_t: cute.Tensor, t_coord: cute.Tensor, m_block: Int32,
                          n_block: Int32, tile_m: cutlass.Constexpr[int],
                          tile_n: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32):
        """dbias += dS for one thread's fragment of the backward's dS^T (keys as rows), float32
        reductions (`red.global.add`): a bias shared by heads or batch entries sums over them,
        whichever CTAs walk them; with `dbias_stores` dbias = dS, stored. Cells past the
        sequence are skipped."""
        d_mn = acc_mn_view(ds_t)
        c_mn = acc_mn_view(t_coord)
        if (n_block + 1) * tile_n <= seqlen_k:
            self.visit(d_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, True,
                       False, "dbias")
        else:
            self.visit(d_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, True,
                       True, "dbias")

    @cute.jit
    def visit(self, s_mn: cute.Tensor, c_mn: cute.Tensor, m_block: Int32, n_block: Int32,
              tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int], seqlen_q: Int32,
              seqlen_k: Int32, keys_as_rows: cutlass.Constexpr[bool],
              clamp_keys: cutlass.Constexpr[bool], what: cutlass.Constexpr[str]):
        """One pass over the fragment's cells, query row by query row: `what` = "bias" (add
        bias / softmax_scale), "mask" (-inf where the mask is 0) or "dbias" (add the fragment
        into dbias). Each query row's cells are one line of the tensor, read at the tile's
        first key plus the cell's compile-time column; `clamp_keys` clamps keys past the
        sequence to its last (reads) or skips them (dbias). A function of its own: its locals
        stay out of the caller's runtime `if`."""
        line_mode = 1 if const_expr(keys_as_rows) else 0
        num_lines = cute.size(s_mn, mode=[line_mode])
        num_keys = cute.size(s_mn, mode=[1 - line_mode])
        # Coordinates relative to this thread's first row and key fold to compile-time
        # offsets (as in kernels/sm90/mask.py): each line is one address, its cells immediates.
        first_key = self.key_of(c_mn, 0, keys_as_rows)
        first_row = self.row_of(c_mn, 0, keys_as_rows)
        key_base = n_block * tile_n + first_key
        row_base = m_block * tile_m + first_row
        tensor, slab = self.mask, self.mask_slab
        if const_expr(what == "bias"):
            tensor, slab = self.bias, self.bias_slab
        elif const_expr(what == "dbias"):
            tensor, slab = self.dbias, self.bias_slab
            if const_expr(self.dbias_tiles):
                # The fragment lies in one TILE x TILE tile (a step's rows and a warpgroup's
                # keys never cross one): its sums are a slot of their own (read by
                # `with_dbias_slot`), at the coordinates (and the sequence's ends) taken from
                # the tile's corner.
                tile_row, tile_col = row_base // SUMS_TILE, key_base // SUMS_TILE
                slab = self.dbias_slot
                row_base, seqlen_q = (row_base - tile_row * SUMS_TILE,
                                      seqlen_q - tile_row * SUMS_TILE)
                key_base, seqlen_k = (key_base - tile_col * SUMS_TILE,
                                      seqlen_k - tile_col * SUMS_TILE)
        # The backward's lines are the query rows of its S^T fragment (16 or 32 per thread):
        # with 64-bit row strides each held a 64-bit address, 247 spill instructions per step
        # against 59 at 32-bit offsets (SASS, CPU compile, head dim 128, mask and bf16 bias
        # with its gradient; H200, 16K: backward -2%, docs/history.md 2026-11-29). The
        # forward's are two rows: 64-bit offsets cost no spill there, 32-bit ones 86.
        cells = slab_rows(tensor, slab) if const_expr(keys_as_rows) else tensor[slab, None, None]
        if const_expr(self.pairs and not keys_as_rows and not clamp_keys and what != "dbias"):
            self.visit_pairs(s_mn, c_mn, cells, num_lines, num_keys, row_base, first_row,
                             key_base, first_key, seqlen_q, what)
        else:
            self.visit_cells(s_mn, c_mn, cells, num_lines, num_keys, row_base, first_row,
                             key_base, first_key, seqlen_q, seqlen_k, keys_as_rows, clamp_keys,
                             what)

    @cute.jit
    def visit_pairs(self, s_mn: cute.Tensor, c_mn: cute.Tensor, cells: cute.Tensor,
                    num_lines: cutlass.Constexpr[int], num_keys: cutlass.Constexpr[int],
                    row_base: Int32, first_row: Int32, key_base: Int32, first_key: Int32,
                    seqlen_q: Int32, what: cutlass.Constexpr[str]):
        """`visit` of the forward's fragment (rows x keys, every key inside the sequence),
        which holds each row's keys in adjacent pairs, the first even (the accumulator's
        columns 2p, 2p + 1): one 32-bit bias load (16-bit for the mask's bytes) per pair
        instead of two."""
        for i in cutlass.range_constexpr(num_lines):
            row = row_base + (self.row_of(c_mn, i, False) - first_row)
            line = cells[cutlass.min(row, seqlen_q - 1), None]
            for p in cutlass.range_constexpr(num_keys // 2):
                key = key_base + (self.key_of(c_mn, 2 * p, False) - first_key)
                pair = cute.make_rmem_tensor((2,), line.element_type)
                pair.store(cute.local_tile(line, (2,), (key // 2,)).load())
                for e in cutlass.range_constexpr(2):
                    j = 2 * p + e
                    if const_expr(what == "bias"):
                        s_mn[i, j] = s_mn[i, j] + Float32(pair[e]) * self.bias_scale
                    elif pair[e] == 0:
                        s_mn[i, j] = -Float32.inf

    @cute.jit
    def visit_cells(self, s_mn: cute.Tensor, c_mn: cute.Tensor, cells: cute.Tensor,
                    num_lines: cutlass.Constexpr[int], num_keys: cutlass.Constexpr[int],
                    row_base: Int32, first_row: Int32, key_base: Int32, first_key: Int32,
                    seqlen_q: Int32, seqlen_k: Int32, keys_as_rows: cutlass.Constexpr[bool],
                    clamp_keys: cutlass.Constexpr[bool], what: cutlass.Constexpr[str]):
        """`visit` cell by cell."""
        for i in cutlass.range_constexpr(num_lines):
            row = row_base + (self.row_of(c_mn, i, keys_as_rows) - first_row)
            if const_expr(what == "dbias"):
                if row < seqlen_q:
                    line = cells[row, None]
                    self.add_line(s_mn, line, i, num_keys, c_mn, key_base, first_key, seqlen_k,
                                  keys_as_rows, clamp_keys)
            else:
                line = cells[cutlass.min(row, seqlen_q - 1), None]
                for j in cutlass.range_constexpr(num_keys):
                    key = key_base + (self.key_of(c_mn, j, keys_as_rows) - first_key)
                    if const_expr(clamp_keys):
                        key = cutlass.min(key, seqlen_k - 1)
                    r, c = (j, i) if const_expr(keys_as_rows) else (i, j)
                    if const_expr(what == "bias"):
                        s_mn[r, c] = s_mn[r, c] + Float32(line[key]) * self.bias_scale
                    elif line[key] == 0:
                        s_mn[r, c] = -Float32.inf

    @cute.jit
    def add_line(self, d_mn: cute.Tensor, line: cute.Tensor, i: cutlass.Constexpr[int],
                 num_keys: cutlass.Constexpr[int], c_mn: cute.Tensor, key_base: Int32,
                 first_key: Int32, seqlen_k: Int32, keys_as_rows: cutlass.Constexpr[bool],
                 clamp_keys: cutlass.Constexpr[bool]):
        """dbias's line of one query row += the fragment's cells of that row."""
        for j in cutlass.range_constexpr(num_keys):
            key = key_base + (self.key_of(c_mn, j, keys_as_rows) - first_key)
            r, c = (j, i) if const_expr(keys_as_rows) else (i, j)
            if const_expr(clamp_keys):
                if key < seqlen_k:
                    self.add_cell(line, key, d_mn[r, c])
            else:
                self.add_cell(line, key, d_mn[r, c])

    @cute.jit
    def add_cell(self, line: cute.Tensor, key: Int32, value: Float32):
        if const_expr(self.dbias_stores):
            line[key] = line.element_type(value)
        else:
            # A reduction even where this thread alone adds into the cell: a load and a store
            # would put the load's latency into the step (docs/history.md, 2026-11-28).
            cute.arch.red(line.iterator + key, value, op="add", dtype="f32", sem="relaxed",
                          scope="gpu")

    @staticmethod
    def row_of(c_mn, i: int, keys_as_rows: bool):
        """The query row (in the tile) of the fragment's i-th line."""
        return c_mn[0, i][1] if keys_as_rows else c_mn[i, 0][0]

    @staticmethod
    def key_of(c_mn, j: int, keys_as_rows: bool):
        """The key (in the tile) of the fragment's j-th cell along a line."""
        return c_mn[j, 0][0] if keys_as_rows else c_mn[0, j][1]
