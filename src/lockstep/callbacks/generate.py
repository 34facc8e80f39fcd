"""Generate: at an interval, text samples from a HuggingFaceModel's prompts, logged as a table."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist
from lockstep.core.callback import Callback
from lockstep.optional import HUGGINGFACE_INSTALL_HINT
from lockstep.parallel.precision import autocast
from lockstep.time import Time, TimeUnit, Timestamp, is_interval_due

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["Generate"]

log = logging.getLogger(__name__)


class Generate(Callback):
    """Every ``interval`` (and when training ends), generate a continuation of each of ``prompts``
    with the model's tokenizer and ``generate`` (``kwargs`` go to it: ``max_new_tokens``,
    ``do_sample``, ``top_p``, ...), ``batch_size`` prompts at a time, and log the table
    ``generations`` (columns ``prompt`` and ``generation``) from rank 0, as Composer's callback.

    ``interval`` is a Time, a time string (``'100ba'``, ``'1ep'``, ``'500sp'``, ``'0.5dur'``) or an
    int (epochs). Every rank generates (under FSDP the ranks meet in each forward); the model must
    be a ``HuggingFaceModel`` with a tokenizer.
    """

    def __init__(self, prompts: list[str], interval: str | int | Time, batch_size: int | None = None,
                 **kwargs: Any) -> None:
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            raise ImportError(f"Generate needs transformers: {HUGGINGFACE_INSTALL_HINT}") from e
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a non-empty list of strings, got {prompts!r}")
        self.prompts = list(prompts)
        self.generate_kwargs = kwargs
        self.batch_size = batch_size if batch_size is not None else len(prompts)
        self.interval = Time.from_input(interval, TimeUnit.EPOCH)
        self.last_generate_batch: int | None = None
        self._seen: Timestamp | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._seen = state.timestamp.copy()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit != TimeUnit.EPOCH:
            self._maybe_generate(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit == TimeUnit.EPOCH:
            self._maybe_generate(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.last_generate_batch != int(state.timestamp.batch):
            self.generate(state, logger)

    def _maybe_generate(self, state: State, logger: Logger) -> None:
        before, self._seen = self._seen or Timestamp(), state.timestamp.copy()
        if is_interval_due(before, state.timestamp, self.interval, state.max_duration):
            self.generate(state, logger)

    def generate(self, state: State, logger: Logger) -> None:
        """Generate and log now (every rank calls it)."""
        from lockstep.models.huggingface import HuggingFaceModel

        model = state.model
        if not isinstance(model, HuggingFaceModel):
            raise ValueError(f"Generate needs a HuggingFaceModel, and the model is a {type(model).__name__}")
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError("Generate needs the HuggingFaceModel's tokenizer: pass tokenizer= when building it")
        started, self.last_generate_batch = time.perf_counter(), int(state.timestamp.batch)
        training, padding_side = model.training, tokenizer.padding_side
        model.eval()
        tokenizer.padding_side = "left"  # new tokens follow every prompt directly
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
        try:
            encoded = tokenizer(self.prompts, return_tensors="pt", padding=True)
            outputs: list[torch.Tensor] = []
            for start in range(0, len(self.prompts), self.batch_size):
                ids = encoded["input_ids"][start:start + self.batch_size].to(state.device.torch_device)
                mask = encoded["attention_mask"][start:start + self.batch_size].to(state.device.torch_device)
                with torch.no_grad(), autocast(state.precision, state.device.torch_device):
                    outputs.extend(model.generate(ids, attention_mask=mask, synced_gpus=dist.get_world_size() > 1,
                                                  **self.generate_kwargs))
        finally:
            tokenizer.padding_side = padding_side
            model.train(training)
        if dist.get_global_rank() == 0:
            prompt_length = encoded["input_ids"].shape[1]
            rows = [[prompt, tokenizer.decode(out[prompt_length:], skip_special_tokens=True)]
                    for prompt, out in zip(self.prompts, outputs)]
            logger.log_table(columns=["prompt", "generation"], rows=rows, name="generations")
        log.info("Generate: %d prompts in %.2f s", len(self.prompts), time.perf_counter() - started)
