"""The TMA-fed shared-memory pipelines of the sm90 kernels (forward and backward)."""
import cutlass.pipeline as pipeline


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
