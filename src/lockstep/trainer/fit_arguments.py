"""``Trainer.fit``'s keyword arguments, Composer's: the data and the duration to train, and the
others, each of which changes the run from this ``fit`` on as the Trainer's argument of that name
would have."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.checks import check_bool, check_choice
from lockstep.core.precision import precision_name
from lockstep.optim.stepper import compile_schedulers
from lockstep.parallel.precision import PRECISIONS, make_grad_scaler
from lockstep.parallel.strategy import Strategy
from lockstep.time import Time, Timestamp, time_argument
from lockstep.trainer import evaluation, setup
from lockstep.trainer.config import check_ratio, scale_duration, subset
from lockstep.trainer.options import check_label

if TYPE_CHECKING:
    from lockstep.trainer.trainer import Trainer


@dataclass(kw_only=True, slots=True)
class FitArguments:
    """What a ``fit`` call asks for; None (and Composer's defaults) change nothing."""

    train_dataloader: Any = None
    train_dataloader_label: str = "train"
    duration: Time | str | int | None = None
    reset_time: bool = False
    train_subset_num_batches: int | None = None
    spin_dataloaders: bool | None = None
    eval_dataloader: Any = None
    eval_interval: Time | str | int | Any = 1
    eval_subset_num_batches: int = -1
    schedulers: Any = None
    scale_schedule_ratio: float = 1.0
    step_schedulers_every_batch: bool | None = None
    device_train_microbatch_size: int | str | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        check_ratio(self.scale_schedule_ratio)
        if self.schedulers is None:  # as in Composer: they act on the schedulers given with them
            if self.scale_schedule_ratio != 1.0:
                raise ValueError("fit(scale_schedule_ratio=...) needs fit(schedulers=...): it stretches those "
                                 "schedulers and the duration together")
            if self.step_schedulers_every_batch is not None:
                raise ValueError("fit(step_schedulers_every_batch=...) needs fit(schedulers=...): it says how "
                                 "those schedulers step")
        if self.spin_dataloaders is not None:
            check_bool("spin_dataloaders", self.spin_dataloaders)
        if self.precision is not None:
            self.precision = precision_name(self.precision)
            check_choice("precision", self.precision, PRECISIONS)


def apply(trainer: Trainer, given: FitArguments) -> None:
    """Change ``trainer`` as ``given`` asks, before its loop starts (on every rank)."""
    s, loop = trainer.state, trainer.loop
    if given.train_dataloader is not None:
        trainer._use_train_dataloader(given.train_dataloader)
        trainer.options.train_dataloader_label = check_label(given.train_dataloader_label)
    if given.reset_time:
        s.timestamp = Timestamp()
    if given.duration is not None:
        s.max_duration = setup.more_duration(given.duration, s.timestamp, given.reset_time)
    if trainer.train_dataloader is None or s.max_duration is None or not s.optimizers:
        raise ValueError("fit() needs a train_dataloader, a max_duration (or duration=) and optimizers")
    if given.train_subset_num_batches is not None:
        loop.train_subset_num_batches = subset("train_subset_num_batches", given.train_subset_num_batches)
        s.batches_per_epoch = setup.epoch_length(trainer.train_dataloader, loop.train_subset_num_batches)
    if given.spin_dataloaders is not None:
        trainer.options.spin_dataloaders = given.spin_dataloaders
    if given.schedulers is not None:
        _use_schedulers(trainer, given)
    if given.eval_dataloader is not None:
        _use_evaluators(trainer, given)
    elif given.eval_interval not in (0, 1) or given.eval_subset_num_batches != -1:
        warnings.warn("fit(eval_interval=..., eval_subset_num_batches=...) apply to fit(eval_dataloader=...); "
                      "without it they change nothing", stacklevel=3)
    if given.device_train_microbatch_size is not None:
        _use_microbatch_size(trainer, given.device_train_microbatch_size)
    if given.precision is not None and given.precision != s.precision:
        _use_precision(trainer, given.precision)
    if trainer.saver:  # 'dur' save intervals follow the new max_duration
        trainer.saver.max_duration = s.max_duration


def _use_schedulers(trainer: Trainer, given: FitArguments) -> None:
    """New schedulers in place of the run's, stretched with the duration by the ratio."""
    s = trainer.state
    assert s.max_duration is not None  # fit() checked it
    s.max_duration = scale_duration(s.max_duration, given.scale_schedule_ratio)
    s.schedulers = compile_schedulers(setup.as_list(given.schedulers), s, given.scale_schedule_ratio)
    trainer._batch_schedulers, trainer._epoch_schedulers = setup.split_schedulers(
        s.schedulers, given.step_schedulers_every_batch)


def _use_evaluators(trainer: Trainer, given: FitArguments) -> None:
    """New evaluators in place of the run's (Composer replaces them and their metrics)."""
    s = trainer.state
    trainer.evaluators, s.eval_metrics = evaluation.build_evaluators(
        given.eval_dataloader, s.model, s.device, _interval(given.eval_interval),
        subset("eval_subset_num_batches", given.eval_subset_num_batches))
    s.evaluators = trainer.evaluators
    trainer._evaluated_at.clear()


def _use_microbatch_size(trainer: Trainer, size: int | str) -> None:
    if trainer.parallel.deepspeed_config is not None:
        raise ValueError("fit(device_train_microbatch_size=...) under DeepSpeed: its engine fixed the microbatch "
                         "size at Trainer(...) (train_micro_batch_size_per_gpu); give it there")
    if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"device_train_microbatch_size must be an integer >= 1 or 'auto', got {size!r}")
    loop = trainer.loop
    loop.device_train_microbatch_size, loop.grad_accum = size, None
    trainer._microbatches.auto = setup.auto_microbatching(loop, trainer.parallel)
    trainer.state.device_train_microbatch_size = loop.fixed_microbatch_size


def _use_precision(trainer: Trainer, precision: str) -> None:
    """Another autocast for the steps from now on; FSDP and DeepSpeed built theirs into the model."""
    strategy: Strategy = trainer.strategy
    if trainer.parallel.fsdp_config is not None or trainer.parallel.deepspeed_config is not None:
        raise ValueError(f"fit(precision={precision!r}): under FSDP or DeepSpeed the precision is part of the "
                         f"wrapped model, fixed at Trainer(precision={trainer.state.precision!r}); give it there")
    strategy.precision = precision
    strategy.scaler = trainer.state.scaler = make_grad_scaler(precision, strategy.device)
    trainer.state.precision = precision


def _interval(interval: Any) -> Any:
    return interval if callable(interval) else time_argument("eval_interval", interval)
