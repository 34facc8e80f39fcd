"""lockstep: data-parallel PyTorch training — a launcher, ``lockstep.dist`` and a Trainer.

Public names are imported lazily so that the ``lockstep`` launcher, and worker bootstraps, start
without paying for ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.9.0"

# public name -> module that defines it
_LAZY = {
    "dist": "lockstep.dist",
    "testing": "lockstep.testing",
    "Trainer": "lockstep.trainer.trainer",
    "State": "lockstep.state",
    "Model": "lockstep.model",
    "ComposerModel": "lockstep.models",
    "Callback": "lockstep.core.callback",
    "Event": "lockstep.core.event",
    "Algorithm": "lockstep.core.algorithm",
    "Evaluator": "lockstep.core.evaluator",
    "DataSpec": "lockstep.core.data_spec",
    "Logger": "lockstep.loggers.logger",
    "ensure_time": "lockstep.time",
    "Time": "lockstep.time",
    "TimeUnit": "lockstep.time",
    "Timestamp": "lockstep.time",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"lockstep.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
