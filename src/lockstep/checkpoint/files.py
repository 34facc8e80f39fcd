"""Checkpoint files on disk: atomic writes, the latest pointer, verified loading.

A save writes a temporary file beside the target, fsyncs it, renames it over the target and fsyncs
the folder, so a crash at any moment leaves either the old file or the complete new one. The latest
pointer is a relative symlink replaced the same way. Loading checks every record's CRC32 (torch's
reader does not) and unpickles with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import mmap
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint import writable, zipwriter

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)$")

# Tests set this to kill the process after the temporary file is durable and before it is published.
_before_publish: Callable[[Path], None] | None = None


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint that is missing, damaged, or does not fit this run; the message names the file.
    Also a RuntimeError, which is what torch (and so Composer) raises for a state_dict that does not fit."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose bytes are bad (truncated, a failed CRC, a dangling pointer): an older one
    may still be good, where one that does not fit the run would not be."""


DAMAGED = ".damaged"
"""The suffix autoresume gives a damaged newest checkpoint it resumed past (kept to look at)."""


def set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint ``path`` with the ``.damaged`` suffix, over one set aside at
    an earlier resume; the new path."""
    aside = path.with_name(path.name + DAMAGED)
    remove(aside)
    os.replace(path, aside)
    return aside


def temp_path(path: Path, pid: int | None = None) -> Path:
    """The temporary name beside ``path`` of a writer process (this one by default)."""
    return path.with_name(f".{path.name}.tmp.{os.getpid() if pid is None else pid}")


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(obj: Any, path: Path) -> Path:
    """``torch.save`` to a temporary file beside ``path``; :func:`publish` makes it ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(path)
    try:
        zipwriter.save(obj, str(temp))  # a path: torch's own file writer, which releases the GIL
    except Exception as e:
        cause = writable.disk_cause(e, path.parent)  # while the partial file still takes its space
        temp.unlink(missing_ok=True)
        if cause is None:
            raise
        error = OSError(f"could not write {path.name}: {cause}")
        error.errno = getattr(e, "errno", None)
        raise error from e
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def publish(temp: Path, path: Path) -> None:
    """Make the temporary file (or folder, whose files are already synced) durable, then rename it
    to ``path`` and make the rename durable."""
    replaced = None
    try:
        if temp.is_dir():
            fsync_dir(temp)
        else:
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())
        if _before_publish is not None:
            _before_publish(path)
        if temp.is_dir() and path.is_dir() and not path.is_symlink():
            # A folder cannot be renamed over a non-empty one: move the old one aside first.
            replaced = path.with_name(f".{path.name}-replaced.tmp.{os.getpid()}")
            os.replace(path, replaced)
        os.replace(temp, path)
    except BaseException:
        remove(temp)
        raise
    fsync_dir(path.parent)
    if replaced is not None:
        remove(replaced)


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def save_durably(obj: Any, path: Path) -> None:
    """``torch.save`` and fsync, in place: for files inside a temporary folder published later."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def point_latest(pointer: Path, target: Path) -> None:
    """Make ``pointer`` a symlink to ``target`` (relative when they share a folder), atomically."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    link = os.path.relpath(target, pointer.parent)
    temp = temp_path(pointer)
    temp.unlink(missing_ok=True)
    os.symlink(link, temp)
    try:
        os.replace(temp, pointer)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(pointer.parent)


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by writers that died mid-save (their pid is gone)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        match = _TEMP.match(entry.name)
        if match and not _pid_alive(int(match["pid"])):
            remove(entry)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_pointer(path: Path) -> Path:
    """The file a latest pointer names (or ``path`` itself), with a clear error when it dangles."""
    if path.is_symlink():
        target = path.parent / os.readlink(path)
        if not target.exists():
            raise DamagedCheckpoint(f"latest pointer {path} names {target}, which does not exist")
        return target
    return path


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Raise CheckpointError unless ``path`` is a complete torch zip file whose records match their
    CRCs. ``share=(i, n)`` checks the i-th of n parts of about equal bytes, so that n ranks reading
    one file split the work (the zip's directory is checked by every one of them)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder, not a checkpoint file")
    with open(path, "rb") as f:
        # mmap only once ZipFile has read the file: an empty file cannot be mapped
        _check_records(path, f, lambda: mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), share)


def _check_records(path: Path, source: Any, mapped: Callable[[], Any], share: tuple[int, int]) -> None:
    try:
        with zipfile.ZipFile(source) as archive:
            records = _part(archive.infolist(), *share)
            with mapped() as data:
                bad = next((r.filename for r in records if not _record_ok(archive, data, r)), None)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise DamagedCheckpoint(
            f"checkpoint {path} is truncated or not a torch checkpoint ({e}); "
            f"load an earlier checkpoint") from None
    if bad is not None:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: record {bad} fails its CRC check; "
                              f"load an earlier checkpoint")


def _part(records: list[zipfile.ZipInfo], index: int, parts: int) -> list[zipfile.ZipInfo]:
    """The ``index``-th of ``parts`` groups of records of about equal size (see :func:`share`)."""
    if parts == 1:
        return records
    by_name = {r.filename: r for r in records}
    return [by_name[name] for name in share({r.filename: r.compress_size for r in records}, index, parts)]


def share(sizes: dict[str, int], index: int, parts: int) -> list[str]:
    """The ``index``-th of ``parts`` groups of names of about equal total size (largest first, each
    to the lightest group): every rank sees the same sizes, so the groups are the same, and the
    ranks that split a check between them check each name once."""
    loads = [0] * parts
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        lightest = loads.index(min(loads))
        loads[lightest] += size + 1
        if lightest == index:
            mine.append(name)
    return mine


def _record_ok(archive: zipfile.ZipFile, data: Any, record: zipfile.ZipInfo) -> bool:
    """The record's stored bytes match its CRC. torch writes records uncompressed, so their CRC is
    computed straight from the mapped file (or the bytes in memory), copying nothing; other records
    go through zipfile."""
    if record.compress_type != zipfile.ZIP_STORED:
        with archive.open(record) as f:  # zipfile checks the CRC as it reads
            while f.read(1 << 20):
                pass
        return True
    _, begin = zipwriter.local_header(data, record.header_offset, record.filename)
    if begin + record.compress_size > len(data):
        raise EOFError(f"record {record.filename} runs past the end of the file")
    with memoryview(data)[begin:begin + record.compress_size] as stored:
        return zipwriter.crc32(stored) == record.CRC


def read(path: Path, share: tuple[int, int] = (0, 1)) -> Any:
    """Verify (``share`` of its records, see :func:`verify`) and load ``path`` on CPU with
    ``weights_only=True`` (no arbitrary code runs)."""
    verify(path, share)
    # mmap: the data was just read for the CRC check, so mapping it copies nothing again.
    # MAP_PRIVATE whatever the user set: tensors written later must never reach the file.
    with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
        return _load(path, path, mmap=True)


def read_bytes(data: bytes, path: Path) -> Any:
    """:func:`read` for the whole content of checkpoint ``path`` in memory (received from a rank
    that sees the file)."""
    _check_records(path, io.BytesIO(data), lambda: contextlib.nullcontext(data), (0, 1))
    return _load(io.BytesIO(data), path)


def _safe_globals() -> list[Any]:
    """What a checkpoint may hold besides tensors and containers: a Timestamp's wall-clock fields;
    in Composer's checkpoints also numpy's RNG state (a uint32 array) and the torch version string."""
    import numpy as np
    from torch.torch_version import TorchVersion

    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    dtypes = [np.dtypes.UInt32DType] if hasattr(np, "dtypes") else []
    # numpy 1.x and 2.x pickle the array constructor under different module names
    return [datetime.timedelta, TorchVersion, np.ndarray, np.dtype, *dtypes,
            (reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct")]


def _load(source: Any, path: Path, **kwargs: Any) -> Any:
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(source, map_location="cpu", weights_only=True, **kwargs)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for foreign content
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {path} with weights_only=True: {first_line}") from None
