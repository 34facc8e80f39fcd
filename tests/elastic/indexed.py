"""The elastic tests' dataset: each sample carries its index, so that a log of what each step
trained shows every sample's place. Kept apart from the test modules so that the ranks of
``elastic_job.py`` import it without importing pytest."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

SAMPLES = 44  # at 4 ranks of 3: global batches of 12, 12, 12 and 8 per epoch
PER_RANK_BATCH = 3


class Indexed(Dataset):
    """Features, labels and each sample's index (which the model ignores)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i
