"""Composer's ``LoadCheckpoint`` callback: load a checkpoint at an event."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from lockstep.checkpoint import ignore, loader
from lockstep.core.callback import Callback
from lockstep.core.event import Event

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["LoadCheckpoint"]

log = logging.getLogger(__name__)

_AT_START = (Event.BEFORE_LOAD, Event.AFTER_LOAD)


class LoadCheckpoint(Callback):
    """Load ``load_path`` into the run at ``event`` (default ``BEFORE_LOAD``, while the Trainer is
    built), on every rank, as Composer's ``LoadCheckpoint``.

    ``load_weights_only`` takes only the model's weights (at any event, e.g. ``'fit_start'``);
    otherwise the whole training state (optimizers, schedulers, timestamp, RNG and data position)
    is loaded, which only works at ``BEFORE_LOAD`` or ``AFTER_LOAD``, before training starts.
    ``strict_model_weights`` and ``ignore_keys`` mean what the Trainer's
    ``load_strict_model_weights`` and ``load_ignore_keys`` do.
    """

    def __init__(self, load_path: str, load_weights_only: bool = False, strict_model_weights: bool = True,
                 ignore_keys: Any = None, event: str | Event = Event.BEFORE_LOAD) -> None:
        if not isinstance(load_path, str) or not load_path:
            raise ValueError(f"LoadCheckpoint(load_path={load_path!r}): give the checkpoint's path")
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", load_path):  # s3://, gs://, azure://, https://, ...
            raise ValueError(f"LoadCheckpoint(load_path={load_path!r}): lockstep loads checkpoints from local paths; "
                             f"download it and give its local path")
        try:
            self.event = event if isinstance(event, Event) else Event[str(event).upper()]
        except KeyError:
            raise ValueError(f"LoadCheckpoint(event={event!r}) is not an event: use one of Event's names, "
                             f"such as 'before_load' or 'fit_start'") from None
        if not load_weights_only and self.event not in _AT_START:
            raise ValueError(f"LoadCheckpoint(event={self.event.name}) with load_weights_only=False: the whole "
                             f"training state loads only before training, at BEFORE_LOAD or AFTER_LOAD; set "
                             f"load_weights_only=True to load weights at {self.event.name}")
        self.load_path = load_path
        self.load_weights_only = load_weights_only
        self.strict_model_weights = strict_model_weights
        self.ignore_keys = ignore.check(ignore_keys)
        self.loaded: loader.Loaded | None = None
        """What the load gave (None before it ran, or when nothing was loaded)."""
        self._layout: Layout | None = None

    def bind(self, layout: Layout) -> None:
        """The Trainer's checkpoint layout (how its backend's state goes into a checkpoint)."""
        self._layout = layout

    def _listens_to(self, event: Event) -> bool:
        return event is self.event

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event is not self.event:
            return
        if self._layout is None:  # driven by an Engine of the user's, not a Trainer: the State's model as it is
            from lockstep.checkpoint.states import ReplicatedLayout
            self._layout = ReplicatedLayout(state.model, list(state.optimizers))
        log.info("loading checkpoint %s at %s", self.load_path, self.event.name)
        self.loaded = loader.load(self.load_path, state, self._layout, run_name=state.run_name,
                                  weights_only=self.load_weights_only, strict=self.strict_model_weights,
                                  ignore=self.ignore_keys, what="LoadCheckpoint(load_path)")
