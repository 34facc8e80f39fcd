"""``Trainer.fit``'s keyword arguments, Composer's: the data and the duration to train, and the
others, each of which changes the run from this ``fit`` on as the Trainer's argument of that name
would have."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lockstep.checks import check_bool, check_choice
from lockstep.core.data_spec import DataSpec, ensure_data_spec
from lockstep.core.precision import precision_name
from lockstep.optim.stepper import compile_schedulers
from lockstep.parallel.precision import PRECISIONS
from lockstep.time import Time, Timestamp, TimeUnit, time_argument
from lockstep.trainer import data, evaluation, setup
from lockstep.parallel.config import ParallelConfig
from lockstep.state import State
from lockstep.trainer.config import LoopConfig, check_ratio, scale_duration, subset
from lockstep.trainer.options import check_label


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


@dataclass(slots=True)
class Changes:
    """What a ``fit`` call changes, worked out and checked before anything changes (the Trainer
    applies them)."""

    spec: DataSpec | None = None
    timestamp: Timestamp | None = None
    max_duration: Time | None = None
    subset: int | None = None
    schedulers: list[Any] | None = None
    split: tuple[list[Any], list[Any]] | None = None
    evaluators: tuple[list[Any], dict[str, Any]] | None = None


def _check_duration(given: FitArguments, changes: Changes, loop: LoopConfig, train_dataloader: Any,
                    fit_count: int) -> None:
    """Composer's refusals: epochs of a dataloader without a length, and a second ``fit()`` that
    would train nothing (a resumed run whose checkpoint is already at the end is not one: it ends
    quietly, so a job restarted after its last save still exits 0)."""
    loader = changes.spec.dataloader if changes.spec is not None else train_dataloader
    subset_given = (changes.subset if changes.subset is not None else loop.train_subset_num_batches) \
        not in (None, -1)
    if changes.max_duration.unit is TimeUnit.EPOCH and setup.safe_len(loader) is None and not subset_given:
        raise ValueError(f"max_duration cannot be specified in epochs when using an infinite dataloader (got "
                         f"'{changes.max_duration}'): give it in ba, sp or tok, or pass train_subset_num_batches")
    elapsed = changes.timestamp.get(changes.max_duration.unit)
    if fit_count and given.duration is None and not given.reset_time \
            and elapsed.value >= changes.max_duration.value:
        raise ValueError(f"The max_duration ({changes.max_duration}) is less than or equal to the elapsed training "
                         f"duration ({elapsed}). No training would occur. Please provide the `duration` or specify "
                         f"`reset_time=True` in Trainer.fit().")


def check(given: FitArguments, *, state: State, loop: LoopConfig, parallel: ParallelConfig, train_dataloader: Any,
          fit_count: int) -> Changes:
    """Everything ``given`` changes in a Trainer with these parts, checked, with nothing changed yet."""
    s = state
    changes = Changes()
    if given.train_dataloader is not None:
        changes.spec = ensure_data_spec(given.train_dataloader)
        data.check_distributed_sampler(changes.spec.dataloader, "train_dataloader")
        check_label(given.train_dataloader_label)
    changes.timestamp = Timestamp() if given.reset_time else s.timestamp
    changes.max_duration = s.max_duration if given.duration is None else \
        setup.more_duration(given.duration, changes.timestamp, given.reset_time)
    if not s.optimizers:
        raise ValueError("No optimizer was specified when constructing the Trainer (the model has no parameters "
                         "to train, so none was made): give a model with parameters, or only call eval()")
    if (train_dataloader is None and changes.spec is None) or changes.max_duration is None:
        raise ValueError("fit() needs a train_dataloader and a max_duration (or duration=)")
    if given.train_subset_num_batches is not None:
        changes.subset = subset("train_subset_num_batches", given.train_subset_num_batches)
    _check_duration(given, changes, loop, train_dataloader, fit_count)
    if given.schedulers is not None:  # stretched with the duration by the ratio
        changes.max_duration = scale_duration(changes.max_duration, given.scale_schedule_ratio)
        changes.schedulers = compile_schedulers(setup.as_list(given.schedulers), s, given.scale_schedule_ratio)
        changes.split = setup.split_schedulers(changes.schedulers, given.step_schedulers_every_batch)
    if given.eval_dataloader is not None:
        changes.evaluators = evaluation.build_evaluators(
            given.eval_dataloader, s.model, s.device.torch_device, _interval(given.eval_interval),
            subset("eval_subset_num_batches", given.eval_subset_num_batches))
    elif given.eval_interval not in (0, 1) or given.eval_subset_num_batches != -1:
        warnings.warn("fit(eval_interval=..., eval_subset_num_batches=...) apply to fit(eval_dataloader=...); "
                      "without it they change nothing", stacklevel=4)
    if given.device_train_microbatch_size is not None:
        _check_microbatch_size(given.device_train_microbatch_size, loop, parallel)
    if given.precision is not None and given.precision != s.precision and \
            (parallel.fsdp_config is not None or parallel.deepspeed_config is not None):
        raise ValueError(f"fit(precision={given.precision!r}): under FSDP or DeepSpeed the precision is part of "
                         f"the wrapped model, fixed at Trainer(precision={s.precision.value!r}); give it there")
    return changes


def _check_microbatch_size(size: int | str, loop: LoopConfig, parallel: ParallelConfig) -> None:
    if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"device_train_microbatch_size must be an integer >= 1 or 'auto', got {size!r}")
    if parallel.deepspeed_config is not None and size != loop.device_train_microbatch_size:
        raise ValueError("fit(device_train_microbatch_size=...) under DeepSpeed: its engine fixed the microbatch "
                         "size at Trainer(...) (train_micro_batch_size_per_gpu); give it there")
    if size == "auto":
        setup.check_auto_microbatching(parallel)


def _interval(interval: Any) -> Any:
    return interval if callable(interval) else time_argument("eval_interval", interval)
