"""MLflow runs, written through ``MlflowClient`` on a background thread (no network needed: the
default store is a local SQLite file)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from lockstep.loggers.background import ThreadedDestination
from lockstep.loggers.logger_destination import as_number, require

if TYPE_CHECKING:
    from lockstep.state import State


class MLFlowLogger(ThreadedDestination):
    """Metrics and parameters to an MLflow run named after the Trainer's ``run_name``.

    ``tracking_uri``: default ``$MLFLOW_TRACKING_URI``, else a SQLite store, ``mlflow.db`` in the run
    folder (or the working directory). A ``http://localhost:5000`` tracking server works too.
    ``experiment_name``: default ``$MLFLOW_EXPERIMENT_NAME``, else ``'lockstep'``. Metrics are sent
    in batches of up to ``flush_interval`` batches. Needs ``pip install 'torch-lockstep[mlflow]'``.
    """

    def __init__(self, experiment_name: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, str] | None = None, flush_interval: int = 10,
                 rank_zero_only: bool = True) -> None:
        require("mlflow", "mlflow", "MLFlowLogger")
        self.experiment_name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lockstep"
        self.run_name, self.tracking_uri, self.tags = run_name, tracking_uri, dict(tags or {})
        self.flush_interval, self.rank_zero_only = flush_interval, rank_zero_only
        self.run_id: str | None = None
        self._client: Any = None
        self._metrics: list[Any] = []

    def init(self, state: State, logger: Any = None) -> None:
        from lockstep import dist

        if self.rank_zero_only and dist.get_global_rank() != 0:
            return
        if self.tracking_uri is None:
            folder = state.run_folder or os.getcwd()
            self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(folder, 'mlflow.db')}"
        self.run_name = self.run_name or state.run_name
        if not self.rank_zero_only:
            self.run_name = f"{self.run_name}-rank{dist.get_global_rank()}"
        self._start("lockstep-mlflow")
        self._submit(self._open)

    def _open(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(self.experiment_name))
        self.run_id = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._submit(self._add, dict(metrics), step or 0, int(time.time() * 1000))

    def _add(self, metrics: dict[str, Any], step: int, at_ms: int) -> None:
        from mlflow.entities import Metric

        self._metrics += [Metric(_key(k), as_number(v), at_ms, step) for k, v in metrics.items()]
        if step % self.flush_interval == 0:
            self._flush_work()

    def _flush_work(self) -> None:
        while self._metrics:  # MLflow takes at most 1000 metrics per call
            chunk, self._metrics = self._metrics[:1000], self._metrics[1000:]
            self._client.log_batch(self.run_id, metrics=chunk)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._submit(self._params, dict(hyperparameters))

    def _params(self, hyperparameters: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(_key(k), str(v)[:6000]) for k, v in hyperparameters.items()]
        self._client.log_batch(self.run_id, params=params)

    def _close_work(self) -> None:
        self._client.set_terminated(self.run_id)


def _key(name: str) -> str:
    """MLflow keys allow letters, digits and ``_ - . / space``; Composer's names already fit, others
    are made to."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)
