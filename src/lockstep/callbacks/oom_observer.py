"""OOMObserver: write the CUDA allocator's state when a GPU runs out of memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep.callbacks._cuda_traces import (file_prefix, flamegraph_script, log, on_cuda, trace_folder, upload,
                                             write_snapshot)
from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["OOMObserver"]

# file suffix -> the torch.cuda._memory_viz function that renders it (None: the pickled snapshot)
_FILES = {"_snapshot.pickle": None, "_trace_plot.html": "trace_plot", "_segment_plot.html": "segment_plot",
          "_segment_flamegraph.svg": "segments", "_memory_flamegraph.svg": "memory"}
# rendered by Brendan Gregg's flamegraph.pl, which torch would otherwise download from GitHub
_FLAMEGRAPHS = {"_segment_flamegraph.svg", "_memory_flamegraph.svg"}


class OOMObserver(Callback):
    """On a GPU: records the allocator's history from INIT on (at most ``max_entries`` events) and,
    when an allocation is about to fail with out-of-memory, writes ``<folder>/<filename>`` +
    ``_snapshot.pickle``, ``_trace_plot.html``, ``_segment_plot.html``, and where
    ``~/.cache/flamegraph.pl`` is present (it is never downloaded), ``_segment_flamegraph.svg`` and
    ``_memory_flamegraph.svg``. ``folder`` and ``filename`` take ``{run_name}``, ``{rank}``, ...;
    unless ``overwrite``, the folder must be empty. With a file uploader among the loggers, the
    files go to ``remote_file_name`` too.

    Without a GPU it warns at INIT and does nothing. CI has no GPU: ``scripts/gpu_check.py`` checks it on one.
    """

    def __init__(self, max_entries: int = 100000, folder: str = "{run_name}/torch_traces",
                 filename: str = "rank{rank}_oom",
                 remote_file_name: str | None = "{run_name}/oom_traces/rank{rank}_oom", overwrite: bool = False) -> None:
        self.max_entries = max_entries
        self.folder, self.filename = folder, filename
        self.remote_file_name, self.overwrite = remote_file_name, overwrite
        self.folder_name: Path | None = None
        self._enabled = True

    def init(self, state: State, logger: Logger) -> None:
        self._enabled = on_cuda(state, "OOMObserver")
        if not self._enabled:
            return
        self.folder_name = trace_folder(self.folder, state, self.overwrite, "OOMObserver")
        torch.cuda.memory._record_memory_history("all", max_entries=self.max_entries)
        torch._C._cuda_attach_out_of_memory_observer(  # type: ignore[attr-defined]
            lambda device, alloc, device_alloc, device_free: self._dump(state, logger))
        log.info("OOMObserver is recording CUDA allocations")

    def _dump(self, state: State, logger: Logger) -> None:
        """Runs inside the allocator, before the out-of-memory error unwinds and frees anything."""
        log.warning("OOMObserver: out of memory; writing the allocator's state")
        assert self.folder_name is not None
        prefix = file_prefix(self.folder_name, self.filename, state)
        try:
            snapshot = torch.cuda.memory._snapshot()
            if all(len(trace) == 0 for trace in snapshot["device_traces"]):
                log.info("OOMObserver: no allocation was recorded")
                return
            from torch.cuda import _memory_viz

            # Never download during an out-of-memory error: a compute node is often offline, and
            # a blocked connection would hold the failing step for minutes.
            drawn = flamegraph_script().exists()
            if not drawn:
                log.info("OOMObserver: no flame graphs (put flamegraph.pl at %s to get them)", flamegraph_script())
            files = {prefix + suffix: None if name is None else getattr(_memory_viz, name)
                     for suffix, name in _FILES.items() if drawn or suffix not in _FLAMEGRAPHS}
            paths = write_snapshot(snapshot, files)
            log.info("OOMObserver wrote %s_*", prefix)
            upload(logger, self.remote_file_name, state, paths, self.overwrite)
        except Exception as e:  # noqa: BLE001 - the out-of-memory error is the one to report
            log.error("OOMObserver failed to write the snapshot: %s", e)
