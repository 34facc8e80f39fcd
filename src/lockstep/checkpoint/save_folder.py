"""One run's save folder as a single object: what it names, where its files are written, and which
bucket, if any, holds it.

``save_folder`` reaches the code in one of three forms: the template the user gave
(``s3://ckpt/{run_name}``, ``runs/{run_name}/checkpoints``), the local folder files are written to
(the folder itself, or a bucket folder's staging folder under ``.lockstep/``), and the bucket's
folder. :class:`SaveFolder` holds the three, with the names made in them, so that the writer,
autoresume and the fetches read one object rather than a writer's attributes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.checkpoint import remote, templates
from lockstep.checkpoint.layout import LOCAL


@dataclass(frozen=True, slots=True)
class SaveFolder:
    """A run's save folder, for one rank."""

    template: str
    """``save_folder`` as given (a local path or a bucket URI, with place fields)."""
    filename: str
    """``save_filename``: the template of each checkpoint's name, relative to the folder."""
    place: dict[str, Any]
    """The values of the place fields in names: this rank's for per-rank files, else rank 0's."""
    local: Path
    """Where files are written: the folder itself, or, for a bucket's folder, its staging folder."""
    remote: remote.RemoteFolder | None
    """The bucket's folder, when ``template`` is a URI."""
    latest: Path | None
    """The latest pointer in :attr:`local` (None: ``save_latest_filename=None``)."""
    latest_template: str | None
    """The pointer as a template, so that each rank can look for its own before rank 0's."""

    @classmethod
    def of(cls, template: str, filename: str, latest_filename: str | None, *, run_name: str,
           layout: str) -> SaveFolder:
        place = templates.place_values(run_name, rank=None if layout == LOCAL else 0)
        local_template = remote.local_template(template) if remote.is_remote(template) else template
        local = Path(templates.format_name(local_template, place))
        bucket = remote.RemoteFolder.of(templates.format_name(template, place), local) \
            if remote.is_remote(template) else None
        return cls(template=template, filename=filename, place=place, local=local, remote=bucket,
                   latest=None if latest_filename is None else local / templates.format_name(latest_filename, place),
                   latest_template=None if latest_filename is None else os.path.join(local_template, latest_filename))

    def filename_glob(self) -> str:
        """A glob, relative to :attr:`local`, of every checkpoint name :attr:`filename` makes."""
        return templates.glob_of(self.filename, self.place)
