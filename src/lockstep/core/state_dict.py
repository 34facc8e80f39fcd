"""A :class:`~lockstep.state.State` as Composer's ``state_dict()``, and back.

Composer keys optimizers, schedulers, callbacks and the scaler by class name (so one of each
class), algorithms as a list of ``(class name, state)``; the model is its full state_dict (its
shards under FSDP ``sharded``), the optimizer state keyed by parameter name. This is the form
``State.state_dict()`` returns and Composer's tests and tools read; the Trainer's checkpoints have
layouts of their own (:mod:`lockstep.checkpoint.payload`), and hold the same callbacks, algorithms
and dataset state through :func:`stateful_parts`.
"""

from __future__ import annotations

import inspect
import os
import platform
import warnings
from typing import Any

from types import ModuleType

import torch

from lockstep import dist
from lockstep.batch import ensure_tuple

State = Any
"""A :class:`lockstep.core.state.State` (not imported: it imports this module)."""

BY_CLASS = ("schedulers", "callbacks", "scaler", "timestamp")
"""Attributes saved as ``{class name: obj.state_dict()}`` (optimizers too, through DCP)."""


def of(state: State) -> dict[str, Any]:
    """Composer's ``State.state_dict()``."""
    out: dict[str, Any] = {}
    for name in state.serialized_attributes:
        value = _serialized(state, name)
        if value is not None:
            out[name] = value
    out["integrations"] = integrations(state.model)
    out["metadata"] = metadata(state)
    return out


def _serialized(state: State, name: str) -> Any:
    if name == "model":
        return model_of(state)
    if name == "optimizers":
        return optimizers_of(state)
    if name == "algorithms":
        return [(type(a).__qualname__, a.state_dict()) for a in state.algorithms]
    if name in BY_CLASS:
        return {type(o).__qualname__: o.state_dict() for o in ensure_tuple(getattr(state, name))
                if hasattr(o, "state_dict")}
    if name == "dataset_state":
        return dataset_state_of(state)
    if name == "train_metrics":
        return _metrics(state.train_metrics) if state.save_metrics and state.train_metrics is not None else None
    if name == "eval_metrics":
        if not state.save_metrics:
            return None
        return {label: _metrics(metrics) for label, metrics in state.eval_metrics.items()}
    return getattr(state, name)


def _dcp() -> ModuleType:
    """torch's ``distributed.checkpoint.state_dict``, imported on first use: it imports DTensor and
    sympy, ~0.7 s of CPU that a process which never saves Composer's form need not pay."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _options(state: State, **kwargs: Any) -> Any:
    return _dcp().StateDictOptions(full_state_dict=state.fsdp_state_dict_type == "full",
                                   cpu_offload=state.fsdp_enabled, **kwargs)


def model_of(state: State) -> dict[str, Any]:
    """The model's state_dict (under FSDP: full or sharded, as its state_dict_type says)."""
    if not state.fsdp_enabled:
        return state.model.state_dict()
    return _dcp().get_model_state_dict(state.model, options=_options(state))


def optimizers_of(state: State) -> dict[str, Any]:
    """``{class name: state}`` of the first optimizer (Composer saves one), keyed by parameter name."""
    if not state.optimizers:
        return {}
    optimizer = state.optimizers[0]
    saved = _dcp().get_optimizer_state_dict(state.model, optimizer, options=_options(state))
    return {type(optimizer).__qualname__: saved}


def dataset_state_of(state: State) -> dict[str, Any]:
    """Composer's ``{'train': ..., 'eval': {}}``: the train dataset's ``state_dict(num_samples,
    from_beginning=True)`` where it has one (mosaicml-streaming's ``StreamingDataset``), else None."""
    dataset = dataset_of(state.train_dataloader)
    train = None
    if _takes_a_position(dataset) and not hasattr(state.train_dataloader, "state_dict"):
        train = dataset.state_dict(int(state.timestamp.sample_in_epoch), True)
    return {"train": train, "eval": {}}


def _takes_a_position(dataset: Any) -> bool:
    """Whether ``dataset.state_dict`` is the streaming kind, ``(num_samples, from_beginning)``. A
    dataset whose ``state_dict()`` takes nothing follows torchdata's protocol instead, and its
    StatefulDataLoader saves it (lockstep keeps the loader's state with each rank's position)."""
    method = getattr(dataset, "state_dict", None)
    if method is None:
        return False
    try:
        inspect.signature(method).bind(0, True)
    except (TypeError, ValueError):
        return False
    return True


def _metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, metric in metrics.items():
        metric.persistent(mode=True)
        out[name] = {"state_dict": metric.state_dict(), "_computed": metric._computed}
    return out


def integrations(model: Any) -> dict[str, Any]:
    """Composer's ``state['integrations']``: a HuggingFaceModel's config and tokenizer files
    (``huggingface``), which the Hugging Face converters read back."""
    import sys
    module = sys.modules.get("lockstep.models.huggingface")  # loaded only if a HuggingFaceModel exists
    if module is not None and isinstance(model, module.HuggingFaceModel):
        return {"huggingface": model.get_metadata()}
    return {}


def environment() -> dict[str, Any]:
    """What the run ran on, under Composer's keys (``composer.utils.get_composer_env_dict``)."""
    import lockstep

    gpus = torch.cuda.is_available()
    local = max(dist.get_local_world_size(), 1)
    return {"composer_version": lockstep.__version__, "composer_commit_hash": None,
            "cpu_model": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "num_nodes": max(dist.get_world_size() // local, 1),
            "gpu_model": torch.cuda.get_device_name() if gpus else None,
            "num_gpus_per_node": local if gpus else 0, "num_gpus": dist.get_world_size() if gpus else 0,
            "cuda_device_count": torch.cuda.device_count()}


def metadata(state: State) -> dict[str, Any]:
    """Composer's ``state['metadata']``: where and how the state was made."""
    loader = state.train_dataloader
    info: dict[str, Any] = {
        "composer_env_info": environment(),
        "torch_version": torch.__version__, "device": state.device.name, "precision": state.precision.value,
        "world_size": dist.get_world_size(), "device_train_microbatch_size": state.device_train_microbatch_size,
    }
    if loader is not None and hasattr(loader, "batch_size"):
        info["train_dataloader_batch_size"] = loader.batch_size
    return info


# -- loading ------------------------------------------------------------------------------------


def load(state: State, saved: dict[str, Any], *, strict: bool = False) -> None:
    """Composer's ``State.load_state_dict``: the model first, then every other serialized
    attribute present, in sorted order (the same on every rank)."""
    if "model" in saved:
        load_model(state, saved, strict=strict)
    for name in sorted(saved):
        if name not in state.serialized_attributes or name == "model":
            continue
        value = saved[name]
        if name == "optimizers":
            load_optimizers(state, saved)
        elif name == "dataset_state":
            load_dataset_state(state, value)
        elif name in ("train_metrics", "eval_metrics"):
            _load_metrics(state, name, value)
        elif name == "algorithms":
            load_by_class(state.algorithms, dict(value) if isinstance(value, list) else value, "algorithms")
        elif name in BY_CLASS:
            load_by_class(ensure_tuple(getattr(state, name)), value, name)
        else:
            try:
                setattr(state, name, value)
            except AttributeError:  # a property without a setter
                pass


def load_model(state: State, saved: dict[str, Any], *, strict: bool) -> None:
    weights = saved["model"]
    if weights is None:
        return
    if saved.get("is_model_ddp", False) and not state.is_model_ddp:
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")
    if not state.fsdp_enabled:
        state.model.load_state_dict(weights, strict=strict)
        return
    _dcp().set_model_state_dict(state.model, weights, options=_options(state, strict=strict))


def load_optimizers(state: State, saved: dict[str, Any]) -> None:
    """Each optimizer from ``saved['optimizers'][<class name>]``; one missing there is warned about and left."""
    by_class = saved["optimizers"] or {}
    for optimizer in state.optimizers:
        name = type(optimizer).__qualname__
        if name not in by_class:
            warnings.warn(f"{name} is not in the state_dict. Its state will not be restored.", UserWarning,
                          stacklevel=3)
            continue
        _dcp().set_optimizer_state_dict(state.model, optimizer, by_class[name], options=_options(state))


def load_by_class(targets: Any, saved: dict[str, Any] | None, what: str) -> None:
    """Each object's state from ``saved[<its class name>]``; one missing there is warned about and left."""
    saved = saved or {}
    for target in targets:
        name = type(target).__qualname__
        if name not in saved:
            warnings.warn(f"{name} is not in the state_dict. Its state will not be restored.", UserWarning,
                          stacklevel=3)
            continue
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(saved[name])


def load_dataset_state(state: State, saved: dict[str, Any] | None) -> None:
    """The train dataset's position (:func:`dataset_state_of`); kept for later when the dataset has
    no ``load_state_dict`` yet (set with ``state.train_dataloader``)."""
    if saved is None:
        return
    dataset = dataset_of(state.train_dataloader)
    saved = dict(saved)
    if hasattr(dataset, "load_state_dict") and saved.get("train") is not None:
        dataset.load_state_dict(saved["train"])
        saved["train"] = None
        state.dataset_resumption["train"] = True
    state.dataset_state = saved


def _load_metrics(state: State, name: str, saved: Any) -> None:
    if not saved:
        return
    live = state.train_metrics if name == "train_metrics" else state.eval_metrics
    if name == "train_metrics":
        _load_metric_group(live or {}, saved, state)
        return
    for label, metrics in (live or {}).items():
        if label in saved:
            _load_metric_group(metrics, saved[label], state)


def _load_metric_group(live: dict[str, Any], saved: dict[str, Any], state: State) -> None:
    for metric_name, metric in live.items():
        entry = saved.get(metric_name)
        if not isinstance(entry, dict):
            continue
        metric._update_count += 1  # torchmetrics warns on compute() of a metric never updated
        metric.load_state_dict(entry["state_dict"], strict=False)
        metric._computed = entry["_computed"]
        metric.persistent(mode=True)
        state.device.module_to_device(metric)



def dataset_of(dataloader: Any) -> Any:
    """The dataset behind a DataLoader, a DataSpec or an Evaluator; None for any other iterable."""
    dataloader = getattr(dataloader, "dataloader", dataloader)  # an Evaluator or a DataSpec
    dataloader = getattr(dataloader, "dataloader", dataloader)  # an Evaluator's DataSpec
    return dataloader.dataset if isinstance(dataloader, torch.utils.data.DataLoader) else None
