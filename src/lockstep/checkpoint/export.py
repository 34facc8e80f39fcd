"""Any lockstep checkpoint -> a plain ``state_dict`` of full tensors, and safetensors files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lockstep.checkpoint import files, payload
from lockstep.checkpoint.files import CheckpointError


def export_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Return the model weights of the checkpoint at ``path`` as full CPU tensors.

    ``path`` may be a checkpoint file, a latest pointer, or a plain ``torch.save``'d state_dict.
    Nothing in it is executed: it is read with ``weights_only=True``.
    """
    target = files.resolve_pointer(Path(path))
    content = files.read(target)
    meta = payload.metadata(content, target)
    weights = content if meta is None else content["model"]
    return {name: _full(t) for name, t in weights.items() if isinstance(t, torch.Tensor)}


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint's model weights to ``out`` in the safetensors format (atomically)."""
    from safetensors.torch import save as to_bytes

    weights = _unshare(export_state_dict(path))
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"out={str(out)!r} should end with .safetensors")
    data = to_bytes(weights, metadata={"format": "pt"})
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    # a checkpoint loaded with mmap is backed by its file: copy so the result outlives the file
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _unshare(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in weights.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


__all__ = ["CheckpointError", "export_safetensors", "export_state_dict"]
