"""The job's device mesh: data-parallel replicas, data-parallel shards and tensor-parallel ranks.

Composer's ``data_parallel_replicate_degree``, ``data_parallel_shard_degree`` and
``tensor_parallel_degree`` give the sizes of its dimensions, outermost first, so the ranks of one
tensor-parallel group are consecutive (on one node, where their collectives are cheapest) and the
replicas are the outermost: with 4 ranks, replicate 2 x shard 2 puts ranks 0-1 in one replica and
2-3 in the other. One size may be -1: the world size divided by the others.

The ranks of one tensor-parallel group work on the same batch, so the data is split over the
data-parallel ranks only: :func:`data_parallel` says how, for the Trainer's counts and samplers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

REPLICATE, SHARD, TENSOR = "data_parallel_replicate", "data_parallel_shard", "tensor_parallel"
"""Composer's names of the mesh dimensions (``composer.utils.misc.ParallelismType``)."""


@dataclass(frozen=True, slots=True)
class MeshShape:
    """The sizes of the mesh's dimensions; ``replicate`` is None when the mesh has no such dimension."""

    replicate: int | None
    shard: int
    tensor: int

    @property
    def data_parallel(self) -> int:
        """How many ranks train on different data."""
        return (self.replicate or 1) * self.shard

    def dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The sizes and names of the dimensions the mesh is built with."""
        named = [(self.replicate, REPLICATE), (self.shard, SHARD), (self.tensor if self.tensor > 1 else None, TENSOR)]
        kept = [(size, name) for size, name in named if size is not None]
        return tuple(s for s, _ in kept), tuple(n for _, n in kept)

    def describe(self) -> str:
        sizes, names = self.dims()
        return " x ".join(f"{name} {size}" for size, name in zip(sizes, names))


def resolve_shape(world_size: int, *, shard: int = -1, replicate: int | None = None, tensor: int = 1) -> MeshShape:
    """The mesh for these degrees (Composer's rules); a ValueError naming the degree to change."""
    given = {"data_parallel_shard_degree": shard, "tensor_parallel_degree": tensor}
    if replicate is not None:
        given["data_parallel_replicate_degree"] = replicate
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"{name}={value!r} must be a positive integer or -1 (the ranks the other degrees leave)")
    if tensor == -1:
        raise ValueError("tensor_parallel_degree=-1: give the number of ranks that split each layer, such as 2")
    unknown = [name for name, value in given.items() if value == -1]
    if len(unknown) > 1:
        raise ValueError(f"{' and '.join(unknown)} are both -1: at most one degree may take the ranks the "
                         f"others leave")
    known = 1
    for value in given.values():
        known *= value if value != -1 else 1
    text = ", ".join(f"{name}={value}" for name, value in given.items())
    if world_size % known or (not unknown and known != world_size):
        raise ValueError(f"{text} needs {'a multiple of ' if unknown else ''}{known} ranks, but the world size "
                         f"is {world_size}: make the degrees multiply to {world_size}")
    fill = world_size // known
    return MeshShape(replicate=fill if replicate == -1 else replicate, shard=fill if shard == -1 else shard,
                     tensor=tensor)


def build_mesh(device_type: str, shape: MeshShape) -> DeviceMesh:
    """The job's mesh (a collective: every rank builds it, in the same order as the others)."""
    sizes, names = shape.dims()
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def data_parallel_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """The dimensions FSDP shards and replicates over: (replicate, shard), or shard alone."""
    return mesh[(REPLICATE, SHARD)] if shape.replicate is not None else mesh[SHARD]


@dataclass(frozen=True, slots=True)
class DataParallel:
    """How this rank's data relates to the others': it trains on share ``rank`` of ``size``, and
    ``copies`` ranks (a tensor-parallel group) train on each share."""

    rank: int
    size: int
    copies: int = 1


_current: DataParallel | None = None


def set_data_parallel(value: DataParallel | None) -> None:
    """Record the split of the data for this process (None: every rank trains on its own share)."""
    global _current
    _current = value


def data_parallel() -> DataParallel:
    """The split of the data among the ranks (see :func:`set_data_parallel`)."""
    if _current is not None:
        return _current
    from lockstep import dist
    return DataParallel(dist.get_global_rank(), dist.get_world_size())
