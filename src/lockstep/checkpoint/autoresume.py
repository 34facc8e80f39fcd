"""Autoresume's choice of checkpoint: the newest one the latest pointer names, or, when that one is
damaged, the bucket's copy of it, else the newest older one that loads (the damaged one set aside).
A bucket's folder is first brought onto this node's disk (:func:`lockstep.checkpoint.fetch.autoresume`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist
from lockstep.checkpoint import fetch, loader, templates
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.checkpoint.files import DAMAGED, CheckpointError, DamagedCheckpoint, point_latest, set_aside
from lockstep.checkpoint.layout import LOCAL, Layout
from lockstep.checkpoint.save_folder import SaveFolder

if TYPE_CHECKING:
    from lockstep.core.state import State


def resume(config: CheckpointConfig, state: State, layout: Layout, where: SaveFolder,
           device: torch.device) -> loader.Loaded | None:
    """Load the newest checkpoint the latest pointer names. If its bytes are damaged (a restart
    would fail on it every time), fall back to the newest one that loads, with a warning naming
    what was wrong, and set the damaged one aside. The loader finds damage before any rank loads
    anything, so a fallback starts from an untouched state. A checkpoint that does not fit the run
    fails as it is. Per-rank files (FSDP ``local``) fall back to the newest step every rank has."""
    template = where.latest_template
    assert template is not None  # CheckpointConfig: autoresume needs save_latest_filename
    if where.remote is not None and not fetch.autoresume(where, device, layout_name=layout.name, run_name=state.run_name):
        if dist.get_global_rank() == 0:
            warnings.warn(f"autoresume found no complete checkpoint in {where.remote.uri} (no latest pointer "
                          f"there yet), and the local copies in {where.local} do not serve every rank: they "
                          f"are what a job stopped before its first checkpoint reached the bucket left on "
                          f"its nodes; starting fresh", stacklevel=4)
        return None
    try:
        return loader.load(template, state, layout, run_name=state.run_name,
                           weights_only=False, strict=config.load_strict_model_weights, optional=True,
                           what="autoresume's latest pointer")
    except DamagedCheckpoint as newest:
        if where.remote is not None:
            again = _from_bucket_copy(config, state, layout, where, device, newest)
            if again is not None:
                return again
        per_rank = layout.name == LOCAL
        for path in _older_checkpoints(where, per_rank=per_rank):
            try:
                loaded = loader.load(str(path), state, layout, run_name=state.run_name, weights_only=False,
                                     strict=config.load_strict_model_weights, what="autoresume's fallback")
            except DamagedCheckpoint:
                continue
            rank = dist.get_global_rank()
            aside = _set_aside(where, path) if per_rank or rank == 0 else ""
            if rank == 0:
                warnings.warn(f"autoresume skipped the newest checkpoint, which does not load ({newest}); "
                              f"resumed from {path} instead{aside}", stacklevel=4)
            return loaded
        raise


def _from_bucket_copy(config: CheckpointConfig, state: State, layout: Layout, where: SaveFolder, device: torch.device,
                      newest: DamagedCheckpoint) -> loader.Loaded | None:
    """A bucket save_folder whose local copy of the newest checkpoint is damaged: set that copy
    aside, download the bucket's copy of the checkpoint its pointer names, and load it (a
    collective; every rank decides alike). None, with a warning, when the bucket has none or its
    copy does not load either: then autoresume falls back to older local checkpoints."""
    assert where.remote is not None and where.latest_template is not None
    rank, bucket = dist.get_global_rank(), where.remote.uri
    try:
        done = fetch.redownload(where, device, layout_name=layout.name, run_name=state.run_name)
    except CheckpointError as e:  # agreed: raised on every rank
        if rank == 0:
            warnings.warn(f"autoresume found the local copy of the newest checkpoint damaged ({newest}) and "
                          f"could not download it again from {bucket} ({e}); trying older local checkpoints",
                          stacklevel=5)
        return None
    if done is None:
        return None  # no pointer in the bucket: nothing there to download
    uri, aside = done
    try:
        loaded = loader.load(where.latest_template, state, layout, run_name=state.run_name, weights_only=False,
                             strict=config.load_strict_model_weights, optional=True,
                             what="autoresume's download from the bucket")
    except DamagedCheckpoint as again:
        if rank == 0:
            warnings.warn(f"autoresume found the local copy of the newest checkpoint damaged ({newest}), and "
                          f"the copy downloaded again from {uri} does not load either ({again}); trying older "
                          f"local checkpoints", stacklevel=5)
        return None
    if rank == 0 and loaded is not None:
        moved = f"set it aside as {', '.join(aside)}" if aside else "it was gone when set aside"
        warnings.warn(f"autoresume found the local copy of the newest checkpoint damaged ({newest}); {moved}, "
                      f"downloaded the bucket's copy {uri} again and resumed from it", stacklevel=5)
    return loaded


def _set_aside(where: SaveFolder, resumed: Path) -> str:
    """Rank 0 (each rank, for per-rank files), once every rank has loaded ``resumed``: rename the
    damaged checkpoint the latest pointer names with a ``.damaged`` suffix (kept to look at, and out
    of the way of the run's next save of that step) and point the pointer at ``resumed``. What it
    did, for the warning; it never raises, since no other rank would know (the run goes on, and its
    next save moves the pointer)."""
    pointer = where.latest
    assert pointer is not None  # autoresume needs save_latest_filename
    done = ""
    try:
        if pointer.is_symlink():
            newest = pointer.parent / os.readlink(pointer)
            if newest.exists() and newest.resolve() != resumed.resolve():
                done = f"; renamed the damaged one to {set_aside(newest).name}"
        point_latest(pointer, resumed)
    except OSError as e:
        done += f"; could not set the damaged one aside ({e})"
    return done


def _older_checkpoints(where: SaveFolder, *, per_rank: bool) -> list[Path]:
    """The run's checkpoints, newest first, the same steps on every rank (the loads that try them
    are collectives), but for those set aside. One file serves every rank: rank 0's list, without
    the one its latest pointer names. Per-rank files: each rank's own file of each step that every
    rank has, in the order of rank 0's (the ranks' pointers may name different steps, so none is
    left out: a damaged step fails its load again)."""
    rank = dist.get_global_rank()
    if not per_rank:
        found: list[Any] = [[str(p) for p in _listed(where, but_newest=True)] if rank == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        return [Path(p) for p in found[0]]
    template, place = where.filename, where.place
    mine = {}
    for path in _listed(where, but_newest=False):
        times = templates.time_fields(template, place, path.relative_to(where.local).as_posix())
        if times is not None:  # else not a name of this run's template
            mine[tuple(times.items())] = path
    every = dist.all_gather_object(list(mine))
    common = set(every[0]).intersection(*every[1:])
    return [mine[key] for key in every[0] if key in common]


def _listed(where: SaveFolder, *, but_newest: bool) -> list[Path]:
    """This rank's checkpoints of the run in its folder (``save_filename`` may name subfolders),
    newest first, but for those set aside and, ``but_newest``, the one its latest pointer names."""
    pointer = where.latest
    newest = None
    if but_newest and pointer is not None and pointer.is_symlink():
        newest = (pointer.parent / os.readlink(pointer)).resolve()
    paths = [p for p in where.local.glob(where.filename_glob())
             if not p.name.endswith(DAMAGED) and (newest is None or p.resolve() != newest)]
    return sorted(paths, key=_mtime, reverse=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
