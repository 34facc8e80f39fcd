"""What a checkpoint file holds, and putting it back into a live Trainer state.

Under DDP one file (written by rank 0) holds everything, since the ranks share the model and
optimizer state. Its top level is Composer's (``state`` and ``rng``), so code that reads a
Composer checkpoint (``ckpt['state']['model']``) reads lockstep's::

    {"state": {"model": {...}, "optimizers": [...], "schedulers": [...], "timestamp": {"Timestamp": {...}},
               "scaler": {...}, "run_name": str, "rank_zero_seed": int, "integrations": {...},
               "callbacks": {name: {...}}, "algorithms": [[name, {...}], ...], "dataset_state": {...},
               ("metrics": {...}, "train_metrics": {...})},
     "rng": [...],                                                  # one RNG state per rank, by rank
     "lockstep": {"version", "layout", "optimizer_keys", "world_size", "rank"},
     "ranks": [{"epoch_rng", "fetch_rng", "loader_state"}, ...]}    # the rest of each rank's position

The header says how the checkpoint is laid out, the same for every run that saves the same
training; what is particular to a run sits where Composer keeps it: its name in
``state['run_name']``, and the checkpoints its save folder holds, oldest first, each with the
timestamp it was saved at (itself last), in ``state['callbacks']['CheckpointSaver']
['all_saved_checkpoints_to_timestamp']`` as ``(name in the save folder, timestamp state)`` pairs
(Composer lists every checkpoint ever saved there, by path; lockstep drops those rotation deleted,
and autoresume continues the list). Checkpoints written before held both in the header as
``run_name`` and ``history``; :func:`normalized` reads either.

Unlike Composer's, ``optimizers`` and ``schedulers`` are lists (Composer keys them by class name,
which allows one of each class). ``save_ignore_keys`` may have left parts out.

Under DDP the header also holds ``ddp_buckets``, the layout of DDP's rebuilt gradient buckets
(:mod:`lockstep.parallel.ddp_buckets`), which a resumed run's DDP starts with.

Under FSDP a rank's entry also holds its own float buffers (``buffers``: FSDP does not keep them
equal across ranks), and in the ``local`` layout the name of its ``file``.

FSDP's ``local`` layout writes one such file per rank (``rank`` says whose, ``shards`` where each
shard sits in the full tensor); its ``sharded`` layout writes this dict without the tensors as
``lockstep.pt`` in a DCP folder. See :mod:`lockstep.checkpoint.fsdp_states`.

The loader works on one flat form, :func:`normalized` of any of: this layout (version 2), the
flat one lockstep wrote before (version 1: the parts of ``state`` and ``ranks`` with each rank's
``rng`` at the top level) and Composer's own (:mod:`lockstep.checkpoint.composer`).

Only tensors, numbers, strings, lists and dicts: it loads with ``weights_only=True``.
"""

from __future__ import annotations

import datetime

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep import elastic
from lockstep.checkpoint import composer, ignore, stateful
from lockstep.core.state_dict import dataset_of, integrations
from lockstep.checkpoint.files import CheckpointError
from lockstep.core import eval_metrics
from lockstep.checkpoint.layout import DEEPSPEED, INDEX, NAME, SHARDED, SINGLE, Layout
from lockstep.time import Timestamp

if TYPE_CHECKING:
    from lockstep.state import State

VERSION = 2
STATEFUL = ("callbacks", "algorithms", "dataset_state")
"""The parts of ``state`` that :mod:`lockstep.checkpoint.stateful` writes and reads."""
READABLE = (1, 2)
"""Version 1: the flat layout before Composer's; both load."""


SAVER = "CheckpointSaver"
RECORD = "all_saved_checkpoints_to_timestamp"


def build(state: State, ranks: list[dict[str, Any]], record: list[tuple[str, Any]],
          layout: Layout, model: dict[str, Any], optimizers: list[Any], rank: int = 0,
          metrics: bool = False) -> dict[str, Any]:
    """The checkpoint of ``state`` (a Trainer State) with every rank's RNG and data position;
    ``model`` and ``optimizers`` come from ``layout.gather()``; ``record``: the saver's
    ``(name, timestamp state)`` of each checkpoint its folder holds, this one last. With
    ``metrics``, also the metrics of the last evaluation (``save_metrics``)."""
    extra = {"metrics": eval_metrics.values(state.eval_metrics),
             "train_metrics": eval_metrics.values({"train": state.train_metrics or {}})["train"]} if metrics else {}
    parts = stateful.save(state)
    parts["callbacks"][SAVER] = {**parts["callbacks"].get(SAVER, {}), RECORD: [tuple(r) for r in record]}
    return {
        "state": {"model": model, "optimizers": optimizers,
                  "schedulers": [s.state_dict() for s in state.schedulers],
                  "timestamp": {"Timestamp": _plain(state.timestamp.state_dict())},
                  "scaler": state.scaler.state_dict() if state.scaler is not None else {},
                  "run_name": state.run_name, "rank_zero_seed": state.rank_zero_seed,
                  "integrations": integrations(state.model), **parts, **extra},
        "rng": [r.get("rng") for r in ranks],
        "lockstep": {"version": VERSION, "layout": layout.name, "optimizer_keys": layout.optimizer_keys,
                     "world_size": len(ranks), "rank": rank, **layout.extra_meta()},
        "ranks": [{k: v for k, v in r.items() if k != "rng"} for r in ranks],
    }


def without(content: dict[str, Any], save_ignore_keys: Any, *, weights_only: bool) -> dict[str, Any]:
    """``content`` (what :func:`build` returns, or a weights-only state_dict) less what
    ``save_ignore_keys`` names (:func:`lockstep.checkpoint.ignore.remove_for_save`), in a copy of its
    containers; the header, the data position and the save record stay (autoresume's rotation and
    the loader's step back to a previous per-rank file need them)."""
    tree = ignore.copy_containers({"state": {"model": content}} if weights_only
                                  else {"state": content["state"], "rng": content["rng"]})
    ignore.remove_for_save(save_ignore_keys, tree)
    if weights_only:
        return tree.get("state", {}).get("model", {})
    kept = {**content, "state": tree.get("state", {})}
    record = content["state"].get("callbacks", {}).get(SAVER, {}).get(RECORD)
    if record is not None:
        callbacks = kept["state"].setdefault("callbacks", {})
        callbacks[SAVER] = {**callbacks.get(SAVER, {}), RECORD: record}
    if "rng" in tree:
        kept["rng"] = tree["rng"]
    else:
        del kept["rng"]
    return kept


def normalized(content: Any, path: Path) -> Any:
    """The flat form the loader applies, of a checkpoint of any layout lockstep reads (see the
    module's docstring); a plain state_dict of tensors as it is. A part that was left out when
    saving (``save_ignore_keys``) is None."""
    if composer.is_composer(content):
        return composer.to_lockstep(content, path, VERSION)
    if not (isinstance(content, dict) and isinstance(content.get("lockstep"), dict)
            and content["lockstep"].get("version") == 2):
        return content  # version 1, a plain state_dict, or something metadata() rejects
    state = content.get("state", {})
    ranks = content.get("ranks") or []
    rngs = content.get("rng")
    timestamp = state.get("timestamp")
    flat = {"lockstep": _header(content["lockstep"], state), "model": state.get("model", {}),
            "optimizers": state.get("optimizers"), "schedulers": state.get("schedulers"),
            "scaler": state.get("scaler", {}), "rank_zero_seed": state.get("rank_zero_seed"),
            "timestamp": timestamp.get("Timestamp") if isinstance(timestamp, dict) else None,
            "ranks": [{**entry, "rng": rngs[i] if rngs is not None and i < len(rngs) else None}
                      for i, entry in enumerate(ranks)]}
    flat.update({k: state[k] for k in ("metrics", "train_metrics") if k in state})
    flat.update({k: state[k] for k in STATEFUL if k in state})
    return flat


def _header(header: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The header with the run's name and save record (see the module's docstring) as the loader
    reads them: ``run_name``, ``history`` (names, oldest first) and ``saved_at`` (name: timestamp state)."""
    saver = (state.get("callbacks") or {}).get(SAVER)
    record = saver.get(RECORD) if isinstance(saver, dict) else None
    pairs = [(str(p[0]), p[1]) for p in record if isinstance(p, (list, tuple)) and len(p) == 2] \
        if isinstance(record, (list, tuple)) else []
    header = dict(header)
    header.setdefault("run_name", state.get("run_name"))
    header.setdefault("history", [name for name, _ in pairs])
    header.setdefault("saved_at", dict(pairs))
    return header


def plain_timestamp(timestamp: Timestamp) -> dict[str, Any]:
    """``timestamp``'s state as a checkpoint holds it."""
    return _plain(timestamp.state_dict())


def layout_of(meta: dict[str, Any]) -> str:
    return meta.get("layout", SINGLE)


def metadata(payload: Any, path: Path) -> dict[str, Any] | None:
    """The ``lockstep`` header, or None for a file that is a plain state_dict of tensors."""
    if isinstance(payload, dict) and "lockstep" in payload:
        meta = payload["lockstep"]
        if not isinstance(meta, dict) or meta.get("version") not in READABLE:
            raise CheckpointError(f"checkpoint {path} has format version "
                                  f"{meta.get('version') if isinstance(meta, dict) else '?'}; "
                                  f"this lockstep reads versions {', '.join(map(str, READABLE))}")
        return meta
    if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return None
    raise CheckpointError(f"{path} is neither a lockstep checkpoint nor a state_dict of tensors")


def check_complete(payload: dict[str, Any], path: Path, layout: Layout, state: State) -> None:
    """Everything :func:`apply` needs is there and fits in number and kind (before any loading)."""
    missing = {"ranks", "optimizers", "schedulers", "scaler", "timestamp"} - payload.keys()
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: it lacks {sorted(missing)}")
    for name in ("optimizers", "schedulers"):
        live, saved = getattr(state, name), payload[name]
        if saved is not None and len(live) != len(saved):  # None: left out when saving
            raise CheckpointError(f"checkpoint {path} holds {len(saved)} {name} but the Trainer has "
                                  f"{len(live)}: pass the same {name} as the run that saved it")
    keys = payload["lockstep"].get("optimizer_keys", INDEX)
    # full tensors in one file: index-keyed (DDP) and name-keyed (FSDP) state convert either way
    convertible = layout_of(payload["lockstep"]) == SINGLE and {keys, layout.optimizer_keys} <= {INDEX, NAME}
    if state.optimizers and keys != layout.optimizer_keys and not convertible:
        raise CheckpointError(
            f"checkpoint {path} keys its optimizer state by parameter {keys} but this run keys it by "
            f"{layout.optimizer_keys} (a DDP checkpoint and FSDP differ here): pass load_weights_only=True "
            f"to start from its weights")


def apply(payload: dict[str, Any], state: State, path: Path, rank: int, world_size: int) -> dict[str, Any] | None:
    """Load schedulers, scaler and timestamp into ``state`` (the model and optimizers are the
    layout's to load); return this rank's entry
    (RNG and data position) for the training loop to apply when it starts, or None when the
    checkpoint came from another world size. The caller has run :func:`check_complete` and
    checked the world size with :func:`check_world_size`."""
    if payload["schedulers"] is not None:  # None: left out by load_ignore_keys or save_ignore_keys
        _load_list("schedulers", state.schedulers, payload["schedulers"], path)
    if state.scaler is not None and payload["scaler"]:
        state.scaler.load_state_dict(payload["scaler"])
    try:
        if payload["timestamp"] is not None:  # None: left out by save_ignore_keys, so training starts over
            state.timestamp = Timestamp.from_state_dict(payload["timestamp"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    if "metrics" in payload:
        eval_metrics.restore_values(state.eval_metrics, payload["metrics"])
    if isinstance(payload.get("train_metrics"), dict):
        eval_metrics.restore_values({"train": state.train_metrics or {}}, {"train": payload["train_metrics"]})
    if isinstance(payload.get("rank_zero_seed"), int):  # the run goes on with the seed it started with
        state.rank_zero_seed = payload["rank_zero_seed"]
    stateful.load(state, payload)
    ranks = payload["ranks"]
    return ranks[rank] if len(ranks) == world_size else None


def _load_list(name: str, live: list[Any], saved: list[Any], path: Path) -> None:
    for i, (obj, sd) in enumerate(zip(live, saved)):
        try:
            obj.load_state_dict(sd)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: {name}[{i}] ({type(obj).__name__}) does not "
                                  f"match the saved one: {e}") from None


def check_world_size(payload: dict[str, Any], path: Path, world_size: int, state: State) -> None:
    """Only a sharded (DCP) checkpoint reshards to another world size; in an elastic job
    (``LOCKSTEP_FULL_WORLD_SIZE``), whose data follows the global batch whatever the world size,
    a DDP one, in which every rank holds the whole state, loads at any world size too, and so does
    a DeepSpeed one (:mod:`lockstep.checkpoint.deepspeed_reshard`). So does a DDP one whose train
    dataset puts itself back in place (mosaicml-streaming's ``StreamingDataset``, by ``state``'s and
    the checkpoint's ``dataset_state``), which splits the rest of its epoch over the ranks there
    are by its own rules (for streaming: the same ``num_canonical_nodes``)."""
    meta = payload["lockstep"]
    saved, layout = meta.get("world_size"), layout_of(meta)
    if saved == world_size or layout == SHARDED:
        return
    if elastic.full_world_size() and layout in (SINGLE, DEEPSPEED):
        return
    if layout == SINGLE and _dataset_resumes_itself(payload, state):
        return
    raise CheckpointError(f"checkpoint {path} was saved by {saved} rank(s) and this run has "
                          f"{world_size}: an exact resume needs the same world size; pass "
                          f"load_weights_only=True to start a new run from its weights")


def _dataset_resumes_itself(payload: dict[str, Any], state: State) -> bool:
    """Whether the checkpoint holds the train dataset's own position and the live one takes it."""
    saved = payload.get("dataset_state") or {}
    return saved.get("train") is not None and callable(getattr(dataset_of(state.train_dataloader),
                                                               "load_state_dict", None))


def _plain(timestamp: dict[str, Any]) -> dict[str, Any]:
    """A Timestamp's state_dict with its wall-clock timedeltas in seconds: the checkpoint stays
    loadable by ``torch.load(weights_only=True)`` with no allowlist (Timestamp reads either)."""
    return {k: v.total_seconds() if isinstance(v, datetime.timedelta) else v for k, v in timestamp.items()}
