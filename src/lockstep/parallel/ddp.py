"""DDP: when to wrap, and the three gradient sync strategies of the microbatch loop.

* ``single_auto_sync`` (default): DDP reduces gradients during the backward of the last microbatch
  only; earlier microbatches run under ``no_sync``. One gradient all-reduce pass per step.
* ``multi_auto_sync`` (default with ``find_unused_parameters``): DDP reduces during every
  microbatch's backward, so a parameter used by only some microbatches is still reduced.
* ``forced_sync``: every microbatch runs under ``no_sync``; after the last, each gradient is
  all-reduced by hand (SUM then divide: gloo has no AVG).

All three produce the same gradients.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lockstep import dist, elastic
from lockstep.checks import check_choice
from lockstep.parallel import ddp_buckets
from lockstep.parallel.precision import NULL_CONTEXT
from lockstep.parallel.strategy import Strategy

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout


class DDPSyncStrategy(StrEnum):
    SINGLE_AUTO_SYNC = "single_auto_sync"
    MULTI_AUTO_SYNC = "multi_auto_sync"
    FORCED_SYNC = "forced_sync"


def resolve_sync_strategy(strategy: str | None, find_unused_parameters: bool) -> DDPSyncStrategy:
    if strategy is None:
        return DDPSyncStrategy.MULTI_AUTO_SYNC if find_unused_parameters else DDPSyncStrategy.SINGLE_AUTO_SYNC
    check_choice("ddp_sync_strategy", strategy, [s.value for s in DDPSyncStrategy])
    return DDPSyncStrategy(strategy)


class DDPStrategy(Strategy):
    """DDP at any world size: the model is wrapped only when there is more than one rank and some
    parameter is trainable; at world size 1 (or with nothing to train) it runs as it is."""

    def __init__(self, device: torch.device, precision: str, *, sync_strategy: DDPSyncStrategy,
                 find_unused_parameters: bool = False) -> None:
        super().__init__(device, precision)
        self.sync_strategy, self.find_unused_parameters = sync_strategy, find_unused_parameters
        self.buckets: ddp_buckets.BucketLayout | None = None
        """The layout of DDP's rebuilt gradient buckets, once known: a checkpoint records it, and
        DDP starts with it on resume (:mod:`lockstep.parallel.ddp_buckets`)."""
        self._await_rebuild = False
        self.elastic = False
        """Whether the gradients are all-reduced by hand after the last microbatch, DDP left out
        (an elastic job)."""

    def _wrap(self, model: nn.Module) -> nn.Module:
        if dist.get_world_size() == 1 or not any(p.requires_grad for p in model.parameters()):
            return model
        membership = elastic.current()
        if membership is not None:
            # DDP's reducer waits for its all-reduces inside torch, where no change of the job's
            # ranks can end the wait: the gradients are all-reduced as under forced_sync instead,
            # through lockstep.dist, whose waits a change ends (lockstep.elastic.membership).
            self.elastic = True
            if not membership.fresh:  # a rank that joins the running job takes a peer's state instead
                for tensor in [*model.parameters(), *model.buffers()]:  # as DDP starts: rank 0's values
                    dist.broadcast(tensor.data, 0)
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP rebuilds its buckets after the first synchronized backward; never when it finds
        # unused parameters, nor under forced_sync, which never lets DDP synchronize.
        forced = self.sync_strategy is DDPSyncStrategy.FORCED_SYNC
        self._await_rebuild = not (self.find_unused_parameters or forced)
        # Gradients as views of DDP's buckets: the all-reduced bucket is the gradient, not copied
        # back into a tensor of its own every step. The same values bit for bit, one copy of the
        # gradients less in memory, and a faster step (docs/benchmarks.md).
        with ddp_buckets.starting_with(self.buckets, model) if self.buckets else NULL_CONTEXT:
            return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                           find_unused_parameters=self.find_unused_parameters)

    def use_buckets(self, layout: Any) -> None:
        """Build DDP anew so that it starts with ``layout`` (a checkpoint's), as the run that saved
        it reduced by then (every rank, a collective). A layout that does not fit the model (a
        checkpoint of another model) is left out, with a warning."""
        ddp = self.module
        if not isinstance(ddp, DistributedDataParallel):
            return
        if not ddp_buckets.fits(layout, self.model, ddp.parameters_to_ignore):
            if dist.get_global_rank() == 0:
                warnings.warn("the checkpoint's layout of DDP's gradient buckets does not fit this model; DDP "
                              "starts with its own, so the steps after the resume may differ in the last bits")
            return
        self.buckets = layout
        self.module = self._wrap(self.model)  # the old DDP goes, and its reducer's gradient hooks with it

    def optimizer_step(self) -> None:
        if self._await_rebuild:
            self._rebuild_buckets()
        super().optimizer_step()

    def _rebuild_buckets(self) -> None:
        """Rebuild DDP's buckets right after the first synchronized backward (DDP would at the next
        forward), so that a checkpoint of this step already records the layout of the next."""
        ddp = self.module
        assert isinstance(ddp, DistributedDataParallel)
        # DDP's own call (a collective: rank 0's layout is broadcast), made at every forward
        if ddp.reducer._rebuild_buckets() or ddp._has_rebuilt_buckets:
            self._await_rebuild = False
            self.buckets = ddp_buckets.read(self.model, ddp.parameters_to_ignore) or self.buckets

    def layout(self) -> Layout:
        return ddp_buckets.DDPLayout(self)

    def sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        # plain context objects, not generators: this runs for every microbatch
        if self.elastic:
            return _ThenSync(NULL_CONTEXT, self.model) if is_last_microbatch else NULL_CONTEXT
        if not isinstance(self.module, DistributedDataParallel):
            return NULL_CONTEXT
        strategy = self.sync_strategy
        if strategy is DDPSyncStrategy.MULTI_AUTO_SYNC or (
                strategy is DDPSyncStrategy.SINGLE_AUTO_SYNC and is_last_microbatch):
            return NULL_CONTEXT
        if is_last_microbatch and strategy is DDPSyncStrategy.FORCED_SYNC:
            return _ThenSync(self.module.no_sync(), self.model)
        return self.module.no_sync()

    def abandon_backward(self) -> None:
        # A forward with gradient sync on arms DDP's reducer for the backward; without this, the
        # next backward (even under no_sync) would start gradient all-reduces the other ranks do
        # not expect. _reset_state is the reducer's own recovery for a backward that failed.
        if isinstance(self.module, DistributedDataParallel):
            self.module.reducer._reset_state()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "wrapped": isinstance(self.module, DistributedDataParallel),
                "sync_strategy": self.sync_strategy.value}


class _ThenSync:
    """``inner``, then (when it exits without an error) a forced sync of ``model``'s gradients."""

    def __init__(self, inner: contextlib.AbstractContextManager[Any], model: nn.Module) -> None:
        self.inner, self.model = inner, model

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)
        if exc[0] is None:
            forced_sync_gradients(self.model.parameters())


def forced_sync_gradients(params: Iterable[nn.Parameter]) -> None:
    """All-reduce every gradient by hand and average it (the end of a forced_sync step).

    One flat all-reduce carries the gradients and, per parameter, how many ranks had one: every
    rank must issue the same collective even when a parameter went unused on some of them, and a
    parameter no rank used keeps ``grad=None`` as it would under DDP.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    present = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype,
                           device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [present])
    dist.all_reduce(flat, "SUM")
    flat /= dist.get_world_size()
    counts = flat[-len(params):]
    offset = 0
    for p, count in zip(params, counts.tolist()):
        numel = p.numel()
        if count > 0:
            p.grad = flat[offset:offset + numel].view_as(p).clone()
        offset += numel
