"""MemorySnapshot: record the CUDA allocator's history over a few batches and write it out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep.callbacks._cuda_traces import file_prefix, log, on_cuda, trace_folder, upload, write_snapshot
from lockstep.core.callback import Callback
from lockstep.time import Time, TimeUnit

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["MemorySnapshot"]


class MemorySnapshot(Callback):
    """On a GPU: after ``skip_batches`` batches, record every CUDA allocation and free (at most
    ``max_entries``) for ``interval``, then write ``<folder>/<filename>.pickle`` (the allocator
    snapshot, for https://pytorch.org/memory_viz) and ``.html`` (its trace plot), once per run.
    ``folder`` and ``filename`` take ``{run_name}``, ``{rank}``, ... and ``filename`` also
    ``{epoch}``, ``{batch}``, ...; unless ``overwrite``, the folder must be empty. With a file
    uploader among the loggers, the files go to ``remote_file_name`` too.

    Without a GPU it warns at INIT and does nothing. CI has no GPU: ``scripts/gpu_check.py`` checks it on one.
    """

    def __init__(self, skip_batches: int = 1, interval: int | str | Time = "3ba", max_entries: int = 100000,
                 folder: str = "{run_name}/torch_traces", filename: str = "rank{rank}.{batch}.memory_snapshot",
                 remote_file_name: str | None = "{run_name}/torch_memory_traces", overwrite: bool = False) -> None:
        self.batches_left_to_skip = skip_batches
        self.interval = Time.from_input(interval, TimeUnit.BATCH)
        self.max_entries = max_entries
        self.folder, self.filename = folder, filename
        self.remote_file_name, self.overwrite = remote_file_name, overwrite
        self.folder_name: Path | None = None
        self._start: int | None = None
        self._enabled = True

    def init(self, state: State, logger: Logger) -> None:
        self._enabled = on_cuda(state, "MemorySnapshot")
        if self._enabled:
            self.folder_name = trace_folder(self.folder, state, self.overwrite, "MemorySnapshot")

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._enabled and self._start is None and self.batches_left_to_skip == 0:
            torch.cuda.memory._record_memory_history("all", max_entries=self.max_entries)
            self._start = int(state.timestamp.get(self.interval.unit))

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self._enabled:
            return
        if self.batches_left_to_skip > 0:
            self.batches_left_to_skip -= 1
            return
        now = int(state.timestamp.get(self.interval.unit))
        if self._start is not None and now >= self._start + self.interval.value:
            self._export(state, logger)
            torch.cuda.memory._record_memory_history(None)
            self._start, self._enabled = None, False

    def _export(self, state: State, logger: Logger) -> None:
        assert self.folder_name is not None
        prefix = file_prefix(self.folder_name, self.filename, state)
        try:
            snapshot = torch.cuda.memory._snapshot()
            if all(len(trace) == 0 for trace in snapshot["device_traces"]):
                log.info("MemorySnapshot: no allocation was recorded")
                return
            from torch.cuda import _memory_viz

            paths = write_snapshot(snapshot, {prefix + ".pickle": None, prefix + ".html": _memory_viz.trace_plot})
            log.info("MemorySnapshot written to %s.pickle and .html", prefix)
            upload(logger, self.remote_file_name, state, paths, self.overwrite)
        except (OSError, RuntimeError) as e:  # a failed snapshot must not stop training
            log.error("MemorySnapshot failed: %s", e)
