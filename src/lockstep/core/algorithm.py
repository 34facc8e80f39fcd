"""Algorithm: a change to the training step, passed as ``Trainer(algorithms=[...])``.

As in Composer, an algorithm says at which events it acts (:meth:`Algorithm.match`) and acts
there (:meth:`Algorithm.apply`); the Trainer runs matching algorithms before the callbacks of the
same event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.core.event import Event
    from lockstep.core.state import State


class Algorithm:
    """Base class: an algorithm that never matches does nothing."""

    @property
    def find_unused_parameters(self) -> bool:
        """Whether DDP must look for parameters without gradients (an algorithm that freezes some)."""
        return False

    @property
    def backwards_create_graph(self) -> bool:
        """Whether backward must keep the graph (an algorithm that differentiates twice)."""
        return False

    @staticmethod
    def required_on_load() -> bool:
        """Whether a checkpoint written with this algorithm needs it to load."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Saved under ``state['algorithms']`` as ``(class name, this)``; Composer's default is the repr."""
        return {"repr": repr(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (nothing, by default)."""

    def match(self, event: Event, state: State) -> bool:
        """Whether :meth:`apply` runs at ``event``."""
        return False

    def apply(self, event: Event, state: State, logger: Any = None) -> None:
        """Change the training step at ``event``."""
