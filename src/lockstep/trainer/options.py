"""Composer's Trainer arguments about how a run is set up and observed, checked: the label of the
training data, algorithm passes and traces, hyperparameter logging, deterministic kernels, the
profiler, and loss weighting by tokens."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lockstep.checks import check_bool
from lockstep.utils.reproducibility import configure_deterministic_mode


@dataclass(kw_only=True, slots=True)
class RunOptions:
    train_dataloader_label: str = "train"
    """The label of the training data (Composer names training metrics with it)."""
    spin_dataloaders: bool = True
    """As Composer: at the start of ``fit`` read the first batch of each evaluation loader and, when
    resuming, of the training loader in each epoch already done, before the checkpoint's RNG state
    goes back (:func:`lockstep.trainer.data.spin`), so data drawn from the global generators when
    first read is drawn as in the uninterrupted run. The order of the samples does not need it:
    lockstep restores each epoch's sampler seed and the batches done from the checkpoint."""
    algorithm_passes: Any = None
    """Functions ``(algorithms, event) -> algorithms`` that order (or filter) the algorithms that
    match each event, after Composer's default pass (reverse order at ``AFTER_*`` events)."""
    log_traces: bool = False
    """Log ``algorithm_traces/<Algorithm>/<event>`` when algorithms run."""
    auto_log_hparams: bool = False
    """Log the Trainer's arguments as hyperparameters when it is built."""
    load_progress_bar: bool = True
    """A progress bar while a checkpoint downloads (checkpoints load from local paths here)."""
    load_exclude_algorithms: list[str] = field(default_factory=list)
    """Algorithms not to apply to the model while loading: lockstep's algorithms never change the
    model at load time, so the names are checked and kept."""
    accumulate_train_batch_on_tokens: bool = False
    """Weight each microbatch's loss by its share of the global batch's tokens, not samples."""
    deterministic_mode: bool = False
    """Deterministic kernels (``lockstep.utils.reproducibility.configure_deterministic_mode``)."""
    profiler: Any = None
    """A :class:`lockstep.profiler.Profiler`: torch.profiler traces of the batches it schedules."""

    def __post_init__(self) -> None:
        check_label(self.train_dataloader_label)
        for name in ("spin_dataloaders", "log_traces", "auto_log_hparams", "load_progress_bar",
                     "accumulate_train_batch_on_tokens", "deterministic_mode"):
            check_bool(name, getattr(self, name))
        self.algorithm_passes = _passes(self.algorithm_passes)
        excluded = self.load_exclude_algorithms or []
        if isinstance(excluded, str) or not all(isinstance(n, str) for n in excluded):
            raise TypeError("load_exclude_algorithms must be a list of algorithm class names, such as "
                            "['GradientClipping']")
        self.load_exclude_algorithms = list(excluded)
        if self.profiler is not None:
            from lockstep.profiler import Profiler

            if not isinstance(self.profiler, Profiler):
                raise TypeError(f"profiler must be a lockstep.profiler.Profiler, got {type(self.profiler).__name__}")


def _passes(value: Any) -> list[Callable[..., Any]]:
    """Composer's forms: a pass, a ``(pass, index)`` pair, or a list of either; in that order."""
    if value is None:
        return []
    items = value if isinstance(value, list) and not _is_pair(value) else [value]
    ordered: list[Callable[..., Any]] = []
    for item in items:
        if callable(item):
            ordered.append(item)
        elif _is_pair(item):
            ordered.insert(item[1] if item[1] >= 0 else len(ordered) + item[1] + 1, item[0])
        else:
            raise TypeError(f"algorithm_passes has {item!r}: give functions (algorithms, event) -> algorithms, "
                            f"or (function, position) pairs")
    return ordered


def _is_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and callable(item[0]) and isinstance(item[1], int)


def start(run: RunOptions) -> None:
    """What the options do before anything else runs: deterministic kernels when asked."""
    if run.deterministic_mode:
        configure_deterministic_mode()


def keeps_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate the Trainer's ``__init__``: ``self.local_hparams`` (Composer's name) holds the
    arguments it was given, every default filled in, as loggable values (``auto_log_hparams``
    logs them). Only hyperparameter logging reads them: every argument reaches its config by name."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def keeping(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self.local_hparams = hyperparameters_of({k: v for k, v in bound.arguments.items() if k != "self"})
        init(self, *args, **kwargs)

    return keeping


def check_unsupported(*, precision_config: dict[str, Any] | None, profiler: Any,
                      device_train_microbatch_size: Any) -> None:
    """The arguments of Composer's that lockstep cannot honour yet: a one-line error each."""
    if profiler is not None and device_train_microbatch_size == "auto":  # Composer refuses the pair too
        raise ValueError("device_train_microbatch_size='auto' does not work with the profiler (its search would "
                         "be profiled): give the microbatch size as a number")
    if precision_config:  # Composer's precision_config configures amp_fp8 only
        raise ValueError(f"precision_config={precision_config!r} configures amp_fp8 (Transformer Engine), which "
                         f"lockstep does not have: remove it and use precision='amp_bf16' or 'amp_fp16'")


def hyperparameters_of(arguments: dict[str, Any]) -> dict[str, Any]:
    """``auto_log_hparams``: each argument as a loggable value (numbers, strings, lists and dicts
    of them; other objects by their class name), as Composer's ``extract_hparams`` does."""
    return {name: _loggable(value) for name, value in arguments.items() if not name.startswith("_") and name != "self"}


def _loggable(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth == 0 and isinstance(value, (list, tuple)):
        return [_loggable(v, 1) for v in value]
    if depth == 0 and isinstance(value, dict):
        return {str(k): _loggable(v, 1) for k, v in value.items()}
    if hasattr(value, "unit") and hasattr(value, "value"):  # a Time
        return str(value)
    return type(value).__name__


def check_label(label: Any) -> str:
    """``train_dataloader_label``, checked."""
    if not isinstance(label, str) or not label:
        raise ValueError(f"train_dataloader_label={label!r}: give a non-empty string, such as 'train'")
    return label
