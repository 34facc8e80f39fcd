"""TensorBoard event files, written on a background thread."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lockstep.loggers.background import ThreadedDestination
from lockstep.loggers.logger_destination import as_number, require

if TYPE_CHECKING:
    from lockstep.state import State


class TensorboardLogger(ThreadedDestination):
    """Scalars to TensorBoard event files under ``log_dir`` (default: ``tensorboard/`` in the run
    folder, or ``tensorboard_logs/<run_name>`` without one). View them with
    ``tensorboard --logdir <log_dir>``. Needs ``pip install 'torch-lockstep[tensorboard]'``.

    ``flush_interval``: batches between flushes of the event file to disk.
    """

    def __init__(self, log_dir: str | None = None, flush_interval: int = 100, rank_zero_only: bool = True) -> None:
        require("tensorboard", "tensorboard", "TensorboardLogger")
        self.log_dir = log_dir
        self.flush_interval = flush_interval
        self.rank_zero_only = rank_zero_only
        self._writer: Any = None

    def init(self, state: State, logger: Any = None) -> None:
        from lockstep import dist

        if self.rank_zero_only and dist.get_global_rank() != 0:
            return
        if self.log_dir is None:
            folder = state.run_folder
            self.log_dir = (os.path.join(folder, "tensorboard") if folder
                            else os.path.join("tensorboard_logs", state.run_name))
        if not self.rank_zero_only:
            self.log_dir = os.path.join(self.log_dir, f"rank{dist.get_global_rank()}")
        self._start("lockstep-tensorboard")
        self._submit(self._open)

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=self.log_dir, max_queue=1000, flush_secs=30)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._submit(self._write, dict(metrics), step)

    def _write(self, metrics: dict[str, Any], step: int | None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # one event for all of a call's scalars: an event each costs ten times the CPU, on a core
        # that training needs
        summary = Summary(value=[Summary.Value(tag=name, simple_value=as_number(value))
                                 for name, value in metrics.items()])
        self._writer._get_file_writer().add_summary(summary, global_step=step)
        if step is not None and step % self.flush_interval == 0:
            self._writer.flush()

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        text = "\n".join(f"- {k}: {v}" for k, v in sorted(hyperparameters.items()))
        self._submit(lambda: self._writer.add_text("hyperparameters", text))

    def _flush_work(self) -> None:
        self._writer.flush()

    def _close_work(self) -> None:
        self._writer.close()
