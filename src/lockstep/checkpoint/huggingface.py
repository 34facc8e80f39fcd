"""A checkpoint of a ``HuggingFaceModel`` -> a folder that ``from_pretrained`` loads.

Reads any checkpoint lockstep loads (its own of every layout, Composer's monolithic file or
sharded folder), takes the model's config (and the tokenizer's files, when there was a tokenizer)
from ``state['integrations']['huggingface']``, where ``HuggingFaceModel`` put them, and the
weights through :func:`lockstep.checkpoint.export_state_dict`.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint import composer, files, payload
from lockstep.checkpoint.export import export_state_dict
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.layout import SHARDED_META
from lockstep.optional import HUGGINGFACE_INSTALL_HINT

_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def write_huggingface_pretrained_from_composer_checkpoint(
        checkpoint_path: str | os.PathLike[str], output_path: str | os.PathLike[str], trust_remote_code: bool = False,
        output_precision: str = "fp32", local_checkpoint_save_location: str | os.PathLike[str] | None = None) -> None:
    """Write ``output_path`` (config, weights and tokenizer files) from the checkpoint of a
    ``HuggingFaceModel`` at ``checkpoint_path`` (Composer's function of this name).

    ``output_precision`` is ``'fp32'``, ``'fp16'`` or ``'bf16'``. The checkpoint is read in place
    (``local_checkpoint_save_location`` is accepted for Composer's signature and not needed);
    ``trust_remote_code`` must stay False: the model class is taken from transformers only.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"writing a Hugging Face folder needs transformers: {HUGGINGFACE_INSTALL_HINT}") from e
    if output_precision not in _PRECISIONS:
        raise ValueError(f"output_precision={output_precision!r}: give one of {sorted(_PRECISIONS)}")
    if trust_remote_code:
        raise ValueError("trust_remote_code=True: lockstep builds the model from transformers' own classes only")
    del local_checkpoint_save_location
    metadata = _huggingface_metadata(Path(checkpoint_path))
    config_entry = metadata["model"]["config"]
    config = transformers.AutoConfig.for_model(**config_entry["content"])
    model = _model_class(config_entry.get("class", ""), transformers)(config)
    prefix = "model."
    weights = {k[len(prefix):]: v for k, v in export_state_dict(checkpoint_path).items() if k.startswith(prefix)}
    dtype = _PRECISIONS[output_precision]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied and k not in _tied_names(model)]:
        raise CheckpointError(f"{checkpoint_path}: its weights do not fit {type(model).__name__}: missing "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.to(dtype).save_pretrained(output_path)
    _write_tokenizer(metadata.get("tokenizer") or {}, Path(output_path))


def _huggingface_metadata(path: Path) -> dict[str, Any]:
    target = files.resolve_pointer(path)
    if composer.is_composer_folder(target):
        state = composer.read_folder(target)["state"]
    else:
        content = files.read(target / SHARDED_META if target.is_dir() else target)
        if not isinstance(content, dict) or not isinstance(content.get("state"), dict):
            version = payload.metadata(content, target) if isinstance(content, dict) else None
            raise CheckpointError(f"{target} has no state['integrations'] (a weights-only file, or format "
                                  f"version {version and version.get('version')}): save it again with a "
                                  f"HuggingFaceModel, or build the model and load export_state_dict's weights")
        state = content["state"]
    metadata = (state.get("integrations") or {}).get("huggingface")
    if not metadata:
        raise CheckpointError(f"{target} was not saved from a HuggingFaceModel: it holds no "
                              f"state['integrations']['huggingface'] (the model's config)")
    return metadata


def _model_class(name: str, transformers: Any) -> Any:
    module, _, cls = name.rpartition(".")
    if not module.startswith("transformers."):
        raise CheckpointError(f"the checkpoint's model class {name!r} is not one of transformers' own")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError):
        return getattr(transformers, cls)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameters that share their tensor with another one (an LM head tied to the embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


def _write_tokenizer(entries: dict[str, Any], folder: Path) -> None:
    for stem, entry in entries.items():
        target = folder / f"{stem}{entry['file_extension']}"
        content = entry["content"]
        if entry["file_extension"] == ".json":
            target.write_text(json.dumps(content, indent=2))
        elif entry["file_extension"] == ".txt":
            target.write_text("\n".join(content))
