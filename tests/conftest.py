"""Shared test isolation, and the order tests are handed to the workers in."""

from collections.abc import Iterator

import pytest
import torch.distributed as torch_dist


@pytest.fixture(autouse=True)
def _no_process_group_leaks() -> Iterator[None]:
    """Tear down a process group a single-process test created, so the next test starts without one."""
    yield
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None and marker.args else 0.0


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules whose tests are given the longest timeouts (the long multi-process runs) first: the
    workers (``-n``) take tests in this order, and a long test taken last keeps one worker busy
    while the others have nothing left. A module's tests stay together, so a fixture it shares
    between them is made once per worker."""
    longest: dict[str, float] = {}
    for item in items:
        longest[item.nodeid.split("::")[0]] = max(longest.get(item.nodeid.split("::")[0], 0.0), _timeout(item))
    items.sort(key=lambda item: -longest[item.nodeid.split("::")[0]])  # stable: within a module, as written
