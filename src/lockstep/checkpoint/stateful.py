"""The parts of a run that keep state of their own, beside the model and optimizers: the
callbacks, the algorithms and the train dataset (Composer's ``state['callbacks']``,
``state['algorithms']`` and ``state['dataset_state']``).

A checkpoint holds each callback's ``state_dict()`` under its class name, each algorithm's as a
``(class name, state)`` pair in order, and the train dataset's ``state_dict(num_samples,
from_beginning=True)`` where it has one (mosaicml-streaming's ``StreamingDataset``); a resumed run
hands them back to ``load_state_dict``. Checkpoints load with ``weights_only=True``, so what a
part returns is kept as tensors, numbers, strings, lists and dicts: enum members become their
values, time spans seconds, and a part whose state holds anything else is left out of the checkpoint with a warning
naming it, rather than making the checkpoint unloadable.
"""

from __future__ import annotations

import datetime
import enum
import warnings
from typing import TYPE_CHECKING, Any

import torch

from lockstep.batch import ensure_tuple

if TYPE_CHECKING:
    from lockstep.state import State

_warned: set[str] = set()


class _NotPlain(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def plain(value: Any) -> Any:
    """``value`` with what ``torch.load(weights_only=True)`` reads back; _NotPlain names what it cannot."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, datetime.timedelta):  # a Timestamp's clocks (Timestamp.from_state_dict reads seconds)
        return value.total_seconds()
    if isinstance(value, (str, int, float)):  # a subclass (a StrEnum not caught above, a numpy scalar)
        return type(value).__mro__[-2](value) if not isinstance(value, bool) else bool(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    raise _NotPlain(type(value).__name__)


def _kept(owner: str, state: Any) -> Any:
    try:
        return plain(state)
    except _NotPlain as e:
        if owner not in _warned:
            _warned.add(owner)
            warnings.warn(f"{owner}'s state_dict() holds a {e.kind}, which a checkpoint loaded with weights_only=True "
                          f"cannot hold: it is not saved (return tensors, numbers, strings, lists and dicts)",
                          stacklevel=4)
        return None


def save(state: State) -> dict[str, Any]:
    """``{'callbacks': ..., 'algorithms': ..., 'dataset_state': ...}`` of ``state``, for ``state`` in a checkpoint."""
    from lockstep.core.state_dict import dataset_state_of

    callbacks = {}
    for callback in state.callbacks:
        name = type(callback).__qualname__
        kept = _kept(f"callback {name}", callback.state_dict()) if hasattr(callback, "state_dict") else {}
        if kept is not None:
            callbacks[name] = kept
    algorithms = []
    for algorithm in state.algorithms:
        name = type(algorithm).__qualname__
        kept = _kept(f"algorithm {name}", algorithm.state_dict()) if hasattr(algorithm, "state_dict") else {}
        if kept is not None:
            algorithms.append([name, kept])
    return {"callbacks": callbacks, "algorithms": algorithms,
            "dataset_state": _kept("the train dataset", dataset_state_of(state))}


def load(state: State, saved: dict[str, Any]) -> None:
    """Hand each part its saved state (what ``save`` wrote, or a Composer checkpoint's). A part the
    checkpoint has no state for keeps its own: an older checkpoint, or a callback added since."""
    from lockstep.core.state_dict import load_dataset_state

    callbacks = saved.get("callbacks")
    if isinstance(callbacks, dict):
        for callback in state.callbacks:
            entry = callbacks.get(type(callback).__qualname__)
            if entry is not None and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(entry)
    algorithms = saved.get("algorithms")
    if isinstance(algorithms, (list, tuple)):
        by_name = {name: entry for name, entry in algorithms}
        for algorithm in ensure_tuple(state.algorithms):
            entry = by_name.get(type(algorithm).__qualname__)
            if entry is not None and hasattr(algorithm, "load_state_dict"):
                algorithm.load_state_dict(entry)
    if saved.get("dataset_state") is not None:
        load_dataset_state(state, saved["dataset_state"])
