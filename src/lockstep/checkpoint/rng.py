"""Every random number generator a training step can draw from, captured in a form that
``torch.load(weights_only=True)`` accepts (tensors, ints, floats, lists) and restored exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RNGState = dict[str, Any]


def capture() -> RNGState:
    """Python's, numpy's, torch's CPU and (when initialised) every CUDA device's generator state."""
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: RNGState = {
        # a tensor, not a list of 625 ints: the weights_only unpickler is slow per Python object
        "python": [version, torch.tensor(mt, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: RNGState) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt.tolist()), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            raise ValueError(f"the checkpoint holds {len(cuda_states)} CUDA generator states but this "
                             f"process sees {torch.cuda.device_count()} devices")
        torch.cuda.set_rng_state_all(cuda_states)
