"""Composer's ``CheckpointSaver`` callback: the Trainer's own checkpoint saving, asked for as a
callback instead of with ``save_*`` arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep.checkpoint.config import CheckpointConfig, SaveInterval
from lockstep.core.callback import Callback
from lockstep.time import Timestamp
from lockstep.utils.checkpoint import PartialFilePath
from lockstep.utils.compression import get_compressor, is_compressed_pt
from lockstep.utils.interval import create_interval_scheduler

__all__ = ["CheckpointSaver"]


class CheckpointSaver(Callback):
    """Save checkpoints during training, with Composer's ``CheckpointSaver`` arguments.

    ``Trainer(callbacks=[CheckpointSaver(folder, ...)])`` saves exactly as
    ``Trainer(save_folder=folder, save_filename=filename, save_latest_filename=latest_filename,
    save_interval=..., save_overwrite=overwrite, save_num_checkpoints_to_keep=...,
    save_weights_only=weights_only)`` does: the Trainer's one saver writes them (same files, same
    resume, same SIGTERM handling), so a run has one saver: give this callback or ``save_folder``,
    not both. After ``fit``, :attr:`saved_checkpoints` lists what this rank wrote.

    ``remote_file_name``, ``latest_remote_file_name``, ``num_concurrent_uploads`` and
    ``upload_timeout_in_seconds`` take effect in Composer only with a ``RemoteUploaderDownloader``
    logger; lockstep uploads checkpoints when ``folder`` is an ``s3://`` URI instead, so they are
    kept, unused. ``ignore_keys`` is the Trainer's
    ``save_ignore_keys``.
    """

    def __init__(
        self,
        folder: str | Path = "{run_name}/checkpoints",
        filename: str | Path = "ep{epoch}-ba{batch}-rank{rank}.pt",
        remote_file_name: str | Path | None = "{run_name}/checkpoints/ep{epoch}-ba{batch}-rank{rank}.pt",
        latest_filename: str | Path | None = "latest-rank{rank}.pt",
        latest_remote_file_name: str | Path | None = "{run_name}/checkpoints/latest-rank{rank}.pt",
        save_interval: SaveInterval = "1ep",
        *,
        overwrite: bool = False,
        num_checkpoints_to_keep: int = -1,
        weights_only: bool = False,
        ignore_keys: Any = None,
        num_concurrent_uploads: int = 1,
        upload_timeout_in_seconds: int = 3600,
    ) -> None:
        self.folder = str(folder)
        self.filename = PartialFilePath(str(filename))
        self.latest_filename = None if latest_filename is None else PartialFilePath(str(latest_filename))
        self.remote_file_name = None if remote_file_name is None else PartialFilePath(str(remote_file_name))
        self.latest_remote_file_name = None if latest_remote_file_name is None \
            else PartialFilePath(str(latest_remote_file_name))
        if is_compressed_pt(str(filename)):  # an unknown extension or a missing tool: say so now
            get_compressor(str(filename)).check_exists()
        self._interval = save_interval
        self.save_interval = save_interval if callable(save_interval) else create_interval_scheduler(save_interval)
        """Composer's: a function ``(state, event) -> bool``, True at the events a save is due."""
        self.overwrite = overwrite
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = weights_only
        self.ignore_keys = ignore_keys
        self.num_concurrent_uploads = num_concurrent_uploads
        self.upload_timeout_in_seconds = upload_timeout_in_seconds
        CheckpointConfig(**self.trainer_arguments())  # bad names or counts: an error here, not at the Trainer
        self.saved_checkpoints: list[str] = []
        """The checkpoints this rank wrote, oldest first (the Trainer's ``saved_checkpoints``)."""
        self.all_saved_checkpoints_to_timestamp: dict[str, Timestamp] = {}
        """Composer's: the checkpoints this run wrote (earlier attempts included, through the
        checkpoint it resumed from) that the folder still holds, by name in the folder, with the
        timestamp each was written at. Composer keys them by path and keeps those rotation deleted."""
        self._saver: Any = None
        self._seen = -1

    def trainer_arguments(self) -> dict[str, Any]:
        """The Trainer's ``save_*`` arguments that say what this callback says."""
        return {"save_folder": self.folder, "save_filename": self.filename.filename,
                "save_latest_filename": None if self.latest_filename is None else self.latest_filename.filename,
                "save_interval": self._interval, "save_overwrite": self.overwrite,
                "save_num_checkpoints_to_keep": self.num_checkpoints_to_keep,
                "save_weights_only": self.weights_only, "save_ignore_keys": self.ignore_keys}

    def bind(self, saver: Any) -> None:
        """Follow ``saver``'s record (a ``lockstep.checkpoint.writer.CheckpointWriter``): the
        Trainer's saver that writes this callback's checkpoints."""
        self._saver = saver

    def _record(self, state: Any) -> None:
        """Take the saver's record (the Trainer saves just before BATCH_CHECKPOINT and
        EPOCH_CHECKPOINT, and at the end of fit)."""
        if self._saver is None or self._saver.saves.changes == self._seen:  # most batches: nothing new
            return
        self._seen = self._saver.saves.changes
        had = self.all_saved_checkpoints_to_timestamp
        self.all_saved_checkpoints_to_timestamp = {
            name: had.get(name) or Timestamp.from_state_dict(saved)
            for name, saved in self._saver.record() if saved is not None}

    def batch_checkpoint(self, state: Any, logger: Any) -> None:
        self._record(state)

    def epoch_checkpoint(self, state: Any, logger: Any) -> None:
        self._record(state)

    def fit_end(self, state: Any, logger: Any) -> None:
        self._record(state)

    def state_dict(self) -> dict[str, Any]:
        """Composer's: ``all_saved_checkpoints_to_timestamp`` as a list of (path, timestamp state)."""
        return {"all_saved_checkpoints_to_timestamp": [
            (path, timestamp.state_dict()) for path, timestamp in self.all_saved_checkpoints_to_timestamp.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for path, timestamp in state.get("all_saved_checkpoints_to_timestamp", []):
            self.all_saved_checkpoints_to_timestamp[path] = Timestamp.from_state_dict(timestamp)
