"""``device_train_microbatch_size='auto'``: find the largest microbatch that fits, as Composer does.

Training starts with each rank's whole batch as one microbatch. When any rank runs out of memory
(CUDA's ``OutOfMemoryError``, or the CPU allocator's "can't allocate memory"), every rank drops
the gradients of the batch, halves the microbatch and trains the same batch again; the size that
worked is kept for the rest of the run. Ranks agree with one small all-reduce per attempt, just
before the last microbatch's backward (where DDP all-reduces the gradients), or as soon as a rank
runs out of memory: every rank reaches that point exactly once, however many microbatches it has.

An out-of-memory error inside the last microbatch's backward, where DDP's gradient all-reduce
runs, cannot be recovered from on one rank alone (Composer has the same limit); it ends the run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lockstep import dist
from lockstep.state import State

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

    def retrying(self, attempt: Callable[[], T], state: State, batch: Any, abandon: Callable[[], None]) -> T:
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
            state.device_train_microbatch_size = self.shrink(state.model.num_samples(batch))
            if dist.get_global_rank() == 0:
                print(f"lockstep: out of memory on a rank; training this batch again in microbatches of "
                      f"{state.device_train_microbatch_size} samples", file=sys.stderr, flush=True)
