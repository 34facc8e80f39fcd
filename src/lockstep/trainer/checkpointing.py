"""The Trainer's checkpoint config -> a saver, and the load that happens before training."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist
from lockstep.checkpoint import loader
from lockstep.checkpoint.files import CheckpointError, DamagedCheckpoint
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.checkpoint.saver import CheckpointSaver
from lockstep.checkpoint.layout import LOCAL, SINGLE, CheckpointLayout
from lockstep.time import Time

if TYPE_CHECKING:
    from lockstep.state import State


def make_saver(config: CheckpointConfig, *, run_name: str, max_duration: Time | None, layout: CheckpointLayout,
               device: torch.device) -> CheckpointSaver | None:
    if config.save_folder is None:
        return None
    if config.save_weights_only and layout.name != SINGLE:
        raise ValueError(f"save_weights_only=True writes one file of full weights, but this run saves "
                         f"{layout.name!r} checkpoints: use fsdp_config={{'state_dict_type': 'full'}} (or DDP), "
                         f"or export the weights afterwards with lockstep.checkpoint.export_state_dict")
    saver = CheckpointSaver(config, run_name=run_name, max_duration=max_duration, layout=layout.name, device=device)
    saver.check_folder()
    return saver


def load_at_start(config: CheckpointConfig, state: State, layout: CheckpointLayout, saver: CheckpointSaver | None,
                  *, run_name_given: bool) -> loader.Loaded | None:
    """Autoresume from the run's newest checkpoint, else ``load_path``, else start fresh; then
    tell the saver what the run continues from."""
    loaded = None
    if config.autoresume:
        if not run_name_given:
            raise ValueError("autoresume=True needs run_name=...: a restarted job finds its checkpoints by "
                             "its run name, and a generated name differs on every launch")
        assert saver is not None  # CheckpointConfig: autoresume needs save_folder, so there is a saver
        loaded = _autoresume(config, state, layout, saver)
    if loaded is None and config.load_path is not None:
        loaded = loader.load(config.load_path, state, layout, run_name=state.run_name,
                             weights_only=config.load_weights_only, strict=config.load_strict_model_weights,
                             ignore=config.load_ignore_keys)
    if saver is not None:
        saver.begin(loaded)
    return loaded


def _autoresume(config: CheckpointConfig, state: State, layout: CheckpointLayout,
                saver: CheckpointSaver) -> loader.Loaded | None:
    """Load the newest checkpoint the latest pointer names. If its bytes are damaged (a restart
    would fail on it every time), fall back to the newest one that loads, with a warning naming
    both. A checkpoint that does not fit the run fails as it is; per-rank files (FSDP ``local``)
    do not fall back."""
    template = saver.latest_template
    assert template is not None  # CheckpointConfig: autoresume needs save_latest_filename
    try:
        return loader.load(template, state, layout, run_name=state.run_name,
                           weights_only=False, strict=config.load_strict_model_weights, optional=True,
                           what="autoresume's latest pointer")
    except DamagedCheckpoint as newest:
        if layout.name == LOCAL:
            raise
        for path in _older_checkpoints(saver):
            try:
                loaded = loader.load(str(path), state, layout, run_name=state.run_name, weights_only=False,
                                     strict=config.load_strict_model_weights, what="autoresume's fallback")
            except CheckpointError:
                continue
            if dist.get_global_rank() == 0:
                warnings.warn(f"autoresume skipped the newest checkpoint, which does not load ({newest}); "
                              f"resumed from {path} instead", stacklevel=4)
            return loaded
        raise


def _older_checkpoints(saver: CheckpointSaver) -> list[Path]:
    """Rank 0's view of the run's checkpoints other than the latest pointer's, newest first (every
    rank gets the same list: the loads that try them are collectives)."""
    found: list[Any] = [None]
    if dist.get_global_rank() == 0:
        pointer = saver.latest
        newest = os.path.basename(os.readlink(pointer)) if pointer is not None and pointer.is_symlink() else None
        paths = [p for p in saver.folder.glob(saver.filename_glob()) if p.name != newest]
        found[0] = [str(p) for p in sorted(paths, key=_mtime, reverse=True)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    return [Path(p) for p in found[0]]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
