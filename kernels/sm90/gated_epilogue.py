"""NSA's gated sum in the last branch's forward epilogue (`FwdSpec.gated_sum`).

nsa() combines its branch outputs as out = sum_b g[:, :, c_b] * o_b, in float32 and rounded
once. Standing alone (kernels/sm90/gated_sum.py) that pass reads every branch output back from
memory and writes the sum: at 64K tokens, H=32, D=128, 2 GiB and about 0.49 ms of an H200's
bandwidth, with the tensor cores idle. Here the branch that runs last adds the earlier
branches' outputs to its own as it stores it:

- the storer warp TMA-loads each warpgroup's 64 rows of every earlier output into a staging
  buffer laid out (and swizzled) as the output's own (`issue_loads`), at the start of each
  tile, so the loads run under the tile's products;
- for a half whose 64 rows lie inside the sequence, the consumers stage O as always and the
  storer warp, once the loads have landed, sums the staged tiles 16 bytes at a time in the
  standalone pass's order (o_0 g_0, then + o_1 g_1, ..., this kernel's rounded output last: the
  same bits) over the first earlier output's buffer (`sum_staged`), and TMA-stores it with O;
- a half that crosses the sequence's end is summed by its consumers in registers (`load`: the
  staged rows by `ldmatrix` in the accumulator's layout; `combine`) and stored from there row by
  row, as its O is.

Two earlier versions put the sum on the consumers' path for every half, which lengthened the
selected branch's forward by more than the pass it saved: loading the earlier outputs from
global memory in the accumulator's layout (+0.60-0.74 ms on 64K-token packings), then reading
the storer's staged loads by `ldmatrix` (+0.54 ms; H200, 2026-11-30, docs/history.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from kernels.sm90.layouts import acc_mn_view

_ROWS = 64  # rows of one consumer warpgroup
_VECTOR = 8  # elements the storer warp sums at a time: 16 bytes of a staged tile's row


@dataclass(frozen=True)
class GatedTerms:
    """What a `FwdSpec.gated_sum` kernel reads and writes beside its output."""
    gates: cute.Tensor                 # (T, H, G) float32
    columns: cutlass.Constexpr[tuple]  # the earlier outputs' gate columns, then this output's
    staged: tuple                      # per earlier output: (64, D, warpgroup) smem like sO; the
                                       # first one receives the sum
    load_atoms: tuple                  # per earlier output: its TMA load atom
    term_views: tuple                  # per earlier output: its (T, D, H) TMA view
    landed: cute.Pointer               # one mbarrier per warpgroup: its rows have landed
    sum_atom: cute.CopyAtom            # the sum's TMA store atom
    sum_view: cute.Tensor              # (T, D, H) TMA view of the sum
    sum_rows: cute.Tensor              # (T, H, D) the sum, for halves stored from registers
    head_dim: cutlass.Constexpr[int]
    num_warpgroups: cutlass.Constexpr[int]

    @cute.jit
    def issue_loads(self, offset_q: Int32, head: Int32, m_block: Int32):
        """Storer warp, the whole warp, at the start of a tile of the sequence: every
        warpgroup's 64 rows of every earlier output (rows past the tensor come as zeros, rows
        past the sequence are never stored). One lane sets the transaction bytes; the TMA copy
        elects its own lane (called from one lane, its elect would wait for the others)."""
        num_bytes = len(self.staged) * _ROWS * self.head_dim * 2
        for wg in cutlass.range_constexpr(self.num_warpgroups):
            barrier = self.landed + wg
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(barrier, num_bytes)
            half = m_block * self.num_warpgroups + wg
            for j in cutlass.range_constexpr(len(self.staged)):
                view = cute.domain_offset((offset_q, 0), self.term_views[j][None, None, head])
                g_rows = cute.local_tile(view, (_ROWS, self.head_dim), (half, 0))
                t_s, t_g = cpasync.tma_partition(
                    self.load_atoms[j], 0, cute.make_layout(1),
                    cute.group_modes(self.staged[j], 0, 2), cute.group_modes(g_rows, 0, 2))
                cute.copy(self.load_atoms[j], t_g, t_s[(None, wg)], tma_bar_ptr=barrier)

    @cute.jit
    def sum_staged(self, sO: cute.Tensor, offset_q: Int32, head: Int32, half: Int32, wg,
                   iteration: Int32, lane: Int32):
        """Storer warp, for warpgroup wg's staged half `half` (all 64 rows inside the
        sequence): once the earlier outputs' rows have landed (phase = the tile's iteration
        parity), lane i sums rows i and i + 32, 16 bytes at a time, into the first earlier
        output's buffer, then fences them for the TMA store. The buffers share O's layout, so
        a row's 16 bytes sit at one place in each."""
        cute.arch.mbarrier_wait(self.landed + wg, iteration % 2)
        own = len(self.staged)
        buffers = [staged[None, None, wg] for staged in self.staged]
        buffers.append(sO[None, None, wg])
        for i in cutlass.range_constexpr(_ROWS // 32):
            row = lane + 32 * i
            gate_row = offset_q + half * _ROWS + row
            gates = []
            for j in cutlass.range_constexpr(own + 1):
                gates.append(self.gates[gate_row, head, self.columns[j]])
            for c in cutlass.range(self.head_dim // _VECTOR, unroll=2):
                pieces = []
                for j in cutlass.range_constexpr(own + 1):
                    pieces.append(cute.local_tile(buffers[j], (1, _VECTOR), (row, c)))
                total = pieces[0].load().to(Float32) * gates[0]
                for j in cutlass.range_constexpr(1, own + 1):
                    total = total + pieces[j].load().to(Float32) * gates[j]
                pieces[0].store(total.to(pieces[0].element_type))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()

    @cute.jit
    def skip(self):
        """Storer warp, for a tile past every sequence: complete its phase anyway (one lane),
        so the consumers' phase of each tile stays the tile's iteration parity."""
        with cute.arch.elect_one():
            for wg in cutlass.range_constexpr(self.num_warpgroups):
                cute.arch.mbarrier_arrive(self.landed + wg)

    @cute.jit
    def load(self, out_store, r_o: cute.Tensor, offset_q: Int32, seqlen_q: Int32, head: Int32,
             m_block: Int32, iteration: Int32, tidx: Int32):
        """Consumer side: (this thread's elements of each earlier output, in r_o's layout; its
        rows' gates (G', rows)) once its warpgroup's rows have landed."""
        wg = tidx // 128
        _, _, first_row, co_mn = out_store.warpgroup_rows(m_block, tidx)
        num_rows = cute.size(co_mn, mode=[0])
        gates = cute.make_rmem_tensor(cute.make_layout((len(self.columns), num_rows)), Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = offset_q + cutlass.min(first_row + co_mn[r, 0][0], seqlen_q - 1)
            for j in cutlass.range_constexpr(len(self.columns)):
                gates[j, r] = self.gates[row, head, self.columns[j]]
        load_atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4),
                                        r_o.element_type)
        thr_load = cute.make_tiled_copy_C(load_atom, out_store.tiled_mma).get_slice(tidx % 128)
        cute.arch.mbarrier_wait(self.landed + wg, iteration % 2)
        values = []
        for j in cutlass.range_constexpr(len(self.staged)):
            value = cute.make_rmem_tensor_like(r_o)
            cute.copy(load_atom, thr_load.partition_S(self.staged[j][None, None, wg]),
                      thr_load.retile(value))
            values.append(value)
        return values, gates

    @cute.jit
    def combine(self, out_store, loaded, r_o: cute.Tensor) -> cute.Tensor:
        """The gated sum of the loaded outputs and r_o (this kernel's output, rounded to the
        output type as it is stored), in r_o's layout and type."""
        values, gates = loaded
        r_sum = cute.make_rmem_tensor_like(r_o)
        o_mn, sum_mn = acc_mn_view(r_o), acc_mn_view(r_sum)
        terms_mn = [acc_mn_view(value) for value in values]
        own = len(values)
        pair = out_store.column_pair
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                total = pair(terms_mn[0], r, c).load().to(Float32) * gates[0, r]
                for j in cutlass.range_constexpr(1, own):
                    total = total + pair(terms_mn[j], r, c).load().to(Float32) * gates[j, r]
                total = total + pair(o_mn, r, c).load().to(Float32) * gates[own, r]
                pair(sum_mn, r, c).store(total.to(r_o.element_type))
        return r_sum
