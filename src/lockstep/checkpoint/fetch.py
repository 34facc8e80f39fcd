"""Checkpoints that start in a bucket: ``load_path='s3://...'`` (or an object name in
``load_object_store``) and autoresume on a machine whose staging folder lacks them. The files are
downloaded into the local staging folder, then the loader reads them as it reads any local
checkpoint. Each rank downloads only what it reads: its own file of per-rank checkpoints; of a
folder checkpoint (FSDP ``sharded``, DeepSpeed) the parts its ``lockstep.pt`` records that it reads
at this world size (every part at another), each part once per staging folder, by one of the ranks
there that read it; of a single-file checkpoint, one rank per staging folder the file every rank
there reads. Every file appears whole or not at all (downloaded to a temporary name, then renamed),
and so does a folder checkpoint downloaded where there was none.

Autoresume takes the local checkpoint when every rank finds there all it reads, unless the
bucket's pointer names a newer one (the job ran on other machines since this disk's copy).
Otherwise (a fresh node, or nodes without a shared disk, where no node's staging folder holds
every rank's parts of a folder checkpoint) it downloads the checkpoint the bucket's pointer names,
which every rank has uploaded in full, and points the local pointer at it. When the bucket has no pointer yet and the
local files serve only some ranks (a job killed before its first checkpoint was complete in the
bucket, on nodes that share no disk), the run starts fresh.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep import _agreement, dist
from lockstep.checkpoint import files, integrity, payload, remote, templates
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.remote import error_line as _line
from lockstep.checkpoint.layout import DEEPSPEED, FOLDER_LAYOUTS, LOCAL, SHARDED_META
from lockstep.checkpoint.save_folder import SaveFolder
from lockstep.objectstore import ObjectStore, parse_uri, store_for_uri

if TYPE_CHECKING:
    import torch


def load_path(path: str, object_store: ObjectStore | None, *, layout_name: str, run_name: str,
              device: torch.device | str = "cpu", weights_only: bool = False) -> str:
    """Download what this rank loads of ``load_path`` (a collective); the local template to load.
    With ``object_store``, ``path`` is an object name in it (as Composer's ``load_object_store``).
    ``weights_only``: ``load_weights_only`` (see :func:`download_folder`)."""
    if object_store is None:
        store, key_template = store_for_uri(path, "load_path")
        local_root = os.path.join(remote.STAGING_ROOT, *parse_uri(path)[:2])  # .lockstep/SCHEME/BUCKET
    else:
        store, key_template = object_store, parse_uri(path)[2] if remote.is_remote(path) else path
        local_root = os.path.join(remote.STAGING_ROOT, "load_object_store")
    own = templates.format_name(key_template, templates.place_values(run_name))
    zero = templates.format_name(key_template, templates.place_values(run_name, rank=0))
    error = remote.object_store_problem(store, os.path.dirname(own), f"load_path {path!r}")
    folder = error is None and layout_name in FOLDER_LAYOUTS and own == zero and not _exists(store, zero)
    if all(_agreement.gather_small_objects(folder)):  # a folder checkpoint: each rank its parts
        download_folder(store, zero, Path(local_root, zero), what=f"load_path {path!r}", device=device,
                        weights_only=weights_only)
        return os.path.join(local_root, key_template)
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


def autoresume(where: SaveFolder, device: torch.device, *, layout_name: str, run_name: str) -> bool:
    """Before autoresume reads the local staging folder (a collective): unless the local files
    serve every rank, download the checkpoint the bucket's pointer names, and point the local
    pointer at it, or when the bucket's pointer names a newer checkpoint than the local pointer
    (by their names' time fields). Local checkpoints come first otherwise, being at least as new
    as the bucket's on a disk the job last ran on: a single file on rank 0's disk (the loader
    sends it to ranks without it), per-rank files on every rank, a folder checkpoint with every
    part each rank reads on that rank's disk.

    Returns False (on every rank) when the run must start fresh: the bucket has no pointer (no
    checkpoint ever reached it whole) and the local files serve only some ranks: what a job
    killed before its first checkpoint was complete in the bucket left on the disks of its nodes,
    which share none (a rank that sees no local pointer at all). When every rank sees one, the
    local files are read as a local save_folder's are (a damaged newest checkpoint falls back to
    an older one)."""
    template, folder = where.latest_template, where.remote
    assert template is not None and folder is not None
    from lockstep.checkpoint.loader import candidates

    own, zero = candidates(template, run_name)
    if layout_name == LOCAL:
        seen = _agreement.gather_small_objects(own.exists() or own.is_symlink())
        if all(seen) and not _bucket_ahead(where, device, run_name, per_rank=True):
            return True
        return _per_rank_files(where, device, run_name) or not any(seen)
    if layout_name in FOLDER_LAYOUTS:
        pointer = next((p for p in (own, zero) if p.exists() or p.is_symlink()), None)
        holds = pointer is not None and _holds_reads(pointer)
        found = _agreement.gather_small_objects((pointer is not None, holds))
        if all(holds for _, holds in found) and not _bucket_ahead(where, device, run_name, per_rank=False):
            return True
        seen = [seen for seen, _ in found]
        # no rank sees a local pointer: nothing was left anywhere, a fresh start rather than a stopped job's copies
        return _folder_from_pointer(where, device) or all(seen) or not any(seen)
    local = own.exists() or own.is_symlink() or zero.exists() or zero.is_symlink()
    seen = _agreement.gather_small_objects(local)
    if seen[0] and not _bucket_ahead(where, device, run_name, per_rank=False):
        return True  # the loader sends rank 0's file to ranks without it
    error, downloaded = None, False
    if dist.get_local_rank() == 0:
        try:
            downloaded = _from_pointer(where, device)
        except Exception as e:
            error = f"autoresume from {folder.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)
    return any(_agreement.gather_small_objects(downloaded)) or not any(seen)


def _bucket_ahead(where: SaveFolder, device: torch.device, run_name: str, *, per_rank: bool) -> bool:
    """Whether the bucket's latest pointer names a newer checkpoint than the local one does (a
    collective; rank 0's pointers, or under per-rank files each rank's own), by the time fields of
    their names: a disk that holds an older copy of the run (the job ran on other machines since)
    must not take the run back. False where a name does not tell (another save_filename)."""
    targets = _agreed_targets(where, device, per_rank=per_rank)
    key = targets[dist.get_global_rank()] if per_rank else targets[0]
    ahead = False
    if key is not None and (per_rank or dist.get_global_rank() == 0):
        assert where.remote is not None and where.latest is not None
        template = where.filename
        try:
            local = files.resolve_pointer(where.latest).relative_to(where.local).as_posix()
            ahead = _later(templates.time_fields(template, where.place, key[len(where.remote.key_of("")):]),
                           templates.time_fields(template, where.place, local))
        except Exception:  # a local pointer the loader will find damaged, or a name elsewhere
            ahead = False
    return any(_agreement.gather_small_objects(ahead))


def _later(a: dict[str, int] | None, b: dict[str, int] | None) -> bool:
    """Whether the time fields ``a`` are later than ``b`` (the first unit both have that differs)."""
    if a is None or b is None:
        return False
    for unit in ("batch", "sample", "token", "epoch"):
        if unit in a and unit in b and a[unit] != b[unit]:
            return a[unit] > b[unit]
    return False


def redownload(where: SaveFolder, device: torch.device, *, layout_name: str, run_name: str) -> tuple[str, list[str]] | None:
    """After the local copy of the newest checkpoint failed to load as damaged (every rank agreed,
    before any rank loaded anything), a collective: set that copy aside with the ``.damaged``
    suffix, on each staging folder that holds it, then download the checkpoint the bucket's
    pointer names as :func:`autoresume` does on a fresh machine (each rank what it reads) and
    point the local pointers at it. Returns the bucket's URI of what was downloaded and the copies
    set aside (every rank's); None, having touched nothing, when the bucket has no pointer.
    Raises CheckpointError, on every rank, when a download fails."""
    folder = where.remote
    assert folder is not None and where.latest is not None and where.latest_template is not None
    from lockstep.checkpoint.loader import candidates

    per_rank = layout_name == LOCAL
    targets = _agreed_targets(where, device, per_rank=per_rank)
    if all(t is None for t in targets) or (not per_rank and targets[0] is None):
        return None
    own, zero = candidates(where.latest_template, run_name)
    followed = next((p for p in ((own,) if per_rank else (own, zero)) if p.is_symlink()), None)
    damaged = None if followed is None else followed.parent / os.readlink(followed)
    place = (socket.gethostname(), *_identity_of(where.local))
    every = _agreement.gather_small_objects((place, _absolute(followed), _absolute(damaged)))
    sharing = [r for r, (host, _, _) in enumerate(every) if host == place]
    first = per_rank or dist.get_global_rank() == sharing[0]  # per-rank files: no rank reads another's
    mine = (dist.get_global_rank(),) if per_rank else sharing
    aside = _set_aside_damaged(where, device, sorted({every[r][2] for r in mine if every[r][2] is not None}) if first else [])
    if per_rank:
        _per_rank_files(where, device, run_name)
        downloaded = files.resolve_pointer(where.latest).relative_to(where.local).as_posix()
        uri = f"{folder.store.get_uri(folder.key_of(downloaded))} (each rank its own file)"
    else:
        pointers = sorted({every[r][1] for r in sharing if every[r][1]} | {_absolute(zero)}) if first else []
        uri = _download_again(where, device, targets[0], layout_name, pointers)
    every_aside = sorted({p for one in _agreement.gather_small_objects(aside) for p in one})
    return uri, every_aside


def _set_aside_damaged(where: SaveFolder, device: torch.device, paths: list[str]) -> list[str]:
    """Rename each of ``paths`` (this rank's share of the damaged copies) with the ``.damaged``
    suffix, a collective that raises on every rank if any rank could not; the new names."""
    assert where.remote is not None
    aside, error = [], None
    for path in paths:
        try:
            if os.path.lexists(path):
                aside.append(str(files.set_aside(Path(path))))
        except OSError as e:
            error = f"autoresume from {where.remote.uri}: could not set the damaged {path} aside: {e}"
    _agreement.raise_first_error(error, CheckpointError, device=device)  # before any download
    return aside


def _download_again(where: SaveFolder, device: torch.device, key: str, layout_name: str, pointers: list[str]) -> str:
    """Download the checkpoint ``key`` (a collective: a folder's parts by the ranks that read them,
    a single file by the ranks given ``pointers``, the first of each staging folder), then point
    ``pointers`` at it; its URI."""
    folder = where.remote
    assert folder is not None
    what = f"autoresume from {folder.uri}"
    local = where.local / key[len(folder.key_of("")):]
    if layout_name in FOLDER_LAYOUTS:
        download_folder(folder.store, key, local, what=what, device=device)
    error = None
    if pointers:
        try:
            if layout_name not in FOLDER_LAYOUTS:
                _download(folder.store, key, local)
            for pointer in pointers:
                files.point_latest(Path(pointer), local)
        except Exception as e:
            error = f"{what}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)  # every copy in place
    return folder.store.get_uri(key)


def _agreed_targets(where: SaveFolder, device: torch.device, *, per_rank: bool) -> list[str | None]:
    """Every rank's reading of the bucket's latest pointer (a collective): each rank reads its own
    under per-rank files, else rank 0 alone (the others' entries are None). A failed read raises
    on every rank."""
    assert where.remote is not None
    target, error = None, None
    if per_rank or dist.get_global_rank() == 0:
        try:
            target = _pointer_target(where, device)
        except Exception as e:
            error = f"autoresume from {where.remote.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)
    return _agreement.gather_small_objects(target)


def _identity_of(path: Path) -> tuple[int, int]:
    """The device and inode of the folder ``path`` (made if missing): what tells staging folders apart."""
    path.mkdir(parents=True, exist_ok=True)
    seen = os.stat(path)
    return seen.st_dev, seen.st_ino


def _absolute(path: Path | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def _pointer_target(where: SaveFolder, device: torch.device) -> str | None:
    """The key the bucket's latest pointer names; None when there is no pointer (nothing saved yet)."""
    folder, pointer = where.remote, where.latest
    assert folder is not None and pointer is not None
    key = folder.key_of(str(pointer.relative_to(where.local))) + remote.POINTER_SUFFIX
    try:
        target = folder.store.read_bytes(key).decode().strip()
    except FileNotFoundError:
        return None
    if not target.startswith(folder.key_of("")):
        raise CheckpointError(f"the latest pointer {folder.store.get_uri(key)} names {target!r}, which is not "
                              f"in the save_folder")
    return target


def _from_pointer(where: SaveFolder, device: torch.device) -> bool:
    """A single-file checkpoint: download the one the bucket's pointer names, and point the local
    pointer at it; False when the bucket has no pointer (nothing saved there yet)."""
    folder, pointer = where.remote, where.latest
    assert folder is not None and pointer is not None
    target = _pointer_target(where, device)
    if target is None:
        return False
    local = where.local / target[len(folder.key_of("")):]
    _download(folder.store, target, local)
    files.point_latest(pointer, local)
    return True


def _holds_reads(pointer: Path) -> bool:
    """Whether the folder checkpoint ``pointer`` names holds, on this rank's disk, every part this
    rank reads. Not on a node whose disk rank 0 does not see (rank 0 published the folder on its
    own), nor on rank 0's node then (the other nodes' parts are only in the bucket)."""
    try:
        target = files.resolve_pointer(pointer)
        meta = payload.metadata(files.read(target / SHARDED_META), target) or {}
        reads = integrity.reads_of(meta, dist.get_global_rank(), dist.get_world_size())
        names = reads if reads is not None else set(meta.get("parts") or {}) | set(meta.get("files") or {})
        return all((target / name).is_file() for name in names)
    except Exception:  # damaged or foreign: the bucket's copy is whole
        return False


def _folder_from_pointer(where: SaveFolder, device: torch.device) -> bool:
    """Every rank: download the parts it reads of the folder checkpoint the bucket's pointer names
    (a collective); then one rank of each staging folder points the local pointer at it. Nothing
    when the bucket has no pointer yet; then False."""
    folder, pointer = where.remote, where.latest
    assert folder is not None and pointer is not None
    what = f"autoresume from {folder.uri}"
    target = _agreed_targets(where, device, per_rank=False)[0]
    if target is None:
        return False  # nothing saved in the bucket yet
    local = where.local / target[len(folder.key_of("")):]
    first = download_folder(folder.store, target, local, what=what, device=device)
    error = None
    if first:
        try:
            files.point_latest(pointer, local)
        except OSError as e:
            error = f"{what}: could not point {pointer} at {local}: {e}"
    _agreement.raise_first_error(error, CheckpointError, device=device)  # every pointer moved
    return True


def download_folder(store: ObjectStore, key: str, local: Path, *, what: str, device: torch.device | str = "cpu",
                    weights_only: bool = False) -> bool:
    """Download the folder checkpoint ``key`` into ``local`` (a collective): of its parts, those
    this rank reads (all of them when it is loaded at another world size than the one that saved
    it, or, with ``weights_only``, when it is a DeepSpeed checkpoint, whose full weights are rebuilt
    from every rank's partition), each by one of the ranks that share ``local`` and read it.
    A folder not there yet is filled under a temporary name and renamed once every part is in
    it, so a download cut short leaves no folder under the checkpoint's name (the next job's
    sweep removes the temporary one); into a folder already there (a node's own parts of it),
    ``lockstep.pt`` is written last. Returns whether this rank is the first of those that share
    ``local``."""
    error, names, data, place = None, [], b"", None
    try:
        place = (socket.gethostname(), *_identity_of(local.parent))  # the same folder on the same machine
        data, names = _reads_of_download(store, key, local, weights_only)
    except Exception as e:
        error = f"{what}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)
    every = _agreement.gather_small_objects((place, names, os.getpid(), local.is_dir()))
    sharing = [rank for rank, (host, *_) in enumerate(every) if host == place]
    first, rank = sharing[0], dist.get_global_rank()
    fresh = not every[first][3]  # as the first rank of this folder saw it
    into = files.temp_path(local, every[first][2]) if fresh else local
    try:
        into.mkdir(parents=True, exist_ok=True)
        for name in _turn_of(rank, {r: every[r][1] for r in sharing}):
            store.download_object(f"{key}/{name}", into / name, overwrite=True)
    except Exception as e:
        error = f"{what}: {_line(e)}"
    try:
        _agreement.raise_first_error(error, CheckpointError, device=device)  # every part is in place
    except CheckpointError:
        if fresh and rank == first:
            files.remove(into)
        raise
    if rank == first:
        try:
            _write_whole(into / SHARDED_META, data)
            if fresh:
                _name_download(into, local)
        except OSError as e:
            error = f"{what}: could not put the download in place at {local}: {e}"
    _agreement.raise_first_error(error, CheckpointError, device=device)  # the folder has its name
    return rank == first


def _reads_of_download(store: ObjectStore, key: str, local: Path, weights_only: bool) -> tuple[bytes, list[str]]:
    """The folder checkpoint ``key``'s ``lockstep.pt`` (its bytes) and the names of the parts this
    rank reads of it (see :func:`download_folder`)."""
    data = store.read_bytes(f"{key}/{SHARDED_META}")
    meta = payload.metadata(files.read_bytes(data, local / SHARDED_META), local) or {}
    every_part = weights_only and payload.layout_of(meta) == DEEPSPEED
    reads = None if every_part else integrity.reads_of(meta, dist.get_global_rank(), dist.get_world_size())
    return data, sorted(reads if reads is not None else set(_names_under(store, key)) - {SHARDED_META})


def _turn_of(rank: int, reads: dict[int, list[str]]) -> list[str]:
    """Of the names that the ranks sharing a folder read (``reads``, by rank), those ``rank``
    downloads: each name once, the readers of a name taking turns across names."""
    readers: dict[str, list[int]] = {}
    for reader, names in reads.items():
        for name in names:
            readers.setdefault(name, []).append(reader)
    return [name for i, name in enumerate(sorted(readers)) if readers[name][i % len(readers[name])] == rank]


def _name_download(temp: Path, local: Path) -> None:
    """Rename the downloaded folder ``temp`` to ``local``. Where ``local`` has appeared meanwhile
    (another host that shares this folder over a network file system, and downloaded its own
    ranks' parts of the same checkpoint, renamed its folder first), this folder's files are moved
    into that one, each whole, and this one removed."""
    try:
        os.rename(temp, local)
        return
    except OSError:
        if not (local / SHARDED_META).is_file():
            raise
    for path in sorted(temp.rglob("*")):
        if path.is_file():
            target = local / path.relative_to(temp)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    files.remove(temp)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` under a temporary name, then rename it: no reader ever sees part of it."""
    temp = files.temp_path(path)
    temp.write_bytes(data)
    os.replace(temp, path)


def _names_under(store: ObjectStore, key: str) -> list[str]:
    """The names (relative to ``key``) of the objects under the folder ``key``."""
    base = getattr(store, "prefix", "") + key.rstrip("/") + "/"
    found = store.list_objects(key.rstrip("/") + "/")
    if not found:
        raise FileNotFoundError(f"{store.get_uri(key)} does not exist")
    return [full[len(base):] if full.startswith(base) else os.path.basename(full) for full in found]


def _per_rank_files(where: SaveFolder, device: torch.device, run_name: str) -> bool:
    """FSDP ``local`` checkpoints: each rank downloads its own file of the newest step that any
    rank's pointer names (False, on every rank, when the bucket has no pointer). Each rank moves
    its own pointer, so a job killed between two ranks' moves leaves pointers one step apart; both
    steps are complete in the bucket (a pointer moves only once every rank's file is there), so the
    ranks behind take their file of the newer one."""
    folder, pointer = where.remote, where.latest
    assert folder is not None and pointer is not None
    prefix = folder.key_of("")
    targets = _agreed_targets(where, device, per_rank=True)
    if all(t is None for t in targets):
        return False
    template, newest, error = where.filename, None, None
    try:
        for rank, key in enumerate(targets):
            if key is None:
                continue
            times = templates.time_fields(template, templates.place_values(run_name, rank=rank), key[len(prefix):])
            if times is None:
                raise CheckpointError(f"the latest pointer of rank {rank} names {key!r}, which save_filename="
                                      f"{template!r} does not make")
            if newest is None or times.get("batch", 0) > newest.get("batch", 0):
                newest = times
        assert newest is not None
        name = template.format(**where.place, **newest)
        local = where.local / name
        _download(folder.store, folder.key_of(name), local)
        files.point_latest(pointer, local)
    except Exception as e:
        error = f"autoresume from {folder.uri}: {_line(e)}"
    _agreement.raise_first_error(error, CheckpointError, device=device)
    return True


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




