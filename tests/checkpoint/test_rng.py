"""RNG capture and restore: every generator comes back exactly, through a weights_only file."""

from __future__ import annotations

import random

import numpy as np
import torch

from lockstep import rng


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3).tolist()


def _reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_every_generator_resumes_exactly_through_a_file(tmp_path) -> None:
    _reseed(3)
    random.gauss(0, 1), np.random.randn()  # both keep a cached second normal
    torch.save(rng.capture(), tmp_path / "rng.pt")
    expected = _draws()
    _reseed(9)
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


def test_states_saved_before_packing_still_restore() -> None:
    _reseed(4)
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    old = {"python": [version, torch.tensor(mt, dtype=torch.int64), gauss],
           "numpy": [kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
           "torch": torch.get_rng_state()}
    expected = _draws()
    _reseed(9)
    rng.restore(old)
    assert _draws() == expected
