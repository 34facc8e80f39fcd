"""A run's hold on its save folder: the claim each writing rank takes on the local folder
(:mod:`~lockstep.checkpoint.ownership`) and, for a bucket's folder, rank 0's lease on it across
machines (:mod:`~lockstep.checkpoint.bucket_claim`), taken and given up together on every rank."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from lockstep import _agreement, dist, elastic
from lockstep.checkpoint import bucket_claim, ownership, remote
from lockstep.checkpoint.save_folder import SaveFolder


class FolderClaim:
    """Whether this run may write into ``where`` now, and the claims that say so.

    ``patterns`` gives the globs (relative to the folder) of the names this rank writes, which
    another run's claim must not overlap; ``uploader`` this rank's upload process into the bucket
    (None: a local folder), whose writes stop once another job holds the bucket's folder.
    """

    def __init__(self, where: SaveFolder, run_name: str, *, writes: bool, device: torch.device,
                 patterns: Callable[[], list[str]], uploader: Callable[[], remote.Uploader | None]) -> None:
        self.where, self.run_name, self.writes, self.device = where, run_name, writes, device
        self._patterns, self._uploader = patterns, uploader
        self._rank = dist.get_global_rank()
        self._owned = False
        """Whether this rank holds its claim on the local folder."""
        self._leased = False
        """Whether rank 0 holds the bucket's lease on a bucket's folder."""
        self._agreed = False
        """Whether every rank agreed that the run holds the folder (the same on every rank)."""

    @property
    def held(self) -> bool:
        """Whether the run holds the folder now (every rank agreed: see :meth:`take`)."""
        return self._agreed

    def take(self, error: str | None = None) -> None:
        """Claim the folder for this run until :meth:`release` (a collective): a ValueError on every
        rank if any rank may not write there (``error``: why, found by the caller) or another live
        job owns it. Nothing happens while the run holds it already."""
        if self._agreed:
            return
        if error is None and self.writes:
            error = ownership.claim(self.where.local, self.run_name, self._rank, self._patterns())
            self._owned = error is None
        if error is None and self.where.remote is not None and self._rank == 0:
            error = bucket_claim.claim(self.where.remote, self.run_name, self._patterns(), self._lease_lost)
            self._leased = error is None
        membership = elastic.current()
        joining = membership is not None and membership.fresh  # the others agreed before it joined
        try:
            if joining and error is not None:
                raise ValueError(error)
            if not joining:
                _agreement.raise_first_error(error, ValueError, device=self.device)
        except ValueError:
            self.release()
            raise
        if self.where.remote is not None:  # every rank's writes to the bucket stop once the lease is another job's
            self._guard_uploads(membership, joining)
        self._agreed = True

    def _guard_uploads(self, membership: elastic.Membership | None, joining: bool) -> None:
        """Hand this rank's uploader rank 0's lease (kept in the elastic job's store for a rank that joins later)."""
        assert self.where.remote is not None
        if joining:
            assert membership is not None
            guard = tuple(json.loads(membership.shared("bucket_guard")))
        else:
            guard = _agreement.gather_small_objects(
                bucket_claim.guard(self.where.remote, self.run_name) if self._rank == 0 else None)[0]
            if membership is not None and self._rank == 0:
                membership.share("bucket_guard", json.dumps(guard))
        uploader = self._uploader()
        if uploader is not None:
            uploader.guard = guard

    def release(self) -> None:
        """Give up this rank's claim (the end of ``fit``, ``close``); safe to call again. The
        bucket's lease goes once the writes queued under it have ended."""
        self._agreed = False
        if self._owned:
            self._owned = False
            ownership.release(self.where.local, self.run_name, self._rank)
        if self._leased:
            assert self.where.remote is not None
            uploader = self._uploader()
            if uploader is not None:  # its queued writes are guarded by the lease: they end first
                uploader.drain()
            self._leased = False
            bucket_claim.release(self.where.remote, self.run_name, self._lease_lost)

    def _lease_lost(self, message: str) -> None:
        """Another job took the bucket's folder over: this job fails at its next save (or the end of ``fit``)."""
        uploader = self._uploader()
        if uploader is not None:
            uploader.fail(message)
