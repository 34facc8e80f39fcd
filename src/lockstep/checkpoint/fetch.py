"""Checkpoints that start in a bucket: ``load_path='s3://...'`` (or an object name in
``load_object_store``) and autoresume on a machine whose staging folder is empty. The files are
downloaded into the local staging folder, then the loader reads them as it reads any local
checkpoint. Each rank downloads only what it reads: its own file of per-rank checkpoints; one rank
per machine the files every rank there reads."""

from __future__ import annotations

import os
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
    error = None
    per_rank = layout_name == LOCAL
    if per_rank or dist.get_local_rank() == 0:
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


