"""Composer's ``DataSpec``: a dataloader with the rules for its batches (how to count samples and
tokens, how to split a batch into microbatches, transforms) when the model's defaults do not fit."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["DataSpec", "ensure_data_spec"]


class DataSpec:
    """A dataloader and how to read its batches, as Composer's ``composer.core.DataSpec``.

    Each rule left ``None`` falls back to the model's (``Model.num_samples``, ``Model.num_tokens``,
    ``Model.split_batch``); a transform left ``None`` does nothing. ``batch_transforms`` runs on
    each batch as it comes from the dataloader, before it is counted; ``microbatch_transforms`` on
    each microbatch once it is on the device. ``num_samples`` and ``num_tokens`` are the dataset's
    sizes, when known (kept for callbacks; the Trainer counts the batches themselves).
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        num_samples: int | None = None,
        num_tokens: int | None = None,
        batch_transforms: Callable[[Any], Any] | None = None,
        microbatch_transforms: Callable[[Any], Any] | None = None,
        split_batch: Callable[[Any, int], Sequence[Any]] | None = None,
        get_num_samples_in_batch: Callable[[Any], int] | None = None,
        get_num_tokens_in_batch: Callable[[Any], int] | None = None,
    ) -> None:
        if isinstance(dataloader, DataSpec) or dataloader is None or not isinstance(dataloader, Iterable):
            raise TypeError(f"DataSpec(dataloader=...) takes an iterable of batches such as a DataLoader, "
                            f"got {type(dataloader).__name__}")
        for name, value in (("batch_transforms", batch_transforms), ("microbatch_transforms", microbatch_transforms),
                            ("split_batch", split_batch), ("get_num_samples_in_batch", get_num_samples_in_batch),
                            ("get_num_tokens_in_batch", get_num_tokens_in_batch)):
            if value is not None and not callable(value):
                raise TypeError(f"DataSpec({name}=...) must be a function, got {type(value).__name__}")
        self.dataloader = dataloader
        self.num_tokens = num_tokens
        self.batch_transforms = batch_transforms
        self.microbatch_transforms = microbatch_transforms
        self.split_batch = split_batch
        self.get_num_samples_in_batch = get_num_samples_in_batch
        self.get_num_tokens_in_batch = get_num_tokens_in_batch
        if num_samples is None:  # Composer's default: the dataset's length, when it has one
            try:
                num_samples = len(dataloader.dataset)  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                num_samples = None
        self.num_samples = num_samples

    def __repr__(self) -> str:
        return f"DataSpec({type(self.dataloader).__name__}, num_samples={self.num_samples})"


def ensure_data_spec(dataloader: Any) -> DataSpec:
    """``dataloader`` as a DataSpec: a DataSpec as it is, a dict as DataSpec's arguments, any other
    iterable wrapped with the model's rules."""
    if isinstance(dataloader, DataSpec):
        return dataloader
    if isinstance(dataloader, dict):
        return DataSpec(**dataloader)
    return DataSpec(dataloader)
