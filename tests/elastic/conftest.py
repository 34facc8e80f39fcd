"""The uninterrupted run every elastic test compares with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.elastic.jobs import Reference, finish, global_batches, launch
from tests.helpers import shared_run


def _reference(out: Path) -> Reference:
    finish(launch(out, launcher=("-n", "4")))
    return torch.load(out / "params.pt", weights_only=True), global_batches(out)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run: 4 ranks under DDP, no --min_ranks (made once for every worker)."""
    return shared_run(tmp_path_factory, "elastic-reference", _reference)
