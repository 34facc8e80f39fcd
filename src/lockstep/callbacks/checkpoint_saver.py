"""Composer's ``CheckpointSaver`` callback: the Trainer's own checkpoint saving, asked for as a
callback instead of with ``save_*`` arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep.checkpoint.config import CheckpointConfig, SaveInterval
from lockstep.core.callback import Callback

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
        self.filename = str(filename)
        self.latest_filename = None if latest_filename is None else str(latest_filename)
        self.remote_file_name = None if remote_file_name is None else str(remote_file_name)
        self.latest_remote_file_name = None if latest_remote_file_name is None else str(latest_remote_file_name)
        self.save_interval = save_interval
        self.overwrite = overwrite
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = weights_only
        self.ignore_keys = ignore_keys
        self.num_concurrent_uploads = num_concurrent_uploads
        self.upload_timeout_in_seconds = upload_timeout_in_seconds
        CheckpointConfig(**self.trainer_arguments())  # bad names or counts: an error here, not at the Trainer
        self.saved_checkpoints: list[str] = []
        """The checkpoints this rank wrote, oldest first (the Trainer's ``saved_checkpoints``)."""

    def trainer_arguments(self) -> dict[str, Any]:
        """The Trainer's ``save_*`` arguments that say what this callback says."""
        return {"save_folder": self.folder, "save_filename": self.filename,
                "save_latest_filename": self.latest_filename, "save_interval": self.save_interval,
                "save_overwrite": self.overwrite, "save_num_checkpoints_to_keep": self.num_checkpoints_to_keep,
                "save_weights_only": self.weights_only, "save_ignore_keys": self.ignore_keys}
