"""The parts of a checkpoint folder, recorded when they are written and checked before any is loaded.

A folder layout's checkpoint (FSDP ``sharded``: DCP's ``.distcp`` files and ``.metadata``;
DeepSpeed: the engine's files) is written by every rank. Each rank's writer thread records the
size and CRC32 of every file it wrote (:func:`record`), the records meet on every rank
(:func:`gather`), and rank 0 keeps them in the folder's ``lockstep.pt`` as ``parts``.

Before any rank loads any of it, every rank checks that every part is there at its recorded size,
and the CRC32 of its own share of the parts, about 1/N of the bytes (:func:`check_parts`); the
loader agrees on the outcome, so either every rank loads or none does, and a damaged file is an
error that names it. A DCP folder saved before parts were recorded is checked for what it shows
itself: its ``.metadata`` loads, and every file that names is there and holds the bytes it says
(:func:`check_dcp_files`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import DamagedCheckpoint, share
from lockstep.checkpoint.zipwriter import crc32

DCP_METADATA = ".metadata"
"""DCP's index of a sharded folder: which file holds which bytes of which tensor."""
_CHUNK = 4 << 20


def crc32_of(path: Path) -> int:
    """The CRC32 of a file's bytes (ISA-L's, where installed: it releases the interpreter lock)."""
    value = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            value = crc32(view[:n], value)
    return value


def record(folder: Path, names: Iterable[str]) -> dict[str, list[int]]:
    """``{name: [size, CRC32]}`` of the named files of ``folder`` (names relative to it)."""
    return {name: [(folder / name).stat().st_size, crc32_of(folder / name)] for name in sorted(names)}


def gather(mine: dict[str, list[int]], group: Any) -> dict[str, list[int]]:
    """Every rank's records, on every rank (a collective over ``group``, None without a process
    group): a rank returns once every rank has written and recorded its parts."""
    if group is None:
        return dict(mine)
    every: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, mine, group=group)
    return {name: part for records in every for name, part in records.items()}


def damaged(folder: Path, name: str, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"checkpoint {folder} is damaged: {name} {what}: load an older checkpoint "
                             f"or delete this one")


def check_size(folder: Path, name: str, size: int, *, at_least: bool = False) -> None:
    """Raise :class:`DamagedCheckpoint` unless ``folder/name`` is a file of ``size`` bytes (or more)."""
    try:
        actual = (folder / name).stat().st_size
    except FileNotFoundError:
        raise damaged(folder, name, "is missing (deleted?)") from None
    except OSError as e:
        raise damaged(folder, name, f"cannot be read ({e.strerror})") from None
    if actual < size:
        raise damaged(folder, name, f"is {actual} bytes, expected {'at least ' if at_least else ''}{size} "
                                    f"(truncated?)")
    if actual > size and not at_least:
        raise damaged(folder, name, f"is {actual} bytes, expected {size} (overwritten?)")


def check_parts(folder: Path, parts: Mapping[str, Sequence[int]], mine: tuple[int, int] = (0, 1)) -> None:
    """Raise :class:`DamagedCheckpoint` naming the first part of ``folder`` that is missing or of
    another size than recorded, or, among this rank's share (``mine``: index, of how many), fails
    its CRC32. Every rank checks every size (a stat each), so each sees a file its node lacks."""
    for name, (size, _) in sorted(parts.items()):
        check_size(folder, name, size)
    for name in share({name: size for name, (size, _) in parts.items()}, *mine):
        if crc32_of(folder / name) != parts[name][1]:
            raise damaged(folder, name, "fails its CRC32 check (flipped bytes?)")


def check_dcp_files(folder: Path) -> None:
    """A DCP folder saved without recorded parts: its ``.metadata`` is there and loads, and each
    file it names is there, at least as long as the bytes it says that file holds."""
    import torch.distributed.checkpoint as dcp

    check_size(folder, DCP_METADATA, 1, at_least=True)
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
        ends: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # a truncated or altered pickle raises anything
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise damaged(folder, DCP_METADATA, f"does not load ({detail}; truncated or flipped bytes?)") from None
    for name, end in sorted(ends.items()):
        check_size(folder, name, end, at_least=True)


def check_sharded(folder: Path, meta: Mapping[str, Any], mine: tuple[int, int] = (0, 1)) -> None:
    """Check an FSDP ``sharded`` folder before any rank loads it: its recorded parts, else what
    DCP's ``.metadata`` says (a folder saved before parts were recorded)."""
    parts = meta.get("parts")
    if parts:
        check_parts(folder, parts, mine)
    else:
        check_dcp_files(folder)


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a folder layout's parts (then one without lockstep.pt is damaged)."""
    return (folder / DCP_METADATA).exists() or (folder / "deepspeed").is_dir() or \
        any(folder.glob("*.distcp"))
