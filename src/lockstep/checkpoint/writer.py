"""When and where checkpoints are written: interval, names, latest pointer, retention, overwrite."""

from __future__ import annotations

import copy
import glob
import os
import shutil
import socket
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import _agreement, dist, elastic, idle, progress
from lockstep.checkpoint import files, integrity, leftovers, payload, remote, staging, templates, writable
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.checkpoint.folder_claim import FolderClaim
from lockstep.checkpoint.mirror import BucketMirror
from lockstep.checkpoint.save_folder import SaveFolder
from lockstep.checkpoint.save_record import SaveRecord
from lockstep.checkpoint.schedule import SaveSchedule
from lockstep.checkpoint.layout import (
    FOLDER_LAYOUTS, LOCAL, SHARDED_META, SINGLE, Layout, FolderLayout, is_folder)
from lockstep.time import Time, Timestamp, TimeUnit

if TYPE_CHECKING:
    from lockstep.checkpoint.loader import Loaded
    from lockstep.state import State


def _check_config(config: CheckpointConfig, layout: str, max_duration: Time | None) -> None:
    """Settings the saver cannot work with, refused before anything is written."""
    if config.save_folder is None:
        raise ValueError("CheckpointWriter needs config.save_folder")
    if layout == LOCAL:
        for name in ("save_filename", "save_latest_filename"):
            value = getattr(config, name)
            if value is not None and "rank" not in templates.fields_of(value, name):
                raise ValueError(f"fsdp_config state_dict_type='local' writes one file per rank, so "
                                 f"{name}={value!r} must contain {{rank}}")
    if isinstance(config.save_interval, Time) and config.save_interval.unit is TimeUnit.DURATION \
            and max_duration is None:
        raise ValueError(f"save_interval='{config.save_interval}' is a fraction of max_duration, so "
                         f"max_duration is needed")


class CheckpointWriter:
    """Writes the Trainer's checkpoints. Rank 0 writes one file that holds every rank's RNG state
    and data position; all ranks take part in gathering those. Under FSDP's ``local`` layout each
    rank writes its own file (and pointer); under ``sharded`` the ranks write one DCP folder, and
    under DeepSpeed one folder of the engine's files.

    Training waits only while the state is copied in memory; a background thread then writes the
    file (in folder layouts, every rank's thread its part), fsyncs it, renames it into place,
    moves the latest pointer and prunes old checkpoints. Until that is done the checkpoint is not
    visible, so a crash in between leaves the previous one as the latest. :meth:`wait` blocks
    until the newest checkpoint is durable.

    In the single-file layout the thread also copies the parameters and optimizer state, while
    the next batch's forward and backward read them: until :attr:`copying` is set, nothing may
    change them (:meth:`before_weights_change` waits for it).
    """

    def __init__(self, config: CheckpointConfig, *, run_name: str, max_duration: Time | None,
                 layout: str = SINGLE, device: torch.device | str = "cpu") -> None:
        _check_config(config, layout, max_duration)
        self.config, self.layout = config, layout
        self.schedule = SaveSchedule(config.save_interval, max_duration)
        """When a checkpoint is due."""
        self.device = torch.device(device)
        """Where this run's collectives reduce tensors (NCCL reduces only CUDA tensors)."""
        self.run_name = run_name
        self.where = SaveFolder.of(config.save_folder, config.save_filename,  # type: ignore[arg-type]
                                   config.save_latest_filename, run_name=run_name, layout=layout)
        """The save folder: its names, its local (or staging) folder, its bucket."""
        self.mirror = None if self.where.remote is None else BucketMirror(
            self.where, uploads=self.writes or layout in FOLDER_LAYOUTS, publishes=self.writes,
            keep=config.save_num_checkpoints_to_keep, device=self.device)
        """The bucket's copy of the folder, when save_folder is a bucket's (the local folder stages it)."""
        self.folder_claim = FolderClaim(self.where, run_name, writes=self.writes, device=self.device,
                                        patterns=self._patterns, uploader=lambda: self.uploader)
        """The run's hold on the folder, from :meth:`check_folder` to the end of ``fit``."""
        self.saves = SaveRecord(config.save_num_checkpoints_to_keep, layout)
        """This run's checkpoints in the folder, kept across resumes."""
        self.last_saved_batch: int | None = None
        self._swept = False
        self._pool: ThreadPoolExecutor | None = None
        self._publisher: Future[None] | None = None
        self._failure: BaseException | None = None
        self._stager = staging.Stager()
        self.copying: threading.Event | None = None
        """Set once the background save has copied the parameters and optimizer state (None: no such copy)."""
        self._writer_group: torch.distributed.ProcessGroup | None = None
        """The process group of a folder layout's writes, made at its first save."""
        self._writer_generation = 0
        """The generation of an elastic job's ranks that made it."""
        self._failed_folder: Path | None = None
        """The temporary folder of a folder layout's write that failed."""
        self._may_replace_own = False
        """Set on autoresume: files past the resume point are this run's leftovers from before a crash."""

    @property
    def uploader(self) -> remote.Uploader | None:
        """This rank's upload process into the bucket (None: a local save_folder)."""
        return None if self.mirror is None else self.mirror.uploader

    def check_folder(self) -> None:
        """Before training (a collective): the folder exists or can be created and takes a write on
        every rank that writes into it; otherwise a ValueError on every rank that names the cause,
        instead of an error at the first save, after training has run."""
        error = writable.check_folder(self.where.local) if self.writes or self.layout in FOLDER_LAYOUTS else None
        if error is None and self.where.remote is not None:  # wrong credentials, no bucket, no server: now
            error = self.where.remote.problem()
        self.folder_claim.take(error)

    def _patterns(self) -> list[str]:
        """Globs of the names this rank writes in the folder, for :mod:`ownership`."""
        names = [self.filename_glob()]
        if self.where.latest is not None:
            names.append(self.where.latest.name)
        return names

    def close(self) -> None:
        """Release the folder and end the upload process, once it has done what it was given
        (``Trainer.close``; no save follows)."""
        self.folder_claim.release()
        if self.uploader is not None:
            self.uploader.close()

    def sweep_leftovers(self) -> None:
        """When a job starts (a collective), before autoresume downloads anything, in a bucket's
        staging folder: the first rank of each node's folder removes what a killed job left there
        unfinished, partial checkpoint folders and files being written or downloaded
        (:mod:`leftovers`), also on nodes whose disk rank 0 does not see. No writer of this run is
        alive then (a live job of the run on rank 0's disk is refused by :meth:`claim`)."""
        if self.where.remote is None:
            return
        error, place = None, None
        try:
            seen = os.stat(self.where.local)
            place = (socket.gethostname(), seen.st_dev, seen.st_ino)  # one folder of one machine
        except FileNotFoundError:
            pass  # nothing left on this disk
        except OSError as e:
            error = f"cannot read the staging folder {self.where.local}: {e}"
        every = _agreement.gather_small_objects((place, self._patterns()))
        sharing = [rank for rank, (where, _) in enumerate(every) if where == place]
        if place is not None and error is None and sharing[0] == dist.get_global_rank():
            globs = sorted({g for rank in sharing for g in every[rank][1]})
            try:
                leftovers.sweep(self.where.local, globs)
            except OSError as e:
                error = f"cannot remove what a stopped job left in the staging folder {self.where.local}: {e}"
        _agreement.raise_first_error(error, RuntimeError, device=self.device)  # every sweep is done

    def begin(self, resumed: Loaded | None) -> None:
        """Before training: continue the save history of the checkpoint the run resumed from, or,
        starting fresh, refuse a folder that holds checkpoints this run would mix with."""
        config = self.config
        self._may_replace_own = config.autoresume
        if not config.autoresume and config.load_path is None:
            self._refuse_existing()
        if resumed is not None and not resumed.weights_only:
            self.last_saved_batch = resumed.batch
            if config.autoresume:
                self.saves.resumed(resumed.history, resumed.saved_at)
        if self.where.remote is not None and self.writes and config.autoresume:
            self.mirror.left_earlier(resumed)  # type: ignore[union-attr]

    def join_running(self) -> None:
        """Before training, on a rank that joins a running elastic job: its saves go on from the
        others', in a folder that holds theirs (and its own from before its node was lost)."""
        self._may_replace_own = True

    @property
    def writes(self) -> bool:
        """Whether this rank publishes files (in folder layouts every rank also writes into the folder)."""
        return self.layout == LOCAL or dist.get_global_rank() == 0

    def filename_glob(self) -> str:
        """A glob, relative to the folder, of every checkpoint name ``save_filename`` makes."""
        return self.where.filename_glob()

    def _refuse_existing(self) -> None:
        """Before training: refuse a folder that already holds checkpoints this run would mix with."""
        if self.config.save_overwrite or not self.writes:
            return
        pattern = str(self.where.local / self.filename_glob())
        found = sorted(glob.glob(pattern))
        if self.where.latest is not None and (self.where.latest.exists() or self.where.latest.is_symlink()):
            found.insert(0, str(self.where.latest))
        if not found and self.where.remote is not None:
            in_bucket = self.where.remote.holds_objects()
            found = [f"{self.where.remote.store.scheme}://{self.where.remote.store.bucket}/{in_bucket}"] if in_bucket else []
        if found:
            where = self.where.local if self.where.remote is None else self.where.remote.uri
            raise FileExistsError(
                f"save_folder {where} already holds checkpoints (e.g. {found[0]}): pass "
                f"save_overwrite=True to replace them, autoresume=True to continue that run, or "
                f"another save_folder")

    def due(self, before: Timestamp, after: Timestamp, event: object, state: State, *, epoch_end: bool) -> bool:
        """Whether a checkpoint is due (see :meth:`SaveSchedule.due`)."""
        return self.schedule.due(before, after, event, state, epoch_end=epoch_end)

    @property
    def max_duration(self) -> Time | None:
        return self.schedule.max_duration

    @max_duration.setter
    def max_duration(self, value: Time | None) -> None:  # a fit(duration=...) moves 'dur' intervals
        self.schedule.max_duration = value

    def save(self, state: State, rank_entry: dict[str, Any], layout: Layout, *,
             wait: bool = False) -> Path | None:
        """Write the checkpoint of ``state`` now (a collective: every rank calls it); its path on
        the ranks that wrote a part of it, else None.

        Training waits for one small all-gather and a copy of the state in memory; a thread writes
        the copy and publishes it (in folder layouts every rank's thread writes its part: FSDP
        shards, DeepSpeed's files). A checkpoint too big to copy into free memory is written
        before this returns. With ``wait`` (the caller calls :meth:`wait` next: the end of
        training, preemption) there is nothing to overlap, so the state is written and published
        straight away, without the copy.
        """
        name = templates.format_name(self.config.save_filename, self.where.place, state.timestamp)
        path = self.where.local / name
        if self.layout == LOCAL:  # so that export finds every rank's file from any one of them
            rank_entry = {**rank_entry, "file": name}
        buffers = layout.rank_buffers()
        if buffers:
            rank_entry = {**rank_entry, "buffers": buffers}
        ranks, pid = self._agree(path, name, rank_entry)
        membership = elastic.current()
        if membership is not None:
            # every rank on to the save, or none (another may have given up the gather just done,
            # seeing a change of the job's ranks, after its part reached the others): on to the
            # collectives that follow, where they would wait for it, and so that every rank counts
            # the save as done, or none (a rank that saved alone is at another step of the batch's end)
            membership.all_or_none("the checkpoint's write")
        with _agreement.long_io():  # every rank is here (it took part in the agreement)
            model, optimizers = layout.gather() if self.writes or layout.collective else ({}, [])
        if self.writes and not self._swept:  # temporary files of a writer that died mid-save
            files.remove_stale_temps(self.where.local)
            self._swept = True
        history = self.saves.saving(name, payload.plain_timestamp(state.timestamp))
        if self.mirror is not None:
            self.mirror.saved(name)
        if is_folder(layout):
            self._save_folder(state, ranks, history, layout, model, optimizers, path, pid, wait=wait)
        elif self.writes:
            self._save_file(state, ranks, history, layout, model, optimizers, path, wait=wait)
        self.last_saved_batch = state.timestamp.batch.value
        return path if self.writes or is_folder(layout) else None  # every rank writes a folder's parts

    def _agree(self, path: Path, name: str, rank_entry: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """Every rank's entry and rank 0's pid, once the previous save is published everywhere.

        One gather, so that a refusal or a failed earlier write raises on every rank rather than
        leaving the others in the next collective; the pid names a folder layout's temporary folder.
        """
        failure = self._join()  # the previous save's publish updates the history
        clash = self.writes and (path.exists() or path.is_symlink()) and not (self.config.save_overwrite or self._may_replace_own)
        gathered = _agreement.gather_small_objects((_to_wire(rank_entry), clash, os.getpid(), failure,
                                                     None if self.mirror is None else self.mirror.state()))
        self._raise_failure(next(((r, g[3]) for r, g in enumerate(gathered) if g[3] is not None), None))
        if self.mirror is not None:  # the bucket's pointer moves to what every rank has uploaded
            self.mirror.after_uploads([g[4] for g in gathered])
        if self.layout == LOCAL:  # only now is the previous save published on every rank
            self._prune()
        if any(g[1] for g in gathered):
            shown = path if clash else f"{self.where.local}/{name} (on another rank)"
            raise FileExistsError(f"checkpoint {shown} already exists: pass save_overwrite=True to "
                                  f"replace it, or choose another save_folder or save_filename")
        return ([_from_wire(e) for e, *_ in gathered] if self.writes else []), gathered[0][2]

    def _meta(self, state: State, ranks: list[dict[str, Any]], history: list[str], layout: Layout,
              rests: list[Any]) -> dict[str, Any] | None:
        """Rank 0's lockstep.pt of a folder layout: everything but the model and optimizer tensors."""
        if dist.get_global_rank() != 0:
            return None
        return payload.build(state, ranks, self.saves.kept(history), layout, {}, rests,
                             metrics=self.config.save_metrics)

    def record(self) -> list[tuple[str, Any]]:
        """``(name, timestamp state)`` of each checkpoint this run saved that the folder still
        holds, oldest first (a rank that publishes no files lists all it took part in)."""
        return self.saves.entries(self.writes)

    def _save_file(self, state: State, ranks: list[dict[str, Any]], history: list[str], layout: Layout,
                   model: dict[str, Any], optimizers: list[Any], path: Path, *, wait: bool) -> None:
        """A writer's one file: staged and written by the thread, or written here when it does not fit."""
        content = model if self.config.save_weights_only else payload.build(
            state, ranks, self.saves.kept(history), layout, model, optimizers, rank=dist.get_global_rank(),
            metrics=self.config.save_metrics)
        if self.config.save_ignore_keys is not None:
            try:
                content = payload.without(content, self.config.save_ignore_keys,
                                          weights_only=self.config.save_weights_only)
            except ValueError as e:  # nothing of the model left: raised on every rank by wait() or the next save
                self._failure = e
                return
        staged = None if wait else self._staged(content, layout.step_storages())
        if staged is not None:
            self.copying = threading.Event()
            self._hand_over(False, self._copy_and_publish, staged, path, history, self.copying)
            return
        try:  # written before training goes on
            with _agreement.long_io():
                temp = files.write_temp(content, path)
        except Exception as e:  # raised on every rank by wait() or the next save
            self._failure = e
            return
        self._hand_over(wait, self._publish, temp, None, path, history)

    def _staged(self, content: Any, later: Collection[tuple[str, int]] = ()) -> Any:
        """``content`` copied for the writer thread (``later``: see :meth:`Stager.stage`), or None
        when the copy does not fit in memory."""
        try:
            with _agreement.long_io():
                return self._stager.stage(content, later)
        except staging.DoesNotFit:
            return None

    def _copy_and_publish(self, staged: Any, path: Path, history: list[str], copied: threading.Event) -> None:
        """The writer thread's job: finish the staged copy, let training change the state again,
        then write and publish the copy."""
        try:
            self._stager.copy_later()
        except BaseException as e:  # raised on every rank by the next save or wait
            self._failure = e
            return
        finally:
            copied.set()
        self._publish(None, staged, path, history)

    def before_weights_change(self) -> None:
        """Return once no background save still reads the parameters or optimizer state: the
        Trainer calls it before anything may change them in place (the optimizer step, and an
        algorithm or callback acting at an event)."""
        copying = self.copying
        if copying is not None:
            copying.wait()
            self.copying = None

    def _save_folder(self, state: State, ranks: list[dict[str, Any]], history: list[str], layout: FolderLayout,
                     model: dict[str, Any], optimizers: list[Any], path: Path, pid: int, *, wait: bool) -> None:
        """A folder layout (FSDP ``sharded``: DCP's shards; DeepSpeed: the engine's files): every
        rank's thread writes its part into one temporary folder, then rank 0 adds lockstep.pt and
        publishes it.

        The writes meet over a process group of their own, so that a thread can write while
        training uses the default one. Each rank decides alone whether its part fits in memory to
        be copied: one rank writing in its thread while another writes here still meet there.
        """
        generation = _generation()
        if self._writer_group is None or generation != self._writer_generation:
            # a collective: every rank's first folder save comes here, and the first after an
            # elastic job's ranks changed (the old group holds ranks that left)
            self._writer_group, self._writer_generation = _writer_group(), generation
        temp = files.temp_path(path, pid)
        parts, rests = layout.folder_parts(temp, model, optimizers)
        meta = self._meta(state, ranks, history, layout, rests)
        staged = None if wait else self._staged(parts)
        if staged is not None:  # training goes on changing what these hold
            parts, meta = staged, copy.deepcopy(meta)
        self._hand_over(staged is None, self._write_folder, temp, parts, meta, path, history, layout)

    def _write_folder(self, temp: Path, parts: Any, meta: dict[str, Any] | None, path: Path,
                      history: list[str], layout: FolderLayout) -> None:
        try:
            written = layout.write_parts(temp, parts, self._writer_group)
            if self.mirror is not None and meta is None:
                self.mirror.upload_folder_part(temp, path)
            if self.uploader is not None and self._writer_group is not None:
                dist.barrier(group=self._writer_group)  # rank 0 renames the folder after every rank linked its files
                if meta is None and not _sees_rank_zero(temp, written):
                    # another node's disk: rank 0 never publishes this copy, and its uploads read links
                    shutil.rmtree(temp, ignore_errors=True)
            if meta is not None:  # rank 0, once every rank's part is written
                layout.seal(temp, meta)
                files.save_durably(meta, temp / SHARDED_META)
                if self.mirror is not None:
                    self.mirror.upload_folder_part(temp, path)
                self._publish(temp, None, path, history)
        except BaseException as e:  # raised on every rank by the next save or wait
            self._failure, self._failed_folder = e, temp

    def _hand_over(self, now: bool, write: Callable[..., None], *args: Any) -> None:
        """Run ``write`` here (``now``), or on the one lasting writer thread."""
        if now:
            with _agreement.long_io():
                write(*args)
            return
        if self._pool is None:  # one lasting thread: starting a thread per save costs a GIL handoff
            idle_only = self.layout not in FOLDER_LAYOUTS  # those writers meet in collectives
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lockstep-checkpoint",
                                            initializer=idle.yield_to_training, initargs=(idle_only,))
        self._publisher = self._pool.submit(_with_short_lock_turns, write, *args)

    def _publish(self, temp: Path | None, staged: Any, path: Path, history: list[str]) -> None:
        try:
            files.publish(temp if temp is not None else files.write_temp(staged, path), path)
            if self.where.latest is not None and self.config.save_num_checkpoints_to_keep != 0:  # 0: pruned next
                files.point_latest(self.where.latest, path)
            if self.mirror is not None and self.layout not in FOLDER_LAYOUTS:
                self.mirror.upload_file(str(path.relative_to(self.where.local)), path)
            self.saves.published(history)
            if self.layout != LOCAL:
                self._prune()
        except BaseException as e:  # raised on every rank by the next save or wait
            self._failure = e

    def _join(self) -> str | None:
        """Wait for the background publish; its failure, if any, as a message."""
        self.settle()
        if self._failure is None:
            return None
        return f"{type(self._failure).__name__}: {self._failure}"

    def _raise_failure(self, first: tuple[int, str] | None) -> None:
        if first is not None:
            cause, self._failure = self._failure, None
            progress.echo(first[0])
            where = "" if dist.get_world_size() == 1 else f" on rank {first[0]}"
            raise RuntimeError(f"writing a checkpoint in {self.where.local} failed{where}: {first[1]}") from cause

    def wait(self) -> None:
        """Return on every rank once the newest checkpoint is durable and the latest pointer names
        it; raise on every rank if writing it failed on any."""
        failure = self._join()
        self._raise_failure(_agreement.first_error(failure, device=self.device))
        if self.layout == LOCAL:
            self._prune()
        if self.mirror is not None:
            self.mirror.finish()

    def settle(self) -> None:
        """Wait for the write in flight, on this rank alone (no collective). ``fit`` calls it when
        training raised, since the other ranks may be gone: the copy of the state being written
        predates the error, and a Trainer this process builds next for the run must find it whole,
        not still being written. A failure of the write is kept for the next :meth:`save` or
        :meth:`wait`."""
        if self._publisher is not None:
            with _agreement.long_io():
                self._publisher.result()  # _publish keeps its failure; it never raises
            self._publisher = self.copying = None

    def settle_after_change(self) -> None:
        """:meth:`settle`, after an elastic job's ranks changed: a write that the change broke off
        (a collective of the ranks that were) is given up, its temporary folder removed, rather
        than raised at the next save; the newest checkpoint is then the one before it. Any failure
        of that write is given up: a peer that saw the change first removes the temporary folder
        they share, which this rank's write then finds missing files in."""
        self.settle()
        if self._failure is None or elastic.current() is None:
            return
        self._failure = None
        if self._failed_folder is not None:
            shutil.rmtree(self._failed_folder, ignore_errors=True)
            self._failed_folder = None

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond ``num_to_keep``. Per-rank files are pruned only
        once every rank has published the newest, so that after a crash between two ranks'
        publishes the ranks ahead still hold the step the others are at (the loader goes back to it)."""
        while (oldest := self.saves.oldest_beyond_keep()) is not None:
            files.remove(self.where.local / oldest)
            self.saves.forget_oldest()


def _sees_rank_zero(temp: Path, written: Collection[str]) -> bool:
    """Whether ``temp`` is the copy of a folder checkpoint that rank 0 publishes: it holds a file
    rank 0 wrote (among ``written``, every rank's files). When rank 0 wrote none, assume it is."""
    own = [name for name in written if integrity.part_rank(name) == 0]
    return not own or any((temp / name).exists() for name in own)


def _with_short_lock_turns(write: Callable[..., None], *args: Any) -> None:
    with idle.short_lock_turns():
        write(*args)


def _generation() -> int:
    """The generation of an elastic job's ranks (0 outside one)."""
    membership = elastic.current()
    return 0 if membership is None else membership.generation


def _writer_group() -> torch.distributed.ProcessGroup | None:
    """A gloo group of every rank for a folder layout's writes (None without a process group: DCP
    then writes as one process). gloo, because DCP's collectives move CPU objects, and on a GPU the
    default group is NCCL's."""
    if not torch.distributed.is_initialized():
        return None
    return torch.distributed.new_group(backend="gloo")


@dataclass(frozen=True, slots=True)
class _WireTensor:
    """A tensor as plain bytes: pickling a tensor itself runs a whole torch.save per tensor."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().contiguous().reshape(-1)
        return _WireTensor(str(flat.dtype).removeprefix("torch."), tuple(obj.shape),
                           flat.view(torch.uint8).numpy().tobytes())
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_wire(v) for v in obj)
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, _WireTensor):
        dtype = getattr(torch, obj.dtype)
        if not obj.data:
            return torch.empty(obj.shape, dtype=dtype)
        return torch.frombuffer(bytearray(obj.data), dtype=torch.uint8).view(dtype).reshape(obj.shape)
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_from_wire(v) for v in obj)
    return obj
