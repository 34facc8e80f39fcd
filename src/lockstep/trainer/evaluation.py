"""Evaluation during and outside ``fit``: the evaluators (Composer's ``Evaluator``) built from
``eval_dataloader``, when each one's interval asks for it, and the loop over one evaluator's
dataloader whose metrics equal one process's over the whole dataset."""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lockstep import dist, elastic, progress
from lockstep.batch import take
from lockstep.core.data_spec import DataSpec
from lockstep.core.eval_metrics import LOSS, value_of
from lockstep.core.evaluator import Evaluator, ensure_evaluator, select_metrics
from lockstep.elastic.collectives import gather_metrics_through_lockstep
from lockstep.core.event import Event
from lockstep.loggers.logger import Logger
from lockstep.model import Model
from lockstep.parallel.strategy import Strategy
from lockstep.state import State
from lockstep.time import Time, Timestamp, is_interval_due, is_reached
from lockstep.trainer import data


def build_evaluators(eval_dataloader: Any, model: Model, device: torch.device, eval_interval: Any,
                     subset_num_batches: int | None) -> tuple[list[Evaluator], dict[str, dict[str, Any]]]:
    """The evaluators of ``eval_dataloader`` (a dataloader, a DataSpec, an Evaluator, or a list of
    Evaluators) and their metrics, ``{label: {name: Metric}}``: each evaluator's own copies of the
    model's eval metrics it names, and ``'loss'``. An evaluator without its own interval or subset
    takes the Trainer's."""
    if eval_dataloader is None:
        return [], {}
    given = list(eval_dataloader) if isinstance(eval_dataloader, (list, tuple)) else [eval_dataloader]
    evaluators = [ensure_evaluator(e) for e in given]
    # As in Composer, each plain dataloader is an Evaluator labelled 'eval' (several share its
    # metrics); labels the user chose must differ.
    labels = [e.label for e, g in zip(evaluators, given) if isinstance(g, Evaluator)]
    if len(set(labels)) != len(labels):
        raise ValueError(f"eval_dataloader: the Evaluators' labels {labels} repeat; give each a different label")
    model_metrics = model.get_metrics(is_train=False)
    metrics = {}
    for evaluator in evaluators:
        data.check_distributed_sampler(evaluator.dataloader.dataloader, f"eval_dataloader {evaluator.label!r}")
        data.shielded(evaluator.dataloader.dataloader)
        data.split_over_data_parallel(evaluator.dataloader.dataloader, f"eval_dataloader {evaluator.label!r}")
        if evaluator.eval_interval is None:
            evaluator.eval_interval = eval_interval
        if evaluator.subset_num_batches is None:
            evaluator.subset_num_batches = -1 if subset_num_batches is None else subset_num_batches
        chosen = select_metrics(model_metrics, evaluator.metric_names)
        if LOSS not in chosen:
            from lockstep.core.eval_loss import EvalLoss  # only with evaluators: it imports torchmetrics
            chosen[LOSS] = EvalLoss()
        metrics[evaluator.label] = {name: m.to(device) for name, m in chosen.items()}
        gather_metrics_through_lockstep(metrics[evaluator.label].values())
    return evaluators, metrics


def is_due(interval: Time | Callable[[State, Event], bool], state: State, before: Timestamp, event: Event) -> bool:
    """Whether ``interval`` asks for an evaluation at ``event`` (BATCH_END or EPOCH_END), ``before``
    being the timestamp before the batch or the epoch end that just passed."""
    if callable(interval):  # Composer's form: asked at BATCH_END, and at EPOCH_END
        return bool(interval(state, event))
    if interval.value == 0:  # Composer's eval_interval=0: never during fit
        return False
    return is_interval_due(before, state.timestamp, interval, state.max_duration)


def is_due_at_fit_end(interval: Time | Callable[[State, Event], bool], state: State, last_batch: int | None) -> bool:
    """Whether ``interval`` asks for an evaluation once ``fit`` ended (after FIT_END), as Composer's
    intervals do: a callable is asked at FIT_END; a Time interval evaluates when the run reached its
    ``max_duration`` and the last batch did not evaluate already (``last_batch``: the batch count at
    this evaluator's latest evaluation during fit)."""
    if callable(interval):
        return bool(interval(state, Event.FIT_END))
    if interval.value == 0:
        return False
    return (state.max_duration is not None and is_reached(state.timestamp, state.max_duration)
            and last_batch != state.timestamp.batch.value)


def batch_limit(subset_num_batches: int | None) -> int | None:
    """A subset count as ``itertools.islice`` takes it (None: every batch)."""
    return None if subset_num_batches is None or subset_num_batches == -1 else subset_num_batches


@torch.no_grad()
def evaluate(state: State, strategy: Strategy, evaluator: Evaluator, metrics: dict[str, Any], limit: int | None,
             run_event: Callable[[Event], None], logger: Logger) -> dict[str, float]:
    """Evaluate on this rank's batches of ``evaluator``'s dataloader (at most ``limit``); its
    ``metrics`` (``state.eval_metrics[label]``) are computed over all ranks and logged as
    ``metrics/<label>/<Name>``. Returns their values.

    Samples a DistributedSampler repeats to pad the ranks' shares are left out."""
    was_training, training_batch = state.model.training, state.batch
    outer = state.active_dataloader()
    spec = evaluator.dataloader
    state.set_dataloader(spec.dataloader, evaluator.label, -1 if limit is None else limit)
    state.eval_timestamp = Timestamp()
    state.model.eval()
    try:  # a change of an elastic job's ranks may end it early: the training state is put back
        return _evaluate(state, strategy, evaluator, metrics, limit, run_event, logger)
    finally:
        state.model.train(was_training)
        state.batch, state.outputs = training_batch, None
        state.restore_dataloader(outer)


def _evaluate(state: State, strategy: Strategy, evaluator: Evaluator, metrics: dict[str, Any], limit: int | None,
              run_event: Callable[[Event], None], logger: Logger) -> dict[str, float]:
    spec = evaluator.dataloader
    run_event(Event.EVAL_START)
    for metric in metrics.values():
        metric.reset()
    evaluated = 0
    for batch, n in _real_batches(state, strategy, spec, limit):
        _evaluate_batch(state, strategy, evaluator, batch, n, metrics, run_event)
        evaluated += 1
    with warnings.catch_warnings():
        if not evaluated:  # said once, here, instead of torchmetrics' warning for each metric
            warnings.warn(f"evaluator {evaluator.label!r} had no batch to evaluate on rank {dist.get_global_rank()}: "
                          f"its dataloader yields none here (check its dataset, batch_size and sampler); its "
                          f"metrics count the other ranks' samples only", UserWarning, stacklevel=4)
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric .* before the ``update``")
        results = {name: value_of(m) for name, m in metrics.items()}  # every rank: compute() gathers
    from lockstep.core.eval_loss import EvalLoss  # imported by now: the evaluators made one
    logger.log_metrics({f"metrics/{evaluator.label}/{name}": value for name, value in results.items()
                        if name != LOSS or not isinstance(metrics[name], EvalLoss)})
    run_event(Event.EVAL_END)
    return results


def _real_batches(state: State, strategy: Strategy, spec: DataSpec, limit: int | None) -> Any:
    """This rank's prepared batches and their sample counts, cut where the sampler's padding starts."""
    dataloader = spec.dataloader
    if elastic.current() is not None:
        data.split_over_the_ranks_now(dataloader)
    data.set_epoch(dataloader, int(state.timestamp.batch))  # as Composer: a shuffling sampler's order moves on
    remaining = data.real_eval_samples(dataloader)
    module = strategy.eval_module
    count = spec.get_num_samples_in_batch or state.model.num_samples
    for batch in itertools.islice(dataloader, limit):
        if spec.batch_transforms is not None:
            batch = spec.batch_transforms(batch)
        batch = strategy.prepare_batch(batch)
        n = count(batch)
        if remaining is not None:
            if remaining <= 0:
                if strategy.gathers_in_forward:  # every rank must take part in each gather
                    module(batch)
                continue
            if n > remaining:
                batch, n = take(batch, 0, remaining), remaining
            remaining -= n
        yield batch, n


def _evaluate_batch(state: State, strategy: Strategy, evaluator: Evaluator, batch: Any, n: int,
                    metrics: dict[str, Any], run_event: Callable[[Event], None]) -> None:
    started = time.perf_counter()
    model = state.model
    module = strategy.eval_module  # the bare module: no DDP hooks, nothing to hang on
    spec = evaluator.dataloader
    state.batch = batch
    run_event(Event.EVAL_BATCH_START)
    size = evaluator.device_eval_microbatch_size
    pieces = [(batch, n)]
    if size is not None and n > size:
        count = spec.get_num_samples_in_batch or model.num_samples
        pieces = [(piece, count(piece)) for piece in (spec.split_batch or model.split_batch)(batch, size)]
    from lockstep.core.eval_loss import EvalLoss  # imported by now: the evaluators made one
    loss_metric = metrics.get(LOSS) if isinstance(metrics.get(LOSS), EvalLoss) else None
    for piece, samples in pieces:
        if spec.microbatch_transforms is not None:
            piece = spec.microbatch_transforms(piece)
        state.batch = piece
        with strategy.autocast():
            run_event(Event.EVAL_BEFORE_FORWARD)
            state.outputs = outputs = module(state.batch)
            run_event(Event.EVAL_AFTER_FORWARD)
            if loss_metric is not None:
                loss_metric.update(model.loss(outputs, state.batch), samples)
            eval_outputs = model.eval_forward(state.batch, outputs)
        for name, metric in metrics.items():
            if metric is not loss_metric:
                model.update_metric(state.batch, eval_outputs, metric)
    state.eval_timestamp = state.eval_timestamp.to_next_batch(n, duration=time.perf_counter() - started)
    run_event(Event.EVAL_BATCH_END)
    progress.heartbeat(state.timestamp.batch.value)
