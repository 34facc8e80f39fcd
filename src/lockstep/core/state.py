"""Composer's ``composer.core.state`` path: :class:`~lockstep.state.State`."""

from lockstep.state import State

__all__ = ["State"]
