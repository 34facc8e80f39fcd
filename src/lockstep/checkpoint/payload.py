"""What a checkpoint file holds, and putting it back into a live Trainer state.

One file (written by rank 0) holds everything, since DDP ranks share the model and optimizer state::

    {"lockstep": {"version", "layout", "world_size", "run_name", "history"},
     "timestamp": {...}, "model": {...}, "optimizers": [...], "schedulers": [...], "scaler": {...},
     "ranks": [{"rng", "epoch_rng", "fetch_rng"}, ...]}     # one entry per rank, by rank

Only tensors, numbers, strings, lists and dicts: it loads with ``weights_only=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError
from lockstep.time import Timestamp

VERSION = 1
SINGLE = "single"  # one file for every rank


def build(state: Any, scaler: torch.amp.GradScaler | None, ranks: list[dict[str, Any]],
          history: list[str]) -> dict[str, Any]:
    """The checkpoint of ``state`` (a Trainer State) with every rank's RNG and data position."""
    return {
        "lockstep": {"version": VERSION, "layout": SINGLE, "world_size": len(ranks),
                     "run_name": state.run_name, "history": list(history)},
        "timestamp": state.timestamp.state_dict(),
        "model": state.model.state_dict(),
        "optimizers": [o.state_dict() for o in state.optimizers],
        "schedulers": [s.state_dict() for s in state.schedulers],
        "scaler": scaler.state_dict() if scaler is not None else {},
        "ranks": ranks,
    }


def metadata(payload: Any, path: Path) -> dict[str, Any] | None:
    """The ``lockstep`` header, or None for a file that is a plain state_dict of tensors."""
    if isinstance(payload, dict) and "lockstep" in payload:
        meta = payload["lockstep"]
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            raise CheckpointError(f"checkpoint {path} has format version "
                                  f"{meta.get('version') if isinstance(meta, dict) else '?'}; "
                                  f"this lockstep reads version {VERSION}")
        return meta
    if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return None
    raise CheckpointError(f"{path} is neither a lockstep checkpoint nor a state_dict of tensors")


def load_model(model: torch.nn.Module, weights: dict[str, Any], path: Path, strict: bool) -> None:
    try:
        model.load_state_dict(weights, strict=strict)  # strict=False: missing/extra keys by request
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        raise CheckpointError(f"checkpoint {path} does not fit the model: {detail[:600]}") from None


def apply(payload: dict[str, Any], state: Any, scaler: torch.amp.GradScaler | None, path: Path,
          rank: int) -> dict[str, Any]:
    """Load optimizers, schedulers, scaler and timestamp into ``state``; return this rank's entry
    (RNG and data position) for the training loop to apply when it starts. The caller has checked
    the world size with :func:`check_world_size`."""
    missing = {"ranks", "optimizers", "schedulers", "scaler", "timestamp"} - payload.keys()
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: it lacks {sorted(missing)}")
    _load_list("optimizers", state.optimizers, payload["optimizers"], path)
    _load_list("schedulers", state.schedulers, payload["schedulers"], path)
    if scaler is not None and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    try:
        state.timestamp = Timestamp.from_state_dict(payload["timestamp"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return payload["ranks"][rank]


def _load_list(name: str, live: list[Any], saved: list[Any], path: Path) -> None:
    if len(live) != len(saved):
        raise CheckpointError(f"checkpoint {path} holds {len(saved)} {name} but the Trainer has "
                              f"{len(live)}: pass the same {name} as the run that saved it")
    for i, (obj, sd) in enumerate(zip(live, saved)):
        try:
            obj.load_state_dict(sd)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: {name}[{i}] ({type(obj).__name__}) does not "
                                  f"match the saved one: {e}") from None


def check_world_size(payload: dict[str, Any], path: Path, world_size: int) -> None:
    saved = payload["lockstep"].get("world_size")
    if saved != world_size:
        raise CheckpointError(f"checkpoint {path} was saved by {saved} rank(s) and this run has "
                              f"{world_size}: an exact resume needs the same world size; pass "
                              f"load_weights_only=True to start a new run from its weights")
