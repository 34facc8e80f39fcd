"""Microbatches: a rank's batch split, each piece's forward and backward with its share of the
global batch, and the search of ``device_train_microbatch_size='auto'``.

With ``'auto'``, Composer's search for the largest microbatch that fits: training starts with each rank's whole batch as one microbatch. When any rank runs out of memory
(CUDA's ``OutOfMemoryError``, or the CPU allocator's "can't allocate memory"), every rank drops
the gradients of the batch, halves the microbatch and trains the same batch again; the size that
worked is kept for the rest of the run. Ranks agree with one small all-reduce per attempt, just
before the last microbatch's backward (where DDP all-reduces the gradients), or as soon as a rank
runs out of memory: every rank reaches that point exactly once, however many microbatches it has.

An out-of-memory error inside the last microbatch's backward, where DDP's gradient all-reduce
runs, cannot be recovered from on one rank alone (Composer has the same limit); it ends the run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lockstep import dist
from lockstep.core.data_spec import DataSpec
from lockstep.core.event import Event
from lockstep.parallel.strategy import Strategy
from lockstep.model import total_loss
from lockstep.state import State
from lockstep.trainer import train_metrics
from lockstep.trainer.config import LoopConfig

T = TypeVar("T")


class RetrySmaller(Exception):
    """Some rank ran out of memory in this microbatch: train the batch again, in smaller pieces."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


class AutoMicrobatch:
    """The microbatch size the search has reached (None: the whole batch); DDP or one process."""

    def __init__(self, device: torch.device) -> None:
        self.size: int | None = None
        self.passed = False
        """Whether this attempt got past the agreement (an error after it cannot be retried)."""
        self._device = device
        self._flag = torch.zeros(1, device=device)

    def agree(self, out_of_memory: bool) -> None:
        """Raise RetrySmaller on every rank if any rank ran out of memory (a collective)."""
        self._flag.fill_(1.0 if out_of_memory else 0.0)
        dist.all_reduce(self._flag, "MAX")
        if self._flag.item() > 0:
            raise RetrySmaller
        self.passed = True

    def shrink(self, batch_samples: int) -> int:
        """Halve the microbatch after an out-of-memory error; the new size."""
        current = self.size or batch_samples
        if current <= 1:
            raise RuntimeError("device_train_microbatch_size='auto': a rank ran out of memory with a "
                               "microbatch of 1 sample; the model does not fit: shard it (fsdp_config), "
                               "lower the precision, or checkpoint activations")
        self.size = current // 2
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return self.size

    def retrying(self, attempt: Callable[[], T], state: State, batch: Any, abandon: Callable[[], None],
                 num_samples: Callable[[Any], int]) -> T:
        """``attempt()`` (the batch's forwards and backwards), again in halved microbatches for as
        long as any rank runs out of memory; ``abandon`` drops the backward a failed attempt began."""
        while True:
            self.passed = False
            try:
                return attempt()
            except RetrySmaller:
                pass
            except Exception as e:
                if self.passed or not is_out_of_memory(e):
                    raise
                state.outputs = state.loss_tensor = None
                try:
                    self.agree(True)  # tells every rank, and raises RetrySmaller here too
                except RetrySmaller:
                    pass
            for optimizer in state.optimizers:
                optimizer.zero_grad(set_to_none=True)
            state.outputs = state.loss_tensor = None
            abandon()
            state.device_train_microbatch_size = self.shrink(num_samples(batch))
            if dist.get_global_rank() == 0:
                print(f"lockstep: out of memory on a rank; training this batch again in microbatches of "
                      f"{state.device_train_microbatch_size} samples", file=sys.stderr, flush=True)


class Microbatches:
    """The forward and backward of a rank's batch, in the microbatches the Trainer was asked for."""

    def __init__(self, state: State, strategy: Strategy, run_event: Callable[[Event], None], loop: LoopConfig,
                 auto: AutoMicrobatch | None, *, count: Callable[[Any], int] | None = None) -> None:
        self.state, self.strategy, self.run_event, self.loop, self.auto = state, strategy, run_event, loop, auto
        self.count = count
        """What a microbatch's loss is weighted by (``accumulate_train_batch_on_tokens``: its
        tokens); None: its samples."""
        self.cap: int | None = None
        """The most samples a microbatch holds when no size or count was asked for (an elastic
        job's share of a global batch may be larger than the loader's batch size)."""
        self.spec: DataSpec | None = None
        """The training data's DataSpec: its ``split_batch``, ``get_num_samples_in_batch`` and
        ``microbatch_transforms``, where given, replace the model's rules."""

    def forward_backward(self, batch: Any, share: float, loud: bool) -> torch.Tensor:
        """Accumulate the gradients of ``batch`` (each sample weighted by ``share``); the batch's mean
        loss. Without ``loud``, nothing acts at the microbatch events, so they are not run."""
        if self.auto is None:
            losses, counts = self._each(batch, share, loud)
        else:
            losses, counts = self.auto.retrying(lambda: self._each(batch, share, loud), self.state, batch,
                                                self.strategy.abandon_backward, self._num_samples)
        return mean_loss(losses, counts)

    def _each(self, batch: Any, share: float, loud: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Forward and backward of every microbatch of ``batch``; their losses and sample counts."""
        s, strategy, run, auto, count = self.state, self.strategy, self.run_event, self.auto, self.count
        microbatches = self.split(batch)
        losses, counts, last = [], [], len(microbatches) - 1
        spec = self.spec
        transform = spec.microbatch_transforms if spec is not None else None
        metrics = bool(s.train_metrics)
        if metrics:  # here, not per batch: a retry after running out of memory starts them over
            train_metrics.reset(s)
        for i, micro in enumerate(microbatches):
            n = self._num_samples(micro) if count is None else count(micro)
            s.batch = micro if transform is None else transform(micro)
            with strategy.sync_context(i == last):
                with strategy.autocast():
                    if loud:
                        run(Event.BEFORE_FORWARD)
                    s.outputs = strategy.module(s.batch)
                    if loud:
                        run(Event.AFTER_FORWARD)
                        run(Event.BEFORE_LOSS)
                    s.loss_tensor = s.model.loss(s.outputs, s.batch)
                    if loud:
                        run(Event.AFTER_LOSS)
                if auto is not None and i == last:
                    auto.agree(False)  # every rank got here: the gradient all-reduce may start
                if loud:
                    run(Event.BEFORE_BACKWARD)
                loss = s.loss_tensor if isinstance(s.loss_tensor, torch.Tensor) else total_loss(s.loss_tensor)
                weight = n * share  # its share of the global batch: 1.0 (no op) for one even microbatch
                strategy.backward(loss if weight == 1.0 else loss * weight)
                if loud:
                    run(Event.AFTER_BACKWARD)
                if metrics:
                    train_metrics.update(s, s.batch, s.outputs)
            losses.append(loss.detach())
            counts.append(n)
        return losses, counts

    def split(self, batch: Any) -> list[Any]:
        loop, auto = self.loop, self.auto
        split = self.spec.split_batch if self.spec is not None and self.spec.split_batch else self.state.model.split_batch
        if auto is not None:
            return [batch] if auto.size is None else list(split(batch, auto.size))
        if loop.device_train_microbatch_size is not None:
            return list(split(batch, loop.device_train_microbatch_size))
        if loop.grad_accum is not None:
            return list(split(batch, math.ceil(self._num_samples(batch) / loop.grad_accum)))
        if self.cap is not None and self._num_samples(batch) > self.cap:
            return list(split(batch, self.cap))
        return [batch]

    def _num_samples(self, batch: Any) -> int:
        spec = self.spec
        if spec is not None and spec.get_num_samples_in_batch is not None:
            return spec.get_num_samples_in_batch(batch)
        return self.state.model.num_samples(batch)



def mean_loss(losses: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """The sample-weighted mean of the microbatches' losses, in a few tensor ops per step."""
    if len(losses) == 1:
        loss = losses[0]
        return loss if loss.dtype is torch.float32 else loss.float()
    stacked = torch.stack(losses).float()
    if len(set(counts)) == 1 and counts[0] > 0:
        return stacked.mean()
    weights = torch.tensor(counts, dtype=torch.float32, device=stacked.device)
    return (stacked * weights).sum() / max(sum(counts), 1)
