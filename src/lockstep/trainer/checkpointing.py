"""The Trainer's checkpoints: config -> a saver, the load before training, and the saves during ``fit``."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist, elastic, progress
from lockstep.checkpoint import autoresume, fetch, ignore, loader, remote
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.callbacks.checkpoint_saver import CheckpointSaver as SaverCallback
from lockstep.callbacks.load_checkpoint import LoadCheckpoint
from lockstep.checkpoint.writer import CheckpointWriter
from lockstep.checkpoint.layout import LOCAL, SINGLE, Layout
from lockstep.core.event import Event
from lockstep.objectstore.uri import is_uri
from lockstep.time import Time, Timestamp
from lockstep.trainer.data import DataPosition, rank_entry, resume_caveat

if TYPE_CHECKING:
    from lockstep.state import State


def saving_arguments(callbacks: Sequence[Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's ``save_*`` ``arguments``, or, as in Composer, those the first ``CheckpointSaver``
    callback among ``callbacks`` says instead (its folder is the run's ``save_folder``, which
    autoresume reads): the Trainer's saver writes that callback's checkpoints."""
    savers = [c for c in callbacks if isinstance(c, SaverCallback)]
    return savers[0].trainer_arguments() if savers else arguments


def more_savers(callbacks: Sequence[Any], config: CheckpointConfig) -> list[tuple[SaverCallback, CheckpointConfig]]:
    """The ``CheckpointSaver`` callbacks after the first, each with the config of the saver that
    writes its checkpoints: its own folder, names, interval and rotation; it neither loads nor
    autoresumes (the run's ``save_folder`` is the first one's)."""
    savers = [c for c in callbacks if isinstance(c, SaverCallback)]
    return [(callback, dataclasses.replace(config, **callback.trainer_arguments(), autoresume=False,
                                           load_path=None, load_object_store=None))
            for callback in savers[1:]]


def with_saver_callback(callbacks: list[Any], config: CheckpointConfig) -> list[Any]:
    """``callbacks`` with a ``CheckpointSaver`` that stands for ``save_folder`` when none is there, as
    Composer's Trainer makes one: its state (every checkpoint written, with its timestamp) is then in
    each checkpoint's ``state['callbacks']``. The Trainer's saver still writes the files."""
    if config.save_folder is None or any(isinstance(c, SaverCallback) for c in callbacks):
        return callbacks
    prefix = config.save_folder.split("://", 1)[1].partition("/")[2] if is_uri(config.save_folder) \
        else config.save_folder  # Composer's names of the files in a bucket, relative to it
    remote = (lambda name: None if name is None else os.path.join(prefix, name)) if prefix else (lambda name: name)
    return [*callbacks, SaverCallback(
        folder=config.save_folder, filename=config.save_filename, latest_filename=config.save_latest_filename,
        remote_file_name=remote(config.save_filename), latest_remote_file_name=remote(config.save_latest_filename),
        save_interval=config.save_interval, overwrite=config.save_overwrite,
        num_checkpoints_to_keep=config.save_num_checkpoints_to_keep, weights_only=config.save_weights_only,
        ignore_keys=config.save_ignore_keys)]


def bind_callbacks(callbacks: Sequence[Any], layout: Layout, saves: Sequence[FitSaves]) -> None:
    """Give the checkpoint callbacks what they need of the Trainer: each ``CheckpointSaver`` the
    saves that write its checkpoints (``saves``: one for each, in order), ``LoadCheckpoint`` the
    backend's checkpoint layout."""
    savers = iter(saves)
    for callback in callbacks:
        if isinstance(callback, SaverCallback):
            fit_saves = next(savers, None)
            if fit_saves is not None:
                callback.saved_checkpoints = fit_saves.saved
                callback.bind(fit_saves.saver)
        elif isinstance(callback, LoadCheckpoint):
            callback.bind(layout)


def entry_of_callbacks(callbacks: Sequence[Any]) -> dict[str, Any] | None:
    """This rank's RNG and data entry of the training state a ``LoadCheckpoint`` callback loaded
    while the Trainer was built (the newest such load), for ``fit`` to apply; None if none did."""
    entry = None
    for callback in callbacks:
        loaded = getattr(callback, "loaded", None) if isinstance(callback, LoadCheckpoint) else None
        if loaded is not None and not loaded.weights_only:
            entry = loaded.rank_entry or {}
    return entry


def make_saver(config: CheckpointConfig, *, run_name: str, max_duration: Time | None, layout: Layout,
               device: torch.device) -> CheckpointWriter | None:
    if config.save_folder is None:
        return None
    if config.save_weights_only and layout.name != SINGLE:
        raise ValueError(f"save_weights_only=True writes one file of full weights, but this run saves "
                         f"{layout.name!r} checkpoints: use fsdp_config={{'state_dict_type': 'full'}} (or DDP), "
                         f"or export the weights afterwards with lockstep.checkpoint.export_state_dict")
    if config.save_ignore_keys is not None and layout.name not in (SINGLE, LOCAL):
        raise ValueError(f"save_ignore_keys leaves parts out of single-file checkpoints, and this run saves "
                         f"{layout.name!r} checkpoints: use fsdp_config={{'state_dict_type': 'full'}} (or "
                         f"'local'), or remove save_ignore_keys")
    if config.save_ignore_keys is not None:  # what they leave out, before any checkpoint is written
        ignore.check_save_globs(config.save_ignore_keys, layout.model.state_dict().keys(),
                                weights_only=config.save_weights_only)
    saver = CheckpointWriter(config, run_name=run_name, max_duration=max_duration, layout=layout.name, device=device)
    saver.check_folder()
    return saver


class FitSaves:
    """The saves ``fit`` makes: when ``save_interval`` asks, at the end, and after SIGTERM. Each
    holds this rank's RNG state and data position (``position``, which the data loop keeps)."""

    def __init__(self, saver: CheckpointWriter, state: State, layout: Layout, position: DataPosition,
                 saved: list[str]) -> None:
        self.saver, self.state, self.layout, self.position, self.saved = saver, state, layout, position, saved

    def after_batch(self, before: Timestamp, after: Timestamp) -> None:
        """Save if a batch-end save is due (not at an epoch's last batch: see :meth:`after_epoch`)."""
        if self.saver.due(before, after, Event.BATCH_END, self.state, epoch_end=False):
            self.save(at_epoch_end=False)

    def after_epoch(self, before_batch: Timestamp) -> None:
        """Save if the epoch's last batch, or the epoch's end, made a save due: after EPOCH_END, so
        that ``{epoch}`` in its name counts the epoch."""
        now, due = self.state.timestamp, self.saver.due
        if due(before_batch, now, Event.BATCH_END, self.state, epoch_end=False) or \
                due(before_batch, now, Event.EPOCH_END, self.state, epoch_end=True):
            self.save(at_epoch_end=True)

    def save(self, *, at_epoch_end: bool, wait: bool = False) -> None:
        entry = rank_entry(self.position, at_epoch_end)
        # Progress reports go on: the saver pauses them only around long local work (see
        # _agreement.long_io), so that a rank stopping before a save is caught as a stall.
        path = self.saver.save(self.state, entry, self.layout, wait=wait)
        if path is not None:
            self.saved.append(str(path))

    def finish(self) -> None:
        """Save this batch unless that is done already, and wait until every save is durable."""
        timestamp = self.state.timestamp
        if self.saver.last_saved_batch != timestamp.batch.value:
            self.save(at_epoch_end=timestamp.batch_in_epoch.value == 0, wait=True)
        self.saver.wait()


def save_to_folder(saves: FitSaves | None, saver: CheckpointWriter | None, *, fitting: bool) -> None:
    """``Trainer.save_checkpoint_to_save_folder``: a checkpoint of the state now, into the run's
    ``save_folder`` as its saves during ``fit`` go (a collective), durable when this returns;
    nothing new when the run saved this batch already."""
    if saves is None or saver is None:
        raise ValueError("save_checkpoint_to_save_folder() writes into save_folder: give save_folder=... to "
                         "Trainer(...)")
    held = saver.folder_claim.held  # during fit, and from Trainer(...) to the first fit: kept
    saver.folder_claim.take()
    try:
        saves.finish()
    finally:
        if not held and not fitting:
            saver.folder_claim.release()


def save_named(name: str, state: State, layout: Layout, position: DataPosition, *,
               weights_only: bool) -> str | None:
    """``Trainer.save_checkpoint``: a checkpoint of the state now at ``name`` (a template such as
    ``ep{epoch}-ba{batch}-rank{rank}.pt``, a path or an ``s3://`` URI), in the run's layout, over
    what is there; no latest pointer moves. A collective; the path on the ranks that wrote it."""
    try:
        config = CheckpointConfig(save_folder=os.path.dirname(name) or ".", save_filename=os.path.basename(name),
                                  save_latest_filename=None, save_overwrite=True, save_weights_only=weights_only)
        saver = make_saver(config, run_name=state.run_name, max_duration=state.max_duration, layout=layout,
                           device=state.device.torch_device)
    except (TypeError, ValueError) as e:  # its messages name the Trainer's save_* arguments
        raise type(e)(f"save_checkpoint(name={name!r}, weights_only={weights_only}): {e}") from None
    assert saver is not None  # it has a save_folder
    try:
        saver.begin(None)
        path = saver.save(state, rank_entry(position, state.timestamp.batch_in_epoch.value == 0), layout, wait=True)
        saver.wait()
    finally:
        saver.folder_claim.release()
    return None if path is None else str(path)


def load_at_start(config: CheckpointConfig, state: State, layout: Layout, saver: CheckpointWriter | None,
                  train_dataloader: Any, *, run_name_given: bool) -> dict[str, Any] | None:
    """Autoresume from the run's newest checkpoint, else ``load_path``, else start fresh, and tell
    the saver what the run continues from; returns this rank's RNG and data entry for ``fit`` to
    apply (None when nothing, or only weights, were loaded). A rank that joins a running elastic
    job loads nothing: it takes a peer's state once the others make room for it."""
    membership = elastic.current()
    if membership is not None and membership.fresh:
        if saver is not None:
            saver.join_running()
        return None
    watch = config.autoresume or config.load_path is not None
    if watch:  # a rank that never comes to the load's agreements is a stall the launcher names
        progress.heartbeat(state.timestamp.batch.value)
    try:
        if saver is not None:  # before any download: what a killed job left half written on each node
            saver.sweep_leftovers()
        loaded = _load(config, state, layout, saver, run_name_given=run_name_given)
    finally:
        if watch:  # until the first batch ends: a first step may compile for long
            progress.stop_heartbeat()
    if saver is not None:
        saver.begin(loaded)
    if loaded is None or loaded.weights_only:
        return None
    if dist.get_global_rank() == 0:
        caveat = resume_caveat(train_dataloader, state.timestamp.epoch.value)
        if caveat:
            warnings.warn(caveat, stacklevel=3)
    return loaded.rank_entry or {}


def load_after_change(config: CheckpointConfig, state: State, layout: Layout,
                      saver: CheckpointWriter | None) -> dict[str, Any]:
    """After the ranks of an elastic job under FSDP or DeepSpeed changed: the newest checkpoint of
    ``save_folder`` loaded into the model sharded anew (the lost ranks' shards are nowhere else),
    every rank; this rank's RNG and data entry (empty at another world size, whose RNG streams do
    not map onto the ranks). The Trainer settled ``saver``'s write in flight before the new group
    formed (:meth:`CheckpointWriter.settle_after_change`)."""
    assert saver is not None  # setup.check_elastic: an elastic job that shards its state has a save_folder
    dist.barrier()  # every rank's write in flight over: the newest checkpoint is whole
    loaded = autoresume.resume(config, state, layout, saver.where, saver.device)
    if loaded is None:
        raise RuntimeError(f"lockstep: the job's ranks changed, with sharded state, before its first checkpoint in "
                           f"{config.save_folder}: the lost ranks' shards are nowhere else, so it cannot go on; "
                           f"save earlier (save_interval) or start it again")
    return loaded.rank_entry or {}


def _load(config: CheckpointConfig, state: State, layout: Layout, saver: CheckpointWriter | None,
          *, run_name_given: bool) -> loader.Loaded | None:
    loaded = None
    if config.autoresume:
        if not run_name_given:
            raise ValueError("autoresume=True needs run_name=...: a restarted job finds its checkpoints by "
                             "its run name, and a generated name differs on every launch")
        assert saver is not None  # CheckpointConfig: autoresume needs save_folder, so there is a saver
        loaded = autoresume.resume(config, state, layout, saver.where, saver.device)
    if loaded is None and config.load_path is not None:
        path = config.load_path
        if remote.is_remote(path) or config.load_object_store is not None:  # downloaded first
            path = fetch.load_path(path, config.load_object_store, layout_name=layout.name, run_name=state.run_name,
                                   device=state.device.torch_device, weights_only=config.load_weights_only)
        loaded = loader.load(path, state, layout, run_name=state.run_name,
                             weights_only=config.load_weights_only, strict=config.load_strict_model_weights,
                             ignore=config.load_ignore_keys)
    return loaded


