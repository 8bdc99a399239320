"""The context-parallel group: a torch.distributed ProcessGroup, or one dimension of a DeviceMesh.

A 2-D mesh (data x context) names its dimensions; nsa_context_parallel takes (mesh, "cp") and
works on that dimension's group only, so data parallelism and FSDP2 on the other dimension
see ordinary, replicated parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class ContextParallelGroup:
    """The group nsa_context_parallel communicates over, and this process's place in it."""

    process_group: "dist.ProcessGroup"
    rank: int
    world_size: int
    backend: str

    def data_device_types(self) -> frozenset[str] | None:
        """Device types whose tensors this group's collectives move; None when the backend is
        not one we know (a third-party backend: its own errors then speak for it)."""
        return backend_device_types(self.backend)

    def sum_scattered(self, stacked: Tensor) -> Tensor:
        """The sum over the ranks of stacked[rank], for this rank (stacked: (W, ...) on every
        rank): a reduce-scatter where the backend has one (each rank receives only its part),
        else an all-reduce of the whole, keeping this rank's part."""
        if backend_reduces_scatter(self.backend):
            mine = stacked.new_empty(stacked.shape[1:])
            _reduce_scatter(mine, stacked.flatten(0, 1), group=self.process_group)
            return mine
        total = stacked.contiguous()
        dist.all_reduce(total, group=self.process_group)
        return total[self.rank]

    def collective_device(self, data: object) -> torch.device:
        """Where the small tensors of the agreement collective live: NCCL moves CUDA tensors
        only, so there it must be a CUDA device even when the data is (wrongly) elsewhere."""
        types = self.data_device_types()
        data_device = data.device if isinstance(data, torch.Tensor) else None
        if data_device is not None and data_device.type != "meta" and (
                types is None or data_device.type in types):
            return data_device
        if types is not None and "cpu" not in types and "cuda" in types:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def backend_device_types(backend: str) -> frozenset[str] | None:
    """'gloo' -> {cpu}; 'nccl' -> {cuda}; 'cpu:gloo,cuda:nccl' -> {cpu, cuda}; unknown -> None.

    gloo is held to CPU tensors: its all-to-all does not take CUDA tensors.
    """
    backend = str(backend).lower()
    if ":" in backend:  # a per-device mapping, as init_process_group() without a backend makes
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    return {"gloo": frozenset({"cpu"}), "nccl": frozenset({"cuda"}),
            "mpi": frozenset({"cpu", "cuda"})}.get(backend)


def backend_reduces_scatter(backend: str) -> bool:
    """NCCL and gloo have reduce_scatter_tensor in every torch we support (>= 2.4; gloo's is an
    all-reduce keeping the rank's part, what the fallback does); MPI and backends we do not
    know are not assumed to."""
    parts = [part.split(":")[-1].strip() for part in str(backend).lower().split(",")]
    return all(part in ("nccl", "gloo") for part in parts)


# torch 2.13 renamed reduce_scatter_tensor (the old name still works, with a FutureWarning).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group, argument: str = "group") -> ContextParallelGroup:
    """`group` as a ContextParallelGroup: a ProcessGroup, a 1-D DeviceMesh, or (mesh, dim name).

    These errors are raised before any collective, by the process that got the bad value only:
    without a usable group there is nothing to tell the other ranks through.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{argument}: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group() first")
    process_group = _process_group_of(group, argument)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"{argument}: this process (global rank {dist.get_rank()}) is not a "
                         "member of the group; every rank passes its own context-parallel group")
    return ContextParallelGroup(process_group=process_group, rank=rank,
                                world_size=dist.get_world_size(process_group),
                                backend=str(dist.get_backend(process_group)))


def _process_group_of(group, argument: str):
    device_mesh = _device_mesh_class()
    if isinstance(group, tuple) and len(group) == 2 and device_mesh is not None \
            and isinstance(group[0], device_mesh):
        mesh, dim = group
        names = mesh.mesh_dim_names or ()
        if dim not in names:
            raise ValueError(f"{argument}: the mesh has no dimension {dim!r} (its dimensions: "
                             f"{tuple(names)}); pass (mesh, '<context-parallel dim name>')")
        return mesh.get_group(dim)
    if device_mesh is not None and isinstance(group, device_mesh):
        if group.ndim != 1:
            raise ValueError(f"{argument}: a {group.ndim}-D DeviceMesh needs the context-parallel "
                             "dimension named: pass (mesh, dim_name)")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"{argument} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or "
                    f"(DeviceMesh, dim_name), got {type(group).__name__}")


def _device_mesh_class():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed support
        return None
    return DeviceMesh
