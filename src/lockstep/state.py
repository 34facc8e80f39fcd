"""The run's :class:`~lockstep.core.state.State`, also at ``lockstep.state``."""

from lockstep.core.state import State

__all__ = ["State"]
