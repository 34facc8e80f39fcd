"""Profiling, with Composer's names: ``Profiler(schedule=cyclic_schedule(...))`` writes torch.profiler
traces (Chrome JSON) of the batches the schedule makes active.

``Trainer(profiler=Profiler(...))`` runs the profiler's :attr:`Profiler.callbacks`; where they act in
the loop: FIT_START starts torch's profiler, each BATCH_END steps it (the schedule is asked for the
next batch, and a finished window's trace is written), FIT_END and ``close()`` stop it (writing a
window still recording).

Composer's JSON traces of its own Markers (``JSONTraceHandler``, ``Marker``, ``TraceHandler``,
``SystemProfiler``) are not here.
"""

from lockstep.profiler.profiler import Profiler
from lockstep.profiler.profiler_action import ProfilerAction
from lockstep.profiler.profiler_schedule import cyclic_schedule
from lockstep.profiler.torch_profiler import TorchProfiler

__all__ = ["Profiler", "ProfilerAction", "TorchProfiler", "cyclic_schedule"]
