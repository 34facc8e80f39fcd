"""Small helpers Composer scripts import from ``composer.utils``."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from lockstep.batch import ensure_tuple

__all__ = ["ensure_tuple", "get_free_tcp_port", "is_model_fsdp", "map_collection", "model_eval_mode"]




def map_collection(collection: Any, map_fn: Callable[[Any], Any]) -> Any:
    """``map_fn`` applied to each element of a list, tuple or dict (values), or to ``collection`` itself."""
    if isinstance(collection, (list, tuple)):
        return type(collection)(map_fn(x) for x in collection)
    if isinstance(collection, dict):
        return {k: map_fn(v) for k, v in collection.items()}
    return map_fn(collection)


@contextlib.contextmanager
def model_eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def get_free_tcp_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def is_model_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is sharded with FSDP (FSDP2's ``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
