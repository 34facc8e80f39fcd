"""The Trainer's parallelism arguments, checked, and the backend object they pick."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.parallel.compile import check_compile_config
from lockstep.parallel.ddp import DDPSyncStrategy, DDPStrategy, resolve_sync_strategy
from lockstep.parallel.fsdp_config import FSDPConfig, parse_config
from lockstep.parallel.strategy import Strategy
from lockstep.parallel.tensor_parallel import TensorParallel


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model is spread over the ranks: DDP (the default), FSDP or DeepSpeed."""

    ddp_sync_strategy: DDPSyncStrategy | str | None = None
    """When DDP reduces gradients across microbatches (see :mod:`lockstep.parallel.ddp`)."""
    find_unused_parameters: bool = False
    """DDP's own flag, for models whose forward leaves some parameters unused."""
    fsdp_config: FSDPConfig | Mapping[str, Any] | None = None
    """Shard the model with FSDP (see :mod:`lockstep.parallel.fsdp_sharding`)."""
    tp_config: TensorParallel | None = None
    """Split layers over groups of ranks (see :mod:`lockstep.parallel.tensor_parallel`); needs FSDP."""
    deepspeed_config: Mapping[str, Any] | None = None
    """Train through a DeepSpeed engine (see :mod:`lockstep.parallel.deepspeed`)."""
    compile_config: Mapping[str, Any] | None = None
    """``torch.compile`` arguments; compile the model after wrapping (see :mod:`lockstep.parallel.compile`)."""

    def __post_init__(self) -> None:
        if self.fsdp_config is not None and self.deepspeed_config is not None:
            raise ValueError("fsdp_config and deepspeed_config were both given: pick one way to shard the model")
        if self.tp_config is not None and self.deepspeed_config is not None:
            raise ValueError("tensor parallelism (parallelism_config['tp']) does not work with deepspeed_config: "
                             "shard the model with parallelism_config={'fsdp': {...}, 'tp': {...}} instead")
        if self.tp_config is not None and self.fsdp_config is None:
            raise ValueError("tensor parallelism shards the rest of the model with FSDP: add "
                             "parallelism_config['fsdp'] (an empty {} takes FSDP's defaults)")
        self.compile_config = check_compile_config(self.compile_config)
        if self.compile_config is not None and self.deepspeed_config is not None:
            raise ValueError("compile_config is not supported with deepspeed_config: DeepSpeed wraps the model in "
                             "its own engine; use DDP or fsdp_config to compile")
        self.ddp_sync_strategy = resolve_sync_strategy(self.ddp_sync_strategy, self.find_unused_parameters)
        if self.fsdp_config is not None and not isinstance(self.fsdp_config, FSDPConfig):
            self.fsdp_config = parse_config(self.fsdp_config)


def build_strategy(config: ParallelConfig, *, device: torch.device, precision: str, train_dataloader: Any,
                   microbatch_size: int | None, grad_accum: int | None, num_optimizers: int) -> Strategy:
    """The backend object for ``config``; checks a DeepSpeed config against the Trainer's settings
    and imports DeepSpeed, before any process group exists."""
    if config.fsdp_config is not None:
        from lockstep.parallel.fsdp import FSDPStrategy
        return FSDPStrategy(device, precision, config.fsdp_config, config.tp_config)  # type: ignore[arg-type]
    if config.deepspeed_config is not None:
        from lockstep import dist
        from lockstep.parallel import deepspeed as ds
        filled = ds.fill_config(config.deepspeed_config, batch_size=ds.batch_size_of(train_dataloader),
                                microbatch_size=microbatch_size, grad_accum=grad_accum,
                                world_size=dist.get_world_size(), precision=precision, optimizers=num_optimizers)
        return ds.DeepSpeedStrategy(device, precision, filled)
    return DDPStrategy(device, precision, sync_strategy=config.ddp_sync_strategy,  # type: ignore[arg-type]
                       find_unused_parameters=config.find_unused_parameters)
