"""Whether checkpoints can be written into a folder, and why a write failed, in plain words.

A full disk surfaces from ``torch.save`` as ``unexpected pos 644288 vs 644176``, with no errno;
these helpers turn that, and the usual ``OSError`` causes, into a reason a user can act on.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large (a file system or process limit)",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
}
_NEARLY_FULL = 1 << 20  # bytes: after a failed write, less free space than this means the disk filled up


def free_bytes(folder: Path) -> int | None:
    """Bytes this process may still write in ``folder``'s file system (None if unknown)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    blocks = stat.f_bfree if os.geteuid() == 0 else stat.f_bavail  # root may use the reserved blocks
    return blocks * stat.f_frsize


def disk_cause(error: BaseException, folder: Path) -> str | None:
    """Why writing into ``folder`` failed, when the file system is the cause (None otherwise: a
    failure to pickle, say). Call it before removing the partial file, while the space it took
    is still taken."""
    if isinstance(error, OSError) and error.errno in _CAUSES:
        return _CAUSES[error.errno]
    free = free_bytes(folder)
    if free is not None and free < _NEARLY_FULL:
        return f"no space left on device ({free} bytes free in {folder})"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return None


def explain(error: BaseException, folder: Path) -> str:
    """:func:`disk_cause`, or the error itself."""
    return disk_cause(error, folder) or f"{type(error).__name__}: {error}"


def check_folder(folder: Path, argument: str = "save_folder") -> str | None:
    """Create ``folder`` if needed and write a probe file into it: None when it works, else a
    message that names ``argument`` and the cause. The probe is named like a temporary file, so
    one left by a crash is removed with the others."""
    if folder.exists() and not folder.is_dir():
        return f"{argument} {folder} is a file, not a folder: pass a folder path"
    probe = folder / f".lockstep-write-check.tmp.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"lockstep")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"{argument} {folder} is not writable: {explain(e, folder)}; pass a folder this job can write to"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None
