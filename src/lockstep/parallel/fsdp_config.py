"""``fsdp_config``: the user's dict -> a checked :class:`FSDPConfig`, and its mixed-precision dtypes.

Every key and value is checked before any process group or module is touched, so a typo fails at
``Trainer(...)`` with the valid choices listed, not minutes into a run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.checks import check_choice, check_keys

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
MIXED_PRECISIONS = ("FULL", "DEFAULT", "PURE")
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST", "NONE")
STATE_DICT_TYPES = ("full", "local", "sharded")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MP_DICT_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")
_AUTOCAST_DTYPES = {"fp32": torch.float32, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}
PROCESS_GROUP_HELP = "'self', 'node', 'local_rank_across_nodes', 'setK' or 'modK' (K an integer)"
_GROUP_PATTERN = re.compile(r"(set|mod)([1-9][0-9]*)")

MixedPrecisionSpec = str | Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Precision:
    """The dtypes FSDP uses: parameters in forward/backward, gradient reduction, buffers."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    buffer_dtype: torch.dtype


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """The keys of ``fsdp_config`` (seed 001's spec, with ``cpu_offload`` and ``HYBRID_SHARD`` working)."""

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD (parameters, gradients and optimizer state sharded; parameters re-gathered for
    backward), SHARD_GRAD_OP (parameters stay gathered between forward and backward), NO_SHARD
    (replicated, like DDP), HYBRID_SHARD (sharded within a node, replicated across nodes)."""
    min_params: float = 1e8
    """A module holding at least this many parameters not already in a wrapped submodule is wrapped."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory; the step runs on CPU."""
    mixed_precision: MixedPrecisionSpec = "DEFAULT"
    """FULL | DEFAULT | PURE (dtypes from the Trainer's precision), or a dict of
    param_dtype/reduce_dtype/buffer_dtype as 'fp32' | 'fp16' | 'bf16'."""
    backward_prefetch: str = "BACKWARD_POST"
    """Gather the next unit's parameters when a unit's backward starts (BACKWARD_PRE), once its
    gradients are computed (BACKWARD_POST), or not ahead at all (NONE)."""
    activation_checkpointing: bool = False
    """Recompute the activations of the modules the activation-checkpointing rules select."""
    activation_cpu_offload: bool = False
    """Keep the saved activations of those modules in CPU memory until backward."""
    verbose: bool = False
    """Rank 0 prints each wrapped module and its settings."""
    state_dict_type: str = "full"
    """full: rank 0 writes one file; local: each rank writes its shards ({rank} in save_filename);
    sharded: a torch.distributed.checkpoint folder that loads at any world size."""
    data_parallel_shard_degree: int = -1
    """How many ranks each parameter is sharded over (-1: the ranks the other degrees leave)."""
    data_parallel_replicate_degree: int | None = None
    """How many replicas of the sharded model train side by side (HSDP); None: one."""

    def __post_init__(self) -> None:
        _check_choice("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        if isinstance(self.min_params, bool) or not isinstance(self.min_params, (int, float)) or self.min_params < 0:
            raise ValueError(f"fsdp_config['min_params'] must be a number >= 0, got {self.min_params!r}")
        for name in ("cpu_offload", "activation_checkpointing", "activation_cpu_offload", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fsdp_config[{name!r}] must be True or False, got {getattr(self, name)!r}")
        check_mixed_precision(self.mixed_precision, "fsdp_config['mixed_precision']")
        _check_choice("backward_prefetch", self.backward_prefetch, BACKWARD_PREFETCHES)
        _check_choice("state_dict_type", self.state_dict_type, STATE_DICT_TYPES)
        if self.explicit_mesh and self.sharding_strategy == "NO_SHARD":
            raise ValueError("fsdp_config sets data_parallel_shard_degree or data_parallel_replicate_degree, "
                             "which shard the model, but sharding_strategy is NO_SHARD: drop one of them")

    @property
    def explicit_mesh(self) -> bool:
        """Whether the config gives the data-parallel degrees (Composer's mesh) rather than a strategy's."""
        return self.data_parallel_shard_degree != -1 or self.data_parallel_replicate_degree is not None


def parse_config(config: Mapping[str, Any]) -> FSDPConfig:
    """Check the user's ``fsdp_config`` dict; an unknown key is an error listing the valid ones."""
    if not isinstance(config, Mapping):
        raise TypeError(f"fsdp_config must be a dict, got {type(config).__name__}")
    check_keys("fsdp_config", config, [f.name for f in dataclasses.fields(FSDPConfig)])
    return FSDPConfig(**config)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    check_choice(f"fsdp_config[{name!r}]", value, choices)


def check_mixed_precision(spec: Any, where: str) -> None:
    if isinstance(spec, str):
        if spec.upper() not in MIXED_PRECISIONS:
            check_choice(where, spec, MIXED_PRECISIONS, also=f" or a dict of {', '.join(_MP_DICT_KEYS)}")
        return
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a string or a dict, got {type(spec).__name__}")
    check_keys(where, spec, _MP_DICT_KEYS)
    for key, value in spec.items():
        check_choice(f"{where}[{key!r}]", value, DTYPES)


def resolve_precision(spec: MixedPrecisionSpec, trainer_precision: str) -> Precision:
    """Seed 001's table: FULL is fp32 throughout; DEFAULT casts parameters and buffers to the
    autocast dtype and reduces in fp32; PURE also reduces in the autocast dtype. A dict gives the
    dtypes outright (missing keys are fp32)."""
    if not isinstance(spec, str):
        dtypes = {k: DTYPES[spec.get(k, "fp32")] for k in _MP_DICT_KEYS}
        return Precision(**dtypes)
    low = _AUTOCAST_DTYPES[trainer_precision]
    full = torch.float32
    mode = spec.upper()
    if mode == "FULL":
        return Precision(full, full, full)
    if mode == "DEFAULT":
        return Precision(low, full, low)
    return Precision(low, low, low)


def check_process_group(spec: Any, world_size: int, local_world_size: int) -> tuple[str, int]:
    """A per-module ``process_group`` -> ('set', K) or ('mod', K). 'self' is set1, 'node' is
    set{local_world_size}, 'local_rank_across_nodes' is mod{local_world_size}."""
    aliases = {"self": "set1", "node": f"set{local_world_size}",
               "local_rank_across_nodes": f"mod{local_world_size}"}
    text = aliases.get(spec, spec) if isinstance(spec, str) else None
    match = _GROUP_PATTERN.fullmatch(text) if text is not None else None
    if match is None:
        raise ValueError(f"process_group={spec!r} is not supported; use {PROCESS_GROUP_HELP}")
    kind, k = match.group(1), int(match.group(2))
    if world_size % k:
        raise ValueError(f"process_group={spec!r} needs a world size divisible by {k}, but the world "
                         f"size is {world_size}")
    return kind, k
