"""Profiler: Composer's profiler object, which the Trainer runs as callbacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lockstep.core.callback import Callback
from lockstep.profiler.profiler_action import ProfilerAction
from lockstep.profiler.torch_profiler import TorchProfiler, _in_bucket

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["Profiler"]


class Profiler(Callback):
    """Profile training: ``schedule`` (``State -> ProfilerAction``, e.g. :func:`cyclic_schedule`)
    says for each batch whether to record, and torch.profiler traces of the recorded batches go
    to ``torch_prof_folder`` (see :class:`TorchProfiler` for the ``torch_prof_*`` arguments).

    ``Trainer(profiler=...)`` adds :attr:`callbacks` to its callbacks; without that wiring,
    ``Trainer(callbacks=profiler.callbacks)`` does the same. At INIT the profiler sets
    ``state.profiler`` to itself; at AFTER_LOAD it notes ``resumption_batch_idx``, the batch in the
    epoch where this run starts (not 0 when resuming), which :func:`cyclic_schedule` counts from.

    As in Composer, torch traces are written only when one of ``torch_prof_record_shapes``,
    ``torch_prof_profile_memory``, ``torch_prof_with_stack``, ``torch_prof_with_flops`` is set.
    Composer's own JSON traces (``trace_handlers``, its Markers) are not in lockstep:
    ``trace_handlers`` must be empty. The ``sys_prof_*`` statistics go only to those trace
    handlers in Composer, so with none they record nothing there either; they are accepted and
    checked.
    """

    def __init__(
        self,
        schedule: Callable[[State], ProfilerAction],
        trace_handlers: Sequence[Any] | None = (),
        sys_prof_cpu: bool = True,
        sys_prof_memory: bool = False,
        sys_prof_disk: bool = False,
        sys_prof_net: bool = False,
        sys_prof_stats_thread_interval_seconds: float = 0.5,
        torch_prof_folder: str = "{run_name}/torch_traces",
        torch_prof_filename: str = "rank{rank}.{batch}.pt.trace.json",
        torch_prof_remote_file_name: str | None = "{run_name}/torch_traces/rank{rank}.{batch}.pt.trace.json",
        torch_prof_memory_filename: str | None = None,
        torch_prof_memory_remote_file_name: str | None = (
            "{run_name}/torch_memory_traces/rank{rank}.{batch}.pt.memory_trace.html"),
        torch_prof_overwrite: bool = False,
        torch_prof_use_gzip: bool = False,
        torch_prof_record_shapes: bool = False,
        torch_prof_profile_memory: bool = True,
        torch_prof_with_stack: bool = False,
        torch_prof_with_flops: bool = True,
        torch_prof_num_traces_to_keep: int = -1,
    ) -> None:
        if not callable(schedule):
            raise TypeError(f"Profiler: schedule must be a function of the State, like cyclic_schedule(), "
                            f"got {schedule!r}")
        if trace_handlers:
            raise ValueError("Profiler: trace_handlers (Composer's JSONTraceHandler of its Markers) are not in "
                             "lockstep; pass trace_handlers=[] (torch traces come from the torch_prof_* arguments)")
        _check_system_arguments(sys_prof_cpu, sys_prof_memory, sys_prof_disk, sys_prof_net,
                                sys_prof_stats_thread_interval_seconds)
        torch_flags = (torch_prof_record_shapes, torch_prof_profile_memory, torch_prof_with_stack, torch_prof_with_flops)
        if torch_prof_memory_filename is not None and not all(torch_flags[:3]):
            raise ValueError("Profiler: torch_prof_memory_filename needs torch_prof_with_stack, "
                             "torch_prof_record_shapes and torch_prof_profile_memory all True")
        self.schedule = schedule
        self.state: State | None = None
        self.resumption_batch_idx = 0
        """The batch in its epoch where this run started (set at AFTER_LOAD): 0, or where it resumed."""
        self.remote_filenames = [name for name in (torch_prof_remote_file_name, torch_prof_memory_remote_file_name)
                                 if name is not None]
        """The remote names as given (``s3://bucket/...`` included), for a Trainer that makes uploaders of them."""
        self._callbacks: list[Callback] = []
        if any(torch_flags):
            self._callbacks.append(TorchProfiler(
                folder=torch_prof_folder, filename=torch_prof_filename,
                remote_file_name=_without_bucket(torch_prof_remote_file_name),
                memory_filename=torch_prof_memory_filename,
                memory_remote_file_name=_without_bucket(torch_prof_memory_remote_file_name),
                overwrite=torch_prof_overwrite, use_gzip=torch_prof_use_gzip, record_shapes=torch_prof_record_shapes,
                profile_memory=torch_prof_profile_memory, with_stack=torch_prof_with_stack,
                with_flops=torch_prof_with_flops, num_traces_to_keep=torch_prof_num_traces_to_keep))

    @property
    def callbacks(self) -> list[Callback]:
        """What the Trainer runs: this profiler, then its :class:`TorchProfiler` (if any)."""
        return [self, *self._callbacks]

    @property
    def trace_handlers(self) -> list[Any]:
        """Composer's trace handlers: always empty in lockstep."""
        return []

    def bind_to_state(self, state: State) -> None:
        """Make this the run's profiler (``state.profiler``); done at INIT."""
        if state.profiler is not None and state.profiler is not self:
            raise ValueError("a run has one Profiler: this State already has another")
        self.state, state.profiler = state, self

    def init(self, state: State, logger: Logger) -> None:
        self.bind_to_state(state)

    def after_load(self, state: State, logger: Logger) -> None:
        self.resumption_batch_idx = int(state.timestamp.batch_in_epoch)


def _without_bucket(remote: str | None) -> str | None:
    return None if remote is None else _in_bucket(remote)


def _check_system_arguments(cpu: bool, memory: bool, disk: bool, net: bool, interval: float) -> None:
    for name, value in (("sys_prof_cpu", cpu), ("sys_prof_memory", memory), ("sys_prof_disk", disk),
                        ("sys_prof_net", net)):
        if not isinstance(value, bool):
            raise TypeError(f"Profiler: {name} must be True or False, got {value!r}")
    if not isinstance(interval, (int, float)) or interval <= 0:
        raise ValueError(f"Profiler: sys_prof_stats_thread_interval_seconds must be > 0, got {interval!r}")
