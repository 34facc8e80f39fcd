"""Loading a checkpoint into a Trainer on every rank: ``load_path`` and ``autoresume``.

Every step that can fail on one rank is agreed on by all ranks first, so a missing or damaged file
is an error on every rank, never a rank waiting forever for another that gave up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep import dist
from lockstep.checkpoint import files, payload, templates
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.states import (
    DEEPSPEED, FOLDER_LAYOUTS, INDEX, LOCAL, SHARDED_META, SINGLE, Layout, rekey_optimizer)


@dataclass(slots=True)
class Loaded:
    """What a load left for the training loop: this rank's RNG/data entry and the save history."""

    path: Path
    rank_entry: dict[str, Any] | None = None
    """None when the checkpoint is of another world size (a sharded one, resharded)."""
    history: list[str] = field(default_factory=list)
    weights_only: bool = False


def candidates(template: str, run_name: str) -> tuple[Path, Path]:
    """This rank's file, and rank 0's: under DDP rank 0 writes one file that serves every rank,
    so a ``{rank}`` template that names no file for this rank falls back to rank 0's."""
    own = Path(templates.format_name(template, templates.place_values(run_name)))
    zero = Path(templates.format_name(template, templates.place_values(run_name, rank=0)))
    return own, zero


def _agree(flags: list[int], device: torch.device) -> list[int]:
    """One small MAX all-reduce of per-rank integer flags. On the training device: NCCL reduces
    only CUDA tensors."""
    return dist.all_reduce(torch.tensor(flags, dtype=torch.int64, device=device), "MAX").tolist()


def _raise_first(error: str | None) -> None:
    errors = dist.all_gather_object(error)
    for rank, message in enumerate(errors):
        if message is not None:
            prefix = "" if len(errors) == 1 else f"rank {rank}: "
            raise CheckpointError(prefix + message)


def load(template: str, state: Any, scaler: torch.amp.GradScaler | None, layout: Layout, *, run_name: str,
         weights_only: bool, strict: bool, optional: bool = False, what: str = "load_path") -> Loaded | None:
    """Load the checkpoint ``template`` names into ``state`` on every rank.

    With ``optional`` (autoresume), no file on any rank means a fresh start (None), as do per-rank
    files of a first save that only some ranks published (see :func:`_start_over`). Ranks that do
    not see rank 0's single file (another node, no shared file system) get it from rank 0. Reading and
    checking comes first and is agreed on in one all-reduce; only then is anything loaded, since
    FSDP's loads are collectives that every rank must reach. When every rank loaded the same file
    into an unsharded model (DDP), a failure to load it is the same on every rank, so only then is
    there no second agreement.
    """
    templates.check_template(template, what, time_fields=False)
    own, zero = candidates(template, run_name)
    if layout.name == LOCAL:  # per-rank files: rank 0's never serves another rank
        zero = own
    path = next((p for p in (own, zero) if p.exists() or p.is_symlink()), None)
    rank, world = dist.get_global_rank(), dist.get_world_size()
    # Usually every rank reads rank 0's file; then they split its CRC check. The agreement
    # confirms it: a rank that read its own file voids the split, and the file is checked whole.
    shared = path == zero and layout.name != LOCAL
    missing = error = None
    opened = None
    if path is None:
        tried = str(own) if own == zero else f"{own} (nor rank 0's {zero})"
        missing = f"{what} {template!r}: {tried} does not exist"
    else:
        try:
            opened = _open(path, state, layout, run_name=run_name, weights_only=weights_only,
                           check_run_name=optional, share=(rank, world) if shared else (0, 1))
        except CheckpointError as e:
            error = str(e)
    batch = opened.batch if opened else 0
    # rank 0 can send its file to ranks that do not see it (another node's disk)
    sends = rank == 0 and opened is not None and shared and layout.name == SINGLE and opened.path.is_file()
    unseen = -(2 ** 62)  # a rank without the file leaves the step range to the others
    any_missing, any_found, failed, neg_low, high, any_shared, unshared, zero_sends = _agree(
        [int(path is None), int(path is not None), int(error is not None), unseen if path is None else -batch,
         unseen if path is None else batch, int(shared), int(path is not None and not shared), int(sends)],
        state.device)
    if optional and not any_found:
        return None
    if failed:
        _raise_first(error)
    if any_missing and optional and layout.name == LOCAL:
        return _start_over(opened, path, state)
    if any_missing and zero_sends:
        opened = _from_rank_zero(opened, state, layout, run_name=run_name, weights_only=weights_only,
                                 check_run_name=optional)
    elif any_missing:
        shared_fs = " while other ranks found theirs: is it on a file system every node sees?" if any_found else ""
        _raise_first(missing + shared_fs if missing else None)
    if -neg_low != high and optional and layout.name == LOCAL:
        opened = _step_back(opened, -neg_low, path, state, layout, run_name=run_name)
    elif -neg_low != high:
        raise CheckpointError(f"the ranks loaded checkpoints of different steps (batches {-neg_low} to {high}): "
                              f"the per-rank files of {template!r} are not from one save")
    if any_shared and unshared and world > 1:  # rare: the CRC split assumed every rank read this file
        error = _checked(path) if shared else None
        if _agree([int(error is not None)], state.device)[0]:
            _raise_first(error)
    assert opened is not None
    loaded = None
    try:
        loaded = _apply(opened, state, scaler, layout, weights_only=weights_only, strict=strict)
    except CheckpointError as e:
        error = str(e)
        if not unshared and not layout.collective:
            raise
    if (unshared or layout.collective) and _agree([int(error is not None)], state.device)[0]:
        _raise_first(error)
    assert loaded is not None
    return loaded


def _step_back(opened: _Opened | None, low: int, pointer: Path | None, state: Any, layout: Layout, *,
               run_name: str) -> _Opened:
    """Autoresume of per-rank files after a crash between two ranks' publishes: the ranks whose
    latest pointer is one save ahead open their previous checkpoint (kept until every rank had
    published: see CheckpointSaver._prune), so that all resume from the step every rank has. Once
    all agree, those ranks point their latest pointer back and delete the newer file, which no
    other rank's files match."""
    error = None
    ahead = opened
    if opened is not None and opened.batch != low:
        history = (opened.meta or {}).get("history", [])
        previous = opened.path.parent / history[-2] if len(history) >= 2 else None
        try:
            if previous is None or not previous.exists():
                raise CheckpointError(f"{opened.path} is at batch {opened.batch} and other ranks' latest "
                                      f"checkpoints at batch {low}, and this rank no longer has that one")
            opened = _open(previous, state, layout, run_name=run_name, weights_only=False, check_run_name=True,
                           share=(0, 1))
        except CheckpointError as e:
            error = str(e)
    batch = opened.batch if opened is not None and error is None else low
    failed, neg_low, high = _agree([int(error is not None), -batch, batch], state.device)
    if failed:
        _raise_first(error)
    if -neg_low != high:
        raise CheckpointError(f"autoresume found per-rank checkpoints of batches {-neg_low} to {high}, and "
                              f"no step that every rank has: pass load_path to choose one")
    assert opened is not None and ahead is not None
    if ahead is not opened and pointer is not None and pointer.is_symlink():
        files.point_latest(pointer, opened.path)
        files.remove(ahead.path)
    return opened


def _from_rank_zero(opened: _Opened | None, state: Any, layout: Layout, *, run_name: str, weights_only: bool,
                    check_run_name: bool) -> _Opened:
    """Rank 0's single-file checkpoint, sent to the ranks that do not see it: a node whose disk
    is not the one rank 0 saved to (no shared file system). Every rank takes part in the
    broadcast; the ranks without the file check and open what it carries, as if read from disk."""
    header = [(str(opened.path), opened.path.stat().st_size) if opened is not None and dist.get_global_rank() == 0
              else None]
    dist.broadcast_object_list(header, src=0)
    name, size = header[0]
    if dist.get_global_rank() == 0:
        assert opened is not None
        buffer = torch.frombuffer(bytearray(opened.path.read_bytes()), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    buffer = dist.broadcast(buffer.to(state.device), src=0)
    error = None
    if opened is None:
        try:
            opened = _open(Path(name), state, layout, run_name=run_name, weights_only=weights_only,
                           check_run_name=check_run_name, share=(0, 1), data=buffer.cpu().numpy().tobytes())
        except CheckpointError as e:
            error = str(e)
    if _agree([int(error is not None)], state.device)[0]:
        _raise_first(error)
    assert opened is not None
    return opened


def _start_over(opened: _Opened | None, pointer: Path | None, state: Any) -> None:
    """Autoresume of per-rank files after a crash in the run's first save, which some ranks
    published and others did not: no step is on every rank, so the run starts fresh, and the ranks
    that published delete their pointer and file (which no other rank's files match)."""
    error = None
    if opened is not None:
        saves = len((opened.meta or {}).get("history", []))
        if saves > 1:
            error = (f"{opened.path} is this rank's checkpoint number {saves} of the run, yet other ranks find "
                     f"no latest pointer at all: their files are gone (save_folder must be the same folder "
                     f"for every rank, e.g. on a shared file system)")
    if _agree([int(error is not None)], state.device)[0]:
        _raise_first(error)
    if opened is not None and pointer is not None:
        if pointer.is_symlink():
            pointer.unlink()
        files.remove(opened.path)


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
        return int(self.content.get("timestamp", {}).get("batch", 0)) if self.meta is not None else 0

    @property
    def layout(self) -> str:
        return payload.layout_of(self.meta) if self.meta is not None else SINGLE


def _open(path: Path, state: Any, layout: Layout, *, run_name: str, weights_only: bool, check_run_name: bool,
          share: tuple[int, int], data: bytes | None = None) -> _Opened:
    """Read, check and unpickle ``path`` (or, given ``data``, the file's content received from rank 0)."""
    if data is None:
        target = files.resolve_pointer(path)
        content = files.read(_meta_file(target), share=share)
    else:
        target, content = path, files.read_bytes(data, path)
    opened = _Opened(target, content, payload.metadata(content, target))
    meta = opened.meta
    if opened.layout == DEEPSPEED:  # before DeepSpeed unpickles any of them, on any rank
        from lockstep.checkpoint.deepspeed import check_folder
        check_folder(target, meta or {}, check_crc=share[0] == 0)
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
        payload.check_world_size(content, target, dist.get_world_size())
        payload.check_complete(content, target, layout, state)
    return opened


def _meta_file(target: Path) -> Path:
    """The file that holds a checkpoint's header: the checkpoint itself, or a folder's lockstep.pt."""
    if not target.is_dir():
        return target
    if not (target / SHARDED_META).exists():
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
    if saved == DEEPSPEED and meta.get("zero_stage") != getattr(layout, "stage", None):
        raise CheckpointError(f"{opened.path} was saved with ZeRO stage {meta.get('zero_stage')} and this run "
                              f"uses stage {getattr(layout, 'stage', None)}: resume with the same "
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


def _apply(opened: _Opened, state: Any, scaler: torch.amp.GradScaler | None, layout: Layout, *,
           weights_only: bool, strict: bool) -> Loaded:
    content, meta, path = opened.content, opened.meta, opened.path
    if meta is None:
        layout.full_reader().load_model(content, path, strict)
        return Loaded(path, weights_only=True)
    if opened.layout == DEEPSPEED and weights_only:
        from lockstep.checkpoint.deepspeed import export_weights
        layout.full_reader().load_model(export_weights(path), path, strict)
    elif opened.layout in FOLDER_LAYOUTS:
        layout.load_folder(path, content, weights_only=weights_only, strict=strict)  # type: ignore[attr-defined]
    else:
        reader = layout.full_reader() if opened.layout == SINGLE else layout
        reader.load_model(content["model"], path, strict)
        if not weights_only:
            optimizers, keys = content["optimizers"], meta.get("optimizer_keys", INDEX)
            if keys != reader.optimizer_keys:  # a DDP checkpoint into FSDP, or back
                optimizers = [rekey_optimizer(sd, keys, layout.model, o, path)
                              for sd, o in zip(optimizers, layout.optimizers)]
            reader.load_optimizers(optimizers, path)
    if weights_only:
        return Loaded(path, weights_only=True)
    entry = payload.apply(content, state, scaler, path, dist.get_global_rank(), dist.get_world_size())
    if entry and entry.get("buffers"):
        layout.load_rank_buffers(entry["buffers"])
    return Loaded(path, entry, list(meta.get("history", [])))
