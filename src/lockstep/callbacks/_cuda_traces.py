"""What the CUDA memory-trace callbacks share: the GPU check, their folder, and writing a snapshot."""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.checkpoint.templates import format_name, place_values

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

log = logging.getLogger("lockstep")


def on_cuda(state: State, owner: str) -> bool:
    """Whether the model is on a GPU; if not, say once that ``owner`` does nothing."""
    device = next(state.model.parameters(), torch.empty(0, device=state.device.torch_device)).device
    if device.type in ("cuda", "meta"):
        return True
    warnings.warn(f"{owner} does nothing without a GPU (the model is on {device.type}): it records CUDA memory only",
                  stacklevel=2)
    return False


def trace_folder(template: str, state: State, overwrite: bool, owner: str) -> Path:
    """Create the folder named by ``template`` ({run_name}, {rank}, ...); unless ``overwrite``, it must be empty."""
    folder = Path(format_name(template, place_values(state.run_name)))
    folder.mkdir(parents=True, exist_ok=True)
    if not overwrite and any(folder.iterdir()):
        raise FileExistsError(f"{owner}: folder {folder} is not empty; pass overwrite=True or another folder")
    return folder


def file_prefix(folder: Path, template: str, state: State) -> str:
    """The path prefix of this rank's files at the current timestamp."""
    return str(folder / format_name(template, place_values(state.run_name), state.timestamp))


def write_snapshot(snapshot: dict[str, Any], files: dict[str, Any]) -> list[str]:
    """Write the allocator ``snapshot`` (pickled) and each of ``files``: path -> a function of the
    snapshot giving the text of that file (torch.cuda._memory_viz's plots). A file whose rendering
    fails is left out (logged), never left half-written. Returns the paths written."""
    written = []
    for path, render in files.items():
        try:
            data = pickle.dumps(snapshot) if render is None else render(snapshot).encode()
        except Exception as e:  # noqa: BLE001 - one plot failing must not cost the others
            log.warning("could not render %s: %s", path, e)
            continue
        partial = path + ".partial"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
        written.append(path)
    return written


def flamegraph_script() -> Path:
    """Where torch.cuda._memory_viz looks for flamegraph.pl (it downloads it there when missing)."""
    return Path("~/.cache/flamegraph.pl").expanduser()


def upload(logger: Logger, remote_template: str | None, state: State, paths: list[str], overwrite: bool) -> None:
    """Hand ``paths`` to the logger's file uploaders, under ``remote_template``'s folder."""
    if remote_template is None:
        return
    remote = format_name(remote_template, place_values(state.run_name), state.timestamp)
    if "://" in remote:  # s3://bucket/path: the path in the bucket
        remote = remote.split("://", 1)[1].partition("/")[2]
    for path in paths:
        name = os.path.join(remote, os.path.basename(path)).lstrip("/")
        logger.upload_file(remote_file_name=name, file_path=path, overwrite=overwrite)
