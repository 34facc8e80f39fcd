"""Algorithms: changes to the training step, passed as ``Trainer(algorithms=[...])``
(the base class is :class:`lockstep.core.Algorithm`).

lockstep has Composer's ``GradientClipping`` and ``EMA``. The rest of Composer's algorithm library (model
surgery, data augmentation, regularization) is out of its scope: importing one of those names
is an ImportError that says so and names what to use instead.
"""

from typing import Any

from lockstep.algorithms.ema import EMA
from lockstep.algorithms.gradient_clipping import GradientClipping
from lockstep.core.algorithm import Algorithm

__all__ = ["EMA", "Algorithm", "GradientClipping"]

_INSTEAD = {
    "LabelSmoothing": "torch.nn.CrossEntropyLoss(label_smoothing=...) in your model's loss",
    "ChannelsLast": "model.to(memory_format=torch.channels_last) before the Trainer",
    "LowPrecisionLayerNorm": "precision='amp_bf16', under which LayerNorm runs in low precision",
    "LowPrecisionGroupNorm": "precision='amp_bf16'",
    "SWA": "torch.optim.swa_utils.AveragedModel in a callback",
    "LayerFreezing": "requires_grad_(False) on the layers, with find_unused_parameters=True",
    "StochasticDepth": "torchvision.ops.StochasticDepth in your model",
    "CutOut": "a torchvision transform in your dataset", "CutMix": "torchvision.transforms.v2.CutMix",
    "MixUp": "torchvision.transforms.v2.MixUp", "RandAugment": "torchvision.transforms.RandAugment",
    "AugMix": "torchvision.transforms.AugMix",
}
_COMPOSERS = ("Alibi", "AugmentAndMixTransform", "AugMix", "BlurPool", "ChannelsLast", "ColOut", "ColOutTransform",
              "CutMix", "CutOut", "Factorize", "GatedLinearUnits", "GhostBatchNorm", "GyroDropout",
              "LabelSmoothing", "LayerFreezing", "LowPrecisionGroupNorm", "LowPrecisionLayerNorm", "MixUp", "NoOpModel",
              "ProgressiveResizing", "RandAugment", "RandAugmentTransform", "SAM", "SWA", "SelectiveBackprop",
              "SeqLengthWarmup", "SqueezeExcite", "StochasticDepth", "WeightStandardization")


def __getattr__(name: str) -> Any:
    if name in _COMPOSERS:
        instead = _INSTEAD.get(name, "a callback or a change to your model or data")
        raise ImportError(f"{name} is one of Composer's algorithms, which lockstep does not have (it has "
                          f"GradientClipping and EMA): use {instead}")
    raise AttributeError(f"module 'lockstep.algorithms' has no attribute {name!r}")
