"""What a killed job leaves in a staging folder, and its removal when the next job starts.

A job killed mid-save leaves, beside its published checkpoints, temporary names: a checkpoint file
or folder still being written (``.NAME.tmp.PID``, also the folder of a node's parts of a sharded or
DeepSpeed checkpoint, which on a node that rank 0 does not share is deleted only after its upload),
an old folder moved aside while a new one replaced it (``.NAME-replaced.tmp.PID``), and files being
downloaded (``NAME.<32 hex>.tmp``, and the client's own ``NAME.<32 hex>.tmp.<8 hex>``). Rank 0's
writer removes those of dead processes from its own folder at its first save; on a node without
rank 0, whose disk no writer sweeps, they would stay for good. So when a job starts, before it
downloads or writes anything, the first rank of each node's staging folder removes them
(:func:`sweep`). Published checkpoints, and names this run would not write, are left alone.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from pathlib import Path

from lockstep.checkpoint import files

_WRITING = re.compile(r"^\.(?P<name>.+?)(?:-replaced)?\.tmp\.\d+$")
"""A file or folder being written (``files.temp_path``), or an old folder moved aside by ``files.publish``."""
_DOWNLOADING = re.compile(r"^(?P<name>.+)\.[0-9a-f]{32}\.tmp(?:\.[0-9a-fA-F]{8})?$")
"""A file being downloaded (``S3ObjectStore.download_object``'s name, and that of the client under it)."""
_SKIP = frozenset({".uploading"})
"""Kept: the uploader's links, which each rank's uploader clears for itself."""


def leftover_target(name: str) -> str | None:
    """The name that the temporary entry ``name`` would have become; None when it is not one."""
    for pattern in (_WRITING, _DOWNLOADING):
        match = pattern.match(name)
        if match:
            return match["name"]
    return None


def sweep(folder: Path, globs: Sequence[str]) -> list[Path]:
    """Remove the temporary entries under ``folder`` whose name, once written, matches one of
    ``globs`` (relative to ``folder``) or lies inside a folder that does (a checkpoint folder's
    parts); the entries removed. Call it only when no writer of this run is alive: it looks at no
    pid, since on a node without rank 0 the pid in a temporary folder's name is rank 0's, of
    another machine."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for root, dirs, names in os.walk(folder):
        relative = Path(root).relative_to(folder)
        dirs[:] = [d for d in dirs if d not in _SKIP or relative != Path(".")]
        for name in [*dirs, *names]:
            target = leftover_target(name)
            if target is None or not _ours((relative / target).as_posix(), globs):
                continue
            files.remove(Path(root) / name)
            removed.append(Path(root) / name)
            if name in dirs:
                dirs.remove(name)
    return removed


def _ours(path: str, globs: Sequence[str]) -> bool:
    """Whether ``path`` (relative to the folder), or a folder it lies in, matches one of ``globs``."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, g) for p in prefixes for g in globs)
