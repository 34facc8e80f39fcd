"""How an FSDP model's and its optimizers' state goes into a checkpoint and back (the layouts of
:mod:`lockstep.checkpoint.states` that need DCP and DTensor):

* ``single`` with ``state_dict_type='full'``: full tensors gathered to rank 0, one file
  (:class:`FullLayout`; optimizer state keyed by name).
* ``local``: each rank saves the shards it holds, with each shard's place in the full tensor.
* ``sharded``: a torch.distributed.checkpoint folder that loads at any world size. Only tensors go
  through DCP (whose non-tensor path unpickles); the rest travels in ``lockstep.pt``, with the size
  and CRC32 of every file (:mod:`lockstep.checkpoint.integrity`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from lockstep import dist
from lockstep.checkpoint import integrity
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.layout import LOCAL, NAME, SHARDED, SHARDED_META, FolderLayout
from lockstep.checkpoint.states import ReplicatedLayout, misfit, optimizer_misfit


class _OwnBuffers(ReplicatedLayout):
    """FSDP does not synchronise buffers (a BatchNorm's running statistics differ per rank), and
    one file or DCP's deduplication keeps rank 0's only: each rank's entry holds its own."""

    def rank_buffers(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items()
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.is_floating_point()}

    def step_storages(self) -> set[tuple[str, int]]:
        return set()  # FSDP frees and refills its parameters' storage: a save copies everything at once


class FullLayout(_OwnBuffers):
    """FSDP, ``state_dict_type='full'``: full tensors gathered to rank 0, one file."""

    optimizer_keys = NAME
    collective = True
    _SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if dist.collective_interrupt() is not None:  # an elastic job: gathers that a change of its ranks ends
            return self._gather_through_lockstep()
        model = self._restore_buffer_dtypes(get_model_state_dict(self.model, options=self._SAVE))
        return model, [get_optimizer_state_dict(self.model, o, options=self._SAVE) for o in self.optimizers]

    def _gather_through_lockstep(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """What :meth:`gather` returns, with every shard gathered through :mod:`lockstep.dist`
        rather than by DTensor, which waits inside torch: there a rank lost during the save would
        hold the others until the process group's timeout."""
        model = _full_on_rank_0(get_model_state_dict(self.model))
        optimizers = [_full_on_rank_0(get_optimizer_state_dict(self.model, o)) for o in self.optimizers]
        if dist.get_global_rank() != 0:  # as torch's cpu_offload: only rank 0 keeps the full state
            return {}, [{} for _ in self.optimizers]
        return self._restore_buffer_dtypes(model), optimizers

    def load_model(self, weights: dict[str, Any], path: Path, strict: bool) -> None:
        try:  # every rank read the file, so each takes its own shards: nothing is broadcast
            set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=strict))
        except (RuntimeError, KeyError, ValueError) as e:
            raise misfit(path, e) from None

    def load_optimizers(self, saved: list[Any], path: Path) -> None:
        options = StateDictOptions(full_state_dict=True)
        for i, (optimizer, sd) in enumerate(zip(self.optimizers, saved)):
            try:
                set_optimizer_state_dict(self.model, optimizer, sd, options=options)
            except (RuntimeError, KeyError, ValueError) as e:
                raise optimizer_misfit(path, i, optimizer, e) from None


def _full_on_rank_0(state: Any) -> Any:
    """``state`` (a sharded state dict) with each DTensor gathered whole; on rank 0 on the CPU."""
    keep = dist.get_global_rank() == 0

    def whole(value: Any) -> Any:
        if isinstance(value, DTensor):
            value = _gathered(value)
        return value.detach().cpu() if keep and isinstance(value, torch.Tensor) else value

    return pytree.tree_map(whole, state)


def _gathered(value: DTensor) -> torch.Tensor:
    """The full tensor of FSDP's dim-0 shards (``torch.chunk``'s sizes, padded to one for the
    all-gather), gathered through :func:`lockstep.dist.all_gather`."""
    if len(value.placements) != 1 or not value.placements[0].is_shard(0):
        return value.full_tensor()  # not FSDP's plain sharding (an elastic job refuses those)
    local, rows = value.to_local(), value.shape[0]
    group = value.device_mesh.get_group()
    padded = local.new_zeros((-(-rows // group.size()), *value.shape[1:]))
    padded[:local.shape[0]] = local
    return torch.cat(dist.all_gather(padded, group=group))[:rows]


def _gathering_reader(self: ReplicatedLayout) -> ReplicatedLayout:
    """A sharded model loads a single file's full tensors the way FSDP's ``full`` layout does."""
    return FullLayout(self.model, self.optimizers, self.buffer_dtypes)


class LocalLayout(ReplicatedLayout):
    """FSDP, ``state_dict_type='local'``: this rank's shards as plain tensors, one file per rank.

    ``model`` maps each name to its local shard; ``shards`` maps it to (full shape, offset of the
    shard in it), which is what export needs to reassemble full tensors from the rank files.
    """

    name = LOCAL
    optimizer_keys = NAME
    full_reader = _gathering_reader

    def step_storages(self) -> set[tuple[str, int]]:
        return set()  # as in _OwnBuffers

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        model = {k: _local(v) for k, v in self.model.state_dict().items()}
        optimizers = [_to_local(get_optimizer_state_dict(self.model, o)) for o in self.optimizers]
        return model, optimizers

    def extra_meta(self) -> dict[str, Any]:
        return {"shards": {k: _placement(v) for k, v in self.model.state_dict().items()
                           if isinstance(v, torch.Tensor)}}

    def load_model(self, weights: dict[str, Any], path: Path, strict: bool) -> None:
        live = self.model.state_dict()
        missing, unexpected = sorted(live.keys() - weights.keys()), sorted(weights.keys() - live.keys())
        if strict and (missing or unexpected):
            raise CheckpointError(f"checkpoint {path} does not fit the model: missing keys {missing[:5]}, "
                                  f"unexpected keys {unexpected[:5]}")
        with torch.no_grad():
            for key in live.keys() & weights.keys():
                target = _local(live[key])
                if target.shape != weights[key].shape:
                    raise CheckpointError(
                        f"checkpoint {path}: {key} has shard shape {tuple(weights[key].shape)} but this "
                        f"rank's shard is {tuple(target.shape)}: a local checkpoint loads only into the "
                        f"same world size and wrapping")
                target.copy_(weights[key])

    def load_optimizers(self, saved: list[Any], path: Path) -> None:
        specs = self.model.state_dict()
        for i, (optimizer, sd) in enumerate(zip(self.optimizers, saved)):
            try:
                state: dict[str, Any] = {name: {k: _like(v, specs[name]) for k, v in values.items()}
                                         for name, values in sd["state"].items()}
                set_optimizer_state_dict(self.model, optimizer, {"state": state, "param_groups": sd["param_groups"]})
            except (RuntimeError, KeyError, ValueError) as e:
                raise optimizer_misfit(path, i, optimizer, e) from None


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _to_local(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _to_local(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_to_local(v) for v in sd]
    return _local(sd)


def _like(value: Any, spec: Any) -> Any:
    """A saved local shard back as a DTensor placed like the parameter (scalars stay as they are)."""
    if (isinstance(value, torch.Tensor) and isinstance(spec, DTensor) and value.shape != ()
            and value.dim() == spec.dim()):
        return DTensor.from_local(value.to(spec.device), spec.device_mesh, spec.placements,
                                  shape=spec.shape, stride=spec.stride(), run_check=False)
    return value


def _placement(value: torch.Tensor) -> tuple[list[int], list[int]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not isinstance(value, DTensor):
        return list(value.shape), [0] * value.dim()
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return list(value.shape), list(offset)


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, which also records the size and CRC32 of each file this rank writes."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.folder, self.parts = path, {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()  # DCP waits for it next anyway; the files are synced once it is done
        self.parts = integrity.record(self.folder, {r.storage_data.relative_path for r in written.value()})
        return written


class ShardedLayout(_OwnBuffers, FolderLayout):
    """FSDP, ``state_dict_type='sharded'``: DTensors saved and loaded through DCP, with each file's
    size and CRC32 in lockstep.pt (``parts``), which the loader checks before DCP reads any."""

    name = SHARDED
    optimizer_keys = NAME
    collective = True
    full_reader = _gathering_reader
    _parts: dict[str, list[int]] = {}
    """Every rank's records of the last save's files (:meth:`write_parts`), for :meth:`seal`."""
    _reads: list[list[str]] = []
    """Each rank's files to read of the last save (:meth:`write_parts`), for :meth:`seal`."""

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        model = self._restore_buffer_dtypes(get_model_state_dict(self.model))
        return model, [get_optimizer_state_dict(self.model, o) for o in self.optimizers]

    @staticmethod
    def folder_parts(temp: Path, model: dict[str, Any], optimizers: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """(what DCP writes: the model's tensors and the optimizers' sharded ones; the optimizers'
        other parts, which go in lockstep.pt). An optimizer's plain tensors (``step``) are the same
        on every rank: in DCP, one rank's file would hold them, which every rank would then read."""
        split = [split_tensors(o, sharded_only=True) for o in optimizers]
        tensors = {"model": model, "optimizers": {str(i): t or {} for i, (t, _) in enumerate(split)}}
        return tensors, [r or {} for _, r in split]

    def write_parts(self, temp: Path, tensors: dict[str, Any], group: ProcessGroup | None) -> dict[str, list[int]]:
        """Every rank's shards, durable in ``temp`` on return, and every rank's record of them."""
        records, reads = self.write_tensors(temp, tensors, group)
        self._parts, self._reads = integrity.gather(records, group, reads)
        return self._parts

    @staticmethod
    def write_tensors(temp: Path, tensors: dict[str, Any],
                      group: ProcessGroup | None) -> tuple[dict[str, list[int]], set[str]]:
        """Every rank writes its shards into ``temp`` and fsyncs them (a collective over ``group``);
        returns the size and CRC32 of each file this rank wrote (:func:`integrity.record`), and the
        files this rank reads to load them back at this world size (:func:`_reads`)."""
        import torch.distributed.checkpoint as dcp

        writer = _RecordingWriter(temp, sync_files=True)
        metadata = dcp.save(tensors, storage_writer=writer, process_group=group)
        return writer.parts, _reads(tensors, metadata, temp)

    def seal(self, temp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, before lockstep.pt is written: record every rank's files and DCP's .metadata,
        and the files each rank reads."""
        meta["lockstep"]["parts"] = {**self._parts, **integrity.record(temp, [integrity.DCP_METADATA])}
        meta["lockstep"]["reads"] = self._reads
        meta["lockstep"]["optimizer_plain_tensors"] = SHARDED_META

    def load_folder(self, folder: Path, content: dict[str, Any], *, weights_only: bool, strict: bool) -> None:
        """Load a DCP folder into the live (sharded) model and optimizers, at any world size."""
        import torch.distributed.checkpoint as dcp

        model, optimizers = self.gather()  # the live tensors, which DCP fills in place
        tensors: dict[str, Any] = {"model": model}
        if not weights_only:  # plain tensors in lockstep.pt, except in checkpoints saved before they went there
            in_meta = (content.get("lockstep") or {}).get("optimizer_plain_tensors") == SHARDED_META
            tensors["optimizers"] = {str(i): split_tensors(o, sharded_only=in_meta)[0] or {}
                                     for i, o in enumerate(optimizers)}
        try:
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder),
                     planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
        except Exception as e:  # DCP wraps each rank's failure in a CheckpointException
            first = " ".join(str(e).split())[:600]
            raise CheckpointError(f"cannot load sharded checkpoint {folder}: {first}") from None
        set_model_state_dict(self.model, tensors["model"])
        if not weights_only:
            for i, optimizer in enumerate(self.optimizers):
                saved = join_tensors(tensors["optimizers"][str(i)], content["optimizers"][i])
                set_optimizer_state_dict(self.model, optimizer, saved)


def _reads(tensors: dict[str, Any], metadata: Any, folder: Path) -> set[str]:
    """The files of a DCP folder that this rank reads to load ``tensors`` (as saved, so as a run
    of the same world size and sharding asks for them): DCP's load plan for them, and .metadata.
    Besides its own file, that may be the file of another rank that DCP had write a tensor every
    rank holds (an optimizer's ``step``)."""
    import torch.distributed.checkpoint as dcp

    storage = metadata.storage_data
    if storage is None:  # torch 2.11's dcp.save returns the metadata without it (2.13's keeps it)
        try:
            storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
        except Exception:  # no .metadata on this node's disk: every file here counts as read
            return {p.name for p in folder.iterdir() if p.is_file()} | {integrity.DCP_METADATA}
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(tensors, metadata, is_coordinator=False)
    files = {storage[item.storage_index].relative_path for item in planner.create_local_plan().items}
    return files | {integrity.DCP_METADATA}


def split_tensors(sd: Any, *, sharded_only: bool = False) -> tuple[Any, Any]:
    """(the tensors, the rest) of a nested dict: DCP stores the first, lockstep.pt the second.
    ``sharded_only``: tensors that are not DTensors (an optimizer's ``step``, the same on every
    rank) go with the rest."""
    if isinstance(sd, dict) and not sd:
        return None, {}
    if isinstance(sd, dict):
        parts = {k: split_tensors(v, sharded_only=sharded_only) for k, v in sd.items()}
        tensors = {k: t for k, (t, _) in parts.items() if t is not None}
        rest = {k: r for k, (_, r) in parts.items() if r is not None}
        return tensors or None, rest or None
    if isinstance(sd, torch.Tensor) and (isinstance(sd, DTensor) or not sharded_only):
        return sd, None
    return None, sd


def join_tensors(tensors: Any, rest: Any) -> Any:
    if isinstance(tensors, dict) or isinstance(rest, dict):
        tensors, rest = tensors or {}, rest or {}
        return {k: join_tensors(tensors.get(k), rest.get(k)) for k in tensors.keys() | rest.keys()}
    return tensors if tensors is not None else rest

