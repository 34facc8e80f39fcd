"""DeepSpeed checkpoints: the engine's own files inside a lockstep checkpoint folder.

The folder that ``save_filename`` names holds::

    deepspeed/         engine.save_checkpoint's files: model states, each rank's optimizer partition
    zero_to_fp32.py    DeepSpeed's recovery scripts, which it copies beside them
    lockstep.pt        timestamp, schedulers, every rank's RNG and data position, the ZeRO stage,
                       the size of every file above and the CRC32 of each the engine wrote
                       (lockstep.payload's format, without tensors)

DeepSpeed reads its files with ``torch.load(weights_only=False)``. Before it does, every one is
checked on every rank: its size against lockstep.pt, its CRC32 (each rank a share of the files:
:mod:`lockstep.checkpoint.integrity`; in a folder saved without them, its zip records' CRCs), and
its pickle for globals beyond the tensors and containers ``weights_only=True`` allows and three
plain DeepSpeed classes. So a damaged or foreign file is an error naming it, on every rank before
any loads, and no arbitrary code is unpickled.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lockstep.checkpoint import files, integrity, zipwriter
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.layout import DEEPSPEED, SHARDED_META, FolderLayout
from lockstep.checkpoint.states import ReplicatedLayout, misfit
from lockstep.optional import DEEPSPEED_INSTALL_HINT

TAG = "deepspeed"
"""The engine's checkpoint tag: the subfolder its files go in."""
_MODEL_STATES = "mp_rank_00_model_states.pt"
"""The engine's file of the model's weights (and, at ZeRO-0, the optimizer's state)."""
_ALLOWED_GLOBALS = frozenset({
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # an IntEnum
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # plain attributes
    "deepspeed.utils.tensor_fragment.fragment_address",  # a dataclass of two ints
})


class DeepSpeedLayout(ReplicatedLayout, FolderLayout):
    """The engine saves and loads the model and optimizer; lockstep keeps the rest in lockstep.pt."""

    name = DEEPSPEED
    optimizer_keys = DEEPSPEED
    collective = True

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], engine: Callable[[], Any],
                 stage: int) -> None:
        super().__init__(model, optimizers)
        self._engine, self.stage = engine, stage
        self._sizes: dict[str, int] = {}
        self._parts: dict[str, list[int]] = {}

    @property
    def engine(self) -> Any:
        """The strategy's engine now (an elastic job's change of the ranks builds a new one)."""
        return self._engine()

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return {}, [{} for _ in self.optimizers]  # the engine writes them

    def extra_meta(self) -> dict[str, Any]:
        return {"zero_stage": self.stage, "files": self._sizes}

    def folder_parts(self, temp: Path, model: dict[str, Any],
                     optimizers: list[Any]) -> tuple[list[tuple[str, Any]], list[Any]]:
        """Every rank (a collective): run the engine's save into ``temp``, but keep each state dict it
        would write, by reference, with the file it names (:meth:`write_captured` writes them);
        the optimizers have no part of their own in lockstep.pt."""
        writer = self.engine.checkpoint_engine
        captured: list[tuple[str, Any]] = []
        writer.save = lambda state_dict, path: captured.append((str(path), state_dict))
        try:
            self.engine.save_checkpoint(str(temp), tag=TAG, client_state={}, save_latest=False)
        finally:
            del writer.save  # the class's own again
        return captured, [{} for _ in optimizers]

    def write_parts(self, temp: Path, captured: list[tuple[str, Any]],
                    group: ProcessGroup | None) -> dict[str, list[int]]:
        """This rank's files, durable, and its record of them; every rank's are written, and their
        records here, on return (on a node whose disk rank 0 does not see, only these records tell
        rank 0 of this rank's files)."""
        self.write_captured(captured)
        names = {os.path.relpath(path, temp) for path, _ in captured}
        for name in names:
            with open(temp / name, "rb") as f:
                os.fsync(f.fileno())
        mine = integrity.record(temp, names)
        self._parts, _ = integrity.gather(mine, group)
        return self._parts

    def write_captured(self, captured: list[tuple[str, Any]]) -> None:
        """Write the captured state dicts as the engine would have (its serialization). DeepSpeed's
        default engine writes with ``torch.save``; lockstep's writer makes the same files for
        less CPU (``zipwriter``)."""
        writer = self.engine.checkpoint_engine
        plain = type(writer).__name__ == "TorchCheckpointEngine" and getattr(writer, "zipfile_serialization", True)
        for path, state_dict in captured:
            if plain:
                zipwriter.save(state_dict, str(path))
            else:
                writer.save(state_dict, path)

    def seal(self, temp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank has written: fsync every file and folder it sees; record the
        sizes of every rank's files (those of ranks on other nodes from their records), their
        CRC32s, and which files each rank reads to resume (:func:`reads`)."""
        self._sizes = {**_sync_tree(temp), **{name: size for name, (size, _) in self._parts.items()}}
        meta["lockstep"]["files"] = self._sizes
        meta["lockstep"]["parts"] = self._parts
        meta["lockstep"]["reads"] = reads(self._sizes, torch.distributed.get_world_size()
                                          if torch.distributed.is_initialized() else 1,
                                          elastic=bool(self.engine.zero_elastic_checkpoint()))

    def load_folder(self, folder: Path, content: dict[str, Any], *, weights_only: bool, strict: bool) -> None:
        """Resume exactly: the engine loads its model and optimizer states (the same stage; at
        another world size, in an elastic job, the partitions cut anew: :mod:`deepspeed_reshard`)."""
        assert not weights_only  # weights alone come through export_weights at any world size
        saved = content["lockstep"].get("world_size")
        if self.stage > 0 and saved != torch.distributed.get_world_size():
            from lockstep.checkpoint import deepspeed_reshard
            try:
                deepspeed_reshard.load(self.engine, folder, TAG, saved, strict=strict)
            except (RuntimeError, KeyError, ValueError, IndexError) as e:
                raise misfit(folder, e) from None
            return
        try:
            loaded, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_module_strict=strict,
                                                    load_optimizer_states=True, load_lr_scheduler_states=False)
        except (RuntimeError, KeyError, ValueError, AssertionError) as e:
            raise misfit(folder, e) from None
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {folder / TAG}")

    def load_model(self, weights: dict[str, Any], path: Path, strict: bool) -> None:
        """Full tensors (a single-file checkpoint, or a DeepSpeed one's exported weights): into the
        module (gathered under ZeRO-3), then into DeepSpeed's fp32 master copies."""
        import deepspeed

        partitioned = [p for p in self.model.parameters() if hasattr(p, "ds_id")]
        gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0) if partitioned \
            else contextlib.nullcontext()
        try:
            with gathered:
                self.model.load_state_dict(weights, strict=strict)
        except RuntimeError as e:
            raise misfit(path, e) from None
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()


def reads(names: Iterable[str], world_size: int, *, elastic: bool = False) -> list[list[str]]:
    """The files of a DeepSpeed checkpoint folder each rank reads to resume at ``world_size``: at
    ZeRO stages 1 and 2 (unless ``elastic_checkpoint``) and 3, the engine reads its own rank's
    optimizer partition and the files of the whole checkpoint (model states)."""
    every = sorted(names)
    if elastic:
        return [every for _ in range(world_size)]
    return [[n for n in every if integrity.part_rank(n) in (None, rank)] for rank in range(world_size)]


def _sync_tree(folder: Path) -> dict[str, int]:
    """fsync every file under ``folder`` (written by any rank) and its folders; return their sizes."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[path.relative_to(folder).as_posix()] = path.stat().st_size
        files.fsync_dir(Path(root))
    return sizes


def check_folder(folder: Path, meta: dict[str, Any], *, share: tuple[int, int] = (0, 1), every: bool = False,
                 peers: Sequence[int] | None = None) -> None:
    """Raise CheckpointError unless the engine's files that this rank reads are all there, whole,
    and safe to unpickle (:class:`DamagedCheckpoint` when their bytes are bad); ``share`` is (this
    rank, of how many): it checks the size and pickle globals of every file it reads (every file,
    unless the folder records each rank's reads at this world size) and the CRCs of its turn of
    them (:func:`integrity.assign`), among the ranks that read this copy of the folder (``peers``;
    None: every rank). ``every``: this rank reads every file (to rebuild full weights)."""
    if every:
        meta = {key: value for key, value in meta.items() if key != "reads"}
    sizes = meta.get("files") or {}
    if not any(name.startswith(f"{TAG}/") for name in sizes):
        raise CheckpointError(f"{folder} records no DeepSpeed files in {SHARDED_META}: not a complete "
                              f"DeepSpeed checkpoint")
    reading, _ = integrity.assign(sizes, meta, *share, peers)  # every file, unless each rank's reads are recorded
    for name in reading:
        integrity.check_size(folder, name, sizes[name])
    parts = meta.get("parts")
    if parts:
        integrity.check_parts(folder, parts, share, meta, peers)
    else:  # saved before parts were recorded: the zip records' own CRCs
        pickles = {n: s for n, s in sizes.items() if n.endswith(".pt")}
        for name in files.share(pickles, *integrity.within(share, peers)):
            files.verify(folder / name)
    for name in sorted(n for n in reading if n.endswith(".pt")):
        path = folder / name
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception as e:
            raise integrity.damaged(folder, name, f"does not read ({e})") from None
        if unsafe - _ALLOWED_GLOBALS:
            raise CheckpointError(f"DeepSpeed checkpoint file {path} would unpickle "
                                  f"{sorted(unsafe - _ALLOWED_GLOBALS)}, which lockstep does not load")


def export_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights (and buffers) of a DeepSpeed checkpoint folder at any ZeRO stage, rebuilt
    in this process from the fp32 master partitions by DeepSpeed's own ``zero_to_fp32``; at ZeRO-0
    in fp32, which keeps no partitions (the optimizer's state is in the model states file), the
    model's weights as saved. The caller has run :func:`check_folder`."""
    tagged = folder / TAG
    if not any(tagged.glob("*optim_states.pt")):
        states = torch.load(tagged / _MODEL_STATES, map_location="cpu", weights_only=False)
        return {name: t.detach().contiguous() for name, t in states["module"].items()}
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise ImportError(f"{folder} is a DeepSpeed checkpoint; reading it needs DeepSpeed ({e}): "
                          f"{DEEPSPEED_INSTALL_HINT}") from None
    weights = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
    return {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
