"""Gradient clipping, once per optimizer step, on the gradients every rank agrees on.

``'norm'`` scales all gradients together so that their norm over every rank and shard is at most
the threshold: the same parameters as one process calling ``torch.nn.utils.clip_grad_norm_``,
under DDP, FSDP and any microbatch split. Under DeepSpeed the engine clips: ``'norm'`` becomes
``deepspeed_config['gradient_clipping']`` (see :func:`for_deepspeed`). ``'value'`` clamps each
element. ``'adaptive'`` (adaptive gradient clipping, Brock et al. 2021) scales each output unit's
gradient so that its norm is at most ``threshold`` times that unit's weight norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lockstep.checks import check_choice
from lockstep.core.algorithm import Algorithm
from lockstep.core.event import Event

if TYPE_CHECKING:
    from lockstep.state import State

CLIPPING_TYPES = ("norm", "value", "adaptive")


class GradientClipping(Algorithm):
    """Clip gradients after the last microbatch's backward and before the optimizer step."""

    def __init__(self, clipping_type: str, clipping_threshold: float) -> None:
        check_choice("clipping_type", clipping_type, CLIPPING_TYPES)
        if isinstance(clipping_threshold, bool) or not isinstance(clipping_threshold, (int, float)) \
                or not math.isfinite(clipping_threshold) or clipping_threshold <= 0:
            raise ValueError(f"clipping_threshold must be a finite number > 0, got {clipping_threshold!r}")
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)

    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Any = None) -> None:
        strategy = state.strategy
        if self.clipping_type == "norm":
            strategy.clip_gradients_norm(self.clipping_threshold)
        elif self.clipping_type == "value":
            strategy.clip_gradients_value(self.clipping_threshold)
        else:
            strategy.clip_gradients_adaptive(self.clipping_threshold)

    def __repr__(self) -> str:
        return f"GradientClipping(clipping_type={self.clipping_type!r}, clipping_threshold={self.clipping_threshold})"


def for_deepspeed(config: Mapping[str, Any] | None,
                  algorithms: Sequence[Algorithm]) -> tuple[Mapping[str, Any] | None, list[Algorithm]]:
    """Under DeepSpeed the engine clips by norm: fold a ``'norm'`` GradientClipping into the
    config's ``gradient_clipping`` and drop it from the algorithms the Trainer runs."""
    clippers = [a for a in algorithms if isinstance(a, GradientClipping)]
    if config is None or not clippers:
        return config, list(algorithms)
    if len(clippers) > 1:
        raise ValueError("algorithms holds more than one GradientClipping: pass one")
    clipper = clippers[0]
    if clipper.clipping_type != "norm":
        raise ValueError(f"under DeepSpeed the engine clips gradients by their norm only, so "
                         f"GradientClipping(clipping_type={clipper.clipping_type!r}) cannot run: use "
                         f"clipping_type='norm'")
    if "gradient_clipping" in config:
        raise ValueError(f"both deepspeed_config['gradient_clipping']={config['gradient_clipping']!r} and "
                         f"GradientClipping(clipping_type='norm') were given: keep one of them")
    return {**config, "gradient_clipping": clipper.clipping_threshold}, [a for a in algorithms if a is not clipper]
