"""The Trainer's keyword arguments, sorted into the configs of its parts: the loop, the
checkpoints, the parallel backend, and the algorithms it runs itself. Each config's fields are
named as the Trainer's arguments, so the sorting is by name."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lockstep.algorithms.gradient_clipping import for_deepspeed
from lockstep.checkpoint.config import CheckpointConfig
from lockstep.core.algorithm import Algorithm
from lockstep.parallel.config import ParallelConfig
from lockstep.trainer import checkpointing, setup
from lockstep.trainer.config import LoopConfig


@dataclass(frozen=True, slots=True)
class Configs:
    loop: LoopConfig
    checkpoints: CheckpointConfig
    parallel: ParallelConfig
    algorithms: list[Algorithm]
    """The algorithms the Trainer runs (under DeepSpeed, its engine clips gradients instead)."""


def sort(arguments: dict[str, Any]) -> Configs:
    """The configs of ``arguments`` (the Trainer's, by name), each checked."""
    def named(config: type) -> dict[str, Any]:
        return {f.name: arguments[f.name] for f in fields(config)}

    fsdp_config = setup.fsdp_from_parallelism_config(arguments["parallelism_config"], arguments["fsdp_config"])
    loop = LoopConfig(**named(LoopConfig))
    checkpoints = named(CheckpointConfig)
    saving = {name: value for name, value in checkpoints.items() if name.startswith("save_") and name != "save_metrics"}
    checkpoints.update(checkpointing.saving_arguments(arguments["callbacks"], saving))
    deepspeed_config, algorithms = for_deepspeed(arguments["deepspeed_config"],
                                                 setup.check_algorithms(arguments["algorithms"]))
    checked = CheckpointConfig(**checkpoints)
    parallel = ParallelConfig(**{**named(ParallelConfig), "fsdp_config": fsdp_config,
                                 "deepspeed_config": deepspeed_config})
    return Configs(loop=loop, checkpoints=checked, parallel=parallel, algorithms=algorithms)
