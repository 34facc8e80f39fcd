"""ProfilerAction: what the profiler does during a batch (Composer's names and values)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ProfilerAction"]


class ProfilerAction(StrEnum):
    """What a :class:`~lockstep.profiler.Profiler` schedule asks for during one batch.

    ``SKIP``: record nothing. ``WARMUP``: run the profiler without keeping what it sees (torch's
    profiler warms up before its first recorded step). ``ACTIVE``: record. ``ACTIVE_AND_SAVE``:
    record, and write the trace at the end of the batch.
    """

    SKIP = "skip"
    WARMUP = "warmup"
    ACTIVE = "active"
    ACTIVE_AND_SAVE = "active_and_save"

    @classmethod
    def _missing_(cls, value: object) -> ProfilerAction | None:
        # Composer's StringEnum also takes the member's name in any case: ProfilerAction('SKIP')
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None
