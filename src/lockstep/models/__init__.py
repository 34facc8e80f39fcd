"""Models at Composer's ``composer.models`` path: ``ComposerModel`` (the same class as
:class:`lockstep.Model`), ``ComposerClassifier``, ``HuggingFaceModel`` and
``write_huggingface_pretrained_from_composer_checkpoint``.

All but ``ComposerModel`` are imported on first use, so that ``import lockstep.models`` (and
``lockstep.ComposerModel``) imports neither torchmetrics nor transformers. The checkpoint
converter lives with the checkpoint code (:mod:`lockstep.checkpoint.huggingface`, a layer above
this package's) and is only named here, at Composer's path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lockstep.models.base import ComposerModel

if TYPE_CHECKING:
    from lockstep.models.huggingface import HuggingFaceModel
    from lockstep.models.initializers import Initializer
    from lockstep.models.tasks.classification import ComposerClassifier

# public name -> module that defines it
_LAZY = {"ComposerClassifier": "lockstep.models.tasks.classification",
         "Initializer": "lockstep.models.initializers",
         "HuggingFaceModel": "lockstep.models.huggingface",
         "write_huggingface_pretrained_from_composer_checkpoint": "lockstep.checkpoint.huggingface"}

__all__ = ["ComposerModel", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'lockstep.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
