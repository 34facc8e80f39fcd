"""Exporting a trained model for inference (Composer's ``composer.utils.inference``): TorchScript
(scripted, else traced on ``sample_input``) or ONNX (traced on ``sample_input``), written to a local
path or uploaded to an object store."""

from __future__ import annotations

import copy
import logging
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.core.types import StringEnum
from lockstep.objectstore.uri import is_uri, store_for_uri

__all__ = ["ExportFormat", "export_for_inference", "export_with_logger"]

log = logging.getLogger(__name__)


class ExportFormat(StringEnum):
    TORCHSCRIPT = "torchscript"
    ONNX = "onnx"


def export_for_inference(model: nn.Module, save_format: str | ExportFormat, save_path: str,
                         save_object_store: Any = None, sample_input: Any = None, dynamic_axes: Any = None,
                         surgery_algs: Any = None, transforms: Sequence[Callable[[nn.Module], nn.Module]] | None = None,
                         onnx_opset_version: int | None = None, load_path: str | None = None,
                         load_object_store: Any = None, load_strict: bool = False,
                         input_names: list[str] | None = None, output_names: list[str] | None = None) -> None:
    """Write ``model`` (a copy in eval mode on the CPU, with ``transforms`` applied) in
    ``save_format`` to ``save_path``: a local path, a name in ``save_object_store``, or an
    ``s3://`` URI. ONNX needs ``sample_input``; TorchScript uses it only if scripting fails."""
    save_format = ExportFormat(save_format)
    if surgery_algs:
        raise ValueError("export_for_inference(surgery_algs=...): lockstep has no model-surgery algorithms")
    if load_path is not None:
        from lockstep.checkpoint import export_state_dict  # a layer above: only when loading is asked for

        model.load_state_dict(export_state_dict(load_path), strict=load_strict)
    exported = copy.deepcopy(model).cpu().eval()
    for transform in transforms or ():
        exported = transform(exported)
    sample = _as_tuple(sample_input)
    with tempfile.TemporaryDirectory() as scratch:
        local = pathlib.Path(scratch) / "model" if save_object_store is not None or is_uri(save_path) \
            else pathlib.Path(save_path)
        local.parent.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            if save_format is ExportFormat.TORCHSCRIPT:
                torch.jit.save(_torchscript(exported, sample), str(local))
            else:
                if sample is None:
                    raise ValueError("export_for_inference(save_format='onnx') needs sample_input to trace the model")
                torch.onnx.export(exported, sample, str(local), dynamic_axes=dynamic_axes,
                                  opset_version=onnx_opset_version, input_names=input_names,
                                  output_names=output_names)
        if save_object_store is not None:
            save_object_store.upload_object(save_path, str(local))
        elif is_uri(save_path):
            store, key = store_for_uri(save_path, "save_path")
            store.upload_object(key, str(local))


def _as_tuple(sample_input: Any) -> tuple[Any, ...] | None:
    if sample_input is None:
        return None
    return sample_input if isinstance(sample_input, tuple) else (sample_input,)


def _torchscript(model: nn.Module, sample: tuple[Any, ...] | None) -> Any:
    try:
        return torch.jit.script(model)
    except Exception as scripting:  # noqa: BLE001 - tracing is the documented fallback
        if sample is None:
            raise RuntimeError(f"TorchScript export: scripting failed ({type(scripting).__name__}: {scripting}) and "
                               f"no sample_input was given to trace the model with") from scripting
        log.warning("scripting failed (%s); tracing on sample_input instead", scripting)
        return torch.jit.trace(model, sample)


def export_with_logger(model: nn.Module, save_format: str | ExportFormat, save_path: str, logger: Any,
                       save_object_store: Any = None, sample_input: Any = None, **kwargs: Any) -> None:
    """:func:`export_for_inference`, then hand the file to the logger's destinations that store
    files (``logger.upload_file``) when no object store is given."""
    if save_object_store is not None or not getattr(logger, "has_file_upload_destination", lambda: False)():
        export_for_inference(model, save_format, save_path, save_object_store, sample_input, **kwargs)
        return
    with tempfile.TemporaryDirectory() as scratch:
        local = str(pathlib.Path(scratch) / "model")
        export_for_inference(model, save_format, local, None, sample_input, **kwargs)
        logger.upload_file(save_path, local, overwrite=True)
