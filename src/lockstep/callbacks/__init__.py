"""Callbacks: code that runs at named points of the training loop.

The base class and the events are :class:`lockstep.core.Callback` and :class:`lockstep.core.Event`
(whose docstring shows where each event fires); this package holds the built-in callbacks.
"""

from lockstep.callbacks.monitors import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
from lockstep.core.callback import Callback
from lockstep.core.event import Event

__all__ = ["Callback", "Event", "LRMonitor", "MemoryMonitor", "RuntimeEstimator", "SpeedMonitor"]
