"""DTensor checks that never import DTensor.

``torch.distributed.tensor`` costs a process about 0.6 s of CPU to import (it imports sympy), and
a job that shards nothing (DDP, DeepSpeed) never needs it. No DTensor can exist before that module
is imported, so a value is a DTensor only if the module is loaded and says so.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_dtensor", "local"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``, without importing it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local(value: Any) -> Any:
    """This rank's part of a DTensor (``to_local()``); any other value as it is."""
    return value.to_local() if is_dtensor(value) else value
