"""How the model's and optimizers' state goes into a checkpoint and back, per layout.

* ``single``: one file for every rank. Unsharded models (DDP) save ``state_dict()`` as is (here,
  :class:`ReplicatedLayout`); FSDP with ``state_dict_type='full'`` gathers full tensors to rank 0
  (optimizer state keyed by name).
* ``local``: FSDP, each rank saves the shards it holds, with each shard's place in the full tensor.
* ``sharded``: FSDP, a torch.distributed.checkpoint folder that loads at any world size.
* ``deepspeed``: a folder with the DeepSpeed engine's own files and ``lockstep.pt``
  (:mod:`lockstep.checkpoint.deepspeed`).

FSDP's three are in :mod:`lockstep.checkpoint.fsdp_states`, which imports DCP and DTensor (~0.7 s
of CPU, for sympy): a DDP job never loads it. Each is a :class:`~lockstep.checkpoint.layout.Layout`;
``sharded`` and ``deepspeed`` are also a :class:`~lockstep.checkpoint.layout.FolderLayout`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint import staging
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.layout import INDEX, SINGLE, Layout


class ReplicatedLayout(Layout):
    """Unsharded modules (DDP): ``state_dict()`` / ``load_state_dict()`` as they are, in one file
    that rank 0 writes. The base of the other layouts."""

    name = SINGLE
    optimizer_keys = INDEX
    collective = False
    stage: int | None = None

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                 buffer_dtypes: dict[str, torch.dtype] | None = None) -> None:
        self.model, self.optimizers = model, optimizers
        self.buffer_dtypes = buffer_dtypes or {}
        """Buffers FSDP keeps in a lower dtype -> their own dtype, which full and sharded checkpoints hold."""

    def _restore_buffer_dtypes(self, model: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.buffer_dtypes[k]) if k in self.buffer_dtypes else v for k, v in model.items()}

    def extra_meta(self) -> dict[str, Any]:
        return {}

    def restore_meta(self, meta: dict[str, Any]) -> None:
        pass

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Model and optimizer state to save; when :attr:`collective`, every rank calls it and
        ranks that do not write may get empty dicts."""
        return self.model.state_dict(), [o.state_dict() for o in self.optimizers]

    def step_storages(self) -> set[tuple[str, int]]:
        """Keys (:func:`staging.storage_key`) of the storages that only an optimizer step changes
        in place: the parameters and the optimizers' state, less any a buffer shares (a forward
        may change buffers). A background save may copy these until the next optimizer step."""
        keys = {staging.storage_key(p.untyped_storage()) for p in self.model.parameters()}
        for optimizer in self.optimizers:
            for per_param in optimizer.state.values():
                keys.update(staging.storage_key(v.untyped_storage()) for v in per_param.values()
                            if isinstance(v, torch.Tensor))
        keys.difference_update(staging.storage_key(b.untyped_storage()) for b in self.model.buffers())
        return keys

    def full_reader(self) -> Layout:
        return self

    def rank_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers this rank may hold differently from rank 0, for its own entry in the checkpoint;
        none under DDP, which broadcasts rank 0's buffers before every forward."""
        return {}

    def load_rank_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        live = self.model.state_dict()  # shares storage with the buffers
        with torch.no_grad():
            for key, value in saved.items():
                if key in live and live[key].shape == value.shape:
                    live[key].copy_(value)

    def load_model(self, weights: dict[str, Any], path: Path, strict: bool) -> None:
        try:
            self.model.load_state_dict(weights, strict=strict)
        except RuntimeError as e:
            raise misfit(path, e) from None

    def load_optimizers(self, saved: list[Any], path: Path) -> None:
        for i, (optimizer, sd) in enumerate(zip(self.optimizers, saved)):
            try:
                optimizer.load_state_dict(sd)
            except (ValueError, KeyError, RuntimeError) as e:
                raise optimizer_misfit(path, i, optimizer, e) from None


def rekey_optimizer(saved: dict[str, Any], keys: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    path: Path) -> dict[str, Any]:
    """``saved`` (an optimizer state dict keyed by parameter ``keys``) keyed the other way, for
    ``optimizer``: a DDP checkpoint (keyed by index) resumes under FSDP (keyed by name) and back.
    An index is a parameter's place in ``optimizer.param_groups``; a name is its place in
    ``model`` (the same with and without FSDP)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in names for p in order):
        raise CheckpointError(f"checkpoint {path}: the optimizer holds parameters that are not the model's, "
                              f"so its state cannot be matched by name: pass load_weights_only=True")
    index_to_name = {i: names[id(p)] for i, p in enumerate(order)}
    mapping = index_to_name if keys == INDEX else {n: i for i, n in index_to_name.items()}
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups) or any(
            len(g.get("params", [])) != len(live["params"]) for g, live in zip(groups, optimizer.param_groups)):
        raise CheckpointError(f"checkpoint {path}: its optimizer's parameter groups do not match this run's")
    try:
        return {"state": {mapping[k]: v for k, v in saved.get("state", {}).items()},
                "param_groups": [{**g, "params": [mapping[k] for k in g["params"]]} for g in groups]}
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path}: its optimizer state names parameter {e.args[0]!r}, which "
                              f"this model does not have") from None


def misfit(path: Path, e: Exception) -> CheckpointError:
    detail = " ".join(str(e).split())
    return CheckpointError(f"checkpoint {path} does not fit the model: {detail[:600]}")


def optimizer_misfit(path: Path, i: int, optimizer: torch.optim.Optimizer, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: optimizers[{i}] ({type(optimizer).__name__}) does not "
                           f"match the saved one: {' '.join(str(e).split())[:400]}")
