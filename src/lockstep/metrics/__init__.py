"""Composer's metrics at Composer's ``composer.metrics`` path: torchmetrics ``Metric`` objects, so
their states reduce over ranks when computed."""

from lockstep.metrics.metrics import CrossEntropy, Dice, LossMetric, MIoU
from lockstep.metrics.nlp import BinaryF1Score, LanguageCrossEntropy, LanguagePerplexity, MaskedAccuracy

__all__ = ["MIoU", "Dice", "CrossEntropy", "LossMetric", "BinaryF1Score", "LanguageCrossEntropy",
           "MaskedAccuracy", "LanguagePerplexity"]
