"""Weights & Biases runs; ``mode='offline'`` (or ``WANDB_MODE=offline``) needs no network."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lockstep.loggers.background import ThreadedDestination
from lockstep.loggers.logger_destination import as_number, require

if TYPE_CHECKING:
    from lockstep.state import State


class WandBLogger(ThreadedDestination):
    """Metrics and config to a W&B run named after the Trainer's ``run_name``, from a background
    thread. ``mode``: ``'online'``, ``'offline'`` (sync later with ``wandb sync``) or ``'disabled'``;
    default ``$WANDB_MODE``, else online. Files go under the run folder when there is one.
    Needs ``pip install 'torch-lockstep[wandb]'``.
    """

    def __init__(self, project: str | None = None, entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, mode: str | None = None,
                 init_kwargs: dict[str, Any] | None = None, rank_zero_only: bool = True) -> None:
        require("wandb", "wandb", "WandBLogger")
        self.project, self.entity, self.name, self.group, self.tags = project, entity, name, group, tags
        self.mode, self.init_kwargs, self.rank_zero_only = mode, dict(init_kwargs or {}), rank_zero_only
        self.run: Any = None

    def init(self, state: State, logger: Any = None) -> None:
        from lockstep import dist

        if self.rank_zero_only and dist.get_global_rank() != 0:
            return
        name = self.name or state.run_name
        if not self.rank_zero_only:
            name = f"{name}-rank{dist.get_global_rank()}"
        kwargs = {"project": self.project, "entity": self.entity, "name": name, "group": self.group,
                  "tags": self.tags, "mode": self.mode or os.environ.get("WANDB_MODE") or "online",
                  **({"dir": str(state.run_folder)} if state.run_folder else {}), **self.init_kwargs}
        self._start("lockstep-wandb")
        self._submit(self._open, kwargs)

    def _open(self, kwargs: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(**kwargs)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._submit(self._log, dict(metrics), step)

    def _log(self, metrics: dict[str, Any], step: int | None) -> None:
        self.run.log({k: as_number(v) for k, v in metrics.items()}, step=step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._submit(lambda: self.run.config.update(hyperparameters, allow_val_change=True))

    def fit_end(self, state: State, logger: Any = None) -> None:
        self.close(state, logger)  # wandb writes its summary and stops its service process here

    def _close_work(self) -> None:
        self.run.finish()
