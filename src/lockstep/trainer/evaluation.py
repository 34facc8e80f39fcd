"""Evaluation during and outside ``fit``: when ``eval_interval`` asks for it, and the loop over
``eval_dataloader`` whose metrics equal one process's over the whole dataset."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from lockstep import dist, progress
from lockstep.batch import take
from lockstep.callbacks.loggers import eval_metric_names
from lockstep.core.event import Event
from lockstep.loggers.logger import Logger
from lockstep.parallel.strategy import Strategy
from lockstep.state import State
from lockstep.time import Time, Timestamp, is_interval_due
from lockstep.trainer import data


def is_due(interval: Time | Callable[[State, Event], bool], state: State, before: Timestamp, event: Event) -> bool:
    """Whether ``interval`` asks for an evaluation at ``event`` (BATCH_END or EPOCH_END), ``before``
    being the timestamp before the batch or the epoch end that just passed."""
    if callable(interval):  # Composer's form: asked at BATCH_END, and at EPOCH_END
        return bool(interval(state, event))
    return is_interval_due(before, state.timestamp, interval, state.max_duration)


@torch.no_grad()
def evaluate(state: State, strategy: Strategy, dataloader: Any, metrics: dict[str, Any], limit: int | None,
             run_event: Callable[[Event], None], logger: Logger) -> dict[str, float]:
    """Evaluate on this rank's batches of ``dataloader`` (at most ``limit``) and reduce over the
    ranks; the results (``loss`` and each metric) go to ``state.eval_metrics`` and the logger.

    Samples a DistributedSampler repeats to pad the ranks' shares are left out."""
    was_training, training_batch = state.model.training, state.batch
    state.model.eval()
    run_event(Event.EVAL_START)
    for metric in metrics.values():
        metric.reset()
    totals = torch.zeros(2, dtype=torch.float64, device=state.device)  # loss sum, samples
    for batch, n in _real_batches(state, strategy, dataloader, limit):
        _evaluate_batch(state, strategy, batch, n, metrics, totals, run_event)
    dist.all_reduce(totals, "SUM")
    results = {"loss": float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")}
    results.update({name: float(m.compute()) for name, m in metrics.items()})
    state.eval_metrics = results
    logger.log_metrics(eval_metric_names(results))
    run_event(Event.EVAL_END)
    state.model.train(was_training)
    state.batch, state.outputs = training_batch, None
    return results


def _real_batches(state: State, strategy: Strategy, dataloader: Any, limit: int | None) -> Any:
    """This rank's prepared batches and their sample counts, cut where the sampler's padding starts."""
    remaining = data.real_eval_samples(dataloader)
    module = strategy.eval_module
    for batch in itertools.islice(dataloader, limit):
        batch = strategy.prepare_batch(batch)
        n = state.model.num_samples(batch)
        if remaining is not None:
            if remaining <= 0:
                if strategy.gathers_in_forward:  # every rank must take part in each gather
                    module(batch)
                continue
            if n > remaining:
                batch, n = take(batch, 0, remaining), remaining
            remaining -= n
        yield batch, n


def _evaluate_batch(state: State, strategy: Strategy, batch: Any, n: int, metrics: dict[str, Any],
                    totals: torch.Tensor, run_event: Callable[[Event], None]) -> None:
    model = state.model
    module = strategy.eval_module  # the bare module: no DDP hooks, nothing to hang on
    state.batch = batch
    run_event(Event.EVAL_BATCH_START)
    with strategy.autocast():
        run_event(Event.EVAL_BEFORE_FORWARD)
        state.outputs = outputs = module(state.batch)
        run_event(Event.EVAL_AFTER_FORWARD)
        totals[0] += model.loss(outputs, batch).double() * n
        totals[1] += n
        eval_outputs = model.eval_forward(batch, outputs)
    for metric in metrics.values():
        model.update_metric(batch, eval_outputs, metric)
    run_event(Event.EVAL_BATCH_END)
    progress.heartbeat(state.timestamp.batch.value)
