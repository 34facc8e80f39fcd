"""``Trainer.predict``: the model's outputs on a dataloader, with Composer's PREDICT events."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from lockstep.batch import map_tensors
from lockstep.core.event import Event
from lockstep.parallel.strategy import Strategy
from lockstep.state import State


@torch.no_grad()
def predict(state: State, strategy: Strategy, run_event: Callable[[Event], None], dataloader: Any,
            limit: int | None, return_outputs: bool) -> list[Any]:
    """Run ``model(batch)`` on this rank's batches of ``dataloader`` (at most ``limit``) in eval
    mode; the outputs on CPU, one per batch, when ``return_outputs``. The model's mode and the
    state's batch are put back afterwards, also when a batch raises."""
    was_training, training_batch = state.model.training, state.batch
    module = strategy.eval_module  # the bare module: no DDP hooks; FSDP still gathers in its forward
    outputs: list[Any] = []
    state.model.eval()
    try:
        run_event(Event.PREDICT_START)
        for batch in itertools.islice(dataloader, limit):
            state.batch = strategy.prepare_batch(batch)
            run_event(Event.PREDICT_BATCH_START)
            run_event(Event.PREDICT_BEFORE_FORWARD)
            with strategy.autocast():
                state.outputs = module(state.batch)
            run_event(Event.PREDICT_AFTER_FORWARD)
            if return_outputs:
                outputs.append(map_tensors(state.outputs, _to_cpu))
            run_event(Event.PREDICT_BATCH_END)
        run_event(Event.PREDICT_END)
    finally:
        state.model.train(was_training)
        state.batch, state.outputs = training_batch, None
    return outputs


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()
