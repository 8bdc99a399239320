"""NSA's gated sum in the last branch's forward epilogue (`FwdSpec.gated_sum`).

nsa() combines its branch outputs as out = sum_b g[:, :, c_b] * o_b, in float32 and rounded
once. Standing alone (kernels/sm90/gated_sum.py) that pass reads every branch output back from
memory and writes the sum: at 64K tokens, H=32, D=128, 2 GiB and about 0.49 ms of an H200's
bandwidth, with the tensor cores idle. Here the branch that runs last adds the earlier
branches' outputs to its own while its tile is still in registers: each consumer thread loads
its elements of the earlier outputs and its rows' gates (`load`, issued before the tile's last
P V so that the loads run under it, as the row dots' dO does), and `combine` forms the sum in
the order the standalone kernel does (o_0 g_0, then + o_1 g_1, ..., this kernel's rounded
output last), so the result is the same bits. The output store (kernels/sm90/epilogue.py)
stages it beside O and the storer warp stores both.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kernels.sm90.layouts import acc_mn_view


@dataclass(frozen=True)
class GatedTerms:
    """The earlier branch outputs and the gates of a `FwdSpec.gated_sum` kernel."""
    gates: cute.Tensor                # (T, H, G) float32
    terms: tuple                      # 1 or 2 (T, H, D) earlier branch outputs, in sum order
    columns: cutlass.Constexpr[tuple]  # their gate columns, then this kernel's output's

    @cute.jit
    def load(self, out_store, offset_q: Int32, seqlen_q: Int32, head: Int32, m_block: Int32,
             tidx: Int32):
        """(this thread's elements of each earlier output, its rows' gates (G', rows)) for
        `combine`; rows past the sequence read its last row."""
        values = [out_store.load_rows(term, offset_q, seqlen_q, head, m_block, tidx)
                  for term in self.terms]
        _, _, first_row, co_mn = out_store.warpgroup_rows(m_block, tidx)
        num_rows = cute.size(co_mn, mode=[0])
        gates = cute.make_rmem_tensor(cute.make_layout((len(self.columns), num_rows)), Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = offset_q + cutlass.min(first_row + co_mn[r, 0][0], seqlen_q - 1)
            for j in cutlass.range_constexpr(len(self.columns)):
                gates[j, r] = self.gates[row, head, self.columns[j]]
        return values, gates

    @cute.jit
    def combine(self, out_store, loaded, r_o: cute.Tensor) -> cute.Tensor:
        """The gated sum of the loaded outputs and r_o (this kernel's output, rounded to the
        output type as it is stored), in r_o's layout and type."""
        values, gates = loaded
        r_sum = cute.make_rmem_tensor_like(r_o)
        o_mn, sum_mn = acc_mn_view(r_o), acc_mn_view(r_sum)
        own = len(self.terms)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                total = values[0][None, c, r].load().to(Float32) * gates[0, r]
                for j in cutlass.range_constexpr(1, own):
                    total = total + values[j][None, c, r].load().to(Float32) * gates[j, r]
                total = (total + out_store.column_pair(o_mn, r, c).load().to(Float32)
                         * gates[own, r])
                out_store.column_pair(sum_mn, r, c).store(total.to(r_o.element_type))
        return r_sum
