"""Checkpoints that start in a bucket: ``load_path='s3://...'`` (or an object name in
``load_object_store``) and autoresume on a machine whose staging folder is empty. The files are
downloaded into the local staging folder, then the loader reads them as it reads any local
checkpoint. Each rank downloads only what it reads: its own file of per-rank checkpoints; one rank
per machine the files every rank there reads."""

from __future__ import annotations

import os
import re
import string
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep import _agreement, dist
from lockstep.checkpoint import files, remote, templates
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.layout import LOCAL
from lockstep.objectstore import ObjectStore, parse_uri, store_for_uri

if TYPE_CHECKING:
    import torch

    from lockstep.checkpoint.saver import CheckpointSaver


def load_path(path: str, object_store: ObjectStore | None, *, layout_name: str, run_name: str,
              device: torch.device | str = "cpu") -> str:
    """Download what this rank loads of ``load_path`` (a collective); the local template to load.
    With ``object_store``, ``path`` is an object name in it (as Composer's ``load_object_store``)."""
    if object_store is None:
        store, key_template = store_for_uri(path, "load_path")
        local_root = os.path.join(remote.STAGING_ROOT, parse_uri(path)[1])
    else:
        store, key_template = object_store, parse_uri(path)[2] if remote.is_remote(path) else path
        local_root = os.path.join(remote.STAGING_ROOT, "load_object_store")
    own = templates.format_name(key_template, templates.place_values(run_name))
    zero = templates.format_name(key_template, templates.place_values(run_name, rank=0))
    error = remote.object_store_problem(store, os.path.dirname(own), f"load_path {path!r}")
    if error is None:
        try:
            if layout_name == LOCAL or (own != zero and _exists(store, own)):
                _download(store, own, Path(local_root, own))
            elif dist.get_local_rank() == 0:  # rank 0's checkpoint, read by every rank of this machine
                _download(store, zero, Path(local_root, zero))
        except Exception as e:
            error = f"load_path {path!r}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)  # also: every download is done
    return os.path.join(local_root, key_template)


def autoresume(saver: CheckpointSaver, *, layout_name: str, run_name: str) -> None:
    """Before autoresume reads the local staging folder (a collective): when no rank has a latest
    pointer there, download the checkpoint the bucket's pointer names, and point the local one at
    it. Local checkpoints come first: they are at least as new as the bucket's."""
    template, folder = saver.latest_template, saver.remote
    assert template is not None and folder is not None
    from lockstep.checkpoint.loader import candidates

    local = any(p.exists() or p.is_symlink() for p in candidates(template, run_name))
    if any(_agreement.gather_small_objects(local)):
        return
    if layout_name == LOCAL:
        _per_rank_files(saver, run_name)
        return
    error = None
    if dist.get_local_rank() == 0:
        try:
            _from_pointer(saver)
        except Exception as e:
            error = f"autoresume from {folder.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=saver._device)


def _from_pointer(saver: CheckpointSaver) -> None:
    folder, pointer = saver.remote, saver.latest
    assert folder is not None and pointer is not None
    key = folder.key_of(str(pointer.relative_to(saver.folder))) + remote.POINTER_SUFFIX
    try:
        target = folder.store.read_bytes(key).decode().strip()
    except FileNotFoundError:
        return  # nothing saved yet: a fresh start
    prefix = folder.key_of("")
    if not target.startswith(prefix):
        raise CheckpointError(f"the latest pointer {folder.store.get_uri(key)} names {target!r}, which is not "
                              f"in the save_folder")
    local = saver.folder / target[len(prefix):]
    _download(folder.store, target, local)
    files.point_latest(pointer, local)


def _per_rank_files(saver: CheckpointSaver, run_name: str) -> None:
    """FSDP ``local`` checkpoints: each rank downloads its own file of the newest step that any
    rank's pointer names. Each rank moves its own pointer, so a job killed between two ranks'
    moves leaves pointers one step apart; both steps are complete in the bucket (a pointer moves
    only once every rank's file is there), so the ranks behind take their file of the newer one."""
    folder, pointer = saver.remote, saver.latest
    assert folder is not None and pointer is not None
    prefix = folder.key_of("")
    target, error = None, None
    try:
        target = folder.store.read_bytes(folder.key_of(str(pointer.relative_to(saver.folder))) +
                                         remote.POINTER_SUFFIX).decode().strip()
    except FileNotFoundError:
        pass
    except Exception as e:
        error = f"autoresume from {folder.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=saver._device)
    targets = _agreement.gather_small_objects(target)
    if all(t is None for t in targets):
        return
    template, newest = saver.config.save_filename, None
    try:
        for rank, key in enumerate(targets):
            if key is None:
                continue
            times = _time_fields(template, templates.place_values(run_name, rank=rank), key[len(prefix):])
            if times is None:
                raise CheckpointError(f"the latest pointer of rank {rank} names {key!r}, which save_filename="
                                      f"{template!r} does not make")
            if newest is None or times.get("batch", 0) > newest.get("batch", 0):
                newest = times
        assert newest is not None
        name = template.format(**saver.place, **newest)
        local = saver.folder / name
        _download(folder.store, folder.key_of(name), local)
        files.point_latest(pointer, local)
    except Exception as e:
        error = f"autoresume from {folder.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=saver._device)


def _time_fields(template: str, place: dict[str, object], name: str) -> dict[str, int] | None:
    """The time fields (``{batch}``, ...) of ``name``, which ``template`` made with ``place``."""
    pattern, seen = [], set()
    for literal, field, spec, _ in string.Formatter().parse(template):
        pattern.append(re.escape(literal))
        if field is None:
            continue
        if field in place:
            pattern.append(re.escape(format(place[field], spec or "")))
        elif field in seen:
            pattern.append(f"(?P={field})")
        else:
            seen.add(field)
            pattern.append(f"(?P<{field}>\\d+)")
    match = re.fullmatch("".join(pattern), name)
    return None if match is None else {k: int(v) for k, v in match.groupdict().items()}


def _exists(store: ObjectStore, key: str) -> bool:
    try:
        store.get_object_size(key)
        return True
    except FileNotFoundError:
        return False


def _download(store: ObjectStore, key: str, local: Path) -> None:
    """The object ``key`` to ``local``, or, when there is no such object, every object under
    ``key/`` into the folder ``local`` (a folder checkpoint)."""
    if _exists(store, key):
        store.download_object(key, local, overwrite=True)
        return
    under = store.list_objects(key.rstrip("/") + "/")
    base = getattr(store, "prefix", "") + key.rstrip("/") + "/"
    if not under:
        raise FileNotFoundError(f"{store.get_uri(key)} does not exist")
    for full in under:
        relative = full[len(base):] if full.startswith(base) else os.path.basename(full)
        store.download_object(full[len(getattr(store, 'prefix', '')):], local / relative, overwrite=True)


def _line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


