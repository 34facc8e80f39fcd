"""A bucket's copy of a save folder: what each rank's upload process sends there, when the bucket's
latest pointer moves, and the bucket's own rotation.

Checkpoints are written and published in the local staging folder first (by
:class:`~lockstep.checkpoint.writer.CheckpointWriter`); each rank hands its files to its upload
process. At every save's agreement the ranks share what they have uploaded; the newest save every
rank has uploaded in full is published in the bucket (its pointer moved there), and what rotation
drops goes then. A failed upload fails the job on every rank, naming the rank it came from.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep import _agreement, dist, progress
from lockstep.checkpoint import bucket_rotation, remote
from lockstep.checkpoint.save_folder import SaveFolder

if TYPE_CHECKING:
    from lockstep.checkpoint.loader import Loaded

UploadState = tuple[list[int], str | None]
"""The saves whose parts a rank has uploaded, and its first upload failure."""


class BucketMirror:
    """This rank's side of a bucket's folder (``uploads``: it uploads files; ``publishes``: it
    moves the bucket's pointer and rotates its own checkpoints there)."""

    def __init__(self, where: SaveFolder, *, uploads: bool, publishes: bool, keep: int,
                 device: torch.device) -> None:
        assert where.remote is not None
        self.where, self.remote = where, where.remote
        self.uploads, self.publishes, self.device = uploads, publishes, device
        self.uploader = remote.Uploader(self.remote, dist.get_global_rank(), active=uploads, keep=keep)
        self._pending: dict[int, str] = {}
        """Each save (numbered alike on every rank) not yet known complete in the bucket: this rank's name of it."""
        self._saves = 0
        self._rotation = bucket_rotation.BucketRotation(keep)
        """The bucket's own record of this rank's checkpoints there, which its rotation follows."""

    def left_earlier(self, resumed: Loaded | None) -> None:
        """A restarted job: the bucket's rotation starts from the checkpoints earlier attempts left
        there under this rank's names (more than the resumed checkpoint's history may name)."""
        try:
            names = self.remote.names()
        except Exception as e:  # rotation then deletes only this attempt's checkpoints
            warnings.warn(f"could not list {self.remote.uri} ({remote.error_line(e)}): checkpoints an earlier "
                          f"attempt left there are not rotated", stacklevel=3)
            return
        ours = None  # a fresh start: what earlier attempts left is stale
        if resumed is not None and not resumed.weights_only:
            ours = resumed.history[-1] if resumed.history else ""  # "": a name that tells no time
        self._rotation.earlier(*bucket_rotation.left_earlier(names, self.where.filename, self.where.place, ours))

    def saved(self, name: str) -> None:
        """A save began on every rank (``name``: this rank's name of it)."""
        self._saves += 1
        self._pending[self._saves] = name
        if self.publishes:
            self._rotation.saved(name)

    def upload_file(self, name: str, path: Path) -> None:
        """Hand a published single-file checkpoint to the upload process."""
        self.uploader.upload(name, [(path, name)])

    def upload_folder_part(self, temp: Path, path: Path) -> None:
        """Hand this rank's files of a folder checkpoint to the upload process (rank 0: the files no
        other rank writes, lockstep.pt among them)."""
        name, rank = str(path.relative_to(self.where.local)), dist.get_global_rank()
        mine = [(p, os.path.join(name, str(p.relative_to(temp)))) for p in sorted(temp.rglob("*"))
                if p.is_file() and remote.owner_of(p.name) == rank]
        self.uploader.upload(name, mine)

    def state(self) -> UploadState | None:
        """What this rank has uploaded, for the agreement (None: it uploads nothing)."""
        if not self.uploads:
            return None
        done, failure = self.uploader.state()
        names = set(done)
        return [save for save, name in self._pending.items() if name in names], failure

    def after_uploads(self, states: list[UploadState | None]) -> None:
        """Every rank, with every rank's upload state: fail on a lost upload; else move the bucket's
        latest pointer to the newest checkpoint every rank has uploaded, then rotate the bucket."""
        failed = next(((r, s[1]) for r, s in enumerate(states) if s is not None and s[1] is not None), None)
        if failed is not None:
            self._fail(*failed)
        done = [None if s is None else s[0] for s in states]
        save = remote.complete(list(self._pending), done)
        if save is None:
            return
        settled = [(s, self._pending.pop(s)) for s in sorted(self._pending) if s <= save]
        if not self.publishes:
            return
        # each earlier save, complete or not (dropped from some rank's queue), with its name
        old = self._rotation.settle([(name, remote.complete([s], done) is not None) for s, name in settled])
        newest = settled[-1][1]
        pointer = None
        if self.where.latest is not None:
            pointer = self.remote.key_of(str(self.where.latest.relative_to(self.where.local))) + remote.POINTER_SUFFIX
        self.uploader.publish(newest, self.remote.key_of(newest), pointer, old)

    def finish(self) -> None:
        """At the end of ``fit`` (and after SIGTERM's save): wait for every upload, then publish
        the newest checkpoint in the bucket; raise on every rank if any upload failed."""
        self.uploader.drain()
        self.after_uploads(_agreement.gather_small_objects(self.state()))
        self.uploader.drain()
        _, failure = self.uploader.state()
        first = _agreement.first_error(failure, device=self.device)
        if first is not None:
            self._fail(*first)

    def _fail(self, rank: int, why: str) -> None:
        progress.echo(rank)  # every rank raises it: the launcher names the rank it came from
        where = "" if dist.get_world_size() == 1 else f" on rank {rank}"
        raise RuntimeError(f"uploading checkpoints to {self.remote.uri} failed{where}: {why}")
