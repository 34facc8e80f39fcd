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

import torch

from lockstep import dist


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
