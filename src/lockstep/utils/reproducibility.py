"""Composer's ``composer.utils.reproducibility``: seeding, deterministic mode, and the RNG state of
every rank in Composer's form (lockstep's own checkpoints use :mod:`lockstep.rng`)."""

from __future__ import annotations

import contextlib
import os
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lockstep import dist
from lockstep.rng import seed_everything

__all__ = ["MAX_SEED", "configure_deterministic_mode", "get_random_seed", "get_rng_state", "load_rng_state",
           "seed_all", "seed_context"]

MAX_SEED = 2**32 - 1
"""Seeds are 32-bit unsigned integers."""


def seed_all(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (every CUDA device's too)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed} is out of range: give an int in [0, 2**32 - 1]")
    seed_everything(seed)


def get_random_seed() -> int:
    """A seed drawn from the clock, not from the seeded generators (not cryptographically secure)."""
    return random.Random(time.time_ns()).randint(0, MAX_SEED)


def configure_deterministic_mode() -> None:
    """Make torch pick deterministic kernels (and fail on ops that have none), as Composer's
    ``deterministic_mode`` does. Slower: for tests and debugging. On a GPU, call it before CUDA
    is used."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS is deterministic only with this


def get_rng_state() -> list[dict[str, Any]]:
    """Every rank's generator states (python, numpy, torch, CUDA when in use), indexed by rank: a
    collective."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return dist.all_gather_object(state)


def load_rng_state(rng_state_dicts: list[dict[str, Any]]) -> None:
    """Restore this rank's entry of :func:`get_rng_state`'s list (a warning if the world size differs)."""
    world, rank = dist.get_world_size(), dist.get_global_rank()
    if world != len(rng_state_dicts):
        warnings.warn(f"the RNG state holds {len(rng_state_dicts)} ranks and this run has {world}: ranks "
                      f"beyond {len(rng_state_dicts) - 1} keep their generators as they are", stacklevel=2)
    if rank >= len(rng_state_dicts):
        return
    state = rng_state_dicts[rank]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def seed_context(seed: int) -> Iterator[None]:
    """Seed every generator for the block, then put their states back."""
    state = get_rng_state()
    seed_all(seed)
    try:
        yield
    finally:
        load_rng_state(state)
