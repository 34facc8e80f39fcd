"""Helpers the tests share: free ports, bitwise comparison of parameters, a Trainer's weights."""

from __future__ import annotations

import socket
from typing import Any

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same names, and every tensor equal bit for bit."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def trainer_params(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of the Trainer's model state, to compare after it trains on."""
    return {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
