"""TorchProfiler: torch.profiler traces (Chrome JSON) of the batches a Profiler's schedule makes active."""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.profiler
from torch.profiler import ProfilerAction as TorchAction

from lockstep import _agreement, dist
from lockstep.checkpoint.templates import check_template, format_name, place_values
from lockstep.core.callback import Callback
from lockstep.profiler.profiler_action import ProfilerAction
from lockstep.time import Timestamp

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["TorchProfiler"]

log = logging.getLogger("lockstep")

_TORCH_ACTIONS = {ProfilerAction.SKIP: TorchAction.NONE, ProfilerAction.WARMUP: TorchAction.WARMUP,
                  ProfilerAction.ACTIVE: TorchAction.RECORD, ProfilerAction.ACTIVE_AND_SAVE: TorchAction.RECORD_AND_SAVE}
_RECORDING = (TorchAction.RECORD, TorchAction.RECORD_AND_SAVE)


class TorchProfiler(Callback):
    """Runs :class:`torch.profiler.profile` during ``fit`` under the schedule of ``state.profiler``
    (a :class:`~lockstep.profiler.Profiler`, which makes this callback; Composer's arguments).

    At the end of each ``ACTIVE_AND_SAVE`` batch (and at FIT_END inside an active window) this rank
    writes the window's trace to ``<folder>/<filename>``: Chrome trace JSON (``chrome://tracing``,
    https://ui.perfetto.dev), gzipped with ``use_gzip`` (``.gz`` is appended). ``folder`` takes
    ``{run_name}``, ``{rank}``, ...; ``filename`` also ``{epoch}``, ``{batch}``, ``{sample}``,
    ``{token}``, counted after the batch. A relative ``folder`` lies in the run folder
    (``state.run_folder``) when the run has one, else in the working directory. Unless ``overwrite``,
    the folder must be empty when training starts and no trace replaces a file. With a file uploader
    among the loggers each file also goes to ``remote_file_name`` (None: not uploaded).
    ``memory_filename`` (``.html``) adds torch's memory timeline of the window (needs
    ``record_shapes``, ``profile_memory`` and ``with_stack``). ``num_traces_to_keep`` >= 0 deletes
    this rank's oldest windows' files beyond that many, after their upload (-1 keeps all).

    Attributes:
        saved_traces: ``(timestamp, [files])`` of each window this rank wrote and still keeps, oldest first.
    """

    def __init__(self, folder: str = "{run_name}/torch_traces", filename: str = "rank{rank}.{batch}.pt.trace.json",
                 remote_file_name: str | None = "{run_name}/torch_traces/rank{rank}.{batch}.pt.trace.json",
                 memory_filename: str | None = None,
                 memory_remote_file_name: str | None = "{run_name}/torch_memory_traces/rank{rank}.{batch}.pt.trace.memory.html",
                 overwrite: bool = False, use_gzip: bool = False, record_shapes: bool = False,
                 profile_memory: bool = True, with_stack: bool = False, with_flops: bool = True,
                 num_traces_to_keep: int = -1) -> None:
        self.folder = check_template(folder, "torch_prof_folder", time_fields=False)
        self.filename = _gz(check_template(filename, "torch_prof_filename"), use_gzip)
        remote_file_name = _checked_optional(remote_file_name, "torch_prof_remote_file_name")
        self.remote_file_name = None if remote_file_name is None else _gz(remote_file_name, use_gzip)
        self.memory_filename = _html(_checked_optional(memory_filename, "torch_prof_memory_filename"))
        if self.memory_filename is not None and importlib.util.find_spec("matplotlib") is None:
            # torch draws the timeline with matplotlib, and without it only prints that it wrote nothing
            raise ImportError("torch_prof_memory_filename needs the 'matplotlib' package: pip install "
                              "'torch-lockstep[profiler]'")
        self.memory_remote_file_name = _html(_checked_optional(memory_remote_file_name,
                                                               "torch_prof_memory_remote_file_name"))
        if not isinstance(num_traces_to_keep, int) or num_traces_to_keep < -1:
            raise ValueError(f"torch_prof_num_traces_to_keep must be -1 (keep all) or >= 0, got {num_traces_to_keep!r}")
        self.overwrite, self.num_traces_to_keep = overwrite, num_traces_to_keep
        self.record_shapes, self.profile_memory = record_shapes, profile_memory
        self.with_stack, self.with_flops = with_stack, with_flops
        self.saved_traces: list[tuple[Timestamp, list[Path]]] = []
        self.profiler: torch.profiler.profile | None = None
        self._folder: Path | None = None
        self._error: Exception | None = None
        self._recorded_batches = 0
        """Batches recorded in the current window."""
        self._discard = False

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.profiler is None:
            raise RuntimeError("TorchProfiler runs under a Profiler: pass Trainer(profiler=Profiler(schedule=...))")
        if self._folder is None:
            self._folder = _trace_folder(self.folder, self.filename, state, self.overwrite)
        schedule, self._recorded_batches = state.profiler.schedule, 0
        self.profiler = torch.profiler.profile(
            schedule=lambda step: _TORCH_ACTIONS[ProfilerAction(schedule(state))],
            on_trace_ready=lambda prof: self._on_trace_ready(prof, state, logger),
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack,
            with_flops=self.with_flops)
        self.profiler.preset_metadata_json("global_rank", json.dumps(dist.get_global_rank()))
        self.profiler.__enter__()

    def batch_start(self, state: State, logger: Logger) -> None:
        if self.profiler is not None and self.profiler.current_action in _RECORDING:
            self._recorded_batches += 1

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.profiler is not None:
            with warnings.catch_warnings():  # one window per file is the point: not news
                warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
                self.profiler.step()  # the schedule now sees the next batch's timestamp
            self._raise_error()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._stop()

    def close(self, state: State, logger: Logger) -> None:
        self._stop()

    def _stop(self) -> None:
        """Stop profiling; a window still recording is written (as Composer does at close)."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            # a window that opened after the run's last batch holds no batch: not worth a file
            self._discard = self._recorded_batches == 0
            profiler.__exit__(None, None, None)
            self._discard = False
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _on_trace_ready(self, prof: torch.profiler.profile, state: State, logger: Logger) -> None:
        # An error raised inside torch's step() would leave its profiler half-switched: keep it
        # for batch_end / fit_end to raise.
        if self._discard:
            return
        self._recorded_batches = 0
        try:
            self._save(prof, state, logger)
        except Exception as e:  # noqa: BLE001 - re-raised by _raise_error right after torch returns
            self._error = e

    def _save(self, prof: torch.profiler.profile, state: State, logger: Logger) -> None:
        assert self._folder is not None
        place, timestamp = place_values(state.run_name), state.timestamp.copy()
        files = [self._write(self.filename, place, timestamp, prof.export_chrome_trace)]
        if self.memory_filename is not None:
            def export(path: str) -> None:
                prof.export_memory_timeline(path, device=str(state.device.torch_device))
            files.append(self._write(self.memory_filename, place, timestamp, export))
        for path, remote in zip(files, (self.remote_file_name, self.memory_remote_file_name)):
            if remote is not None:
                logger.upload_file(remote_file_name=_in_bucket(format_name(remote, place, timestamp)),
                                   file_path=str(path), overwrite=self.overwrite)
        self.saved_traces.append((timestamp, files))
        while self.num_traces_to_keep >= 0 and len(self.saved_traces) > self.num_traces_to_keep:
            for path in self.saved_traces.pop(0)[1]:
                path.unlink(missing_ok=True)

    def _write(self, template: str, place: dict[str, Any], timestamp: Timestamp, export: Any) -> Path:
        assert self._folder is not None
        path = self._folder / format_name(template, place, timestamp)
        if path.exists() and not self.overwrite:
            raise FileExistsError(f"Profiler: trace file {path} exists; pass torch_prof_overwrite=True or "
                                  f"another torch_prof_folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        export(str(path))
        log.info("Profiler: wrote %s", path)
        return path


def _trace_folder(template: str, filename: str, state: State, overwrite: bool) -> Path:
    """Make the trace folder (relative: in the run folder, if any); unless ``overwrite`` it must be
    empty on every rank, which all ranks agree on before any writes."""
    if dist.get_world_size() > 1 and "{rank}" not in template + filename:
        raise ValueError(f"torch_prof_filename={filename!r} needs {{rank}} (or torch_prof_folder does): "
                         f"with {dist.get_world_size()} ranks they would write the same files")
    folder = Path(format_name(template, place_values(state.run_name)))
    if not folder.is_absolute() and state.run_folder is not None:
        folder = Path(state.run_folder) / folder
    error = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        found = None if overwrite else next(iter(sorted(folder.iterdir())), None)
        if found is not None:
            error = (f"Profiler: {found} exists in the trace folder; pass torch_prof_overwrite=True or "
                     f"another torch_prof_folder")
    except OSError as e:
        error = f"Profiler: cannot use trace folder {folder}: {e}"
    _agreement.raise_first_error(error, FileExistsError, device=state.device.torch_device)
    return folder


def _checked_optional(template: str | None, name: str) -> str | None:
    return None if template is None else check_template(template, name)


def _gz(name: str, use_gzip: bool) -> str:
    return name + ".gz" if use_gzip and not name.endswith(".gz") else name


def _html(name: str | None) -> str | None:
    if name is not None and not name.endswith(".html"):
        raise ValueError(f"a torch memory timeline file name must end with .html, got {name!r}")
    return name


def _in_bucket(remote: str) -> str:
    """``s3://bucket/path`` -> ``path`` (the uploader names the bucket); leading slashes dropped."""
    if "://" in remote:
        remote = remote.split("://", 1)[1].partition("/")[2]
    return remote.lstrip("/")
