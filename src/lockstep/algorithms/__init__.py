"""Algorithms: changes to the training step, passed as ``Trainer(algorithms=[...])``
(the base class is :class:`lockstep.core.Algorithm`)."""

from lockstep.algorithms.gradient_clipping import GradientClipping
from lockstep.core.algorithm import Algorithm

__all__ = ["Algorithm", "GradientClipping"]
