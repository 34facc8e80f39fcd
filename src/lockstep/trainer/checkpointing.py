"""The Trainer's checkpoint config -> a saver, and the load that happens before training."""

from __future__ import annotations

from typing import Any

import torch

from lockstep.checkpoint import loader
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.checkpoint.saver import CheckpointSaver
from lockstep.checkpoint.states import Layout
from lockstep.time import Time


def make_saver(config: CheckpointConfig, *, run_name: str, max_duration: Time | None, layout: Layout,
               device: torch.device) -> CheckpointSaver | None:
    if config.save_folder is None:
        return None
    return CheckpointSaver(config, run_name=run_name, max_duration=max_duration, layout=layout.name, device=device)


def load_at_start(config: CheckpointConfig, state: Any, layout: Layout, saver: CheckpointSaver | None, *,
                  run_name_given: bool) -> loader.Loaded | None:
    """Autoresume from the run's newest checkpoint, else ``load_path``, else start fresh; then
    tell the saver what the run continues from."""
    loaded = None
    if config.autoresume:
        if not run_name_given:
            raise ValueError("autoresume=True needs run_name=...: a restarted job finds its checkpoints by "
                             "its run name, and a generated name differs on every launch")
        loaded = loader.load(saver.latest_template, state, layout, run_name=state.run_name,  # type: ignore[union-attr, arg-type]
                             weights_only=False, strict=config.load_strict_model_weights, optional=True,
                             what="autoresume's latest pointer")
    if loaded is None and config.load_path is not None:
        loaded = loader.load(config.load_path, state, layout, run_name=state.run_name,
                             weights_only=config.load_weights_only, strict=config.load_strict_model_weights)
    if saver is not None:
        saver.begin(loaded)
    return loaded
