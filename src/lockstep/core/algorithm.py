"""Algorithm: a change to the training step, passed as ``Trainer(algorithms=[...])``.

As in Composer, an algorithm says at which events it acts (:meth:`Algorithm.match`) and acts
there (:meth:`Algorithm.apply`); the Trainer runs matching algorithms before the callbacks of the
same event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.core.event import Event
    from lockstep.state import State


class Algorithm:
    """Base class: an algorithm that never matches does nothing."""

    def match(self, event: Event, state: State) -> bool:
        """Whether :meth:`apply` runs at ``event``."""
        return False

    def apply(self, event: Event, state: State, logger: Any = None) -> None:
        """Change the training step at ``event``."""
