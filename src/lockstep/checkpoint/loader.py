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


def _agree(error: str | None, batch: int = 0) -> tuple[int, int, int]:
    """One small all-reduce: (ranks that failed, lowest batch, highest batch). If any rank failed,
    raise on every rank with the first failing rank's message (gathered only then)."""
    t = torch.tensor([int(error is not None), -batch, batch], dtype=torch.int64)
    failed, neg_low, high = (int(v) for v in dist.all_reduce(t, "MAX").tolist())
    return failed, -neg_low, high


def _raise_first(error: str | None) -> None:
    errors = dist.all_gather_object(error)
    for rank, message in enumerate(errors):
        if message is not None:
            prefix = "" if len(errors) == 1 else f"rank {rank}: "
            raise CheckpointError(prefix + message)


def load(template: str, state: Any, scaler: torch.amp.GradScaler | None, *, run_name: str,
         weights_only: bool, strict: bool, optional: bool = False, what: str = "load_path") -> Loaded | None:
    """Load the checkpoint ``template`` names into ``state`` on every rank (two small all-reduces).

    With ``optional`` (autoresume), no file on any rank means a fresh start (None).
    """
    templates.check_template(template, what, time_fields=False)
    own, zero = candidates(template, run_name)
    path = next((p for p in (own, zero) if p.exists() or p.is_symlink()), None)
    missing = None
    if path is None:
        tried = str(own) if own == zero else f"{own} (nor rank 0's {zero})"
        missing = f"{what} {template!r}: {tried} does not exist"
    t = torch.tensor([int(path is None), int(path is not None)], dtype=torch.int64)
    missing_ranks, found_ranks = (int(v) for v in dist.all_reduce(t, "SUM").tolist())
    if optional and found_ranks == 0:
        return None
    if missing_ranks:
        _raise_first(missing)
    assert path is not None
    loaded: Loaded | None = None
    error = None
    try:
        # A file every rank reads (rank 0's) is CRC-checked by rank 0 alone; its verdict reaches
        # the others through _agree. A rank's own file is checked by that rank.
        check_crc = dist.get_global_rank() == 0 or path != zero
        loaded = _load_file(path, state, scaler, run_name=run_name, weights_only=weights_only,
                            strict=strict, check_run_name=optional, check_crc=check_crc)
    except CheckpointError as e:
        error = str(e)
    failed, low, high = _agree(error, state.timestamp.batch)
    if failed:
        _raise_first(error)
    if low != high:
        raise CheckpointError(f"the ranks loaded checkpoints of different steps (batches {low} to {high}): "
                              f"the per-rank files of {template!r} are not from one save")
    assert loaded is not None
    return loaded


def _load_file(path: Path, state: Any, scaler: torch.amp.GradScaler | None, *, run_name: str,
               weights_only: bool, strict: bool, check_run_name: bool, check_crc: bool = True) -> Loaded:
    target = files.resolve_pointer(path)
    content = files.read(target, check_crc)
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
