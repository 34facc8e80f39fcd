"""Composer's ready-made models for common tasks, at Composer's ``composer.models.tasks`` path."""

from lockstep.models.tasks.classification import ComposerClassifier

__all__ = ["ComposerClassifier"]
