"""``torch.save`` to a file, checksummed by ISA-L, with large tensors written around the page cache.

Two costs of ``torch.save`` fall on the cores that train while a checkpoint is written in the
background, and both go here:

* torch's zip writer checksums every record with miniz's byte-at-a-time CRC32: about 70 ms of CPU
  for a 200 MB checkpoint here, close to half of what the whole write cost. ISA-L computes the same
  values in a fraction of that (and releases the interpreter lock). The file is written by torch's
  own writer with its checksums off, each record's CRC32 is computed from the bytes handed to it,
  and the zip headers are patched with them.
* Writing through the page cache copies every byte once more, in the kernel. Large tensors whose
  memory is page-aligned (the stager's buffers are) are written with ``O_DIRECT`` instead: torch's
  writer lays out the file with their records' space reserved at 4 KiB boundaries, and their bytes
  go from memory to the disk without a copy. Where the file system refuses ``O_DIRECT``, they are
  written the usual way.

The result is the file ``torch.save`` writes (with ``storage_alignment`` 4096 when a tensor went
around the cache: a setting torch itself offers, and which the file records for its readers).
torch's switch for its checksums is process-wide (``torch.serialization.set_crc32_options``), so a
user's own ``torch.save`` in another thread would lose its checksums; this module asks for a
writer without them and leaves the switch alone.
"""

from __future__ import annotations

import errno
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

try:  # ISA-L's CRC32 gives zlib's values several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    from zlib import crc32

_WRITER = getattr(torch._C, "PyTorchFileWriter", None)
_SAVE = getattr(torch.serialization, "_save", None)
_ALIGNMENT = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)

PAGE = 4096
"""The alignment of memory, file offsets and lengths that ``O_DIRECT`` asks for (at most, on Linux)."""
DIRECT_MIN = 1 << 20
"""Tensors smaller than this go through the page cache: the copy is cheap, a direct write is not."""

_CENTRAL = struct.Struct("<4s12xI8xHHH12x")
"""A zip central directory entry: signature, CRC32 (at 16), name, extra and comment lengths (at 28)."""
LOCAL_HEADER = struct.Struct("<4s2xH6xI8xHH")
"""A zip local file header: signature, flags (at 6), CRC32 (at 14), name and extra lengths (at 26)."""
_DATA_DESCRIPTOR = 0x08
"""The flag that puts a record's CRC32 and sizes in a descriptor after its bytes."""


def save(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` as ``torch.save(obj, path)`` would."""
    if _WRITER is None or _SAVE is None or not path.isascii():
        # torch's writer takes ASCII paths only (torch.save writes others through Python's file)
        torch.save(obj, path)
        return
    direct = any(type(t) is torch.Tensor and t.layout == torch.strided and _goes_direct(t.untyped_storage())
                 for t in tensors(obj))
    records = _Records(PAGE if direct else _ALIGNMENT(), direct)
    records.writer = _WRITER(path, False, records.alignment)
    _SAVE(obj, records, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    records.writer.write_end_of_file()
    records.writer = None  # closes the file
    with open(path, "r+b") as f:
        _finish(f, path, records)


@dataclass
class _Records:
    """Stands in for torch's zip writer during ``_save``: passes records on, noting each one's
    CRC32, and only reserves the space of those that are written directly afterwards."""

    alignment: int
    direct: bool
    writer: Any = None
    sums: dict[str, int] = field(default_factory=dict)
    deferred: dict[str, torch.UntypedStorage] = field(default_factory=dict)

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if name == ".storage_alignment":  # what the file really has: readers compute offsets from it
            data = str(self.alignment)
            nbytes = len(data)
        if self.direct and isinstance(data, torch.UntypedStorage) and _goes_direct(data):
            self.writer.write_record_metadata(name, nbytes)
            self.deferred[name] = data
        else:
            self.writer.write_record(name, data, nbytes)
        self.sums[name] = _crc_of(data, nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)


def _goes_direct(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cpu" and storage.nbytes() >= DIRECT_MIN and storage.data_ptr() % PAGE == 0


def tensors(obj: Any) -> Any:
    """Every tensor in ``obj``'s dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()).cast("B")


def _crc_of(data: Any, nbytes: int) -> int:
    if isinstance(data, str):
        data = data.encode()
    view = _bytes_of(data) if isinstance(data, torch.UntypedStorage) else memoryview(data).cast("B")
    return crc32(view[:nbytes])


def _finish(f: BinaryIO, path: str, records: _Records) -> None:
    """Write the reserved records' bytes, then each record's CRC32 where a zip reader looks for it:
    its central directory entry and the data descriptor after its bytes (torch's writer sets the
    flag that puts it there), or the local header without that flag. Records the writer adds by
    itself (a version, a serialization id: a few bytes each) are read back."""
    with zipfile.ZipFile(f) as archive:
        entries, directory = archive.infolist(), archive.start_dir
    f.seek(directory)
    central = f.read()
    position = 0
    direct_fd = _open_direct(path) if records.deferred else None
    try:
        for entry in entries:
            signature, _, name_len, extra_len, comment_len = _CENTRAL.unpack_from(central, position)
            if signature != b"PK\x01\x02":
                raise zipfile.BadZipFile(f"{path}: the zip directory ends before {entry.filename}")
            f.seek(entry.header_offset)
            flags, start = local_header(f.read(LOCAL_HEADER.size), 0, entry.filename)
            start += entry.header_offset
            name = entry.filename.split("/", 1)[-1]  # torch prefixes every record with the archive's name
            if name in records.deferred:
                _write_at(f, direct_fd, _bytes_of(records.deferred[name]), start)
            crc = records.sums.get(name)
            if crc is None:
                f.seek(start)
                crc = crc32(f.read(entry.compress_size))
            packed = struct.pack("<I", crc)
            f.seek(_crc_offset(f, entry, flags, start))
            f.write(packed)
            f.seek(directory + position + 16)
            f.write(packed)
            position += _CENTRAL.size + name_len + extra_len + comment_len
    finally:
        if direct_fd is not None:
            os.close(direct_fd)


def local_header(data: Any, at: int, filename: str) -> tuple[int, int]:
    """The flags of the zip local header at ``at`` in ``data``, and where its record's bytes begin."""
    signature, flags, _, name_len, extra_len = LOCAL_HEADER.unpack_from(data, at)
    if signature != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"record {filename} has no local header")
    return flags, at + LOCAL_HEADER.size + name_len + extra_len


def _crc_offset(f: BinaryIO, entry: zipfile.ZipInfo, flags: int, start: int) -> int:
    """Where the record's CRC32 is in the file: in its data descriptor (after an optional
    signature), or in its local header."""
    if not flags & _DATA_DESCRIPTOR:
        return entry.header_offset + 14
    f.seek(start + entry.compress_size)
    return start + entry.compress_size + (4 if f.read(4) == b"PK\x07\x08" else 0)


def _open_direct(path: str) -> int | None:
    """A descriptor that writes around the page cache, or None where there is no such thing."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # tmpfs and some network file systems
            return None
        raise


def _write_at(f: BinaryIO, direct_fd: int | None, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``: its whole pages directly when ``direct_fd`` is given (``data``
    and ``offset`` are page-aligned then), the rest through ``f``."""
    done = 0
    if direct_fd is not None and offset % PAGE == 0:
        whole = len(data) - len(data) % PAGE
        try:
            while done < whole:
                done += os.pwrite(direct_fd, data[done:whole], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: an alignment this device does not take
                raise
    f.flush()
    while done < len(data):
        done += os.pwrite(f.fileno(), data[done:], offset + done)
