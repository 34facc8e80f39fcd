"""Callbacks: code that runs at named points of the training loop.

The base class and the events are :class:`lockstep.core.Callback` and :class:`lockstep.core.Event`
(whose docstring shows where each event fires); this package holds the built-in callbacks.
"""

from lockstep.callbacks.activation_monitor import ActivationMonitor
from lockstep.callbacks.checkpoint_saver import CheckpointSaver
from lockstep.callbacks.early_stopper import EarlyStopper
from lockstep.callbacks.export_for_inference import ExportForInferenceCallback
from lockstep.callbacks.free_outputs import FreeOutputs
from lockstep.callbacks.generate import Generate
from lockstep.callbacks.load_checkpoint import LoadCheckpoint
from lockstep.callbacks.memory_snapshot import MemorySnapshot
from lockstep.callbacks.monitors import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
from lockstep.callbacks.nan_monitor import NaNMonitor
from lockstep.callbacks.oom_observer import OOMObserver
from lockstep.callbacks.optimizer_monitor import OptimizerMonitor
from lockstep.callbacks.system_metrics_monitor import SystemMetricsMonitor
from lockstep.callbacks.threshold_stopper import ThresholdStopper
from lockstep.core.callback import Callback
from lockstep.core.event import Event

__all__ = ["ActivationMonitor", "Callback", "CheckpointSaver", "EarlyStopper", "Event", "ExportForInferenceCallback",
           "FreeOutputs", "Generate", "LRMonitor",
           "LoadCheckpoint", "MemoryMonitor", "MemorySnapshot",
           "NaNMonitor", "OOMObserver", "OptimizerMonitor", "RuntimeEstimator", "SpeedMonitor",
           "SystemMetricsMonitor", "ThresholdStopper"]
