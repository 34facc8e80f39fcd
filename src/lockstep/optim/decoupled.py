"""SGD and AdamW with weight decay decoupled from the learning rate, as in Composer.

With ``weight_decay=wd``, each step first multiplies every weight by ``1 - wd * lr / initial_lr``
(``initial_lr`` is the group's lr when the optimizer was made), then takes the usual SGD or Adam
step without any decay in the gradient. So the decay follows the lr schedule's shape but not its
size: ``wd`` is the share of each weight removed per step at the initial lr, and values near
``1e-5`` are typical (a warning is logged from ``1e-3``).

Both are subclasses of torch's ``SGD`` and ``AdamW`` with the same state layout (``momentum_buffer``;
``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), and every group keeps ``initial_lr`` in the
state dict. The update runs on whole lists of tensors (``torch._foreach_*``), op for op as Composer's
per-parameter loop, so the numbers are the same bit for bit.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import SGD, AdamW

from lockstep import dist

__all__ = ["DecoupledAdamW", "DecoupledSGDW"]

log = logging.getLogger(__name__)

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
_HIGH_WEIGHT_DECAY = 1e-3
# On the CPU a foreach op is a loop over its tensors, so a whole model's list streams through memory
# once per op; lists of about this many elements (a few of them fit in L2) measured about twice as
# fast on large models, and as fast as one list on many small tensors.
_CPU_CHUNK_NUMEL = 1 << 16


def _check_hyperparameters(name: str, lr: float, weight_decay: float) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError(f"{name}(lr=Tensor): give lr as a float, e.g. lr=float(lr)")
    if lr < 0.0:
        raise ValueError(f"{name}(lr={lr}): the learning rate must be >= 0")
    if weight_decay < 0.0:
        raise ValueError(f"{name}(weight_decay={weight_decay}): the weight decay must be >= 0")
    if weight_decay >= _HIGH_WEIGHT_DECAY:
        # Decoupled decay is not scaled by lr: 1e-2 here removes 1% of every weight each step.
        log.warning("%s(weight_decay=%s) multiplies every weight by %s on each step at the initial lr; "
                    "decoupled weight decay is usually near 1e-5", name, weight_decay, 1.0 - weight_decay)


def _decay_factor(lr: float, initial_lr: float) -> float:
    """How much of ``weight_decay`` applies at ``lr``: the schedule's multiplier."""
    return lr / initial_lr if initial_lr else 1.0


def _decay(params: list[torch.Tensor], weight_decay: float, lr: float, initial_lr: float) -> None:
    if weight_decay != 0 and params:
        _scale_(params, 1 - _decay_factor(lr, initial_lr) * weight_decay)


def _scale_(tensors: list[torch.Tensor], factor: float) -> None:
    """``tensor.mul_(factor)`` for each tensor, rounded as that call rounds."""
    if tensors[0].device.type == "cpu":
        # On the CPU a Python-number factor is first rounded to a bf16/fp16 tensor's own dtype by the
        # foreach op, but not by tensor.mul_; a float64 0-dim tensor is multiplied as tensor.mul_ does.
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float64))
    else:
        torch._foreach_mul_(tensors, factor)


def _chunks(params: list[torch.Tensor]) -> list[slice]:
    """Consecutive slices of ``params`` on one device to update together: on an accelerator all of
    them (one kernel per op), on the CPU cache-sized runs."""
    chunks, start, numel = [], 0, 0
    for i, param in enumerate(params):
        device = params[start].device
        full = device.type == "cpu" and numel + param.numel() > _CPU_CHUNK_NUMEL
        if i > start and (param.device != device or full):
            chunks.append(slice(start, i))
            start, numel = i, 0
        numel += param.numel()
    chunks.append(slice(start, len(params)))
    return chunks


def _divide_(tensors: list[torch.Tensor], divisors: list[float]) -> None:
    """``tensor / divisor`` for each pair, in place, rounded as that expression rounds on the tensors'
    device: on an accelerator torch multiplies by the divisor's reciprocal in the compute dtype
    (its kernel for division by a Python number does so), on the CPU it divides."""
    if tensors[0].device.type == "cpu":
        torch._foreach_div_(tensors, divisors)
        return
    double = tensors[0].dtype == torch.float64
    torch._foreach_mul_(tensors, [1 / d if double else _float32_reciprocal(d) for d in divisors])


def _float32_reciprocal(value: float) -> float:
    """``1 / value`` computed in float32 (float32 ``value``, float32 quotient): a quotient of two
    float32 numbers taken in double and rounded once to float32 is the correctly rounded one."""
    return _to_float32(1.0 / _to_float32(value))


def _to_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _loss_of(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _remember_initial_lr(groups: list[dict[str, Any]]) -> None:
    for group in groups:
        group["initial_lr"] = group["lr"]


def _grads_of(params: list[torch.Tensor], optimizer: str) -> list[torch.Tensor]:
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise RuntimeError(f"{optimizer} takes dense gradients: use torch.optim.SparseAdam or "
                           f"nn.Embedding(sparse=False) for sparse ones")
    return grads


class _ByGroup:
    """``step`` for both optimizers: each param group updated by the subclass's ``_step_group``."""

    param_groups: list[dict[str, Any]]

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient; ``closure`` re-computes and returns the loss."""
        loss = _loss_of(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss


class DecoupledSGDW(_ByGroup, SGD):
    """SGD (with optional momentum, dampening and Nesterov momentum) and decoupled weight decay.

    Each step, for every parameter with a gradient ``g``: the momentum buffer is ``g`` on its first
    step and ``momentum * buf + (1 - dampening) * g`` after; the direction is ``g + momentum * buf``
    with ``nesterov`` and ``buf`` without (``g`` with ``momentum=0``); the weight is multiplied by
    ``1 - weight_decay * lr / initial_lr`` and then moved by ``-lr`` times the direction.

    Args:
        params: Parameters to optimize, or dicts defining parameter groups.
        lr: Learning rate (required).
        momentum: Momentum factor.
        dampening: Dampening of the gradient's share in the momentum.
        weight_decay: Decoupled weight decay: the share of each weight removed per step at the initial lr.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
    """

    def __init__(self, params: Params, lr: float, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False) -> None:
        _check_hyperparameters("DecoupledSGDW", lr, weight_decay)
        if momentum < 0.0:
            raise ValueError(f"DecoupledSGDW(momentum={momentum}): the momentum must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"DecoupledSGDW(nesterov=True) needs momentum > 0 and dampening=0, got "
                             f"momentum={momentum}, dampening={dampening}")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)
        _remember_initial_lr(self.param_groups)

    @staticmethod
    def sgdw(params: list[torch.Tensor], d_p_list: list[torch.Tensor],
             momentum_buffer_list: list[torch.Tensor | None], *, weight_decay: float, momentum: float,
             lr: float, initial_lr: float, dampening: float, nesterov: bool) -> None:
        """One SGDW step on lists of parameters, gradients and momentum buffers (``None`` for a
        parameter's first step; filled in place)."""
        for chunk in _chunks(params):
            directions = d_p_list[chunk]
            if momentum != 0:
                buffers = momentum_buffer_list[chunk]
                directions = _momentum(directions, buffers, momentum, dampening, nesterov)
                momentum_buffer_list[chunk] = buffers
            _decay(params[chunk], weight_decay, lr, initial_lr)
            if directions:
                torch._foreach_add_(params[chunk], directions, alpha=-lr)

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        grads = _grads_of(params, "DecoupledSGDW")
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        group.setdefault("initial_lr", group["lr"])
        self.sgdw(params, grads, buffers, weight_decay=group["weight_decay"], momentum=group["momentum"],
                  lr=group["lr"], initial_lr=group["initial_lr"], dampening=group["dampening"],
                  nesterov=group["nesterov"])
        for p, buffer in zip(params, buffers, strict=True):
            self.state[p]["momentum_buffer"] = buffer


def _momentum(grads: list[torch.Tensor], buffers: list[torch.Tensor | None], momentum: float,
              dampening: float, nesterov: bool) -> list[torch.Tensor]:
    """Advance the momentum buffers in place (a missing one starts as a copy of its gradient) and
    return the step directions."""
    old = [i for i, buffer in enumerate(buffers) if buffer is not None]
    if old:
        old_buffers = [buffers[i] for i in old]
        _scale_(old_buffers, momentum)
        torch._foreach_add_(old_buffers, [grads[i] for i in old], alpha=1 - dampening)
    for i, buffer in enumerate(buffers):
        if buffer is None:
            buffers[i] = torch.clone(grads[i]).detach()
    started: list[torch.Tensor] = buffers  # type: ignore[assignment]  # every entry is filled above
    if nesterov:
        return list(torch._foreach_add(grads, started, alpha=momentum))
    return list(started)


class DecoupledAdamW(_ByGroup, AdamW):
    """Adam with decoupled weight decay, and Composer's defaults ``betas=(0.9, 0.95)``,
    ``weight_decay=1e-5``.

    Each step, for every parameter with a gradient ``g`` at step ``t``: the weight is multiplied by
    ``1 - weight_decay * lr / initial_lr``; ``m = beta1 * m + (1 - beta1) * g`` and
    ``v = beta2 * v + (1 - beta2) * g * g`` (with ``amsgrad``, ``v_max = max(v_max, v)`` stands for
    ``v`` below); then the weight moves by ``-lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``.

    Args:
        params: Parameters to optimize, or dicts defining parameter groups.
        lr: Learning rate.
        betas: Decay rates of the running averages of the gradient and of its square.
        eps: Added to the denominator for numerical stability.
        weight_decay: Decoupled weight decay: the share of each weight removed per step at the initial lr.
        amsgrad: Normalize by the largest second moment seen so far (the AMSGrad variant).
    """

    metric_functions: dict[str, Callable[[torch.Tensor, dict[str, Any], torch.Tensor], torch.Tensor]] = {
        "l2_norm/moment": lambda param, optim_state, step_tensor: torch.linalg.vector_norm(optim_state["exp_avg"]),
        "l2_norm/param": lambda param, optim_state, step_tensor: torch.linalg.vector_norm(param.data),
        "l2_norm/update": lambda param, optim_state, step_tensor: torch.linalg.vector_norm(step_tensor),
        "l2_norm/grad": lambda param, optim_state, step_tensor: torch.linalg.vector_norm(param.grad),
    }

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 1e-5, amsgrad: bool = False) -> None:
        _check_hyperparameters("DecoupledAdamW", lr, weight_decay)
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"DecoupledAdamW(betas={tuple(betas)}): betas[{i}] must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"DecoupledAdamW(eps={eps}): eps must be >= 0")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        _remember_initial_lr(self.param_groups)
        self.amsgrad = amsgrad

    @staticmethod
    def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
              state_steps: list[torch.Tensor], *, amsgrad: bool, beta1: float, beta2: float, lr: float,
              initial_lr: float, weight_decay: float, eps: float) -> None:
        """One AdamW step with decoupled weight decay on lists of tensors; ``state_steps`` holds each
        parameter's step count, already advanced for this step."""
        steps = [step.item() for step in state_steps]
        for chunk in _chunks(params):
            if chunk.start == chunk.stop:
                continue
            ps, ms, vs = params[chunk], exp_avgs[chunk], exp_avg_sqs[chunk]
            _decay(ps, weight_decay, lr, initial_lr)
            _scale_(ms, beta1)
            torch._foreach_add_(ms, grads[chunk], alpha=1 - beta1)
            _scale_(vs, beta2)
            torch._foreach_addcmul_(vs, grads[chunk], grads[chunk], value=1 - beta2)
            if amsgrad:
                torch._foreach_maximum_(max_exp_avg_sqs[chunk], vs)
            denoms = torch._foreach_sqrt(max_exp_avg_sqs[chunk] if amsgrad else vs)
            _divide_(denoms, [math.sqrt(1 - beta2**step) for step in steps[chunk]])
            torch._foreach_add_(denoms, eps)
            torch._foreach_addcdiv_(ps, ms, denoms, [-lr / (1 - beta1**step) for step in steps[chunk]])

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None and p.requires_grad]
        grads = _grads_of(params, "DecoupledAdamW")
        states = [self._state_of(p, group["amsgrad"]) for p in params]
        steps = [state["step"] for state in states]
        if steps:
            torch._foreach_add_(steps, 1.0)
        group.setdefault("initial_lr", group["lr"])
        beta1, beta2 = group["betas"]
        self.adamw(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                   [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [], steps,
                   amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                   initial_lr=group["initial_lr"], weight_decay=group["weight_decay"], eps=group["eps"])

    def _state_of(self, param: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[param]
        if "step" not in state:
            # On the CPU, as torch's AdamW keeps it: reading it each step then costs no device sync.
            state["step"] = torch.zeros((), dtype=torch.float)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    # ------------------------------------------------------------------ metrics for OptimizerMonitor

    @torch.no_grad()
    def report_per_parameter_metrics(self, param: torch.Tensor, name: str,
                                     optimizer_metrics: dict[str, Any]) -> dict[str, Any]:
        """Add ``l2_norm/{moment,param,update,grad}/<name>`` for ``param`` to ``optimizer_metrics``
        (nothing before its first step); ``update`` is the step the optimizer would take now."""
        if param not in self.state:
            return optimizer_metrics
        group = self.param_groups[0]  # as Composer: the first group's hyperparameters
        state = self.state[param]
        beta1, beta2 = group["betas"]
        step = state["step"].item()
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        update = state["exp_avg"].div(denom).mul_(group["lr"] / (1 - beta1**step))
        decay = group["weight_decay"] * _decay_factor(group["lr"], group["initial_lr"])
        update.add_(param, alpha=-decay)
        for metric, function in self.metric_functions.items():
            optimizer_metrics[f"{metric}/{name}"] = function(param, state, update)
        return optimizer_metrics

    def pre_reduce_metrics(self, optimizer_metrics: dict[str, Any]) -> dict[str, Any]:
        """Square every (L2 norm) metric, so that a sum over ranks gives the squared global norm."""
        for metric in optimizer_metrics:
            optimizer_metrics[metric] = optimizer_metrics[metric] ** 2
        return optimizer_metrics

    def dist_reduce_metrics(self, optimizer_metrics: dict[str, Any]) -> dict[str, Any]:
        """Combine :meth:`pre_reduce_metrics`' output over ranks: the root of the sum for L2 norms,
        the mean for the rest. A rank that lacks a metric contributes zero."""
        keys = sorted({key for keys in dist.all_gather_object(list(optimizer_metrics)) for key in keys})
        device = next((v.device for v in optimizer_metrics.values() if isinstance(v, torch.Tensor)),
                      torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        world_size = dist.get_world_size()
        for metric in keys:
            reduced = optimizer_metrics.get(metric, torch.tensor(0.0, device=device))
            if world_size > 1:
                dist.all_reduce(reduced, reduce_operation="SUM")
            optimizer_metrics[metric] = math.sqrt(reduced) if metric.startswith("l2_norm") else reduced / world_size
        return optimizer_metrics
