"""FSDP: ``prepare_fsdp(model, config, ...)`` shards a model in place with ``fully_shard``.

Which modules become their own FSDP unit, in seed 001's order of rules:

1. a module's ``_fsdp_wrap`` attribute (True, False, or a dict of per-module settings);
2. else ``fsdp_wrap_fn(module)`` of the nearest enclosing module that defines one (the Model
   itself, or e.g. its ``.model``), returning a bool or a dict of per-module settings;
3. else size: a module holding at least ``min_params`` parameters that no wrapped submodule holds.

The root Model is always wrapped, so every parameter belongs to one unit. Activation checkpointing
picks modules the same way (``_activation_checkpointing``, ``activation_checkpointing_fn``), and by
default checkpoints every wrapped submodule.

``fully_shard`` replaces each parameter with a sharded one, so the optimizers built from the model
before are pointed at the new parameters here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lockstep import dist
from lockstep.parallel.fsdp_config import (
    FSDPConfig, Precision, check_mixed_precision, check_process_group, resolve_precision)
from lockstep.parallel.mesh import TENSOR, MeshShape, build_mesh, data_parallel_mesh
from lockstep.parallel.tensor_parallel import TensorParallel, check_plan
from lockstep.parallel.tensor_parallel import apply as apply_tensor_parallel

MODULE_KEYS = ("process_group", "sharding_strategy", "mixed_precision", "cpu_offload")
"""The settings a wrap rule may give one module (a dict from ``_fsdp_wrap`` or ``fsdp_wrap_fn``)."""
_WRAPPED = "_checkpoint_wrapped_module"
"""Where an activation-checkpointing (or offload) wrapper keeps the module it wraps."""


@dataclass(slots=True)
class Unit:
    """One module that ``fully_shard`` made an FSDP unit, and with what."""

    name: str
    module: nn.Module
    kind: str
    """The module's class name (``fully_shard`` swaps in a subclass)."""
    params: int
    strategy: str
    precision: Precision
    cpu_offload: bool
    group: tuple[str, int] | None = None
    """('set', K) or ('mod', K) for a per-module process group; None for the whole job's."""


@dataclass(slots=True)
class FSDPSetup:
    """What :func:`prepare_fsdp` did: the units (root last) and the modules it checkpoints."""

    units: list[Unit] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """State dict name -> original dtype of each buffer kept in a lower buffer dtype: full and
    sharded checkpoints hold those buffers in their original dtype, as FSDP1's did."""
    mesh: DeviceMesh | None = None
    """The job's mesh when the config gives Composer's degrees or tensor parallelism."""

    def describe(self) -> list[str]:
        lines = []
        for u in self.units:
            group = "" if u.group is None else f", process_group {u.group[0]}{u.group[1]}"
            lines.append(f"lockstep fsdp: {u.name or '(root)'} ({u.kind}, {u.params:,} params "
                         f"in scope): {u.strategy}, param/reduce/buffer dtype {_short(u.precision)}"
                         f"{', cpu_offload' if u.cpu_offload else ''}{group}")
        lines += [f"lockstep fsdp: activation checkpointing {name}" for name in self.checkpointed]
        return lines


def _short(p: Precision) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in (p.param_dtype, p.reduce_dtype, p.buffer_dtype))


def prepare_fsdp(model: nn.Module, config: FSDPConfig, precision: str, device: torch.device,
                 optimizers: list[torch.optim.Optimizer], shape: MeshShape | None = None,
                 tp: TensorParallel | None = None) -> FSDPSetup:
    """Shard ``model`` in place per ``config`` and repoint ``optimizers`` at the sharded parameters.
    With ``shape`` (Composer's degrees) every unit is sharded over that mesh's data-parallel
    dimensions, after ``tp`` split its layers over the tensor-parallel one."""
    for i, optimizer in enumerate(optimizers):
        if optimizer.state:
            raise ValueError(f"optimizers[{i}] already holds state (it has taken a step): FSDP shards the "
                             f"parameters, so build the optimizer fresh and pass it to the Trainer")
    if tp is not None:
        check_plan(model, tp.plan)
    world_size, local_world_size = dist.get_world_size(), dist.get_local_world_size()
    wraps = _wrap_decisions(model, config.min_params)
    for settings in wraps.values():
        _check_module_settings(settings, world_size, local_world_size, explicit_mesh=shape is not None)
    owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
    setup = FSDPSetup()
    meshes = _Meshes(device.type, world_size, local_world_size)
    if shape is not None:
        setup.mesh = meshes.use(shape)
        if tp is not None:
            apply_tensor_parallel(model, setup.mesh[TENSOR], tp.plan)
    if config.activation_checkpointing or config.activation_cpu_offload:
        setup.checkpointed = _apply_activation_checkpointing(model, wraps, config)
    for name, module in _post_order(model):
        settings = wraps.get(id(_unwrapped(module)))
        if settings is None and module is not model:
            continue
        unit = _unit(name, module, settings or {}, config, precision, meshes)
        _shard(unit, meshes, device, root=module is model)
        setup.units.append(unit)
    _cast_buffers(model, setup)
    _set_backward_prefetch(setup, config.backward_prefetch, model)
    _repoint_optimizers(optimizers, owners)
    if config.verbose and dist.get_global_rank() == 0:
        print("\n".join(setup.describe()), flush=True)
    return setup


def _unit(name: str, module: nn.Module, settings: Mapping[str, Any], config: FSDPConfig, precision: str,
          meshes: _Meshes) -> Unit:
    """What ``module`` is sharded with: its own settings, else the config's."""
    mp = settings.get("mixed_precision")
    group = check_process_group(settings["process_group"], meshes.world_size, meshes.local_world_size) \
        if "process_group" in settings else None
    return Unit(name, module, type(_unwrapped(module)).__name__, sum(p.numel() for p in module.parameters()),
                settings.get("sharding_strategy", config.sharding_strategy),
                resolve_precision(config.mixed_precision if mp is None else mp, precision),
                settings.get("cpu_offload", config.cpu_offload), group)


# -- which modules --------------------------------------------------------------------------------


def _wrap_decisions(model: nn.Module, min_params: float) -> dict[int, dict[str, Any]]:
    """id(module) -> its per-module settings ({} for the defaults), for every module to wrap."""
    decisions: dict[int, dict[str, Any]] = {}

    def visit(module: nn.Module, rule_owner: nn.Module | None) -> int:
        """Returns the number of parameters under ``module`` that no wrapped descendant holds."""
        owner = module if callable(getattr(module, "fsdp_wrap_fn", None)) else rule_owner
        free = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            free += visit(child, owner)
        if module is model:
            return free
        choice = _rule(module, "_fsdp_wrap", rule_owner, "fsdp_wrap_fn")
        if choice is None:
            choice = free >= min_params and free > 0
        if choice is False:
            return free
        decisions[id(module)] = {} if choice is True else dict(choice)
        return 0

    visit(model, None)
    return decisions


def _rule(module: nn.Module, attribute: str, owner: nn.Module | None, fn_name: str) -> bool | dict | None:
    """The attribute's value, else the owner's function's answer, else None (no rule applies)."""
    value = getattr(module, attribute, None)
    where = f"{type(module).__name__}.{attribute}"
    if value is None and owner is not None:
        value = getattr(owner, fn_name)(module)
        where = f"{type(owner).__name__}.{fn_name}({type(module).__name__})"
    if value is None or isinstance(value, (bool, Mapping)):
        return value
    raise TypeError(f"{where} returned {value!r}: return True, False or a dict of settings")


def _check_module_settings(settings: Mapping[str, Any], world_size: int, local_world_size: int, *,
                           explicit_mesh: bool) -> None:
    unknown = sorted(set(settings) - set(MODULE_KEYS), key=str)
    if unknown:
        raise ValueError(f"per-module FSDP settings have unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"valid keys: {', '.join(MODULE_KEYS)}")
    if explicit_mesh and ("process_group" in settings or settings.get("sharding_strategy") == "NO_SHARD"):
        raise ValueError(f"a per-module {'process_group' if 'process_group' in settings else 'NO_SHARD'} "
                         f"cannot be combined with the data-parallel degrees or tensor parallelism, which shard "
                         f"every module over one mesh: drop it from the wrap rule")
    if "sharding_strategy" in settings:
        FSDPConfig(sharding_strategy=settings["sharding_strategy"])  # validates the value
    if "mixed_precision" in settings:
        check_mixed_precision(settings["mixed_precision"], "per-module mixed_precision")
    if "cpu_offload" in settings and not isinstance(settings["cpu_offload"], bool):
        raise ValueError(f"per-module cpu_offload must be True or False, got {settings['cpu_offload']!r}")
    if "process_group" in settings:
        check_process_group(settings["process_group"], world_size, local_world_size)
        if settings.get("sharding_strategy") == "HYBRID_SHARD":
            raise ValueError("a per-module process_group cannot be combined with HYBRID_SHARD, which "
                             "spans nodes by itself; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")


def _post_order(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Children before parents, so that each module is sharded after the units inside it."""
    def walk(name: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        # An activation-checkpointing wrapper stands for the module inside it: the wrapper is
        # sharded, under the module's own name, and the module is not visited again.
        for child_name, child in _unwrapped(module).named_children():
            yield from walk(f"{name}.{child_name}" if name else child_name, child)
        yield name, module
    yield from walk("", model)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The user's module inside activation-checkpointing / offload wrappers."""
    while hasattr(module, _WRAPPED):
        module = getattr(module, _WRAPPED)
    return module


# -- activation checkpointing -------------------------------------------------------------------


def _apply_activation_checkpointing(model: nn.Module, wraps: Mapping[int, Any], config: FSDPConfig) -> list[str]:
    """Replace each selected module (the outermost, where selections nest) by its wrapper."""
    chosen: list[str] = []

    def visit(parent: nn.Module, prefix: str, owner: nn.Module | None) -> None:
        owner = parent if callable(getattr(parent, "activation_checkpointing_fn", None)) else owner
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}.{child_name}" if prefix else child_name
            choice = _rule(child, "_activation_checkpointing", owner, "activation_checkpointing_fn")
            if choice is None:
                choice = id(child) in wraps
            if choice:
                wrapped = checkpoint_wrapper(child) if config.activation_checkpointing else child
                if config.activation_cpu_offload:
                    wrapped = offload_wrapper(wrapped)
                setattr(parent, child_name, wrapped)
                chosen.append(name)
            else:
                visit(child, name, owner)

    visit(model, "", None)
    return chosen


# -- sharding ------------------------------------------------------------------------------------


class _Meshes:
    """Device meshes, made once each: every rank must create the same process groups in the same order."""

    def __init__(self, device_type: str, world_size: int, local_world_size: int) -> None:
        self.device_type, self.world_size, self.local_world_size = device_type, world_size, local_world_size
        self._cache: dict[tuple[Any, ...], DeviceMesh] = {}
        self._data_parallel: DeviceMesh | None = None

    def use(self, shape: MeshShape) -> DeviceMesh:
        """Build the job's mesh of ``shape``; every unit is then sharded over its data-parallel dimensions."""
        mesh = build_mesh(self.device_type, shape)
        self._data_parallel = data_parallel_mesh(mesh, shape)
        return mesh

    def get(self, strategy: str, group: tuple[str, int] | None) -> DeviceMesh:
        if self._data_parallel is not None:
            return self._data_parallel
        key = (strategy == "NO_SHARD", strategy == "HYBRID_SHARD", group)
        if key not in self._cache:
            self._cache[key] = self._make(*key)
        return self._cache[key]

    def _make(self, replicate: bool, hybrid: bool, group: tuple[str, int] | None) -> DeviceMesh:
        w = self.world_size
        if hybrid:  # shard within a node, replicate across nodes
            lw = self.local_world_size
            return init_device_mesh(self.device_type, (w // lw, lw), mesh_dim_names=("replicate", "shard"))
        if group is None:
            if replicate:
                return init_device_mesh(self.device_type, (w, 1), mesh_dim_names=("replicate", "shard"))
            return init_device_mesh(self.device_type, (w,), mesh_dim_names=("shard",))
        kind, k = group
        # Ranks laid out as a (w/k, k) grid: a row is a set of k consecutive ranks, a column the
        # ranks equal modulo k.
        dim = "row" if kind == "set" else "column"
        if replicate:
            grid = init_device_mesh(self.device_type, (w // k, k, 1), mesh_dim_names=("column", "row", "one"))
            return grid[(dim, "one")]
        grid = init_device_mesh(self.device_type, (w // k, k), mesh_dim_names=("column", "row"))
        return grid[dim]


def _shard(unit: Unit, meshes: _Meshes, device: torch.device, *, root: bool) -> None:
    """``fully_shard`` one unit. The root keeps its parameters gathered from forward to backward
    (FSDP1's behaviour and FSDP2's default): its backward begins the moment its forward ends, so
    resharding it would only put one more all-gather on the critical path."""
    p = unit.precision
    policy = MixedPrecisionPolicy(
        param_dtype=None if p.param_dtype == torch.float32 else p.param_dtype,
        reduce_dtype=None if p.reduce_dtype == torch.float32 and p.param_dtype == torch.float32 else p.reduce_dtype)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if unit.cpu_offload else OffloadPolicy()
    fully_shard(unit.module, mesh=meshes.get(unit.strategy, unit.group),
                reshard_after_forward=not root and unit.strategy in ("FULL_SHARD", "HYBRID_SHARD"),
                mp_policy=policy, offload_policy=offload)


def _cast_buffers(model: nn.Module, setup: FSDPSetup) -> None:
    """FSDP does not shard buffers; like FSDP1, keep each one in its unit's buffer dtype, and
    note the dtype it had for checkpoints (see :attr:`FSDPSetup.buffer_dtypes`)."""
    dtype_of = {id(u.module): u.precision.buffer_dtype for u in setup.units}

    def visit(module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
        dtype = dtype_of.get(id(module), dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                setup.buffer_dtypes[prefix + name] = buffer.dtype
                setattr(module, name, buffer.to(dtype))
        for child_name, child in module.named_children():
            # state dict names leave out activation-checkpointing wrappers
            visit(child, prefix if child_name == _WRAPPED else f"{prefix}{child_name}.", dtype)

    visit(model, "", dtype_of[id(model)])


def _set_backward_prefetch(setup: FSDPSetup, mode: str, root: nn.Module) -> None:
    """When the all-gather of the unit whose backward comes next is issued.

    BACKWARD_PRE is FSDP2's own: when a unit's backward starts. BACKWARD_POST issues it once a
    unit's gradients are computed (FSDP1's default: less overlap, and at most two units gathered at
    once). NONE names each unit itself as the one to prefetch: it is already gathered by then,
    so nothing is fetched ahead."""
    if mode == "BACKWARD_PRE":
        return
    if mode == "BACKWARD_POST":
        _PostBackwardPrefetch([u.module for u in setup.units], root)
        return
    for unit in setup.units:
        module = unit.module
        assert isinstance(module, FSDPModule)
        module.set_modules_to_backward_prefetch([module])


class _PostBackwardPrefetch:
    """BACKWARD_POST on FSDP2. Each forward records the units in the order their forwards end (the
    reverse of their backward order) and hooks the gradients of each unit's inputs: once they are
    computed, the unit's backward is done, and the unit whose forward ended last before this one's
    began is all-gathered (asynchronously; FSDP waits for it when that unit's backward starts). The
    root keeps FSDP2's own prefetch: its backward starts with the loss, and its inputs (the batch)
    have no gradient to hook."""

    def __init__(self, modules: list[nn.Module], root: nn.Module) -> None:
        self.ended: list[FSDPModule] = []
        self.began: dict[int, list[int]] = {}
        """id(unit) -> len(ended) when each of its running forwards began (units may nest)."""
        root.register_forward_pre_hook(self._start)
        for module in modules:
            if module is root:
                continue
            assert isinstance(module, FSDPModule)
            module.set_modules_to_backward_prefetch([module])  # nothing when its backward starts
            module.register_forward_pre_hook(self._forward_begins)
            module.register_forward_hook(self._forward_ends, with_kwargs=True)

    def _start(self, module: nn.Module, args: Any) -> None:
        self.ended, self.began = [], {}

    @staticmethod
    def _recorded() -> bool:
        # not in evaluation, nor in activation checkpointing's recomputation during backward
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        if self._recorded():
            self.began.setdefault(id(module), []).append(len(self.ended))

    def _forward_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._recorded() or not self.began.get(id(module)):
            return
        assert isinstance(module, FSDPModule)
        began = self.began[id(module)].pop()
        self.ended.append(module)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if began > 0 and inputs:
            previous = self.ended[began - 1]

            def gather_previous(grads: Any) -> None:
                previous.unshard(async_op=True)

            torch.autograd.graph.register_multi_grad_hook(inputs, gather_previous)


def _repoint_optimizers(optimizers: list[torch.optim.Optimizer],
                        owners: Mapping[int, tuple[nn.Module, str]]) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [getattr(*owners[id(p)]) if id(p) in owners else p for p in group["params"]]

