"""The Trainer's checkpoints: config -> a saver, the load before training, and the saves during ``fit``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist, progress
from lockstep.checkpoint import fetch, loader, remote
from lockstep.checkpoint.files import DamagedCheckpoint, point_latest, remove
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.callbacks.checkpoint_saver import CheckpointSaver as SaverCallback
from lockstep.callbacks.load_checkpoint import LoadCheckpoint
from lockstep.checkpoint.saver import CheckpointSaver
from lockstep.checkpoint.layout import LOCAL, SINGLE, Layout
from lockstep.core.event import Event
from lockstep.time import Time, Timestamp
from lockstep.trainer.data import DataPosition, rank_entry, resume_caveat

DAMAGED = ".damaged"
"""The suffix autoresume gives a damaged newest checkpoint it resumed past."""

if TYPE_CHECKING:
    from lockstep.state import State


def saving_arguments(callbacks: Sequence[Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's ``save_*`` ``arguments``, or those a ``CheckpointSaver`` callback among
    ``callbacks`` says instead (the Trainer's one saver writes its checkpoints)."""
    savers = [c for c in callbacks if isinstance(c, SaverCallback)]
    if not savers:
        return arguments
    if len(savers) > 1:
        raise ValueError(f"callbacks has {len(savers)} CheckpointSaver callbacks: lockstep runs one checkpoint "
                         f"saver per Trainer; keep one")
    if arguments["save_folder"] is not None:
        raise ValueError("give either save_folder=... or a CheckpointSaver callback, not both: lockstep runs one "
                         "checkpoint saver per Trainer")
    return savers[0].trainer_arguments()


def bind_callbacks(callbacks: Sequence[Any], layout: Layout, saved: list[str]) -> None:
    """Give the checkpoint callbacks what they need of the Trainer: ``CheckpointSaver`` the list of
    checkpoints saved, ``LoadCheckpoint`` the backend's checkpoint layout."""
    for callback in callbacks:
        if isinstance(callback, SaverCallback):
            callback.saved_checkpoints = saved
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
               device: torch.device) -> CheckpointSaver | None:
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
    saver = CheckpointSaver(config, run_name=run_name, max_duration=max_duration, layout=layout.name, device=device)
    saver.check_folder()
    return saver


class FitSaves:
    """The saves ``fit`` makes: when ``save_interval`` asks, at the end, and after SIGTERM. Each
    holds this rank's RNG state and data position (``position``, which the data loop keeps)."""

    def __init__(self, saver: CheckpointSaver, state: State, layout: Layout, position: DataPosition,
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


def load_at_start(config: CheckpointConfig, state: State, layout: Layout, saver: CheckpointSaver | None,
                  train_dataloader: Any, *, run_name_given: bool) -> dict[str, Any] | None:
    """Autoresume from the run's newest checkpoint, else ``load_path``, else start fresh, and tell
    the saver what the run continues from; returns this rank's RNG and data entry for ``fit`` to
    apply (None when nothing, or only weights, were loaded)."""
    watch = config.autoresume or config.load_path is not None
    if watch:  # a rank that never comes to the load's agreements is a stall the launcher names
        progress.heartbeat(state.timestamp.batch.value)
    try:
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


def _load(config: CheckpointConfig, state: State, layout: Layout, saver: CheckpointSaver | None,
          *, run_name_given: bool) -> loader.Loaded | None:
    loaded = None
    if config.autoresume:
        if not run_name_given:
            raise ValueError("autoresume=True needs run_name=...: a restarted job finds its checkpoints by "
                             "its run name, and a generated name differs on every launch")
        assert saver is not None  # CheckpointConfig: autoresume needs save_folder, so there is a saver
        loaded = _autoresume(config, state, layout, saver)
    if loaded is None and config.load_path is not None:
        path = config.load_path
        if remote.is_remote(path) or config.load_object_store is not None:  # downloaded first
            path = fetch.load_path(path, config.load_object_store, layout_name=layout.name, run_name=state.run_name,
                                   device=state.device, weights_only=config.load_weights_only)
        loaded = loader.load(path, state, layout, run_name=state.run_name,
                             weights_only=config.load_weights_only, strict=config.load_strict_model_weights,
                             ignore=config.load_ignore_keys)
    return loaded


def _autoresume(config: CheckpointConfig, state: State, layout: Layout,
                saver: CheckpointSaver) -> loader.Loaded | None:
    """Load the newest checkpoint the latest pointer names. If its bytes are damaged (a restart
    would fail on it every time), fall back to the newest one that loads, with a warning naming
    what was wrong, and set the damaged one aside. The loader finds damage before any rank loads
    anything, so a fallback starts from an untouched state. A checkpoint that does not fit the run
    fails as it is; per-rank files (FSDP ``local``) do not fall back."""
    template = saver.latest_template
    assert template is not None  # CheckpointConfig: autoresume needs save_latest_filename
    if saver.remote is not None:  # the local staging folder first, then the bucket
        fetch.autoresume(saver, layout_name=layout.name, run_name=state.run_name)
    try:
        return loader.load(template, state, layout, run_name=state.run_name,
                           weights_only=False, strict=config.load_strict_model_weights, optional=True,
                           what="autoresume's latest pointer")
    except DamagedCheckpoint as newest:
        if layout.name == LOCAL:
            raise
        for path in _older_checkpoints(saver):
            try:
                loaded = loader.load(str(path), state, layout, run_name=state.run_name, weights_only=False,
                                     strict=config.load_strict_model_weights, what="autoresume's fallback")
            except DamagedCheckpoint:
                continue
            if dist.get_global_rank() == 0:
                warnings.warn(f"autoresume skipped the newest checkpoint, which does not load ({newest}); "
                              f"resumed from {path} instead{_set_aside(saver, path)}", stacklevel=4)
            return loaded
        raise


def _set_aside(saver: CheckpointSaver, resumed: Path) -> str:
    """Rank 0, once every rank has loaded ``resumed``: rename the damaged checkpoint the latest
    pointer names with a ``.damaged`` suffix (kept to look at, and out of the way of the run's next
    save of that step) and point the pointer at ``resumed``. What it did, for the warning; it never
    raises, since no other rank would know (the run goes on, and its next save moves the pointer)."""
    pointer = saver.latest
    assert pointer is not None  # autoresume needs save_latest_filename
    done = ""
    try:
        if pointer.is_symlink():
            newest = pointer.parent / os.readlink(pointer)
            if newest.exists() and newest.resolve() != resumed.resolve():
                aside = newest.with_name(newest.name + DAMAGED)
                remove(aside)  # set aside at an earlier resume
                os.replace(newest, aside)
                done = f"; renamed the damaged one to {aside.name}"
        point_latest(pointer, resumed)
    except OSError as e:
        done += f"; could not set the damaged one aside ({e})"
    return done


def _older_checkpoints(saver: CheckpointSaver) -> list[Path]:
    """Rank 0's view of the run's checkpoints other than the latest pointer's (and those set aside),
    newest first (every rank gets the same list: the loads that try them are collectives)."""
    found: list[Any] = [None]
    if dist.get_global_rank() == 0:
        pointer = saver.latest
        newest = os.path.basename(os.readlink(pointer)) if pointer is not None and pointer.is_symlink() else None
        paths = [p for p in saver.folder.glob(saver.filename_glob())
                 if p.name != newest and not p.name.endswith(DAMAGED)]
        found[0] = [str(p) for p in sorted(paths, key=_mtime, reverse=True)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    return [Path(p) for p in found[0]]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
