"""The Trainer's loop arguments, checked: what to train for, on which device, in which precision."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lockstep import dist
from lockstep.devices import Device
from lockstep.checks import check_choice
from lockstep.core.precision import precision_name
from lockstep.parallel.precision import PRECISIONS
from lockstep.time import Time, check_max_duration, time_argument

DEVICES = ("cpu", "gpu")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """How long and how the training loop runs."""

    max_duration: Time | str | int | None = None
    """When training stops: a Time (``'2ep'``, ``'1000ba'``, ``'1e6tok'``); an int counts epochs."""
    eval_interval: Time | str | int | Callable[[Any, Any], bool] = "1ep"
    """How often ``eval_dataloader`` is evaluated during ``fit``; a callable ``(state, event) -> bool``
    is asked at BATCH_END and EPOCH_END, as in Composer."""
    device: str | torch.device | Device | None = None
    """'cpu' | 'gpu' (this local rank's CUDA device) | None: gpu when CUDA is available."""
    precision: str | None = "fp32"
    """fp32 | amp_bf16 | amp_fp16 (the latter with a GradScaler); None: Composer's default for the
    device, fp32 on CPU and amp_fp16 on GPU."""
    device_train_microbatch_size: int | str | None = None
    """Split each rank's batch into microbatches of this many samples (gradients accumulate);
    ``'auto'``: the largest that fits, found by halving after out-of-memory errors."""
    grad_accum: int | None = None
    """Split each rank's batch into this many microbatches (the older way to say the same)."""
    seed: int | None = None
    """Seed python, numpy and torch with ``seed + rank`` before the model is prepared."""
    scale_schedule_ratio: float = 1.0
    """Stretch max_duration and the lockstep.optim schedules by this factor."""
    train_subset_num_batches: int | None = None
    """End each training epoch after this many batches (-1 or None: the whole dataloader)."""
    eval_subset_num_batches: int | None = None
    """Evaluate on this many batches of each rank's eval dataloader (-1 or None: all of it)."""

    def __post_init__(self) -> None:
        check_ratio(self.scale_schedule_ratio)
        if self.max_duration is not None:
            self.max_duration = scale_duration(check_max_duration(self.max_duration), self.scale_schedule_ratio)
        if not callable(self.eval_interval):
            self.eval_interval = time_argument("eval_interval", self.eval_interval)
        self.device = resolve_device(self.device)
        if self.precision is None:
            self.precision = "fp32" if self.device.type == "cpu" else "amp_fp16"
        self.precision = precision_name(self.precision)
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("device_train_microbatch_size", "grad_accum"):
            value = getattr(self, name)
            if name == "device_train_microbatch_size" and value == "auto":
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("train_subset_num_batches", "eval_subset_num_batches"):
            setattr(self, name, subset(name, getattr(self, name)))
        if self.device_train_microbatch_size is not None and self.grad_accum is not None:
            raise ValueError("give device_train_microbatch_size or grad_accum, not both")

    @property
    def fixed_microbatch_size(self) -> int | None:
        """The microbatch size given as a number (None for the whole batch, or for 'auto')."""
        size = self.device_train_microbatch_size
        return None if size == "auto" else size  # type: ignore[return-value]


def subset(name: str, value: int | None) -> int | None:
    """A batch count >= 1, or None for all batches (Composer writes -1)."""
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, or -1 for every batch; got {value!r}")
    return value


def check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf:
        raise ValueError(f"scale_schedule_ratio must be a positive finite number, got {ratio!r}")


def scale_duration(max_duration: Time, ratio: float) -> Time:
    """``max_duration`` stretched by ``scale_schedule_ratio`` (whole counts, rounded down)."""
    if ratio == 1:
        return max_duration
    scaled = Time(int(max_duration.value * ratio), max_duration.unit)
    if scaled.value == 0:
        raise ValueError(f"scale_schedule_ratio={ratio} shrinks max_duration '{max_duration}' to 0; give "
                         f"max_duration in a finer unit (ba, sp or tok)")
    return scaled


def resolve_device(device: str | torch.device | Device | None) -> torch.device:
    """'cpu' | 'gpu' | a :class:`lockstep.devices.Device` | None (gpu when CUDA is available); gpu
    means this local rank's CUDA device."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, Device):
        return device.torch_device
    if device is None:
        device = "gpu" if torch.cuda.is_available() else "cpu"
    check_choice("device", device, DEVICES, also=" or None (auto)")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='gpu' but torch.cuda.is_available() is False; use device='cpu'")
    return torch.device("cuda", dist.get_local_rank())
