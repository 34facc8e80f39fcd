"""Checkpoints written by Composer 0.32.1, read into the form lockstep's loader applies.

Composer's monolithic file is ``torch.save`` of::

    {"state": {"model": {name: tensor}, "optimizers": {class name: state_dict keyed by parameter name},
               "schedulers": {class name: state_dict}, "timestamp": {"Timestamp": {...}},
               "run_name", "rank_zero_seed", "algorithms", "callbacks", "scaler", "metadata", ...},
     "rng": [one dict per rank: "python", "numpy", "torch", ("cuda")]}

Its sharded checkpoint is the same dict saved through torch.distributed.checkpoint into a folder
(``.metadata`` and ``__<rank>_0.distcp``), non-tensor values as pickled bytes. Those are read here
with ``weights_only=True`` too, so loading a Composer checkpoint runs no code from it.

The result holds full tensors and a header like one lockstep writes, for the ``single`` layout with
optimizer state keyed by parameter name, so it loads into DDP, FSDP (any ``state_dict_type``) or a
single process the way a lockstep checkpoint of full tensors does. What lockstep has no place for
(algorithms' and callbacks' state, the metrics, the dataset state) is not applied.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch

from lockstep import rng
from lockstep.checkpoint.files import CheckpointError, _safe_globals
from lockstep.checkpoint.layout import NAME, SHARDED_META, SINGLE

DCP_METADATA = ".metadata"


def is_composer(content: Any) -> bool:
    """Whether ``content`` (a loaded checkpoint) is Composer's: a ``state`` dict and no lockstep header."""
    return isinstance(content, dict) and isinstance(content.get("state"), dict) and "lockstep" not in content


def is_composer_folder(folder: Path) -> bool:
    """Whether ``folder`` is a sharded checkpoint Composer wrote (its DCP keys start with ``state.``)."""
    if not folder.is_dir() or (folder / SHARDED_META).exists() or not (folder / DCP_METADATA).is_file():
        return False
    try:
        keys = _reader(folder).read_metadata().state_dict_metadata.keys()
    except Exception:  # an unreadable .metadata is not recognisably Composer's: the caller's errors apply
        return False
    return any(k.startswith("state.timestamp.") for k in keys)


def read_folder(folder: Path) -> dict[str, Any]:
    """Every entry of a Composer sharded folder, tensors at full size on CPU, in this process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    content: dict[str, Any] = {}
    try:  # as DCP's own dcp_to_torch_save reads a whole folder, with the planner below
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            _load_state_dict(content, storage_reader=_reader(folder), planner=_safe_load_planner(), no_dist=True)
    except Exception as e:  # DCP wraps the reader's failures in a CheckpointException
        first = " ".join(str(e).split())[:600]
        raise CheckpointError(f"cannot read Composer's sharded checkpoint {folder}: {first}") from None
    return content


def _reader(folder: Path) -> Any:
    import torch.distributed.checkpoint as dcp
    return dcp.FileSystemReader(folder)


def _safe_load_planner() -> Any:
    """DCP's planner that loads everything in the folder, unpickling its non-tensor values with
    ``weights_only=True`` (DCP's own unpickles anything). Made on first use: DCP imports DTensor
    and sympy, which a process that never reads Composer's folders need not load."""
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals(_safe_globals()):
                loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def to_lockstep(content: dict[str, Any], path: Path, version: int) -> dict[str, Any]:
    """A Composer checkpoint as the dict :mod:`lockstep.checkpoint.payload` applies."""
    state = content["state"]
    try:
        timestamp = state["timestamp"]
        timestamp = timestamp.get("Timestamp", timestamp) if isinstance(timestamp, dict) else None
        rngs = content.get("rng")
        world_size = len(rngs) if isinstance(rngs, list) else int(state.get("metadata", {}).get("world_size", 1))
        ranks = [{"rng": rng.from_composer(r) if r is not None else None} for r in rngs] if rngs is not None \
            else [{"rng": None} for _ in range(world_size)]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} looks like a Composer checkpoint but cannot be read as one: {e}") from None
    header = {"version": version, "layout": SINGLE, "optimizer_keys": NAME, "world_size": world_size,
              "run_name": state.get("run_name"), "history": [], "rank": 0, "composer": True}
    return {"lockstep": header, "model": state.get("model", {}),
            "optimizers": _values(state.get("optimizers")), "schedulers": _values(state.get("schedulers")),
            "scaler": {}, "timestamp": timestamp, "ranks": ranks, "rank_zero_seed": state.get("rank_zero_seed"),
            **{k: state[k] for k in ("callbacks", "algorithms", "dataset_state") if k in state}}


def _values(by_class: Any) -> list[Any] | None:
    """Composer keys optimizers and schedulers by class name; lockstep lists them in order."""
    return list(by_class.values()) if isinstance(by_class, dict) else None
