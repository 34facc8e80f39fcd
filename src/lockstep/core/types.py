"""Composer's type names at ``lockstep.core``: ``Batch``, ``Dataset``, ``JSON``, ``TrainerMode``,
and ``StringEnum`` (also at ``lockstep.utils``)."""

from __future__ import annotations

from enum import Enum
from typing import Any, Union

import torch

Batch = Any
"""Whatever a dataloader yields: a tensor, a tuple or dict of them, or anything else."""

Dataset = torch.utils.data.Dataset[Batch]

JSON = Union[str, float, int, None, list["JSON"], dict[str, "JSON"]]


class StringEnum(str, Enum):
    """An Enum of lowercase string values, as Composer's: a member equals its value
    (``TrainerMode.EVAL == 'eval'``), prints as it, and ``TrainerMode('EVAL')`` matches a name or a
    value in any case."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> StringEnum | None:
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        return None


class TrainerMode(StringEnum):
    """What the Trainer is doing: training, evaluating or predicting."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "predict"
