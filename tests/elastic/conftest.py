"""The uninterrupted run every elastic test compares with."""

from __future__ import annotations

import pytest
import torch

from tests.elastic.jobs import Reference, finish, global_batches, launch


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run: 4 ranks under DDP, no --min_ranks."""
    out = tmp_path_factory.mktemp("elastic") / "reference"
    finish(launch(out, launcher=("-n", "4")))
    return torch.load(out / "params.pt", weights_only=True), global_batches(out)
