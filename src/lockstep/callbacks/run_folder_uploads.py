"""RunFolderUploads: hands the run folder's files (metrics.jsonl, loss_curve.png, TensorBoard
event files) to ``logger.upload_file``, so that a destination that stores files
(:class:`lockstep.loggers.RemoteUploaderDownloader`) puts them in its bucket."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lockstep import dist
from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

FILES = ("metrics.jsonl", "loss_curve.png")
FOLDERS = ("tensorboard",)


class RunFolderUploads(Callback):
    """Rank 0, at the end of ``fit`` and at ``close``: ``{run_name}/<path in the run folder>`` for
    each of the run folder's metrics, loss curve and TensorBoard files. The Trainer puts it after
    the logger destinations, so that at ``close`` those have written their files out first."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def _hand_over(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0 or not self.folder.is_dir():
            return
        found = [self.folder / name for name in FILES]
        found += [p for sub in FOLDERS for p in sorted((self.folder / sub).rglob("*"))]
        for path in found:
            if path.is_file():
                logger.upload_file(f"{{run_name}}/{path.relative_to(self.folder).as_posix()}", path, overwrite=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._hand_over(state, logger)

    def close(self, state: State, logger: Logger) -> None:
        self._hand_over(state, logger)
