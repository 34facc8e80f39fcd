"""Composer's ``composer.checkpoint.save`` metadata file: what a run ran on, as JSON beside a
checkpoint. (The Trainer's own checkpoints are written by :mod:`lockstep.checkpoint.writer`.)"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from lockstep import dist
from lockstep.checkpoint import files
from lockstep.core.state_dict import environment

__all__ = ["metadata_state_dict", "save_composer_metadata_to_disk"]


def metadata_state_dict(model: Any = None, sharded_state_dict: bool | None = None, precision: Any = None,
                        device: Any = None, device_train_microbatch_size: int | float | None = None) -> dict[str, Any]:
    """Composer's ``get_metadata_state_dict``: the environment (Composer's keys, lockstep's version
    as ``composer_version``), torch and Python versions, and what is given of the rest."""
    info = {**environment(), "torch_version": torch.__version__, "python_version": platform.python_version()}
    if sharded_state_dict is not None:
        info["sharded_state_dict"] = sharded_state_dict
    if model is not None:
        inner = getattr(model, "module", model)  # DDP and FSDP1 wrap the model
        info["model_name"] = type(getattr(inner, "model", inner)).__name__
        if hasattr(inner, "get_metadata"):
            info["huggingface"] = inner.get_metadata()
    if precision is not None:
        info["precision"] = str(precision).removeprefix("torch.") if isinstance(precision, torch.dtype) \
            else getattr(precision, "value", precision)
    if device is not None:
        info["device"] = getattr(device, "name", str(device))
    if device_train_microbatch_size is not None:
        info["device_train_microbatch_size"] = device_train_microbatch_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info["dist_backend"] = torch.distributed.get_backend()
    return info


def save_composer_metadata_to_disk(destination_file_path: str, model: Any = None,
                                   sharded_state_dict: bool | None = None, precision: Any = None,
                                   device: Any = None,
                                   device_train_microbatch_size: int | float | None = None) -> str:
    """Write :func:`metadata_state_dict` as JSON to ``destination_file_path`` (rank 0 writes it,
    whole or not at all); returns the path."""
    os.makedirs(Path(destination_file_path).parent, exist_ok=True)
    if dist.get_global_rank() == 0:
        text = json.dumps(metadata_state_dict(model, sharded_state_dict, precision, device,
                                              device_train_microbatch_size), indent=4, default=str)
        path = Path(destination_file_path)
        temp = files.temp_path(path)
        temp.write_text(text)
        files.publish(temp, path)
    return destination_file_path
