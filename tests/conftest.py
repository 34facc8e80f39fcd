"""Shared test isolation."""

from collections.abc import Iterator

import pytest
import torch.distributed as torch_dist


@pytest.fixture(autouse=True)
def _no_process_group_leaks() -> Iterator[None]:
    """Tear down a process group a single-process test created, so the next test starts without one."""
    yield
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
