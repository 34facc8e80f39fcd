"""Loading a checkpoint into a Trainer on every rank: ``load_path`` and ``autoresume``.

Every step that can fail on one rank is agreed on by all ranks first, so a missing or damaged file
is an error on every rank, never a rank waiting forever for another that gave up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep import dist
from lockstep.checkpoint import files, payload, templates
from lockstep.checkpoint.files import CheckpointError


@dataclass(slots=True)
class Loaded:
    """What a load left for the training loop: this rank's RNG/data entry and the save history."""

    path: Path
    rank_entry: dict[str, Any] | None = None
    history: list[str] = field(default_factory=list)


def candidates(template: str, run_name: str) -> tuple[Path, Path]:
    """This rank's file, and rank 0's: under DDP rank 0 writes one file that serves every rank,
    so a ``{rank}`` template that names no file for this rank falls back to rank 0's."""
    own = Path(templates.format_name(template, templates.place_values(run_name)))
    zero = Path(templates.format_name(template, templates.place_values(run_name, rank=0)))
    return own, zero


def _find(template: str, run_name: str) -> Path | None:
    for path in candidates(template, run_name):
        if path.exists() or path.is_symlink():
            return path
    return None


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank failed, with the first failing rank's message."""
    errors = dist.all_gather_object(error)
    for rank, message in enumerate(errors):
        if message is not None:
            prefix = "" if dist.get_world_size() == 1 else f"rank {rank}: "
            raise CheckpointError(prefix + message)


def load(template: str, state: Any, scaler: torch.amp.GradScaler | None, *, run_name: str,
         weights_only: bool, strict: bool, optional: bool = False, what: str = "load_path") -> Loaded | None:
    """Load the checkpoint ``template`` names into ``state`` on every rank.

    With ``optional`` (autoresume), no file on any rank means a fresh start (None).
    """
    templates.check_template(template, what, time_fields=False)
    path = _find(template, run_name)
    found = dist.all_gather_object(path is not None)
    if optional and not any(found):
        return None
    if path is None:
        own, zero = candidates(template, run_name)
        tried = str(own) if own == zero else f"{own} (nor rank 0's {zero})"
        _agree(f"{what} {template!r}: {tried} does not exist")
    _agree(None)
    assert path is not None
    loaded: Loaded | None = None
    error = None
    try:
        loaded = _load_file(path, state, scaler, run_name=run_name, weights_only=weights_only,
                            strict=strict, check_run_name=optional)
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    assert loaded is not None
    batches = dist.all_gather_object(state.timestamp.batch)
    if len(set(batches)) > 1:
        raise CheckpointError(f"the ranks loaded checkpoints of different steps (batches {batches}): "
                              f"the per-rank files of {template!r} are not from one save")
    return loaded


def _load_file(path: Path, state: Any, scaler: torch.amp.GradScaler | None, *, run_name: str,
               weights_only: bool, strict: bool, check_run_name: bool) -> Loaded:
    target = files.resolve_pointer(path)
    content = files.read(target)
    meta = payload.metadata(content, target)
    if meta is None:  # a plain state_dict of tensors
        if not weights_only:
            raise CheckpointError(f"{target} holds only model weights (a plain state_dict): pass "
                                  f"load_weights_only=True to load it")
        payload.load_model(state.model, content, target, strict)
        return Loaded(target)
    if check_run_name and meta.get("run_name") != run_name:
        raise CheckpointError(f"autoresume found {target}, a checkpoint of run {meta.get('run_name')!r}, "
                              f"not of run_name {run_name!r}: give each run its own save_folder "
                              f"(e.g. save_folder='checkpoints/{{run_name}}')")
    payload.load_model(state.model, content["model"], target, strict)
    if weights_only:
        return Loaded(target)
    payload.check_world_size(content, target, dist.get_world_size())
    entry = payload.apply(content, state, scaler, target, dist.get_global_rank())
    return Loaded(target, entry, list(meta.get("history", [])))
