"""The TMA-fed shared-memory pipelines of the sm90 kernels (forward and backward): creating
them, naming a stage, loading one sequence's tile into a stage, and the aligned buffers of the
kernels' shared-storage structs."""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync


def tma_pipeline(barrier_storage, num_stages: int, tx_count: int, num_consumer_warps: int):
    """(producer, consumer) of a `num_stages` deep pipeline filled by TMA loads of `tx_count`
    bytes per stage: one producer thread issues them, the consumer warpgroups' warps read.
    Barrier init is deferred: the kernel fences and syncs once after creating all of them."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_warps),
        tx_count=tx_count, defer_sync=True,
    ).make_participants()


def smem_buffer(element_type, count: int, alignment: int):
    """A shared-storage struct field: `count` elements of `element_type`, `alignment` bytes
    aligned (1024 for the swizzled TMA/wgmma tiles)."""
    return cute.struct.Align[cute.struct.MemRange[element_type, count], alignment]


def stage_index(handle, num_stages: int):
    """A pipeline stage index the compiler knows is warp-uniform (0 for a single stage).

    The wgmma smem descriptors are built from it; without the hint, stage indices carried
    through the tile loop made ptxas build every descriptor in regular registers and move it
    to uniform ones before each HGMMA (dense causal 25% slower on the H100).
    """
    if num_stages == 1:
        return 0
    return cute.arch.make_warp_uniform(handle.index)


@cute.jit
def load_seq_tile(tma_atom, m_src, s_dst, handle, offset: Int32, head: Int32, block: Int32,
                  rows: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int], stage):
    """TMA-load rows [block * rows, +rows) of the sequence starting at row `offset` of m_src
    (viewed (rows, head_dim, heads)), one head, into stage `stage` of s_dst, on the barrier of
    the pipeline `handle`."""
    m_seq = cute.domain_offset((offset, 0), m_src[None, None, head])
    g_tile = cute.local_tile(m_seq, (rows, head_dim), (block, 0))
    t_s, t_g = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(s_dst, 0, 2),
        cute.group_modes(g_tile, 0, 2))
    cute.copy(tma_atom, t_g, t_s[(None, stage)], tma_bar_ptr=handle.barrier)
