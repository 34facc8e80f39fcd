"""Composer's ``Initializer``: named weight-initialization schemes, each a function applied to a
module (``model.apply(Initializer.KAIMING_NORMAL.get_initializer())``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lockstep.core.types import StringEnum

_WEIGHTED = (nn.Linear, nn.Conv2d)


def _on_weights(init: Callable[[torch.Tensor], object]) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if isinstance(module, _WEIGHTED):
            init(module.weight)
    return apply


def _batchnorm(weight: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.weight.copy_(weight(module.weight))
                module.bias.zero_()
    return apply


def _log_constant_bias(module: nn.Module) -> None:
    """A Linear's bias set to -log(out_features): uniform outputs after a softmax."""
    if isinstance(module, nn.Linear) and module.bias is not None:
        with torch.no_grad():
            module.bias.fill_(-math.log(module.bias.shape[0]))


class Initializer(StringEnum):
    """A weight-initialization scheme by name; :meth:`get_initializer` gives the function to
    ``model.apply``. Schemes for weights act on Linear and Conv2d layers, ``bn_*`` on BatchNorm2d."""

    KAIMING_NORMAL = "kaiming_normal"
    KAIMING_UNIFORM = "kaiming_uniform"
    BN_UNIFORM = "bn_uniform"
    BN_ONES = "bn_ones"
    XAVIER_UNIFORM = "xavier_uniform"
    XAVIER_NORMAL = "xavier_normal"
    LINEAR_LOG_CONSTANT_BIAS = "linear_log_constant_bias"

    def get_initializer(self) -> Callable[[nn.Module], None]:
        """The function that initializes one module (pass it to ``nn.Module.apply``)."""
        return {
            Initializer.KAIMING_NORMAL: _on_weights(nn.init.kaiming_normal_),
            Initializer.KAIMING_UNIFORM: _on_weights(nn.init.kaiming_uniform_),
            Initializer.XAVIER_UNIFORM: _on_weights(nn.init.xavier_uniform_),
            Initializer.XAVIER_NORMAL: _on_weights(nn.init.xavier_normal_),
            Initializer.BN_ONES: _batchnorm(torch.ones_like),
            Initializer.BN_UNIFORM: _batchnorm(lambda w: torch.rand(w.shape, dtype=w.dtype, device=w.device)),
            Initializer.LINEAR_LOG_CONSTANT_BIAS: _log_constant_bias,
        }[self]
