"""Composer's ``composer.functional`` path: the functional forms of Composer's algorithms.

lockstep has two of Composer's algorithms, ``GradientClipping`` and ``EMA``, as algorithms
(:mod:`lockstep.algorithms`) and not as functions; the rest of Composer's algorithm library is out
of its scope. Importing one of the functions here is an ImportError that says so and names the
nearest thing lockstep or torch has.
"""

from typing import Any

_INSTEAD = {
    "apply_gradient_clipping": "lockstep.algorithms.GradientClipping (Trainer(algorithms=[...])), or "
                               "torch.nn.utils.clip_grad_norm_ / clip_grad_value_",
    "compute_ema": "lockstep.algorithms.EMA (Trainer(algorithms=[...])), or torch.optim.swa_utils.AveragedModel",
    "smooth_labels": "torch.nn.CrossEntropyLoss(label_smoothing=...) in your model's loss",
    "apply_channels_last": "model.to(memory_format=torch.channels_last) before the Trainer",
    "apply_low_precision_layernorm": "precision='amp_bf16'",
    "apply_low_precision_groupnorm": "precision='amp_bf16'",
    "apply_stochastic_depth": "torchvision.ops.StochasticDepth in your model",
    "freeze_layers": "requires_grad_(False) on the layers, with find_unused_parameters=True",
    "cutmix_batch": "torchvision.transforms.v2.CutMix", "mixup_batch": "torchvision.transforms.v2.MixUp",
    "randaugment_image": "torchvision.transforms.RandAugment", "augmix_image": "torchvision.transforms.AugMix",
    "cutout_batch": "a torchvision transform in your dataset",
}
_COMPOSERS = ("apply_alibi", "augmix_image", "apply_blurpool", "apply_channels_last", "colout_batch", "compute_ema",
              "cutmix_batch", "cutout_batch", "apply_factorization", "apply_gated_linear_units",
              "apply_ghost_batchnorm", "apply_gradient_clipping", "apply_low_precision_layernorm",
              "apply_low_precision_groupnorm", "smooth_labels", "freeze_layers", "mixup_batch", "resize_batch",
              "randaugment_image", "should_selective_backprop", "select_using_loss", "set_batch_sequence_length",
              "apply_squeeze_excite", "apply_stochastic_depth", "apply_weight_standardization", "apply_gyro_dropout")

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    if name in _COMPOSERS:
        instead = _INSTEAD.get(name, "a change to your model or data (lockstep has no functional algorithms)")
        raise ImportError(f"lockstep.functional.{name} is one of Composer's functional algorithms, which lockstep "
                          f"does not have: use {instead}")
    raise AttributeError(f"module 'lockstep.functional' has no attribute {name!r}")
