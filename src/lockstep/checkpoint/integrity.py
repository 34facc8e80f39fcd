"""The parts of a checkpoint folder, recorded when they are written and checked before any is loaded.

A folder layout's checkpoint (FSDP ``sharded``: DCP's ``.distcp`` files and ``.metadata``;
DeepSpeed: the engine's files) is written by every rank. Each rank's writer thread records the
size and CRC32 of every file it wrote (:func:`record`), the records meet on every rank
(:func:`gather`), and rank 0 keeps them in the folder's ``lockstep.pt`` as ``parts``.

The folder's ``lockstep.pt`` also records, as ``reads``, the parts each rank reads when it resumes
at the world size that saved (:func:`assign`): its own files and those every rank shares (DCP's
``.metadata``, DeepSpeed's model states), and for DCP any other rank's file that holds a tensor
this rank loads (DCP writes a tensor that every rank holds alike, such as a model buffer, in one
rank's file only). A node with a disk of its own, which downloads the checkpoint from a bucket,
fetches only its ranks' reads.

Before any rank loads any of it, every rank checks that each part it reads is there at its
recorded size, and the CRC32 of its turn of them, so that each copy of a part is checked once, by
one of the ranks that read that copy: about 1/N of the bytes when every rank reads one copy (a
shared disk), and each node's own copy on nodes that downloaded the checkpoint to disks of their
own (``peers``: the ranks that read this rank's copy; :func:`check_parts`); the loader agrees on the outcome, so either
every rank loads or none does, and a damaged file is an error that names it. A DCP folder saved
before parts were recorded is checked for what it shows itself: its ``.metadata`` loads, and
every file that names is there and holds the bytes it says (:func:`check_dcp_files`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lockstep import dist
from lockstep.checkpoint.files import DamagedCheckpoint, share
from lockstep.checkpoint.zipwriter import crc32

DCP_METADATA = ".metadata"
"""DCP's index of a sharded folder: which file holds which bytes of which tensor."""
_CHUNK = 4 << 20
_OWNED = re.compile(r"(?:^__(\d+)_\d+\.distcp$)|(?:pp_rank_(\d+)_)")
"""Names of the files one rank writes into a folder checkpoint: DCP's ``__{rank}_{n}.distcp`` and
DeepSpeed's ``*_pp_rank_{rank}_*``."""


def part_rank(name: str) -> int | None:
    """The rank whose own file ``name`` (a path in a folder checkpoint) is; None for a file of the
    whole checkpoint (lockstep.pt, DCP's .metadata, DeepSpeed's model states), which rank 0 writes."""
    match = _OWNED.search(os.path.basename(name))
    return None if match is None else int(match.group(1) or match.group(2))


def reads_of(meta: Mapping[str, Any], rank: int, world_size: int) -> set[str] | None:
    """The parts (names relative to the folder, lockstep.pt aside) that ``rank`` reads to resume the
    checkpoint whose header is ``meta``; None when every rank reads every part: another world size
    than the one that saved (DCP reshards), or a checkpoint saved before reads were recorded."""
    reads = meta.get("reads")
    if not reads or len(reads) != world_size or not 0 <= rank < world_size:
        return None
    return set(reads[rank])


def within(mine: tuple[int, int], peers: Sequence[int] | None) -> tuple[int, int]:
    """``mine`` (this rank, of how many ranks) as (its place among ``peers``, how many they are):
    the ranks that read the same copy of a file split its check (``peers`` None: every rank does)."""
    rank, _ = mine
    if peers is None or rank not in peers:
        return mine
    return list(peers).index(rank), len(peers)


def assign(sizes: Mapping[str, int], meta: Mapping[str, Any], rank: int, world_size: int,
           peers: Sequence[int] | None = None) -> tuple[list[str], list[str]]:
    """(the parts named in ``sizes`` that this rank reads, those of them whose CRC32 it checks):
    each copy of a part is checked by one of the ranks that read that copy, in turn, so that it is
    checked once. ``peers``: the ranks that read this rank's copy of the folder (None: one copy,
    which every rank reads). Without recorded reads every rank reads every part, and the ranks of
    a copy split its checks by size (:func:`files.share`)."""
    reads = meta.get("reads") if reads_of(meta, rank, world_size) is not None else None
    if reads is None:
        return sorted(sizes), share(dict(sizes), *within((rank, world_size), peers))
    readers: dict[str, list[int]] = {}
    for reader, names_read in enumerate(reads):
        if peers is None or reader in peers:
            for name in names_read:
                readers.setdefault(name, []).append(reader)
    mine = sorted(n for n in sizes if rank in readers.get(n, ()))
    turns = [n for i, n in enumerate(sorted(sizes)) if n in readers and readers[n][i % len(readers[n])] == rank]
    return mine, turns


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


def gather(mine: dict[str, list[int]], group: Any,
           reads: Iterable[str] = ()) -> tuple[dict[str, list[int]], list[list[str]]]:
    """Every rank's records, and every rank's ``reads`` (the parts it reads to resume), on every
    rank (a collective over ``group``, None without a process group): a rank returns once every
    rank has written and recorded its parts."""
    if group is None:
        return dict(mine), [sorted(reads)]
    every = dist.all_gather_object((mine, sorted(reads)), group=group)
    return {name: part for records, _ in every for name, part in records.items()}, [r for _, r in every]


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


def check_parts(folder: Path, parts: Mapping[str, Sequence[int]], mine: tuple[int, int] = (0, 1),
                meta: Mapping[str, Any] | None = None, peers: Sequence[int] | None = None) -> None:
    """Raise :class:`DamagedCheckpoint` naming the first part of ``folder`` that this rank reads
    (``mine``: its rank, of how many; ``meta``: the header that records what each rank reads;
    ``peers``: the ranks that read this copy of the folder) and that is missing or of another size
    than recorded, or, among those it checks (:func:`assign`), fails its CRC32. Each rank stats
    every part it reads, so each sees a file its node lacks."""
    sized = {name: size for name, (size, _) in parts.items()}
    reading, checking = assign(sized, meta or {}, *mine, peers)
    for name in reading:
        check_size(folder, name, sized[name])
    for name in checking:
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


def check_sharded(folder: Path, meta: Mapping[str, Any], mine: tuple[int, int] = (0, 1),
                  peers: Sequence[int] | None = None) -> None:
    """Check an FSDP ``sharded`` folder before any rank loads it: its recorded parts, else what
    DCP's ``.metadata`` says (a folder saved before parts were recorded)."""
    parts = meta.get("parts")
    if parts:
        check_parts(folder, parts, mine, meta, peers)
    else:
        check_dcp_files(folder)


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a folder layout's parts (then one without lockstep.pt is damaged)."""
    return (folder / DCP_METADATA).exists() or (folder / "deepspeed").is_dir() or \
        any(folder.glob("*.distcp"))
