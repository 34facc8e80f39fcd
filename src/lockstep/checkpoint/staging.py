"""A checkpoint's state copied to CPU memory, so that a thread can write it while training goes on.

Training changes parameters and optimizer state in place, so a background write needs its own
copy. Each storage is copied once and the tensors are rebuilt as views of the copies: tensors
that shared memory still share it in the file (tied weights are written once, as ``torch.save``
would). Containers are rebuilt too, since a scheduler or optimizer may change them after the
save returns. A plain copy is cheaper than serializing into memory, and torch's file writer
writes tensor data without holding the interpreter lock, so the thread barely slows training.

Storages that only the optimizer step changes (parameters, optimizer state) need not be copied
before training goes on: :meth:`Stager.stage` can leave them to :meth:`Stager.copy_later`, which the
writer thread runs while the next batch's forward and backward read them, and the next optimizer
step waits for it.
"""

from __future__ import annotations

import copy
import mmap
import os
from collections.abc import Collection
from typing import Any

import torch

from lockstep.checkpoint import zipwriter
from lockstep.dtensors import is_dtensor, local


def storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    """What tells storages apart: tensors that share one have the same key."""
    return (str(storage.device), storage.data_ptr())


def storage_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in ``obj``: what :meth:`Stager.stage` copies."""
    seen: dict[tuple[str, int], int] = {}
    for t in zipwriter.tensors(obj):
        t = local(t)
        if _plain(t):
            s = t.untyped_storage()
            seen[storage_key(s)] = s.nbytes()
        else:
            seen[("other", id(t))] = t.numel() * t.element_size()
    return sum(seen.values())


class DoesNotFit(Exception):
    """The copy would need more new memory than half of what is free."""


class Stager:
    """Copies checkpoints into CPU buffers that it keeps for the next save: writing into memory
    that is already mapped costs a memcpy, while fresh memory costs a page fault every 4 KiB,
    which here was most of the time a copy took. Large buffers start on a page, so that the file
    writer can send them to the disk directly. The caller must be done with one staged copy before
    staging the next."""

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []
        self._later: Collection[tuple[str, int]] = ()
        self._pending: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._room: float | None = None

    def stage(self, obj: Any, later: Collection[tuple[str, int]] = ()) -> Any:
        """``obj`` with its containers rebuilt and every tensor copied to CPU, except that the
        storages keyed in ``later`` (:func:`storage_key`; CPU ones) are only given their buffers:
        :meth:`copy_later` fills those, and the staged copy is whole only after it.

        Raises :class:`DoesNotFit` (and lets go of every buffer) rather than take new buffers of
        more than half the memory that is free: a save never pushes the machine into swap or the
        OOM killer. Buffers kept from the previous save cost nothing more, so then the free memory
        is not even read."""
        self._later, self._pending, self._room = later, [], None
        try:
            return self._stage(obj, {})
        except DoesNotFit:
            self._buffers, self._pending = [], []
            raise
        finally:
            self._later = ()

    def copy_later(self) -> None:
        """Copy the storages that :meth:`stage` left for later (on any thread)."""
        pending, self._pending = self._pending, []
        for buffer, source in pending:
            buffer.copy_(source)

    def _copy(self, source: torch.UntypedStorage, key: tuple[str, int], index: int) -> torch.UntypedStorage:
        if index < len(self._buffers) and self._buffers[index].nbytes() == source.nbytes():
            buffer = self._buffers[index]
        else:
            buffer = self._new_buffer(source.nbytes())
            if index < len(self._buffers):
                self._buffers[index] = buffer
            else:
                self._buffers.append(buffer)
        if key in self._later and source.device.type == "cpu":
            self._pending.append((buffer, source))
            return buffer
        return buffer.copy_(source)

    def _new_buffer(self, nbytes: int) -> torch.UntypedStorage:
        self._take_room(nbytes)
        return _page_aligned(nbytes)

    def _take_room(self, nbytes: int) -> None:
        if self._room is None:
            available = _available_memory()
            self._room = float("inf") if available is None else available / 2
        if nbytes > self._room:
            raise DoesNotFit(f"a copy of {nbytes} more bytes does not fit in memory")
        self._room -= nbytes

    def _stage(self, obj: Any, storages: dict[tuple[str, int], torch.UntypedStorage]) -> Any:
        if is_dtensor(obj):
            # A shard: its local tensor is copied to CPU and keeps its placement, even on a GPU
            # mesh (from_local would move it back), as DCP's own staging does.
            from torch.distributed.tensor import DTensor  # loaded already: obj is one

            shard = self._stage(obj.to_local(), storages)
            return DTensor(shard, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            if not _plain(obj):
                self._take_room(obj.numel() * obj.element_size())
                return obj.detach().to("cpu", copy=True)
            source = obj.untyped_storage()
            key = storage_key(source)
            if key not in storages:
                storages[key] = self._copy(source, key, len(storages))
            view = torch.empty(0, dtype=obj.dtype)
            return view.set_(storages[key], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, dict):
            staged = {k: self._stage(v, storages) for k, v in obj.items()}
            if type(obj) is dict:
                return staged
            # an OrderedDict from state_dict() carries _metadata; a subclass keeps its own fields
            out = copy.copy(obj)
            out.update(staged)
            if hasattr(out, "__dict__"):
                out.__dict__ = copy.deepcopy(out.__dict__)
            return out
        if isinstance(obj, list):
            return [self._stage(v, storages) for v in obj]
        if type(obj) is tuple:
            return tuple(self._stage(v, storages) for v in obj)
        return copy.deepcopy(obj)


def _page_aligned(nbytes: int) -> torch.UntypedStorage:
    """A CPU buffer; a large one starts on a page, so that the file writer can send it to the disk
    without copying it through the page cache (``zipwriter``)."""
    if nbytes < zipwriter.DIRECT_MIN:
        return torch.UntypedStorage(nbytes)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()  # keeps the map


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.layout == torch.strided


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
