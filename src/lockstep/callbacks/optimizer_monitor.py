"""OptimizerMonitor: L2 norms of the gradients (and what the optimizer reports per parameter)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist

from lockstep import dist
from lockstep.dtensors import is_dtensor, local
from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["OptimizerMonitor"]


class OptimizerMonitor(Callback):
    """Every ``batch_log_interval`` batches, at BATCH_END, logs ``l2_norm/grad/<parameter name>`` for
    each parameter with a gradient and ``l2_norm/grad/global`` over all of them. With
    ``log_optimizer_metrics`` and an optimizer that has Composer's
    ``report_per_parameter_metrics(param, name, metrics)`` (DecoupledAdamW's ``l2_norm/moment/...``,
    ``l2_norm/param/...``, ``l2_norm/update/...``), those too.

    The gradients are read as the first optimizer steps (a step hook): synchronized over the ranks,
    unscaled, clipped, and the optimizer's state already updated, as Composer sees them at
    BATCH_END. Under FSDP each rank holds a shard: the norms' squares are summed over the shards
    (one all-reduce), so every rank logs the norms of the whole gradients.
    """

    def __init__(self, log_optimizer_metrics: bool = True, batch_log_interval: int = 10) -> None:
        if batch_log_interval < 1:
            raise ValueError(f"OptimizerMonitor(batch_log_interval={batch_log_interval}) must be >= 1")
        self.log_optimizer_metrics = log_optimizer_metrics
        self.batch_log_interval = batch_log_interval
        self._state: State | None = None
        self._hook: Any = None
        self._captured: dict[str, torch.Tensor] = {}
        self._sharded: set[str] = set()  # the captured metrics of sharded parameters
        self._group: Any = None  # the process group they are sharded over

    def fit_start(self, state: State, logger: Logger) -> None:
        self._remove_hook()
        if state.optimizers:
            self._state = state
            self._hook = state.optimizers[0].register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = self._state
        if state is None or (int(state.timestamp.batch) + 1) % self.batch_log_interval:
            return  # the timestamp moves on after the step: this is batch timestamp.batch + 1
        reporter = getattr(optimizer, "report_per_parameter_metrics", None)
        if not (self.log_optimizer_metrics and callable(reporter)):
            reporter = None
        metrics: dict[str, Any] = {}
        self._sharded = set()
        for name, p in state.model.named_parameters():
            if p.grad is not None and p.requires_grad:
                before = set(metrics)
                if reporter is not None:
                    metrics.update(reporter(p, name, metrics))
                if f"l2_norm/grad/{name}" not in metrics:
                    metrics[f"l2_norm/grad/{name}"] = torch.linalg.vector_norm(local(p.grad))
                group = _shard_group(p.grad)
                if group is not None:
                    self._group = group
                    self._sharded.update(set(metrics) - before)
        self._captured = {k: torch.as_tensor(local(v)).detach().float().reshape(()) for k, v in metrics.items()}

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) % self.batch_log_interval:
            return
        metrics, self._captured = self._captured, {}
        names = sorted(metrics)
        values = torch.stack([metrics[n].to(metrics[names[0]].device) for n in names]) if names else torch.zeros(0)
        if self._sharded:
            values = self._over_shards(names, values)
        grads = [i for i, n in enumerate(names) if n.startswith("l2_norm/grad")]
        total = values[grads].square().sum().sqrt() if grads else values.new_zeros(())
        logger.log_metrics({**dict(zip(names, values.tolist())), "l2_norm/grad/global": float(total)})

    def _over_shards(self, names: list[str], values: torch.Tensor) -> torch.Tensor:
        """Composer's reduction under FSDP, in one all-reduce over the shards: the norm of a sharded
        parameter is the root of its shards' squared norms summed; anything else is averaged (the
        same on every rank when the parameter is not sharded)."""
        group = self._group
        summed_squares = torch.tensor([n in self._sharded and n.startswith("l2_norm") for n in names],
                                      device=values.device)
        summed = dist.all_reduce(torch.where(summed_squares, values.square(), values), "SUM", group=group)
        return torch.where(summed_squares, summed.sqrt(), summed / torch_dist.get_world_size(group))

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def fit_end(self, state: State, logger: Logger) -> None:
        self._remove_hook()

    def close(self, state: State, logger: Logger) -> None:
        self._remove_hook()


def _shard_group(grad: torch.Tensor) -> Any:
    """The process group over which an FSDP gradient is sharded (None: not sharded)."""
    if not is_dtensor(grad):
        return None
    from torch.distributed.tensor import Shard

    dims = [i for i, placement in enumerate(grad.placements) if isinstance(placement, Shard)]
    return grad.device_mesh.get_group(dims[0]) if dims else None
