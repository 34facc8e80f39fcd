"""Composer's ``composer.core.time`` path: the same objects as :mod:`lockstep.time`."""

from lockstep.time import Time, Timestamp, TimeUnit, ensure_time

__all__ = ["Time", "TimeUnit", "Timestamp", "ensure_time"]
