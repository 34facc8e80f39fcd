"""The interface between the training loop and a parallel backend.

The Trainer drives one :class:`Strategy` (DDP, FSDP or DeepSpeed) through the same calls for every
backend, and never asks which one it has. One optimizer step, as the Trainer runs it::

    batch = strategy.prepare_batch(batch)
    for microbatch in split(batch):
        with strategy.sync_context(is_last_microbatch):   # gradients synchronized after the last
            with strategy.autocast():
                loss = model.loss(strategy.module(microbatch), microbatch)
            strategy.backward(loss * share_of_global_batch)
    strategy.clip_gradients_norm(max_norm)               # optional: the global norm, every rank alike
    strategy.optimizer_step()                            # step, and zero the gradients

A new backend is a new subclass in its own module.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep import batch as batches
from lockstep import dist
from lockstep.parallel import clipping
from lockstep.parallel.mesh import DataParallel
from lockstep.parallel.precision import NULL_CONTEXT, autocast, make_grad_scaler

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout


class Strategy:
    """One parallel backend. Subclasses override what their backend does differently.

    Built before the process group exists (so that a bad config fails before any rendezvous),
    then :meth:`setup` prepares the model and optimizers in place, a collective.
    """

    gathers_in_forward = False
    """Whether every forward gathers parameters from all ranks (FSDP, ZeRO-3): then every rank
    must run every forward, also in evaluation."""
    needs_process_group = False
    """Whether the backend needs a process group at world size 1 too."""
    shards_state = False
    """Whether each rank holds only a shard of the model and optimizer state (FSDP): then a rank
    lost in an elastic job takes state no other rank has, and the job goes on from :meth:`reshard`
    and the last checkpoint instead of from a peer's state."""

    whole_from_peers = False
    """Whether, after ranks joined an elastic job and none was lost, the ranks that trained can
    give the state they hold to a model sharded anew (:meth:`held_state`, :meth:`reshard_from`),
    rather than every rank reading the last checkpoint."""

    def __init__(self, device: torch.device, precision: str) -> None:
        self.device, self.precision = device, precision
        self.scaler = make_grad_scaler(precision, device)
        self.model: nn.Module = nn.Module()
        """The user's module (sharded in place under FSDP): what evaluation and checkpoints use."""
        self.module: nn.Module = self.model
        """What the training step calls: the model itself, or a wrapper around it."""
        self.optimizers: list[torch.optim.Optimizer] = []

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Place ``model`` on the device and prepare it and ``optimizers`` for training (every rank)."""
        self.model, self.optimizers = model.to(self.device), optimizers
        self.module = self._wrap(self.model)

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def regroup(self) -> None:
        """After an elastic job's ranks changed, on the new process group, a backend that holds the
        whole state on every rank (not :attr:`shards_state`): ready to train over the new group,
        with the state it held. DDP needs nothing: its collectives go through :mod:`lockstep.dist`,
        which follows the group."""

    def reshard(self) -> nn.Module:
        """A backend that :attr:`shards_state`: the model sharded anew over the ranks now in the job."""
        raise NotImplementedError(f"{type(self).__name__} keeps the whole state on every rank")

    def held_state(self) -> Any:
        """A backend that is :attr:`whole_from_peers`: what this rank holds of the model's and the
        optimizers' state, for every rank of the new group (picklable, on the CPU)."""
        raise NotImplementedError(f"{type(self).__name__} does not give its state to ranks that join")

    def reshard_from(self, held: list[Any], own: Any) -> nn.Module:
        """A backend that is :attr:`whole_from_peers`: :meth:`reshard`, with the state that every
        rank of the new group ``held`` (:meth:`held_state`; None from one that joined) loaded
        into the new model and the optimizers; ``own`` is this rank's."""
        raise NotImplementedError(f"{type(self).__name__} does not give its state to ranks that join")

    def data_parallel(self) -> DataParallel:
        """How the data is split among the ranks: every rank trains on its own share, unless
        tensor parallelism makes a group of ranks train on one."""
        return DataParallel(dist.get_global_rank(), dist.get_world_size())

    def compile(self, config: dict[str, Any]) -> None:
        """``torch.compile`` the prepared model in place (see :mod:`lockstep.parallel.compile`)."""
        from lockstep.parallel.compile import compile_in_place

        compile_in_place(self._compile_targets(), config)

    def _compile_targets(self) -> list[nn.Module]:
        return [self.model]

    def prepare_batch(self, batch: Any) -> Any:
        """The batch as the model takes it: on the training device."""
        if self.device.type == "cpu":
            return batch  # dataloaders already yield CPU tensors: nothing to walk (a call per step less)
        return batches.to_device(batch, self.device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision autocast around forward and loss (nothing in fp32)."""
        return autocast(self.precision, self.device)

    def sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one microbatch's forward and backward; once the last one's context exits, the
        gradients are synchronized over all ranks."""
        return NULL_CONTEXT

    def abandon_backward(self) -> None:
        """Forget a step whose backward will not run (``device_train_microbatch_size='auto'``
        retries a batch after an out-of-memory error)."""

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_gradients_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the synchronized gradients so that their norm over all ranks and shards is at most
        ``max_norm``; returns that norm (before clipping), the same on every rank."""
        self._unscale()
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        return clipping.clip_grad_norm(params, max_norm, norm_type)

    def clip_gradients_value(self, clip_value: float) -> None:
        """Clamp every synchronized gradient element to ``[-clip_value, clip_value]``."""
        self._unscale()
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_value)

    def clip_gradients_adaptive(self, threshold: float) -> None:
        """Adaptive clipping: each unit's gradient norm at most ``threshold`` x its weight norm."""
        self._unscale()
        clipping.clip_adaptive([p for o in self.optimizers for g in o.param_groups for p in g["params"]], threshold)

    def _unscale(self) -> None:
        if self.scaler is not None:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)

    def optimizer_step(self) -> None:
        """Step every optimizer (skipped by the GradScaler when fp16 gradients overflowed), then
        zero the gradients."""
        for optimizer in self.optimizers:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def updated_before_failing(self) -> bool:
        """Whether the optimizer step that raised had already updated this rank's weights or
        optimizer state (a collective after the update failed, such as ZeRO's gather of the updated
        weights ended by a change of an elastic job's ranks): the step then counts as taken. Asked
        once per failure. Here the step has no collective after its update: False."""
        return False

    @property
    def eval_module(self) -> nn.Module:
        """The module evaluation calls: the bare model, with no DDP hooks to wait in."""
        return self.model

    def layout(self) -> Layout:
        """How this backend's model and optimizer state go into a checkpoint and back."""
        from lockstep.checkpoint.states import ReplicatedLayout
        return ReplicatedLayout(self.model, self.optimizers)

    def describe(self) -> dict[str, Any]:
        """Facts about the setup, for logs and tests."""
        return {"backend": type(self).__name__}
