"""The Trainer's checkpoint arguments -> a saver, and the load that happens at construction."""

from __future__ import annotations

from typing import Any

import torch

from lockstep.checkpoint import loader
from lockstep.checkpoint.saver import CheckpointSaver, SaveInterval
from lockstep.checkpoint.states import Layout
from lockstep.time import Time


def make_saver(*, save_folder: str | None, save_filename: str, save_latest_filename: str | None,
               save_interval: SaveInterval, save_num_checkpoints_to_keep: int, save_overwrite: bool,
               run_name: str, max_duration: Time | None, layout: Layout,
               device: torch.device) -> CheckpointSaver | None:
    if save_folder is None:
        return None
    return CheckpointSaver(folder=save_folder, filename=save_filename, latest_filename=save_latest_filename,
                           interval=save_interval, num_to_keep=save_num_checkpoints_to_keep,
                           overwrite=save_overwrite, run_name=run_name, max_duration=max_duration,
                           layout=layout.name, device=device)


def load_at_start(state: Any, scaler: torch.amp.GradScaler | None, saver: CheckpointSaver | None,
                  layout: Layout, *,
                  load_path: str | None, autoresume: bool, run_name_given: bool,
                  weights_only: bool, strict: bool) -> loader.Loaded | None:
    """Autoresume from the run's newest checkpoint, else ``load_path``, else start fresh."""
    loaded = None
    if autoresume:
        if not run_name_given:
            raise ValueError("autoresume=True needs run_name=...: a restarted job finds its checkpoints by "
                             "its run name, and a generated name differs on every launch")
        if saver is None or saver.latest_template is None:
            raise ValueError("autoresume=True needs save_folder and save_latest_filename: it resumes from "
                             "the latest pointer the run writes there")
        loaded = loader.load(saver.latest_template, state, scaler, layout, run_name=state.run_name,
                             weights_only=False, strict=strict, optional=True,
                             what="autoresume's latest pointer")
        saver.may_replace_own = True
    if loaded is None and load_path is not None:
        loaded = loader.load(load_path, state, scaler, layout, run_name=state.run_name,
                             weights_only=weights_only, strict=strict)
    elif saver is not None and not autoresume:
        saver.refuse_existing()
    if saver is not None and loaded is not None and not loaded.weights_only:
        saver.last_saved_batch = state.timestamp.batch
        if autoresume:
            saver.history = loaded.history
    return loaded

