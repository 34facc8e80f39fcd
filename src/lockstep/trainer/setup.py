"""Trainer setup: argument checks and the objects Trainer.__init__ stores."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from collections.abc import Iterator
from typing import Any, SupportsInt

import torch
from torch import nn

from lockstep import dist, elastic
from lockstep.core.callback import Callback
from lockstep.model import Model
from lockstep.trainer import data


def check_inputs(model: Any, optimizers: Any, train_dataloader: Any,
                 eval_dataloader: Any) -> list[torch.optim.Optimizer]:
    """Check what the Trainer is given to train; returns the optimizers as a list."""
    check_model(model)
    optimizer_list = as_list(optimizers)
    check_optimizers(model, optimizer_list)
    for name, loader in (("train_dataloader", train_dataloader), ("eval_dataloader", eval_dataloader)):
        if loader is not None:
            data.check_distributed_sampler(loader, name)
    return optimizer_list


def already_compiled(model: Any) -> bool:
    """Whether ``model`` is what ``torch.compile`` returned (Composer warns: ``compile_config`` is the way)."""
    compiled = type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")
    if compiled:
        logging.getLogger("lockstep.trainer").warning(
            "`model` is already compiled with `torch.compile`: pass the plain model and compile_config={} instead, "
            "so that lockstep compiles it after wrapping it for DDP or FSDP")
    return compiled


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a lockstep.Model (an nn.Module), got {type(model).__name__}")
    for name in ("loss", "num_samples", "split_batch", "eval_forward"):
        if not callable(getattr(model, name, None)):
            raise TypeError(f"model must define {name}(...): subclass lockstep.Model")


NO_TOKENS = ("max_duration is in tokens, but a batch counts no tokens: define num_tokens(batch) on the model, "
             "or get_num_tokens_in_batch(batch) on the train_dataloader")


def more_duration(duration: Any, timestamp: Any, reset_time: bool) -> Any:
    """``fit(duration=)``: the new max_duration, that much past the current timestamp (from zero
    with ``reset_time``), in the duration's unit."""
    from lockstep.time import TimeUnit, time_argument

    more = time_argument("duration", duration)
    if more.unit is TimeUnit.DURATION:
        raise ValueError(f"duration cannot be in 'dur' (got '{more}'): give it in ep, ba, sp or tok")
    return more if reset_time else timestamp.get(more.unit) + more


def epoch_length(loader: Any, limit: int | None) -> int | None:
    """Batches per epoch: ``len(loader)``, capped at ``train_subset_num_batches``."""
    length = safe_len(loader)
    return length if limit is None or length is None else min(length, limit)


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def default_optimizer(model: Any) -> torch.optim.Optimizer | None:
    """Composer's default when no optimizer is given: ``DecoupledSGDW(model.parameters(), lr=0.1)``,
    with a warning; None (and a warning) for a model without parameters."""
    import warnings

    from lockstep.optim.decoupled import DecoupledSGDW

    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        warnings.warn("No optimizer was specified, and the model does not have parameters. Skipping auto-creating "
                      "optimizer.", stacklevel=3)
        return None
    optimizer = DecoupledSGDW(model.parameters(), lr=0.1)
    warnings.warn("No optimizer was specified. Defaulting to DecoupledSGDW(lr=0.1)", stacklevel=3)
    return optimizer


def check_optimizers(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    params = {id(p) for p in model.parameters()}
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{i}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in params for p in held):
            raise ValueError(
                f"optimizers[{i}] ({type(optimizer).__name__}) holds none of the model's parameters: "
                f"build it from this model, e.g. torch.optim.AdamW(model.parameters())")


def model_counts_tokens(model: Model) -> bool:
    return type(model).num_tokens is not Model.num_tokens


def safe_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def resolve_run_folder(run_folder: str | None) -> Path | None:
    """The explicit folder, else the launcher's run directory, else none (nothing written)."""
    folder = run_folder or os.environ.get("LOCKSTEP_RUN_DIRECTORY")
    return Path(folder) if folder else None


RUN_NAME_VARIABLES = ("COMPOSER_RUN_NAME", "RUN_NAME", "LOCKSTEP_RUN_NAME")
"""Where a run name comes from when ``run_name`` is not given, in this order."""


def seed_the_script_started_from() -> int:
    """``state.rank_zero_seed`` without ``seed=``: rank 0's ``torch.initial_seed()`` (what the script
    seeded torch with, or torch's own seed), the same on every rank. Composer draws a fresh seed
    instead; taking the script's keeps a script that seeds before the Trainer reproducible."""
    seed = [torch.initial_seed() % 2**32]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def run_name_from_environment(run_name: str | None) -> str | None:
    """``run_name``, else the first of :data:`RUN_NAME_VARIABLES` that is set."""
    if run_name is None:
        run_name = next((os.environ[v] for v in RUN_NAME_VARIABLES if os.environ.get(v)), None)
    return run_name


def resolve_run_name(run_name: str | None) -> str:
    """Every rank must use the same name, so rank 0's is broadcast. A made-up name is the time it
    was made and four random hex digits, so that two runs started in the same second differ."""
    if run_name is not None:
        return run_name
    membership = elastic.current()
    if membership is not None and membership.fresh:  # the others agreed on it before this rank joined
        return membership.shared("run_name")
    names = [datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
    if membership is not None and dist.get_global_rank() == 0:
        membership.share("run_name", names[0])
    return names[0]


def default_callbacks(run_folder: Path | None, progress_bar: bool, destinations: Sequence[Any] = ()) -> list[Callback]:
    """The progress bar (unless a ProgressBarLogger is among ``destinations``, as in Composer) and,
    with a run folder, the per-rank log, metrics.jsonl and the loss curve."""
    from lockstep.callbacks.run_files import LossCurve, MetricsJSONL, ProgressBar, RankLog

    bar_given = any(isinstance(d, ProgressBar) for d in destinations)  # ProgressBarLogger is one
    callbacks: list[Callback] = [ProgressBar()] if progress_bar and not bar_given else []
    if run_folder is not None:
        callbacks += [RankLog(run_folder / "trainer-rank{rank}.log"), MetricsJSONL(run_folder),
                      LossCurve(run_folder)]
    return callbacks


def upload_callbacks(run_folder: Path | None, destinations: Sequence[Any]) -> list[Callback]:
    """With a run folder and a destination that stores files (RemoteUploaderDownloader): the
    callback that hands it the run folder's files, after every destination (see RunFolderUploads)."""
    if run_folder is None or not any(getattr(d, "can_upload_files", lambda: False)() for d in destinations):
        return []
    from lockstep.callbacks.run_folder_uploads import RunFolderUploads

    return [RunFolderUploads(run_folder)]


def check_loggers(loggers: Any) -> list[Any]:
    """``loggers`` as a list of :class:`lockstep.loggers.LoggerDestination`, or a one-line error."""
    from lockstep.loggers import LoggerDestination

    return _list_of("loggers", loggers, LoggerDestination, "a destination from lockstep.loggers "
                    "(TensorboardLogger(), MLFlowLogger(), ...); callbacks go in callbacks=")


def _list_of(name: str, value: Any, kind: type, expected: str) -> list[Any]:
    items = as_list(value)
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] is a {type(item).__name__}, not {expected}")
    return items


def placement(state: Any) -> dict[str, Any]:
    """Where the run is, as Composer logs it at ``Trainer(...)``: nodes, devices per node, rank 0's seed."""
    local = max(dist.get_local_world_size(), 1)
    return {"num_nodes": max(dist.get_world_size() // local, 1), f"num_{state.device.name}s_per_node": local,
            "rank_zero_seed": state.rank_zero_seed}


def hyperparameters(trainer: Any) -> dict[str, Any]:
    """The run's configuration, as loggers record it at FIT_START."""
    s, loop = trainer.state, trainer.loop
    return {"run_name": s.run_name, "max_duration": str(s.max_duration), "world_size": dist.get_world_size(),
            "device": str(s.device.torch_device), "precision": s.precision, "seed": loop.seed,
            "device_train_microbatch_size": loop.device_train_microbatch_size, "grad_accum": loop.grad_accum,
            "scale_schedule_ratio": loop.scale_schedule_ratio, "strategy": type(trainer.strategy).__name__,
            "optimizers": [type(o).__name__ for o in s.optimizers],
            "algorithms": [type(a).__name__ for a in trainer.algorithms]}


def check_algorithms(algorithms: Any) -> list[Any]:
    """``algorithms`` as a list of :class:`lockstep.algorithms.Algorithm`, or a one-line error."""
    from lockstep.core.algorithm import Algorithm

    return _list_of("algorithms", algorithms, Algorithm, "a lockstep.algorithms.Algorithm "
                    "(e.g. GradientClipping(clipping_type='norm', clipping_threshold=1.0))")


def step_agreement(train_dataloader: Any, model: Model, *, counts_tokens: bool = False) -> tuple[bool, bool]:
    """``(sync, sum_tokens)``: whether the ranks must agree, each step and before it, on the global
    batch size and on whether every rank still has a batch (not when the sampler guarantees equal
    batches); and, when it does, whether the tokens, which only each rank knows, are summed
    alongside the step. ``counts_tokens``: a DataSpec gives ``get_num_tokens_in_batch``."""
    if dist.get_world_size() == 1:
        return False, False
    if not data.equal_batches_guaranteed(train_dataloader):
        return True, False
    return False, (counts_tokens or callable(getattr(train_dataloader, "get_num_tokens_in_batch", None))
                   or model_counts_tokens(model))


def set_python_log_level(level: str | None) -> None:
    """``python_log_level``, as Composer does for its own loggers: basic formatting, and this level
    for the ``lockstep`` loggers."""
    if level is None:
        return
    if not isinstance(level, str) or level.upper() not in logging.getLevelNamesMapping():
        raise ValueError(f"python_log_level={level!r} is not a logging level: use 'debug', 'info', "
                         f"'warning', 'error' or 'critical'")
    logging.basicConfig(format=f"%(asctime)s: rank{dist.get_global_rank()}[%(process)d][%(threadName)s]: "
                               f"%(levelname)s: %(name)s: %(message)s")
    logging.getLogger("lockstep").setLevel(level.upper())


def fsdp_from_parallelism_config(parallelism_config: Any, fsdp_config: Any) -> dict | None:
    """Composer 0.32's ``parallelism_config={'fsdp': {...}, 'tp': {...}}`` (or a ``ParallelismConfig``)
    and ``fsdp_config`` (a dict or an ``FSDPConfig``): the FSDP settings as a dict, checked."""
    from lockstep.utils.parallelism import as_fsdp_dict

    parts = _parallelism_parts(parallelism_config)
    if parts is None:
        return as_fsdp_dict(fsdp_config)
    if fsdp_config is not None and parts.get("fsdp") is not None:
        raise ValueError("give the FSDP settings once: in parallelism_config={'fsdp': ...} or in fsdp_config")
    return as_fsdp_dict(parts.get("fsdp", fsdp_config))


def tp_from_parallelism_config(parallelism_config: Any) -> Any:
    """``parallelism_config['tp']`` checked (see :mod:`lockstep.parallel.tensor_parallel`); None: none."""
    from lockstep.parallel import tensor_parallel

    parts = _parallelism_parts(parallelism_config)
    return None if parts is None else tensor_parallel.parse(parts.get("tp"))


def _parallelism_parts(parallelism_config: Any) -> dict | None:
    from lockstep.utils.parallelism import ParallelismConfig

    if isinstance(parallelism_config, ParallelismConfig):
        parallelism_config = {k: v for k, v in (("fsdp", parallelism_config.fsdp), ("tp", parallelism_config.tp))
                              if v is not None}
    if parallelism_config is None:
        return None
    if not isinstance(parallelism_config, dict):
        raise TypeError(f"parallelism_config must be a dict such as {{'fsdp': {{...}}, 'tp': {{...}}}}, got "
                        f"{type(parallelism_config).__name__}")
    unknown = sorted(set(parallelism_config) - {"fsdp", "tp"}, key=str)
    if unknown:
        raise ValueError(f"parallelism_config has unknown key(s) {', '.join(map(repr, unknown))}: its keys are "
                         f"'fsdp' and 'tp'")
    return parallelism_config


def auto_microbatching(loop: Any, parallel: Any) -> Any:
    """The search of ``device_train_microbatch_size='auto'``, or None when a size is given."""
    from lockstep.trainer.microbatch import AutoMicrobatch

    if loop.device_train_microbatch_size != "auto":
        return None
    check_auto_microbatching(parallel)
    return AutoMicrobatch(loop.device)


def check_auto_microbatching(parallel: Any) -> None:
    """``device_train_microbatch_size='auto'`` runs under DDP and in one process only."""
    if parallel.fsdp_config is not None or parallel.deepspeed_config is not None:
        raise ValueError("device_train_microbatch_size='auto' works under DDP and in one process; with "
                         "FSDP or DeepSpeed give the microbatch size as an int")


def check_elastic(strategy: Any, parallel: Any, save_folder: str | None) -> None:
    """What an elastic job (the launcher's ``--min_ranks``) goes on with after a lost rank: DDP or
    DeepSpeed ZeRO-0 in fp32, whose every rank holds the whole state, or FSDP over one mesh of all
    the ranks or the other ZeRO stages, from the last checkpoint in ``save_folder`` resharded (the
    lost ranks' shards are nowhere else)."""
    prefix = "the launcher's --min_ranks (an elastic job)"
    if not strategy.shards_state:
        return
    if parallel.deepspeed_config is not None:
        if save_folder is None:
            raise ValueError(f"{prefix} under DeepSpeed goes on from the last checkpoint, resharded over the ranks "
                             "left (a lost rank's ZeRO partitions are nowhere else): give save_folder and "
                             "save_interval")
        return
    config = strategy.config
    if strategy.shape is not None or config.sharding_strategy == "HYBRID_SHARD":
        raise ValueError(f"{prefix} under FSDP shards over all the ranks, whatever their number: drop "
                         "HYBRID_SHARD, the mesh degrees and tensor parallelism, or drop --min_ranks")
    if config.state_dict_type not in ("full", "sharded"):
        raise ValueError(f"{prefix} under FSDP goes on from the last checkpoint, resharded: a full or sharded "
                         f"one (state_dict_type 'full', the default, or 'sharded'), not {config.state_dict_type!r}, "
                         "whose per-rank files load only at the world size that wrote them")
    if save_folder is None:
        raise ValueError(f"{prefix} under FSDP goes on from the last checkpoint, resharded over the ranks left "
                         "(a lost rank's shards are nowhere else): give save_folder and save_interval")


def split_schedulers(schedulers: list[Any], every_batch: bool | None) -> tuple[list[Any], list[Any]]:
    """(stepped after every batch, stepped after every epoch), with Composer's rule: lockstep's
    schedules of training time step every batch; torch schedulers step every epoch unless
    ``step_schedulers_every_batch=True``."""
    from lockstep.optim.stepper import ScheduledLR

    if every_batch is not None and not isinstance(every_batch, bool):
        raise TypeError(f"step_schedulers_every_batch must be True, False or None, got {every_batch!r}")
    per_batch = [s for s in schedulers if isinstance(s, ScheduledLR) or every_batch]
    return per_batch, [s for s in schedulers if s not in per_batch]


@contextlib.contextmanager
def kept_out_of_gc() -> Iterator[None]:
    """Keep every object that exists now out of the interpreter's full collections until the end.

    Those scan every object, torch's included: each took about 0.2 s, a stall of several steps.
    What exists before training lives through it. Nothing changes if the user manages freezing."""
    server = sys.modules.get("lockstep.launcher.prefork")  # a rank forked from it: frozen already
    freeze = not getattr(server, "FROZEN", False) and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def tokens_of(global_tokens: SupportsInt) -> int:
    """``accumulate_train_batch_on_tokens``: the global batch's tokens, which weigh the losses."""
    tokens = int(global_tokens)  # waits for the sum over the ranks
    if tokens <= 0:
        raise ValueError("accumulate_train_batch_on_tokens=True, but the batch has no tokens: give the model "
                         "num_tokens(batch), or the dataloader get_num_tokens_in_batch(batch)")
    return tokens
