"""Composer's parallelism config classes (``composer.utils.parallelism``), which the Trainer takes
wherever it takes the dicts: ``fsdp_config=FSDPConfig(...)`` or
``parallelism_config=ParallelismConfig(fsdp=FSDPConfig(...))`` (or ``{'fsdp': FSDPConfig(...)}``).

An ``FSDPConfig`` stands for the dict of the fields set away from Composer's defaults, which
lockstep then checks as it checks ``fsdp_config`` (docs/trainer-arguments.md lists the keys it
acts on): a Composer setting lockstep lacks fails at ``Trainer(...)`` with the keys it has.
``TPConfig`` stands for ``parallelism_config['tp']`` (see :mod:`lockstep.parallel.tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FSDPConfig", "FSDP2Config", "TPConfig", "ParallelismConfig", "as_fsdp_dict"]

_MESH_MESSAGE = ("Directly specifying device mesh for FSDP was deprecated in Composer 0.24 and is not in "
                 "lockstep: give 'data_parallel_shard_degree' and/or 'data_parallel_replicate_degree' instead")


@dataclass(init=False)
class FSDPConfig:
    """Composer's FSDP settings, with its field names and defaults; keyword arguments only."""

    activation_checkpointing: bool = False
    activation_checkpointing_reentrant: bool = True
    activation_cpu_offload: bool = False
    auto_wrap: bool = True
    te_checkpoint_wrapper: bool = False
    te_shard_fp8_weight: bool = False
    backward_prefetch: str = "BACKWARD_POST"
    backward_prefetch_limit: int = 1
    cpu_offload: bool = False
    data_parallel_shard_degree: int = -1
    data_parallel_replicate_degree: int | None = None
    forward_prefetch: bool = False
    forward_prefetch_limit: int = 1
    ignored_modules: Any = None
    keep_low_precision_grads: bool = False
    limit_all_gathers: bool = True
    load_monolith_rank0_only: bool = False
    load_planner: Any = None
    mixed_precision: Any = "DEFAULT"
    process_group: Any = None
    save_planner: Any = None
    sharded_ckpt_prefix_dir: str = "ep{epoch}-ba{batch}"
    sharding_strategy: str = "FULL_SHARD"
    state_dict_type: str = "full"
    sync_module_states: bool = False
    use_orig_params: bool = True
    verbose: bool = False

    def __init__(self, **kwargs: Any) -> None:
        if "device_mesh" in kwargs or "_device_mesh" in kwargs:
            raise ValueError(_MESH_MESSAGE)
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"FSDPConfig has no field {', '.join(map(repr, unknown))}: "
                            f"the fields are {', '.join(sorted(names))}")
        for f in dataclasses.fields(self):
            setattr(self, f.name, kwargs.get(f.name, f.default))


@dataclass
class FSDP2Config:
    """Composer's FSDP2 settings (``fully_shard``), with its field names and defaults."""

    device_mesh: Any = None
    reshard_after_forward: bool | int = True
    activation_checkpointing: bool = False
    activation_cpu_offload: bool = False
    state_dict_type: str = "sharded"
    load_monolith_rank0_only: bool = False
    mixed_precision: str = "DEFAULT"
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.device_mesh is not None:
            raise ValueError(_MESH_MESSAGE)


@dataclass
class TPConfig:
    """Composer's tensor-parallel settings: how many ranks split each layer of the plan, and how."""

    device_mesh: Any = None
    tensor_parallel_degree: int = 1
    layer_plan: Any = None


@dataclass
class ParallelismConfig:
    """Composer's ``parallelism_config``: the FSDP settings and the tensor-parallel ones."""

    fsdp: FSDPConfig | FSDP2Config | dict | None = None
    tp: TPConfig | dict | None = field(default=None)


def as_fsdp_dict(config: Any) -> Any:
    """An ``FSDPConfig`` or ``FSDP2Config`` as the ``fsdp_config`` dict of the fields it sets away
    from the defaults; anything else as it is (a dict is checked where it is used)."""
    if not isinstance(config, (FSDPConfig, FSDP2Config)):
        return config
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if getattr(config, f.name) != f.default}
    if isinstance(config, FSDP2Config):  # its default layout is sharded, and no resharding is SHARD_GRAD_OP
        settings["state_dict_type"] = config.state_dict_type
        if settings.pop("reshard_after_forward", True) is False:
            settings["sharding_strategy"] = "SHARD_GRAD_OP"
    return settings
