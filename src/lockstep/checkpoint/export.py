"""Any lockstep checkpoint -> a plain ``state_dict`` of full tensors, and safetensors files."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from lockstep.checkpoint import composer, files, integrity, payload
from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.deepspeed import check_folder, export_weights
from lockstep.checkpoint.layout import DEEPSPEED, LOCAL, SHARDED_META


def export_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Return the model weights of the checkpoint at ``path`` as full CPU tensors.

    ``path`` may be a checkpoint file (lockstep's or Composer's), a latest pointer, or a plain
    ``torch.save``'d state_dict; a sharded checkpoint folder Composer wrote; for
    FSDP, any one rank's file of a ``local`` checkpoint (the other ranks' files are found beside it)
    or a ``sharded`` checkpoint folder; for DeepSpeed, its checkpoint folder at any ZeRO stage (fp32
    weights rebuilt from the master partitions; needs DeepSpeed installed). Nothing in it is
    executed: files are read with ``weights_only=True``, only tensors are read from a sharded
    folder, and DeepSpeed's files are checked to unpickle nothing but tensors, containers and
    three plain DeepSpeed classes.
    """
    target = files.resolve_pointer(Path(path))
    if composer.is_composer_folder(target):
        content = composer.read_folder(target)["state"]["model"]
        return {name: _full(t) for name, t in content.items() if isinstance(t, torch.Tensor)}
    if target.is_dir():
        folder_meta = _folder_meta(target)
        if payload.layout_of(folder_meta) == DEEPSPEED:
            check_folder(target, folder_meta)
            return export_weights(target)
        integrity.check_sharded(target, folder_meta)
        return _from_sharded(target)
    content = payload.normalized(files.read(target), target)
    meta = payload.metadata(content, target)
    if meta is not None and payload.layout_of(meta) == LOCAL:
        return _from_local(target, content)
    weights = content if meta is None else content["model"]
    return {name: _full(t) for name, t in weights.items() if isinstance(t, torch.Tensor)}


def _from_local(first: Path, content: dict) -> dict[str, torch.Tensor]:
    """Place every rank's shards at their offsets in full tensors (replicas write equal values;
    rank 0's win where modules were kept per rank, e.g. process_group='self')."""
    out: dict[str, torch.Tensor] = {}
    ranks = content["ranks"]
    for rank in reversed(range(len(ranks))):
        path = first.with_name(ranks[rank]["file"])
        part = content if path == first else payload.normalized(files.read(path), path)
        for name, (shape, offset) in part["lockstep"]["shards"].items():
            shard = part["model"][name]
            if name not in out:
                out[name] = torch.empty(shape, dtype=shard.dtype)
            region = out[name]
            for dim, (start, size) in enumerate(zip(offset, shard.shape)):
                region = region.narrow(dim, start, size)
            region.copy_(shard)
    return out


def _folder_meta(folder: Path) -> dict:
    if not (folder / SHARDED_META).exists():
        if integrity.looks_like_checkpoint(folder):
            raise integrity.damaged(folder, SHARDED_META, "is missing (deleted?)")
        raise CheckpointError(f"{folder} is a folder without {SHARDED_META}: not a lockstep checkpoint folder")
    meta = payload.metadata(files.read(folder / SHARDED_META), folder)
    if meta is None:
        raise CheckpointError(f"{folder / SHARDED_META} is not a lockstep checkpoint header")
    return meta


def _from_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """Read the model tensors of a DCP folder in this one process, at their full sizes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    prefix = "model."
    weights = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    nested = {"model": weights}
    with warnings.catch_warnings():  # one process is what no_dist asks for; DCP warns about it all the same
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(nested, storage_reader=reader, no_dist=True)
    return nested["model"]


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint's model weights to ``out`` in the safetensors format (atomically)."""
    from safetensors.torch import save as to_bytes

    weights = _unshare(export_state_dict(path))
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"out={str(out)!r} should end with .safetensors")
    data = to_bytes(weights, metadata={"format": "pt"})
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = files.temp_path(out)
    try:
        temp.write_bytes(data)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    files.publish(temp, out)  # fsync, rename over ``out``, fsync the folder
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
