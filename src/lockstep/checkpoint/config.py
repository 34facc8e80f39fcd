"""The Trainer's checkpoint arguments, checked, under Composer's names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep.checkpoint import ignore, templates
from lockstep.objectstore import ObjectStore
from lockstep.objectstore.uri import check_path, is_uri
from lockstep.state import State
from lockstep.time import Time, time_argument

SaveInterval = Time | str | int | Callable[[State, Any], bool]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where and when checkpoints are written, and what the run starts from."""

    save_folder: str | None = None
    """Where checkpoints go (a template: ``{run_name}``, ``{rank}``, ...): a local folder or a bucket,
    ``s3://BUCKET/PREFIX``; None saves nothing."""
    save_filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt"
    """Each checkpoint's name inside ``save_folder`` (time fields: ``{epoch}``, ``{batch}``, ...)."""
    save_latest_filename: str | None = "latest-rank{rank}.pt"
    """A pointer to the newest checkpoint, which autoresume reads; None writes none."""
    save_interval: SaveInterval = "1ep"
    """A Time (``'1ep'``, ``'100ba'``, ...) or ``fn(state, event) -> bool``."""
    save_num_checkpoints_to_keep: int = -1
    """-1 keeps every checkpoint; N keeps the newest N; 0 deletes each once written and writes no
    latest pointer (as Composer, which then keeps only uploaded copies; not with a bucket folder
    or ``autoresume``)."""
    save_overwrite: bool = False
    """Replace checkpoints already in ``save_folder`` instead of refusing to start."""
    save_metrics: bool = False
    """Also save the metrics' last values (``state.eval_metrics``, ``state.train_metrics``); a resume restores them."""
    save_weights_only: bool = False
    """Write only the model's weights (a plain state_dict of full tensors, as ``torch.save(model.state_dict())``
    would): a smaller file to export or fine-tune from, which loads with ``load_weights_only=True``
    and cannot resume a run."""
    save_ignore_keys: Any = None
    """Parts left out of every checkpoint written, as Composer names them: globs over the paths of
    ``{'state': {...}, 'rng': [...]}`` such as ``'state/model/head.*'``, ``'state/optimizers'`` or
    ``'rng'``; or a function that edits that dict in place (single-file layouts: DDP, FSDP ``full``
    and ``local``)."""
    load_path: str | None = None
    """A checkpoint to start from (``{rank}`` may name each rank's file): a local path, an
    ``s3://`` URI, or an object name in ``load_object_store``."""
    load_object_store: Any = None
    """An object store (:class:`lockstep.objectstore.ObjectStore`) that ``load_path`` names an object in."""
    load_weights_only: bool = False
    """Take only the model weights from ``load_path``; the run starts at batch 0."""
    load_ignore_keys: Any = None
    """Parts of ``load_path``'s checkpoint to leave out, as Composer names them: ``'state/model/<glob>'``,
    ``'state/optimizers'``, ``'state/schedulers'``, ``'rng'``; or a function that edits the
    checkpoint's dict (see :mod:`lockstep.checkpoint.ignore`). Not applied by autoresume."""
    load_strict_model_weights: bool = True
    """Whether the model's keys must match the checkpoint's exactly."""
    autoresume: bool = False
    """Continue from the newest checkpoint of ``run_name`` in ``save_folder``, if there is one."""

    def __post_init__(self) -> None:
        if self.save_folder is not None:
            templates.check_template(self.save_folder, "save_folder", time_fields=False)
            templates.check_template(self.save_filename, "save_filename")
            if self.save_latest_filename is not None:
                templates.check_template(self.save_latest_filename, "save_latest_filename", time_fields=False)
        check_path(self.save_folder, "save_folder")
        check_path(self.load_path, "load_path", any_scheme=self.load_object_store is not None)
        if self.load_object_store is not None:
            if not isinstance(self.load_object_store, ObjectStore):
                raise TypeError(f"load_object_store must be an object store (such as "
                                f"lockstep.objectstore.S3ObjectStore or GCSObjectStore), got {type(self.load_object_store).__name__}")
            if self.load_path is None:
                raise ValueError("load_object_store is given without load_path: name the checkpoint object to load")
        self.load_ignore_keys = ignore.check(self.load_ignore_keys)
        self.save_ignore_keys = ignore.check_save(self.save_ignore_keys)
        keep = self.save_num_checkpoints_to_keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
            raise ValueError(f"save_num_checkpoints_to_keep must be -1 (keep all), 0 (delete each once "
                             f"written) or >= 1, got {keep!r}")
        if keep == 0 and self.save_folder is not None and is_uri(self.save_folder):
            raise ValueError(f"save_num_checkpoints_to_keep=0 would delete every checkpoint from {self.save_folder} "
                             f"(the bucket keeps as many as the staging folder): give -1 to keep all, or >= 1")
        if keep == 0 and self.autoresume:
            raise ValueError("autoresume=True resumes from the checkpoints the run keeps, and "
                             "save_num_checkpoints_to_keep=0 keeps none: give -1 (all) or >= 1")
        if not callable(self.save_interval) or isinstance(self.save_interval, (str, Time)):
            self.save_interval = time_argument("save_interval", self.save_interval)
        if self.autoresume and self.save_weights_only:
            raise ValueError("autoresume=True needs full checkpoints, and save_weights_only=True writes only "
                             "weights: drop one of them")
        if self.autoresume and (self.save_folder is None or self.save_latest_filename is None):
            raise ValueError("autoresume=True needs save_folder and save_latest_filename: it resumes from "
                             "the latest pointer the run writes there")
