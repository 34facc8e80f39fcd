"""Loading a checkpoint into a Trainer on every rank: ``load_path`` and ``autoresume``.

Probe, agree, decide, act. Each rank first looks on its own, without collectives: which file it
found, at which batch, whether it reads and checks (a :class:`Probe`). One all-gather gives every
rank the same list of probes, from which the pure function :func:`decide` picks one action, the
same on every rank. Only then does any rank act. So a missing or damaged file is an error on every
rank, never a rank waiting forever for a peer that gave up. (Before probing, one small all-gather
tells which ranks read the same copy of the checkpoint: those split its CRC checks, and nodes that
read copies on disks of their own each check their own.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import _agreement, dist
from lockstep.checkpoint import ignore as ignore_keys
from lockstep.checkpoint.payload import STATEFUL
from lockstep.checkpoint import composer, files, integrity, payload, templates
from lockstep.checkpoint.files import CheckpointError, DamagedCheckpoint
from lockstep.checkpoint.layout import (
    DEEPSPEED, FOLDER_LAYOUTS, INDEX, LOCAL, SHARDED, SHARDED_META, SINGLE, Layout, is_folder)
from lockstep.checkpoint.states import rekey_optimizer

if TYPE_CHECKING:
    from lockstep.state import State


@dataclass(slots=True)
class Loaded:
    """What a load left for the training loop: this rank's RNG/data entry and the save history."""

    batch: int = 0
    """The batch the checkpoint was saved at (0 for weights only)."""
    rank_entry: dict[str, Any] | None = None
    """None when the checkpoint is of another world size (a sharded one, resharded)."""
    history: list[str] = field(default_factory=list)
    saved_at: dict[str, Any] = field(default_factory=dict)
    """The timestamp state each checkpoint of ``history`` was saved at, where known."""
    weights_only: bool = False


@dataclass(frozen=True, slots=True)
class Probe:
    """What one rank found on its own."""

    found: bool = False
    """This rank has a checkpoint to read: its own file, or rank 0's."""
    shared: bool = False
    """It reads rank 0's file, which (under DDP) every rank reads: the ranks split its CRC check."""
    batch: int = 0
    """The batch that checkpoint was saved at."""
    saves: int = 0
    """How many checkpoints of the run its save history holds."""
    path: str = ""
    error: str | None = None
    """Reading or checking the checkpoint failed; or, when nothing was found, what was missing."""
    damaged: bool = False
    """The error is bad bytes (a :class:`DamagedCheckpoint`), not a checkpoint that does not fit."""
    can_send: bool = False
    """Rank 0 holds a single-file checkpoint it can send to ranks that do not see its disk."""


@dataclass(frozen=True, slots=True)
class Fresh:
    """Nothing to resume from: the run starts at batch 0."""


@dataclass(frozen=True, slots=True)
class Fail:
    message: str
    damaged: bool = False


@dataclass(frozen=True, slots=True)
class StartOver:
    """Per-rank files of a first save that only some ranks published: those ranks delete theirs,
    and the run starts at batch 0."""


@dataclass(frozen=True, slots=True)
class StepBack:
    """Per-rank files of a save some ranks published and others not: the ranks ahead go back to
    ``batch``, the step every rank has."""

    batch: int


@dataclass(frozen=True, slots=True)
class Load:
    receive: bool = False
    """Ranks without the file receive rank 0's."""
    check_whole: bool = False
    """Some ranks read rank 0's file and others their own, so the split CRC check is void: the
    ranks that read rank 0's file check it whole."""
    agree: bool = False
    """Applying may fail on some ranks only (they read different files, or the layout's loads are
    collectives): agree on it afterwards."""


Action = Fresh | Fail | StartOver | StepBack | Load


def decide(probes: Sequence[Probe], *, optional: bool, per_rank_files: bool, collective: bool,
           template: str) -> Action:
    """The one action every rank takes, from every rank's probe (the same list on every rank).
    ``optional``: autoresume, where finding nothing means a fresh start."""
    def on_rank(rank: int, message: str) -> str:
        return message if len(probes) == 1 else f"rank {rank}: {message}"

    found = [p for p in probes if p.found]
    if optional and not found:
        return Fresh()
    failures = [(r, p) for r, p in enumerate(probes) if p.found and p.error]
    # bad bytes first: a rank that read bytes another rank found damaged may fail otherwise
    failed = next((f for f in failures if f[1].damaged), failures[0] if failures else None)
    if failed:
        return Fail(on_rank(failed[0], failed[1].error or ""), failed[1].damaged)
    missing = [(r, p) for r, p in enumerate(probes) if not p.found]
    if missing and optional and per_rank_files:
        return _start_over_or_fail(probes, on_rank)
    if missing and not probes[0].can_send:
        rank, probe = missing[0]
        elsewhere = " while other ranks found theirs: is it on a file system every node sees?" if found else ""
        return Fail(on_rank(rank, f"{probe.error}{elsewhere}"))
    low, high = min(p.batch for p in found), max(p.batch for p in found)
    if low != high and optional and per_rank_files:
        return StepBack(low)
    if low != high:
        return Fail(f"the ranks loaded checkpoints of different steps (batches {low} to {high}): the "
                    f"per-rank files of {template!r} are not from one save")
    unshared = any(p.found and not p.shared for p in probes)
    return Load(receive=bool(missing), check_whole=unshared and any(p.shared for p in probes),
                agree=unshared or collective)


def _start_over_or_fail(probes: Sequence[Probe], on_rank: Any) -> Action:
    ahead = next(((r, p) for r, p in enumerate(probes) if p.saves > 1), None)
    if ahead is None:
        return StartOver()
    rank, probe = ahead
    return Fail(on_rank(rank, f"{probe.path} is this rank's checkpoint number {probe.saves} of the run, yet "
                              f"other ranks find no latest pointer at all: their files are gone (save_folder "
                              f"must be the same folder for every rank, e.g. on a shared file system)"))


def load(template: str, state: State, layout: Layout, *, run_name: str, weights_only: bool, strict: bool,
         optional: bool = False, what: str = "load_path", ignore: ignore_keys.IgnoreKeys = None) -> Loaded | None:
    """Load the checkpoint ``template`` names into ``state`` on every rank (a collective).

    With ``optional`` (autoresume), no file on any rank means a fresh start (None). Ranks that do
    not see rank 0's single file (another node, no shared file system) get it from rank 0.
    ``ignore`` (``load_ignore_keys``) leaves out the parts it names.
    """
    templates.check_template(template, what, time_fields=False)
    peers = _readers_of_copy(_found(template, layout, run_name), layout)
    mine = _probe(template, state, layout, run_name=run_name, weights_only=weights_only, optional=optional,
                  what=what, peers=peers)
    action = decide(dist.all_gather_object(mine.probe), optional=optional, per_rank_files=layout.name == LOCAL,
                    collective=layout.collective, template=template)
    opened = mine.opened
    match action:
        case Fresh():
            return None
        case Fail(message, damaged):
            raise (DamagedCheckpoint if damaged else CheckpointError)(message)
        case StartOver():
            mine.start_over()
            return None
        case StepBack(batch):
            opened = _step_back(mine, batch, state, layout, run_name=run_name)
            agree = True  # each rank applies its own file
        case Load(receive=receive, check_whole=check_whole, agree=agree):
            if receive:
                opened = _from_rank_zero(opened, state, layout, run_name=run_name, weights_only=weights_only,
                                         check_run_name=optional)
            assert opened is not None  # decide() loads once every rank has a file, or receives rank 0's
            if check_whole:
                _agreement.raise_first_error(_checked(opened.path) if mine.probe.shared else None,
                                             DamagedCheckpoint, device=state.device.torch_device)
    return _apply_agreed(opened, state, layout, weights_only=weights_only, strict=strict, agree=agree,
                         ignore=ignore)


def candidates(template: str, run_name: str) -> tuple[Path, Path]:
    """This rank's file, and rank 0's: under DDP rank 0 writes one file that serves every rank,
    so a ``{rank}`` template that names no file for this rank falls back to rank 0's."""
    own = Path(templates.format_name(template, templates.place_values(run_name)))
    zero = Path(templates.format_name(template, templates.place_values(run_name, rank=0)))
    return own, zero


@dataclass(slots=True)
class _Local:
    """This rank's probe, and what stays on this rank: the pointer it followed and the opened file."""

    probe: Probe
    pointer: Path | None = None
    opened: _Opened | None = None

    def start_over(self) -> None:
        """Delete the pointer and file that this rank published (no other rank's files match them)."""
        if self.opened is not None and self.pointer is not None:
            if self.pointer.is_symlink():
                self.pointer.unlink()
            files.remove(self.opened.path)


def _found(template: str, layout: Layout, run_name: str) -> Path | None:
    """The file (or pointer) this rank reads: its own, else rank 0's (never under per-rank files)."""
    own, zero = candidates(template, run_name)
    if layout.name == LOCAL:  # per-rank files: rank 0's never serves another rank
        zero = own
    return next((p for p in (own, zero) if p.exists() or p.is_symlink()), None)


def _readers_of_copy(path: Path | None, layout: Layout) -> list[int] | None:
    """The ranks that read the same copy of the checkpoint as this rank (a collective): they split
    its CRC checks. Nodes without a shared disk each read a copy of their own (downloaded from a
    bucket, or copied there), and each copy must be checked in full. None: every rank reads one
    copy (or per-rank files, which no rank shares)."""
    if dist.get_world_size() == 1 or layout.name == LOCAL:
        return None
    copy = _identity(path)
    every = dist.all_gather_object(copy)
    if copy is None or all(c == copy for c in every):
        return None
    return [rank for rank, c in enumerate(every) if c == copy]


def _identity(path: Path | None) -> tuple[int, ...] | None:
    """What tells copies of a checkpoint apart: the inode and times of its header file, which every
    host that mounts one shared file system sees alike (a host's device numbers differ), and which
    differ between the copies that two nodes wrote to their own disks."""
    if path is None:
        return None
    try:
        target = files.resolve_pointer(path)
        header = target / SHARDED_META if target.is_dir() and (target / SHARDED_META).exists() else target
        st = header.stat()
    except (OSError, CheckpointError):
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _probe(template: str, state: State, layout: Layout, *, run_name: str, weights_only: bool,
           optional: bool, what: str, peers: list[int] | None = None) -> _Local:
    own, zero = candidates(template, run_name)
    if layout.name == LOCAL:  # per-rank files: rank 0's never serves another rank
        zero = own
    path = _found(template, layout, run_name)
    if path is None:
        tried = str(own) if own == zero else f"{own} (nor rank 0's {zero})"
        return _Local(Probe(error=f"{what} {template!r}: {tried} does not exist"))
    # Usually every rank reads rank 0's file; then they split its CRC check.
    shared = path == zero and layout.name != LOCAL
    rank, world = dist.get_global_rank(), dist.get_world_size()
    try:
        opened = _open(path, state, layout, run_name=run_name, weights_only=weights_only, check_run_name=optional,
                       share=(rank, world) if shared else (0, 1), peers=peers if shared else None)
    except CheckpointError as e:
        damaged = isinstance(e, DamagedCheckpoint)
        return _Local(Probe(found=True, shared=shared, path=str(path), error=str(e), damaged=damaged), path)
    can_send = rank == 0 and shared and layout.name == SINGLE and opened.path.is_file()
    probe = Probe(found=True, shared=shared, batch=opened.batch, saves=len(opened.history), path=str(opened.path),
                  can_send=can_send)
    return _Local(probe, path, opened)


def _apply_agreed(opened: _Opened, state: State, layout: Layout, *, weights_only: bool, strict: bool,
                  agree: bool, ignore: ignore_keys.IgnoreKeys = None) -> Loaded:
    """Apply the opened checkpoint. When every rank loaded the same file into an unsharded model,
    a failure is the same on every rank, so only otherwise is there an agreement."""
    if not agree:
        return _apply(opened, state, layout, weights_only=weights_only, strict=strict, ignore=ignore)
    loaded, error = None, None
    try:
        loaded = _apply(opened, state, layout, weights_only=weights_only, strict=strict, ignore=ignore)
    except CheckpointError as e:
        error = str(e)
    _agreement.raise_first_error(error, CheckpointError, device=state.device.torch_device)
    assert loaded is not None  # else this rank's error was raised
    return loaded


def _step_back(mine: _Local, low: int, state: State, layout: Layout, *, run_name: str) -> _Opened:
    """Autoresume of per-rank files after a crash between two ranks' publishes: the ranks whose
    latest pointer is one save ahead open their previous checkpoint (kept until every rank had
    published: see CheckpointWriter._prune), so that all resume from the step every rank has. Once
    all agree, those ranks point their latest pointer back and delete the newer file, which no
    other rank's files match."""
    ahead = mine.opened
    assert ahead is not None  # decide() steps back only once every rank found its file
    opened, error = ahead, None
    if ahead.batch != low:
        history = ahead.history
        previous = ahead.path.parent / history[-2] if len(history) >= 2 else None
        try:
            if previous is None or not previous.exists():
                raise CheckpointError(f"{ahead.path} is at batch {ahead.batch} and other ranks' latest "
                                      f"checkpoints at batch {low}, and this rank no longer has that one")
            opened = _open(previous, state, layout, run_name=run_name, weights_only=False, check_run_name=True,
                           share=(0, 1))
        except CheckpointError as e:
            error = str(e)
    _agreement.raise_first_error(error, CheckpointError, device=state.device.torch_device)
    batches = {b for b in dist.all_gather_object(opened.batch)}
    if len(batches) > 1:
        raise CheckpointError(f"autoresume found per-rank checkpoints of batches {min(batches)} to "
                              f"{max(batches)}, and no step that every rank has: pass load_path to choose one")
    if opened is not ahead and mine.pointer is not None and mine.pointer.is_symlink():
        files.point_latest(mine.pointer, opened.path)
        files.remove(ahead.path)
    return opened


def _from_rank_zero(opened: _Opened | None, state: State, layout: Layout, *, run_name: str,
                    weights_only: bool, check_run_name: bool) -> _Opened:
    """Rank 0's single-file checkpoint, sent to the ranks that do not see it: a node whose disk
    is not the one rank 0 saved to (no shared file system). Every rank takes part in the
    broadcast; the ranks without the file check and open what it carries, as if read from disk."""
    sender = opened if dist.get_global_rank() == 0 else None
    header = [(str(sender.path), sender.path.stat().st_size) if sender is not None else None]
    dist.broadcast_object_list(header, src=0)
    assert header[0] is not None  # decide() has ranks receive only what rank 0 can send
    name, size = header[0]
    if sender is not None:
        buffer = torch.frombuffer(bytearray(sender.path.read_bytes()), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    buffer = dist.broadcast(buffer.to(state.device.torch_device), src=0)
    error = None
    if opened is None:
        try:
            opened = _open(Path(name), state, layout, run_name=run_name, weights_only=weights_only,
                           check_run_name=check_run_name, share=(0, 1), data=buffer.cpu().numpy().tobytes())
        except CheckpointError as e:
            error = str(e)
    _agreement.raise_first_error(error, CheckpointError, device=state.device.torch_device)
    assert opened is not None  # else this rank's error was raised
    return opened


def _checked(path: Path) -> str | None:
    """Check every CRC of a single-file checkpoint; the error, if any."""
    try:
        files.verify(_meta_file(files.resolve_pointer(path)))
    except CheckpointError as e:
        return str(e)
    return None


@dataclass(slots=True)
class _Opened:
    """A checkpoint read and checked, not yet loaded."""

    path: Path
    content: dict[str, Any]
    meta: dict[str, Any] | None
    """The lockstep header; None for a plain state_dict of tensors."""

    @property
    def batch(self) -> int:
        return int((self.content.get("timestamp") or {}).get("batch", 0)) if self.meta is not None else 0

    @property
    def layout(self) -> str:
        return payload.layout_of(self.meta) if self.meta is not None else SINGLE

    @property
    def history(self) -> list[str]:
        """The save history the checkpoint holds (none for a plain state_dict)."""
        return list((self.meta or {}).get("history", []))

    @property
    def saved_at(self) -> dict[str, Any]:
        """The timestamp state each checkpoint of :attr:`history` was saved at, where known."""
        return dict((self.meta or {}).get("saved_at") or {})


def _open(path: Path, state: State, layout: Layout, *, run_name: str, weights_only: bool,
          check_run_name: bool, share: tuple[int, int], data: bytes | None = None,
          peers: list[int] | None = None) -> _Opened:
    """Read, check and unpickle ``path`` (or, given ``data``, the file's content received from rank
    0). ``share``: (this rank, of how many) that read it and split its checks; ``peers``: of those,
    the ranks that read this rank's copy of it (None: all of them)."""
    with _agreement.long_io():  # reading a big file is not a stall, nor are ranks waiting for it
        if data is None:
            target = files.resolve_pointer(path)
            if composer.is_composer_folder(target):
                content = composer.read_folder(target)
            else:
                content = files.read(_meta_file(target), share=integrity.within(share, peers))
        else:
            target, content = path, files.read_bytes(data, path)
        content = payload.normalized(content, target)
        opened = _Opened(target, content, payload.metadata(content, target))
        meta = opened.meta
        if opened.layout == DEEPSPEED:  # before DeepSpeed unpickles any of them, on any rank
            from lockstep.checkpoint.deepspeed import check_folder
            check_folder(target, meta or {}, share=share, every=weights_only, peers=peers)
        elif opened.layout == SHARDED:  # before DCP reads any of them, on any rank
            integrity.check_sharded(target, meta or {}, share, peers)
    if meta is None:
        if not weights_only:
            raise CheckpointError(f"{target} holds only model weights (a plain state_dict): pass "
                                  f"load_weights_only=True to load it")
        return opened
    if check_run_name and meta.get("run_name") != run_name:
        raise CheckpointError(f"autoresume found {target}, a checkpoint of run {meta.get('run_name')!r}, "
                              f"not of run_name {run_name!r}: give each run its own save_folder "
                              f"(e.g. save_folder='checkpoints/{{run_name}}')")
    _check_layout(opened, layout, weights_only)
    if not weights_only:
        payload.check_world_size(content, target, dist.get_world_size(), state)
        payload.check_complete(content, target, layout, state)
    return opened


def _meta_file(target: Path) -> Path:
    """The file that holds a checkpoint's header: the checkpoint itself, or a folder's lockstep.pt."""
    if not target.is_dir():
        return target
    if not (target / SHARDED_META).exists():
        if integrity.looks_like_checkpoint(target):
            raise integrity.damaged(target, SHARDED_META, "is missing (deleted?)")
        raise CheckpointError(f"{target} is a folder without {SHARDED_META}: not a lockstep checkpoint folder")
    return target / SHARDED_META


def _check_layout(opened: _Opened, layout: Layout, weights_only: bool) -> None:
    saved, meta = opened.layout, opened.meta
    assert meta is not None
    if saved == SINGLE and layout.name != SINGLE:
        return  # full tensors load into any layout
    if saved == DEEPSPEED and weights_only:
        return  # its weights are rebuilt in full, which load into any layout
    if saved == DEEPSPEED and layout.name != DEEPSPEED:
        raise CheckpointError(f"{opened.path} is a DeepSpeed checkpoint: resume it with deepspeed_config, or "
                              f"pass load_weights_only=True to start from its weights")
    if saved == DEEPSPEED and meta.get("zero_stage") != layout.stage:
        raise CheckpointError(f"{opened.path} was saved with ZeRO stage {meta.get('zero_stage')} and this run "
                              f"uses stage {layout.stage}: resume with the same "
                              f"zero_optimization stage, or pass load_weights_only=True")
    if saved != layout.name:
        hint = "train with fsdp_config={'state_dict_type': %r}" % saved if saved != SINGLE \
            else "set fsdp_config['state_dict_type'] to 'full'"
        if layout.name == DEEPSPEED:
            hint = ("a DeepSpeed run loads single-file checkpoints' weights too: torch.save "
                    "lockstep.checkpoint.export_state_dict(path) and load that with load_weights_only=True")
        raise CheckpointError(f"{opened.path} is a {saved!r} checkpoint but this run uses {layout.name!r} "
                              f"checkpoints: {hint}")
    if saved == LOCAL:
        if meta.get("world_size") != dist.get_world_size():
            raise CheckpointError(f"{opened.path} is one of {meta.get('world_size')} per-rank files, but this "
                                  f"run has {dist.get_world_size()} ranks: local checkpoints load only at the "
                                  f"same world size (save with state_dict_type='sharded' to change it)")
        if meta.get("rank") != dist.get_global_rank():
            raise CheckpointError(f"{opened.path} holds rank {meta.get('rank')}'s shards, not rank "
                                  f"{dist.get_global_rank()}'s: give load_path a {{rank}} field")


def _apply(opened: _Opened, state: State, layout: Layout, *,
           weights_only: bool, strict: bool, ignore: ignore_keys.IgnoreKeys = None) -> Loaded:
    if ignore is not None:
        return _apply_ignoring(opened, state, layout, weights_only=weights_only, strict=strict, ignore=ignore)
    content, meta, path = opened.content, opened.meta, opened.path
    if meta is None:
        layout.full_reader().load_model(content, path, strict)
        return Loaded(weights_only=True)
    if opened.layout == DEEPSPEED and weights_only:
        from lockstep.checkpoint.deepspeed import export_weights
        layout.full_reader().load_model(export_weights(path), path, strict)
    elif opened.layout in FOLDER_LAYOUTS:
        assert is_folder(layout)  # _check_layout: a folder checkpoint resumes only into its own layout
        with _agreement.long_io():  # after the agreement: every rank is here
            layout.load_folder(path, content, weights_only=weights_only, strict=strict)
    else:
        reader = layout.full_reader() if opened.layout == SINGLE else layout
        reader.load_model(content["model"], path, strict)
        if not weights_only and content["optimizers"] is not None:  # None: left out by save_ignore_keys
            optimizers, keys = content["optimizers"], meta.get("optimizer_keys", INDEX)
            if keys != reader.optimizer_keys:  # a DDP checkpoint into FSDP, or back
                optimizers = [rekey_optimizer(sd, keys, layout.model, o, path)
                              for sd, o in zip(optimizers, layout.optimizers)]
            reader.load_optimizers(optimizers, path)
    if weights_only:
        return Loaded(weights_only=True)
    return _apply_rest(opened, content, state, layout)


def _apply_rest(opened: _Opened, content: dict[str, Any], state: State, layout: Layout) -> Loaded:
    """Schedulers, scaler, timestamp and this rank's buffers; this rank's entry for the loop."""
    entry = payload.apply(content, state, opened.path, dist.get_global_rank(), dist.get_world_size())
    if entry and entry.get("buffers"):
        layout.load_rank_buffers(entry["buffers"])
    if opened.meta is not None:
        layout.restore_meta(opened.meta)
    return Loaded(opened.batch, entry, opened.history, opened.saved_at)


def _apply_ignoring(opened: _Opened, state: State, layout: Layout, *, weights_only: bool, strict: bool,
                    ignore: ignore_keys.IgnoreKeys) -> Loaded:
    """As :func:`_apply`, leaving out what ``load_ignore_keys`` names (a file of full or per-rank tensors)."""
    content, meta, path = opened.content, opened.meta, opened.path
    deepspeed_weights = opened.layout == DEEPSPEED and weights_only
    if meta is not None and opened.layout in FOLDER_LAYOUTS and not deepspeed_weights:
        raise CheckpointError(f"load_ignore_keys works on single-file and per-rank checkpoints, and {path} is a "
                              f"{opened.layout!r} one: export its weights with lockstep.checkpoint.export_state_dict "
                              f"and load those with load_weights_only=True")
    if meta is None:
        weights = content
    elif deepspeed_weights:
        from lockstep.checkpoint.deepspeed import export_weights
        weights = export_weights(path)
    else:
        weights = content["model"]
    full = meta is not None and not weights_only
    rank = dist.get_global_rank()
    tree = ignore_keys.apply(ignore, weights, content["optimizers"] if full and content["optimizers"] is not None
                             else None,
                             content["schedulers"] if full else None,
                             [r.get("rng") for r in content["ranks"]] if full else None,
                             {k: content[k] for k in STATEFUL if full and k in content})
    kept = tree.get("state", {})
    reader = layout if opened.layout == LOCAL else layout.full_reader()
    if kept.get("model"):  # ignoring every weight leaves the model as it is, as in Composer
        reader.load_model(kept["model"], path, strict)
    if meta is None or weights_only:
        return Loaded(weights_only=True)
    if "optimizers" in kept:
        optimizers, keys = kept["optimizers"], meta.get("optimizer_keys", INDEX)
        if keys != reader.optimizer_keys:
            optimizers = [rekey_optimizer(sd, keys, layout.model, o, path)
                          for sd, o in zip(optimizers, layout.optimizers)]
        reader.load_optimizers(optimizers, path)
    rest = {**{k: v for k, v in content.items() if k not in STATEFUL}, "schedulers": kept.get("schedulers"),
            **{k: kept[k] for k in STATEFUL if k in kept}}
    if len(content["ranks"]) > rank:
        rngs = tree.get("rng")
        ranks = list(content["ranks"])
        ranks[rank] = {**ranks[rank], "rng": rngs[rank] if rngs is not None else None}
        rest["ranks"] = ranks
    return _apply_rest(opened, rest, state, layout)
