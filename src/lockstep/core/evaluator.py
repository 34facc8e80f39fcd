"""Composer's ``Evaluator``: a labelled evaluation dataloader with the metrics, interval and subset
of batches it is evaluated with."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from lockstep.core.data_spec import DataSpec, ensure_data_spec
from lockstep.time import Time, TimeUnit, time_argument

__all__ = ["Evaluator", "ensure_evaluator", "select_metrics"]

Interval = Time | str | int | Callable[[Any, Any], bool]


class Evaluator:
    """A dataloader to evaluate on, labelled, as Composer's ``composer.core.Evaluator``.

    ``metric_names`` picks among the model's ``get_metrics(is_train=False)`` (each a regular
    expression matched anywhere in a metric's name, ignoring case; None: all of them).
    ``subset_num_batches`` (None: the Trainer's ``eval_subset_num_batches``; -1: every batch) and
    ``eval_interval`` (None: the Trainer's; an int counts epochs; 0 never evaluates during ``fit``;
    or a function ``(state, event) -> bool``) apply to this evaluator alone.
    ``device_eval_microbatch_size`` evaluates each batch in pieces of that many samples.
    Its metrics are in ``state.eval_metrics[label]`` and logged as ``metrics/<label>/<Name>``.
    """

    def __init__(
        self,
        *,
        label: str,
        dataloader: Any,
        metric_names: list[str] | None = None,
        subset_num_batches: int | None = None,
        eval_interval: Interval | None = None,
        device_eval_microbatch_size: int | None = None,
    ) -> None:
        if not isinstance(label, str) or not label or "/" in label:
            raise ValueError(f"Evaluator(label={label!r}): give a non-empty name without '/', such as 'eval'")
        if metric_names is not None and (not isinstance(metric_names, list)
                                         or not all(isinstance(n, str) for n in metric_names)):
            raise ValueError(f"Evaluator(metric_names={metric_names!r}) must be a list of strings (or None for all)")
        if subset_num_batches is not None and (isinstance(subset_num_batches, bool)
                                               or not isinstance(subset_num_batches, int)
                                               or not (subset_num_batches == -1 or subset_num_batches >= 1)):
            raise ValueError(f"Evaluator(subset_num_batches={subset_num_batches!r}) must be -1 (every batch), "
                             f"an integer >= 1, or None (the Trainer's eval_subset_num_batches)")
        if device_eval_microbatch_size is not None and (isinstance(device_eval_microbatch_size, bool) or not
                                                        isinstance(device_eval_microbatch_size, int)
                                                        or device_eval_microbatch_size < 1):
            raise ValueError(f"Evaluator(device_eval_microbatch_size={device_eval_microbatch_size!r}): give an "
                             f"integer >= 1 or None (the whole batch); lockstep has no 'auto' search for evaluation")
        self.label = label
        self.dataloader: DataSpec = ensure_data_spec(dataloader)
        self.metric_names = metric_names
        self.subset_num_batches = subset_num_batches
        self.device_eval_microbatch_size = device_eval_microbatch_size
        self._eval_interval: Time | Callable[[Any, Any], bool] | None = None
        self.eval_interval = eval_interval  # type: ignore[assignment]

    @property
    def eval_interval(self) -> Time | Callable[[Any, Any], bool] | None:
        """When to evaluate during ``fit``: a Time (``Time(0, ...)``: never), a function, or None
        (the Trainer's ``eval_interval``)."""
        return self._eval_interval

    @eval_interval.setter
    def eval_interval(self, value: Interval | None) -> None:
        self._eval_interval = check_interval(value)

    def __repr__(self) -> str:
        return f"Evaluator(label={self.label!r}, metric_names={self.metric_names!r})"


def check_interval(value: Interval | None) -> Time | Callable[[Any, Any], bool] | None:
    """An evaluation interval as the loop reads it: None, a function, or a Time (0: never)."""
    if value is None or callable(value):
        return value
    try:
        zero = Time.from_input(value, TimeUnit.EPOCH).value == 0
    except (TypeError, ValueError):
        zero = False
    if zero:
        return Time.from_input(value, TimeUnit.EPOCH)
    interval = time_argument("eval_interval", value)
    if interval.unit is TimeUnit.DURATION and not 0 < interval.value <= 1:
        raise ValueError(f"eval_interval='{interval}': a 'dur' interval is a fraction of max_duration in (0, 1]")
    return interval


def ensure_evaluator(evaluator: Any, default_metric_names: list[str] | None = None) -> Evaluator:
    """``evaluator`` as an Evaluator: an Evaluator as it is; a dataloader, DataSpec or dict of
    DataSpec's arguments as Composer does, labelled ``'eval'``."""
    if isinstance(evaluator, Evaluator):
        return evaluator
    return Evaluator(label="eval", dataloader=evaluator, metric_names=default_metric_names)


def select_metrics(metrics: dict[str, Any], metric_names: list[str] | None) -> dict[str, Any]:
    """Fresh copies of the ``metrics`` that ``metric_names`` picks (each name a regular expression
    found anywhere in the metric's name, ignoring case, as in Composer); all of them for None."""
    chosen = {name: metric for name, metric in metrics.items()
              if metric_names is None
              or any(re.match(f".*{pattern}.*", name, re.IGNORECASE) for pattern in metric_names)}
    return copy.deepcopy(chosen)
