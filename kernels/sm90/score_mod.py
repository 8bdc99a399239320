"""A user mask and an additive bias applied to a score tile in registers (the forward's side of
`kernels.masked`'s function on the kernel).

The scores the kernel holds are raw Q K^T; its softmax multiplies them by softmax_scale (in the
log2 domain). So the bias enters as bias / softmax_scale, and a False mask cell as -inf:

    S_kernel = Q K^T + attn_bias / softmax_scale,   -inf where attn_mask is False

Both tensors come as (slabs, Nq, Nk) (a padded call's rows and keys, every broadcast (batch,
head) pair one slab) with a (B, H, 2) int32 table of each (batch, query head)'s slab of the mask
and of the bias: the broadcast rules stay on the host (`kernels/masked.py`), the kernel reads
one slab index per tile. Each thread reads the cells of its own fragment straight from global
memory (L2 serves the neighbours' reads of the same lines). The mask is read only in the tiles
the lists call "mask" tiles (some cell hidden); "full" tiles skip it. The bias is read in every
visited tile.
"""
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from kernels.sm90.layouts import acc_mn_view


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
    owned_bias_grad: cutlass.Constexpr[bool] = False  # this thread alone adds into its cells
    mask_slab: Int32 = 0   # this tile's (`for_tile`)
    bias_slab: Int32 = 0

    @cute.jit
    def for_tile(self, batch: Int32, head: Int32) -> "ScoreMods":
        """The mods of the work tile of (batch, query head)."""
        return replace(self, mask_slab=self.slabs[batch, head, 0],
                       bias_slab=self.slabs[batch, head, 1])

    @cute.jit
    def apply(self, acc_s: cute.Tensor, t_coord: cute.Tensor, m_block: Int32, n_block: Int32,
              tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int], seqlen_q: Int32,
              seqlen_k: Int32, read_mask, keys_as_rows: cutlass.Constexpr[bool] = False):
        """Add the bias to, and apply the mask (where `read_mask`, a Boolean or a Python bool)
        to, one thread's fragment of the score tile (m_block, n_block): S (rows x keys), or
        with `keys_as_rows` the backward's S^T. Rows and keys past the sequence are clamped to
        its last one: their scores are masked or never stored."""
        s_mn = acc_mn_view(acc_s)
        c_mn = acc_mn_view(t_coord)
        if const_expr(self.has_bias):
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    row, key = self.cell(c_mn, r, c, m_block, n_block, tile_m, tile_n,
                                         keys_as_rows)
                    row = cutlass.min(row, seqlen_q - 1)
                    key = cutlass.min(key, seqlen_k - 1)
                    s_mn[r, c] = s_mn[r, c] + Float32(self.bias[self.bias_slab, row, key]) \
                        * self.bias_scale
        if const_expr(self.has_mask):
            if read_mask:
                self.hide_masked(s_mn, c_mn, m_block, n_block, tile_m, tile_n, seqlen_q,
                                 seqlen_k, keys_as_rows)

    @cute.jit
    def hide_masked(self, s_mn: cute.Tensor, c_mn: cute.Tensor, m_block: Int32, n_block: Int32,
                    tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                    seqlen_q: Int32, seqlen_k: Int32, keys_as_rows: cutlass.Constexpr[bool]):
        """-inf where the mask is False (a function of its own: its locals stay out of the
        caller's runtime `if`)."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                row, key = self.cell(c_mn, r, c, m_block, n_block, tile_m, tile_n,
                                     keys_as_rows)
                row = cutlass.min(row, seqlen_q - 1)
                key = cutlass.min(key, seqlen_k - 1)
                if self.mask[self.mask_slab, row, key] == 0:
                    s_mn[r, c] = -Float32.inf

    @cute.jit
    def add_bias_gradient(self, ds_t: cute.Tensor, t_coord: cute.Tensor, m_block: Int32,
                          n_block: Int32, tile_m: cutlass.Constexpr[int],
                          tile_n: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32):
        """dbias += dS for one thread's fragment of the backward's dS^T (keys as rows): float32
        reductions (`red.global.add`), as a bias shared by heads or batch entries that other
        CTAs walk needs, or with `owned_bias_grad` plain loads and stores (every head a cell
        serves is walked by this CTA, and a cell's place in the fragment by this thread, in
        program order). Cells past the sequence are skipped."""
        d_mn = acc_mn_view(ds_t)
        c_mn = acc_mn_view(t_coord)
        for r in cutlass.range_constexpr(cute.size(d_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(d_mn, mode=[1])):
                row, key = self.cell(c_mn, r, c, m_block, n_block, tile_m, tile_n, True)
                if (row < seqlen_q) & (key < seqlen_k):
                    if const_expr(self.owned_bias_grad):
                        cell = (self.bias_slab, row, key)
                        self.dbias[cell] = self.dbias[cell] + d_mn[r, c]
                    else:
                        offset = cute.crd2idx((self.bias_slab, row, key), self.dbias.layout)
                        cute.arch.red(self.dbias.iterator + offset, d_mn[r, c], op="add",
                                      dtype="f32", sem="relaxed", scope="gpu")

    @staticmethod
    def cell(c_mn, r: int, c: int, m_block: Int32, n_block: Int32, tile_m: int, tile_n: int,
             keys_as_rows: bool):
        """(query row, key) in the sequence of fragment element (r, c)."""
        if keys_as_rows:
            return m_block * tile_m + c_mn[0, c][1], n_block * tile_n + c_mn[r, 0][0]
        return m_block * tile_m + c_mn[r, 0][0], n_block * tile_n + c_mn[0, c][1]
