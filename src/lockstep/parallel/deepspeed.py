"""DeepSpeed ZeRO: ``deepspeed_config`` -> a DeepSpeed engine around the Trainer's model and optimizer.

The user's config is passed to DeepSpeed as given, with the fields the Trainer already decides
filled in from it: the batch sizes from the dataloader, microbatching and world size, and the
fp16/bf16 sections from ``precision``. A field the user set to something else is an error that
names both; ``"auto"`` means "fill it in". Two DeepSpeed defaults would change the Trainer's math
or output, so they are set unless the user gives them: ``gradient_clipping`` 0 (DeepSpeed clips at
1.0) and ``steps_per_print`` (DeepSpeed prints every 10 steps). Any torch optimizer may be used
(``zero_allow_untested_optimizer``).

The Trainer drives the engine with an explicit accumulation boundary: every microbatch but the last
runs with the boundary off, so the number of microbatches may change from step to step (a short
last batch) and ``engine.step()`` runs once per optimizer step. The loss is scaled by the Trainer,
never by DeepSpeed's gradient accumulation count. So a rank may take a larger share of a global
batch in more microbatches, which an elastic job's ranks left do: after a change they take the
engine off the model and build a new one over themselves (:meth:`DeepSpeedStrategy.reshard`), and
DeepSpeed's collectives wait through :mod:`lockstep.dist` meanwhile, so that a change ends them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep import batch as batches
from lockstep import dist, elastic
from lockstep.checks import check_keys
from lockstep.optional import DEEPSPEED_INSTALL_HINT
from lockstep.parallel import skeleton
from lockstep.parallel.precision import NULL_CONTEXT
from lockstep.parallel.strategy import Strategy

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout

# DeepSpeed ignores top-level keys it does not know, so a misspelt section would silently train
# without it; these are the keys DeepSpeed reads (tests check each against the installed DeepSpeed).
TOP_LEVEL_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "fp16", "bf16", "bfloat16", "amp",
    "torch_autocast", "gradient_clipping", "graph_harvesting", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "aio", "activation_checkpointing", "sparse_attention", "flops_profiler",
    "comms_logger", "autotuning", "wall_clock_breakdown", "memory_breakdown", "tensorboard", "wandb",
    "csv_monitor", "comet", "elasticity", "data_efficiency", "curriculum_learning", "compression_training",
    "checkpoint", "data_types", "steps_per_print", "dump_state", "disable_allgather", "dataloader_drop_last",
    "pipeline", "progressive_layer_drop", "eigenvalue", "quantize_training", "nebula", "hybrid_engine",
    "compile", "timers", "log_level", "disable_python_gc", "managed_gradient_accumulation", "expert_parallel",
    "vocabulary_size",
)
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_OWN_KEYS = {"optimizer": "optimizers=", "scheduler": "schedulers="}
_HALF = {"amp_fp16": "fp16", "amp_bf16": "bf16"}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed for ``device``: its CPU accelerator when training on the CPU."""
    if "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)
    try:
        with _not_imported(_UNUSED_AT_IMPORT):
            import deepspeed
    except ImportError as e:
        raise ImportError(f"deepspeed_config needs DeepSpeed, which is not installed ({e}): "
                          f"{DEEPSPEED_INSTALL_HINT}") from None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise ValueError(f"DeepSpeed runs on its {accelerator!r} accelerator but the Trainer trains on "
                         f"{device.type!r}: set DS_ACCELERATOR={device.type} before DeepSpeed is imported")
    return deepspeed


_UNUSED_AT_IMPORT = ("mlflow",)
"""What ``import deepspeed`` imports and lockstep never uses: its autotuner's optional experiment
log (~1.8 s of CPU a rank, on machines with mlflow installed). The autotuner then logs without it."""


@contextlib.contextmanager
def _not_imported(names: tuple[str, ...]) -> Iterator[None]:
    """Within: importing one of ``names`` that no one has imported yet raises ImportError (an entry
    of None in ``sys.modules``), which DeepSpeed takes as the optional package being absent."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


_SHARED_MEMORY_OP = "deepspeed_shm_comm"


@contextlib.contextmanager
def _without_inference_all_reduce_op() -> Iterator[None]:
    """DeepSpeed's communication backend loads a C++ op on the CPU accelerator, compiling it the
    first time a machine (or another version of ninja) meets it: over a minute of CPU. Only
    DeepSpeed-Inference's tensor-parallel all-reduce uses it, never a ZeRO step, so while the
    engine (and with it the backend) is built here the op counts as unavailable, as on a
    machine without a compiler; DeepSpeed then all-reduces through torch.distributed."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # DeepSpeed reads this one dict (computed once)
    before = compatible.get(_SHARED_MEMORY_OP)
    compatible[_SHARED_MEMORY_OP] = False
    try:
        yield
    finally:
        if before is None:
            del compatible[_SHARED_MEMORY_OP]
        else:
            compatible[_SHARED_MEMORY_OP] = before


_WAITED = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
           "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced", "gather", "scatter",
           "all_to_all_single", "all_to_all", "barrier")
"""DeepSpeed's collectives (methods of its torch backend, each with ``async_op``)."""


def _wait_through_lockstep() -> None:
    """In an elastic job: DeepSpeed's collectives waited for through :func:`lockstep.dist.wait_collective`.
    In torch's own wait, a rank whose peer had already left for the new process group (it saw the
    change first) would block until the group's timeout; lockstep's wait ends at the change."""
    from deepspeed.comm import comm

    backend = comm.cdb
    if getattr(backend, "_lockstep_waited", False):
        return
    for name in _WAITED:
        method = getattr(type(backend), name, None)
        if method is not None:
            issue = method.__get__(backend)
            if name == "reduce_scatter_tensor":
                issue = _reduce_scatter_on_gloo(issue, type(backend).all_reduce.__get__(backend))
            setattr(backend, name, _waited(issue, _signature(method)))
    backend._lockstep_waited = True


def _number_from_zero() -> None:
    """Have the next ZeRO-3 engine number the model's modules and parameters from 0, as a process's
    first does. DeepSpeed counts them process-wide (a default argument, a class attribute), so an
    elastic job's engine built anew after a change would number on from the one before, and
    disagree on the ids with a rank that joined with its first engine (the engine checks that they
    agree, at the end of the first step)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    defaults = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if defaults and isinstance(defaults[0], list) and len(defaults[0]) == 1:
        defaults[0][0] = 0
    Init.param_id = 0


class _Work:
    """A collective's work whose :meth:`wait` goes through :func:`lockstep.dist.wait_collective`,
    then runs ``then`` (once); anything else is the work's own."""

    def __init__(self, work: Any, then: Callable[[], Any] | None = None) -> None:
        self._work, self._then, self._waited = work, then, work is None

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if not self._waited:
            dist.wait_collective(self._work)
            self._waited = True
            if self._then is not None:
                self._then()
        return True

    def is_completed(self) -> bool:
        return self._waited or self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _reduce_scatter_on_gloo(reduce_scatter: Callable[..., Any], all_reduce: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's ``reduce_scatter_tensor``, which on gloo is an all-reduce of a copy of the input and
    this rank's part of it: gloo's reduce-scatter work never says that it completed, so a polled
    wait would never end (ZeRO-3 reduce-scatters its gradients)."""
    def issue(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False,
              **op: Any) -> Any:
        if torch.distributed.get_backend(group) != "gloo":
            return reduce_scatter(output_tensor, input_tensor, group=group, async_op=async_op, **op)
        whole = input_tensor.clone()
        rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        return _Work(all_reduce(whole, group=group, async_op=True, **op),
                     lambda: output_tensor.copy_(whole.view(size, -1)[rank].view_as(output_tensor)))
    return issue


def _signature(function: Any) -> inspect.Signature:
    """The parameters of a method of DeepSpeed's torch backend, ``self`` first. Its
    ``stage_on_cpu`` decorator returns a ``(self, *args, **kwargs)`` wrapper that keeps the
    method's own signature in its closure (it binds ``async_op`` by it)."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    held = cells.get("signature")
    if held is not None and isinstance(held.cell_contents, inspect.Signature):
        return held.cell_contents
    return inspect.signature(function)


def _waited(issue: Any, signature: inspect.Signature) -> Any:
    """A collective of DeepSpeed's torch backend (``issue``, bound) always issued asynchronously;
    its work waited for through :func:`lockstep.dist.wait_collective`, here unless the caller asked
    for ``async_op`` (it then gets work whose ``wait`` does so)."""
    if "async_op" not in signature.parameters:
        return issue

    def call(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(None, *args, **kwargs).arguments
        del arguments[next(iter(signature.parameters))]  # self
        asked = arguments.pop("async_op", False)
        work = issue(**arguments, async_op=True)
        if not isinstance(work, _Work):
            work = _Work(work)
        if asked:
            return work
        work.wait()
        return None
    return call


def batch_size_of(loader: Any) -> int | None:
    """The per-rank batch size a dataloader yields, when it says."""
    for owner in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(owner, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None


def fill_config(config: Mapping[str, Any], *, batch_size: int | None, microbatch_size: int | None,
                grad_accum: int | None, world_size: int, precision: str,
                optimizers: int) -> dict[str, Any]:
    """The config to give DeepSpeed: the user's, with what the Trainer decides filled in and
    checked. ``batch_size`` is the dataloader's per-rank batch (None when unknown)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"deepspeed_config must be a dict (DeepSpeed's JSON config), got {type(config).__name__}")
    check_keys("deepspeed_config", config, TOP_LEVEL_KEYS)
    config = copy.deepcopy(dict(config))
    for key, argument in _OWN_KEYS.items():
        if key in config:
            raise ValueError(f"deepspeed_config[{key!r}] is set, but the Trainer hands DeepSpeed its own "
                             f"{argument}: remove {key!r} from deepspeed_config and pass {argument} to Trainer")
    if optimizers > 1:
        raise ValueError(f"DeepSpeed trains with one optimizer, but {optimizers} were given: combine them "
                         f"into one with parameter groups")
    _check_zero(config.get("zero_optimization"))
    _fill_batch(config, batch_size, microbatch_size, grad_accum, world_size)
    _fill_precision(config, precision)
    config.setdefault("gradient_clipping", 0.0)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**31 - 1)
    return config


def refill_world_size(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """``config`` with DeepSpeed's global batch for ``world_size`` ranks (an elastic job's ranks
    changed; the Trainer splits the batch itself, and DeepSpeed checks that the product holds)."""
    config = copy.deepcopy(config)
    if all(key in config for key in _BATCH_KEYS):
        config["train_batch_size"] = _global_batch(config["train_micro_batch_size_per_gpu"],
                                                   config["gradient_accumulation_steps"], world_size)
    return config


def _global_batch(microbatch_size: int, accumulation: int, world_size: int) -> int:
    """The ``train_batch_size`` DeepSpeed checks the other two batch keys against."""
    return microbatch_size * accumulation * world_size


def _check_zero(zero: Any) -> None:
    """A ZeRO stage DeepSpeed would refuse (in a 30-line validation dump, after the rendezvous) is
    one line here. DeepSpeed also takes ``"zero_optimization": true``, its old spelling of stage 1."""
    if zero is None or isinstance(zero, bool):
        return
    if not isinstance(zero, Mapping):
        raise TypeError(f"deepspeed_config['zero_optimization'] must be a dict such as {{'stage': 2}}, got {zero!r}")
    stage = zero.get("stage", 0)
    valid = (isinstance(stage, (int, float)) and stage in (0, 1, 2, 3)) or \
        (isinstance(stage, str) and stage.strip() in ("0", "1", "2", "3"))
    if not valid:
        raise ValueError(f"deepspeed_config['zero_optimization']['stage']={stage!r}: ZeRO's stages are 0 (plain "
                         f"data parallel), 1 (optimizer state sharded), 2 (and gradients) and 3 (and parameters)")


def _fill_batch(config: dict[str, Any], batch_size: int | None, microbatch_size: int | None,
                grad_accum: int | None, world_size: int) -> None:
    if batch_size is None:
        # No dataloader to read it from (e.g. evaluation only): DeepSpeed still wants a batch size.
        if all(_unset(config.get(k)) for k in _BATCH_KEYS):
            config["train_micro_batch_size_per_gpu"] = 1
        for key in _BATCH_KEYS:
            if _unset(config.get(key)):
                config.pop(key, None)
        return
    if microbatch_size is None:
        microbatch_size = batch_size if grad_accum is None else math.ceil(batch_size / grad_accum)
    microbatch_size = min(microbatch_size, batch_size)
    if batch_size % microbatch_size:
        raise ValueError(f"under DeepSpeed the dataloader's batch_size ({batch_size}) must be a multiple of "
                         f"the microbatch size ({microbatch_size}): DeepSpeed's config needs train_batch_size = "
                         f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size")
    accumulation = batch_size // microbatch_size
    ours = {
        "train_batch_size": (_global_batch(microbatch_size, accumulation, world_size),
                             f"the global batch {batch_size * world_size} (dataloader batch_size {batch_size} x "
                             f"{world_size} ranks)"),
        "train_micro_batch_size_per_gpu": (microbatch_size, f"the Trainer's microbatch size {microbatch_size} "
                                                            f"(device_train_microbatch_size / grad_accum)"),
        "gradient_accumulation_steps": (accumulation, f"the Trainer's {accumulation} microbatch(es) per batch"),
    }
    for key, (value, what) in ours.items():
        given = config.get(key)
        if not _unset(given) and given != value:
            raise ValueError(f"deepspeed_config[{key!r}]={given!r} conflicts with {what}: remove it from "
                             f"deepspeed_config (lockstep fills it in) or change the Trainer's setting")
        config[key] = value


def _fill_precision(config: dict[str, Any], precision: str) -> None:
    if "bfloat16" in config:  # DeepSpeed's other name for the bf16 section
        if "bf16" in config:
            raise ValueError("deepspeed_config has both 'bf16' and 'bfloat16' sections: keep one")
        config["bf16"] = config.pop("bfloat16")
    wanted = _HALF.get(precision)
    for section in ("fp16", "bf16"):
        value = config.get(section)
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"deepspeed_config[{section!r}] must be a dict such as {{'enabled': True}}, got {value!r}")
        value = dict(value or {})
        enabled = value.get("enabled")
        if not _unset(enabled) and bool(enabled) != (section == wanted):
            raise ValueError(f"deepspeed_config[{section!r}]['enabled']={enabled!r} conflicts with the "
                             f"Trainer's precision={precision!r}: lockstep fills the {section} section from "
                             f"precision ({'amp_fp16' if section == 'fp16' else 'amp_bf16'} enables it), so "
                             f"remove the section or change precision")
        if section == wanted or value:
            config[section] = {**value, "enabled": section == wanted}


def _unset(value: Any) -> bool:
    return value is None or value == "auto"


class DeepSpeedStrategy(Strategy):
    """A DeepSpeed engine around the model and its one optimizer (ZeRO stages 0-3).

    ``config`` comes from :func:`fill_config`. DeepSpeed is imported here, before any process
    group exists, so that a missing install is an error before the rendezvous.
    """

    needs_process_group = True

    def __init__(self, device: torch.device, precision: str, config: dict[str, Any]) -> None:
        super().__init__(device, precision)
        self.scaler = None  # the engine scales an fp16 loss itself
        self.config = config
        self.stage = int(config.get("zero_optimization", {}).get("stage", 0))
        self.gathers_in_forward = self.stage == 3
        half = next((s for s in ("fp16", "bf16") if config.get(s, {}).get("enabled")), None)
        self.dtype = _DTYPES.get(half) if half else None
        """The dtype the engine keeps parameters in (float batches are cast to it); None in fp32."""
        self._deepspeed = import_deepspeed(device)
        if half == "fp16":
            from deepspeed.accelerator import get_accelerator
            if not get_accelerator().is_fp16_supported():
                raise ValueError(f"precision='amp_fp16' under DeepSpeed needs fp16 support, which DeepSpeed's "
                                 f"{device.type} accelerator lacks on this machine: use precision='amp_bf16'")
        self.engine: Any = None
        self._params: list[list[torch.Tensor]] | None = None
        """An elastic job's optimizer parameter groups as given (DeepSpeed replaces them)."""
        self._skeleton: nn.Module | None = None
        """An elastic ZeRO-3 job's model before partitioning, on the meta device (:meth:`reshard`)."""
        self._names: list[list[list[str]]] = []
        self._place = 0
        """This rank's place in the engine's partitioning."""
        self._stepping = self._updated = False
        """Whether a step is in flight, and whether it updated the partitions
        (:meth:`updated_before_failing`)."""
        self._watched: Any = None

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Build the engine (a collective). A rank that joins a running elastic job builds it
        with the others, when they build theirs anew over the larger world (:meth:`reshard`)."""
        membership = elastic.current()
        if membership is not None and self._params is None:
            self._params = [list(group["params"]) for group in (optimizers[0].param_groups if optimizers else [])]
            if self.stage == 3:  # its parameters will be partitioned in place: a new model after a change
                self._skeleton = skeleton.skeleton(model)
                self._names = skeleton.parameter_names(model, optimizers)
        # DeepSpeed calls these torch collectives under their old names on every step; the warning is
        # for DeepSpeed to act on, and would otherwise flood the user's log.
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
        # DeepSpeed reads the rank from the environment, which a run without a launcher lacks.
        for name, value in (("LOCAL_RANK", dist.get_local_rank()), ("RANK", dist.get_global_rank()),
                            ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_WORLD_SIZE", dist.get_local_world_size())):
            os.environ.setdefault(name, str(value))
        self.model, self.optimizers = model.to(self.device), optimizers
        if membership is not None and membership.fresh:
            self.module = self.model  # no engine until the others build theirs with this rank
            return
        self._build()

    def _build(self) -> None:
        # over the ranks there are: an elastic job may start with fewer than the launch's world (a late
        # node), whose global batch the config was filled for
        self.config = refill_world_size(self.config, dist.get_world_size())
        with _without_inference_all_reduce_op():
            self.engine, _, _, _ = self._deepspeed.initialize(
                model=self.model, optimizer=self.optimizers[0] if self.optimizers else None,
                config=copy.deepcopy(self.config), dist_init_required=False)
        self.module = self.engine
        self._place = dist.get_global_rank()  # in the engine's partitioning (its process group is the world)
        if self._params is not None:
            _wait_through_lockstep()
            self._watch_updates()

    def _watch_updates(self) -> None:
        """Note each update of the engine's partitions: ZeRO's step updates this rank's partition,
        then gathers every rank's (a collective that a change of an elastic job's ranks may end),
        and a rank that updated must not train that batch again on the state it sends."""
        base = getattr(self.engine.optimizer, "optimizer", None)  # ZeRO's: the optimizer of the partitions
        if isinstance(base, torch.optim.Optimizer) and base is not self._watched:
            base.register_step_post_hook(self._note_update)
            self._watched = base

    def _note_update(self, *_: Any) -> None:
        # DeepSpeed also steps it with no gradients to make its state, as it builds an engine
        self._updated = self._updated or self._stepping

    def reshard(self) -> nn.Module:
        """After an elastic job's ranks changed, on the new process group: the engine taken off
        the model and a new one built over the ranks now in the job, around the same optimizer (its
        state left for a checkpoint to fill). At stages 0-2, whose model every rank holds whole,
        around the same model; at stage 3, whose parameters the lost ranks held part of, around a
        new model made from the skeleton (its parameters for the checkpoint to fill)."""
        return self._rebuild(keep_state=False)

    def _rebuild(self, keep_state: bool) -> nn.Module:
        """:meth:`reshard`; with ``keep_state``, the optimizer's state kept as it is (ZeRO-0 in fp32,
        whose engine steps the user's optimizer over its own parameter groups)."""
        assert self._params is not None, "reshard() is for an elastic job's DeepSpeed strategy"
        if self.engine is not None:
            self._take_off(self.engine, keep_state)
        if self._skeleton is not None:
            _number_from_zero()  # as a joining rank's first engine does
            self.model = skeleton.materialize(self._skeleton, self.device, self.model)
            skeleton.point_optimizers(self.model, self.optimizers, self._names)
            self._params = [list(group["params"]) for group in (self.optimizers[0].param_groups
                                                                 if self.optimizers else [])]
        for param in self.model.parameters():  # the interrupted step's partial gradients
            param.grad = None
        self._build()
        return self.model

    @property
    def shards_state(self) -> bool:  # type: ignore[override]
        """ZeRO-1-3 partition the optimizer state (and gradients, parameters) over the ranks: an
        elastic job builds a new engine (:meth:`reshard`) and fills it from peers or the last
        checkpoint. ZeRO-0 in fp32 steps the user's optimizer, whose state every rank holds whole, as
        under DDP: the engine is built anew around it as it is (:meth:`regroup`). In bf16 or fp16,
        DeepSpeed keeps fp32 master weights in an optimizer of its own, which only a checkpoint fills."""
        return not (self.stage == 0 and self.dtype is None)

    def regroup(self) -> None:
        """ZeRO-0 in fp32 after an elastic job's ranks changed: a new engine over the new process
        group around the same model and optimizer, whose state is kept (a rank that joined builds its
        first engine here and takes the state from the furthest rank after)."""
        self._rebuild(keep_state=True)

    @property
    def whole_from_peers(self) -> bool:  # type: ignore[override]
        # ZeRO-1 in bf16 or fp16 may be DeepSpeed's BF16_Optimizer, whose partitions lockstep does not cut;
        # ZeRO-3's frozen parameters are in no optimizer partition (the checkpoint's way refuses them)
        if self._params is None or (self.stage == 3 and not all(p.requires_grad for p in self.model.parameters())):
            return False
        return self.stage in (2, 3) or (self.stage == 1 and self.dtype is None)

    def held_state(self) -> Any:
        from lockstep.parallel import deepspeed_peers

        return deepspeed_peers.held(self.engine, self.stage, self._place)

    def reshard_from(self, held: list[Any], own: Any) -> nn.Module:
        from lockstep.parallel import deepspeed_peers

        model = self.reshard()
        deepspeed_peers.load(self.engine, self.stage, held)
        return model

    def _take_off(self, engine: Any, keep_state: bool = False) -> None:
        """``engine``'s hooks off the model, DeepSpeed's clone of the old world forgotten, and the
        optimizer's own parameter groups back (DeepSpeed replaced them with flat partitions), its
        state cleared for a checkpoint or peers to fill unless ``keep_state``."""
        engine.destroy()  # the optimizer's gradient hooks
        for hook in (engine.module_forward_pre_hook, engine.module_forward_post_hook):
            if hook is not None:
                hook.remove()
        from deepspeed.utils import groups
        groups._WORLD_GROUP = None  # DeepSpeed reduces over this clone of the world group
        if self.stage == 3:  # ZeRO-3's list of modules in a forward, which holds every engine's model
            from deepspeed.runtime.zero import parameter_offload
            parameter_offload.FWD_MODULE_STACK.clear()
        if self.optimizers:
            optimizer = self.optimizers[0]
            for group, params in zip(optimizer.param_groups, self._params or []):
                group["params"] = list(params)
            if not keep_state:
                optimizer.state.clear()

    def prepare_batch(self, batch: Any) -> Any:
        batch = super().prepare_batch(batch)
        return batch if self.dtype is None else batches.cast_floats(batch, self.dtype)

    def sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        # DeepSpeed reduces (stage 1) or finishes reducing (stages 2, 3) gradients in the backward
        # of the microbatch marked as the boundary, and steps only then.
        self.engine.set_gradient_accumulation_boundary(is_last_microbatch)
        return NULL_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss carries the Trainer's own share

    def clip_gradients_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise ValueError("under DeepSpeed, gradients are clipped by the engine: set deepspeed_config"
                         "['gradient_clipping'] instead")

    def clip_gradients_value(self, clip_value: float) -> None:
        raise ValueError("DeepSpeed clips gradients by norm only (deepspeed_config['gradient_clipping']): "
                         "clipping by value is not available under deepspeed_config")

    def clip_gradients_adaptive(self, threshold: float) -> None:
        raise ValueError("DeepSpeed clips gradients by norm only (deepspeed_config['gradient_clipping']): "
                         "adaptive clipping is not available under deepspeed_config")

    def optimizer_step(self) -> None:
        self._stepping = True
        try:
            self.engine.step()  # the optimizer step and zero_grad
        finally:
            self._stepping = False
        self._updated = False  # the whole step: nothing of it left in flight

    def updated_before_failing(self) -> bool:
        updated, self._updated = self._updated, False
        return updated

    def layout(self) -> Layout:
        from lockstep.checkpoint.deepspeed import DeepSpeedLayout
        return DeepSpeedLayout(self.model, self.optimizers, lambda: self.engine, self.stage)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "zero_stage": self.stage, "config": self.config}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as full tensors on every rank; under ZeRO-3 they are
    gathered first (a collective)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    import deepspeed
    with deepspeed.zero.GatheredParameters(params):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
