"""DeepSpeed ZeRO's state given by the ranks that trained to an engine built anew over more ranks,
for ranks that join a running elastic job while none was lost.

Every optimizer partition is then still on a rank that trained, so the job need not go back to its
last checkpoint. Each of those ranks sends what its checkpoint file would hold (the fp32 master
partition and the base optimizer's state of it, the loss scaler's) and the lowest one the model's
weights (ZeRO-1/2, where every rank holds them whole) or the parameters' shapes and the buffers
(ZeRO-3); every rank of the new group then cuts its partition of the new engine from them as from a
checkpoint saved by the old number of ranks (:mod:`lockstep.checkpoint.deepspeed_reshard`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

PEERS = Path("<the partitions of the ranks that trained>")
"""What an error of state taken from peers names where a checkpoint's path would be."""


def _cpu(state: Any) -> Any:
    """``state`` with every tensor copied to the CPU (the engine that holds them is taken down)."""
    return pytree.tree_map(lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v, state)


def held(engine: Any, stage: int, place: int) -> dict[str, Any]:
    """What this rank, ``place`` in the engine's partitioning, holds: its optimizer partition (as
    its checkpoint file would have it); from place 0 also the model's state (ZeRO-1/2: its weights;
    ZeRO-3: the parameters' shapes and the buffers)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE, CLIP_GRAD, DS_VERSION, FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT,
        SINGLE_PARTITION_OF_FP32_GROUPS)
    from deepspeed.git_version_info import version

    optimizer = engine.optimizer
    part: dict[str, Any] = {LOSS_SCALER: optimizer.loss_scaler, "dynamic_loss_scale": optimizer.dynamic_loss_scale,
                            "overflow": optimizer.overflow}
    states = None
    if stage == 3:  # what ZeRO-3's state_dict() holds, without its questions to the (abandoned) process group
        optimizer._set_fp32_optimizer_param_groups()
        try:
            part[OPTIMIZER_STATE_DICT] = _cpu(optimizer.optimizer.state_dict())
        finally:
            optimizer._clear_fp32_optimizer_param_groups()
        part[FP32_FLAT_GROUPS] = _cpu(list(optimizer.fp32_partitioned_groups_flat))
        if place == 0:
            states = {"param_shapes": engine._get_zero_param_shapes(), "module": _cpu(dict(engine.module.named_buffers()))}
    else:
        base = optimizer._get_base_optimizer_state() if optimizer.elastic_checkpoint else optimizer.optimizer.state_dict()
        masters = optimizer._get_groups_without_padding(optimizer.single_partition_of_fp32_groups)
        part.update({CLIP_GRAD: optimizer.clip_grad, DS_VERSION: version, BASE_OPTIMIZER_STATE: _cpu(base),
                     SINGLE_PARTITION_OF_FP32_GROUPS: _cpu(masters)})
        if place == 0:
            states = {"module": _cpu(engine.module.state_dict())}
    return {"place": place, "part": part, "states": states}


def load(engine: Any, stage: int, held_by_rank: list[dict[str, Any] | None]) -> None:
    """Cut this rank's partition of ``engine`` (new, over the larger world) from what every rank
    of the new group sent (:func:`held`; None from a rank that joined)."""
    from lockstep.checkpoint import deepspeed_reshard

    parts = sorted((h for h in held_by_rank if h is not None), key=lambda h: h["place"])
    saved, states = [h["part"] for h in parts], parts[0]["states"]
    if stage == 3:
        deepspeed_reshard.cut_stage3(engine, states, saved, PEERS, strict=True)
        return
    engine.module.load_state_dict(states["module"])  # the buffers; the weights follow from the masters
    deepspeed_reshard.cut_stage12(engine, saved)
    # a change that ended the step's gather of the updated weights left some of place 0's as they were
    engine.optimizer.update_lp_params()
