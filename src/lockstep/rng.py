"""Every random number generator a training step can draw from, captured in a form that
``torch.load(weights_only=True)`` accepts (tensors, ints, floats, lists) and restored exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RNGState = dict[str, Any]


def capture() -> RNGState:
    """Python's, numpy's, torch's CPU and (when initialised) every CUDA device's generator state.

    The large parts (python's and numpy's Mersenne Twister keys, torch's states) travel as one
    byte tensor: every rank's states are in each checkpoint, and the weights_only unpickler pays
    per object, so fewer objects load faster.
    """
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    # np.fromiter: a third of torch.tensor's time for 625 Python ints (a capture may run every batch)
    parts = [torch.from_numpy(np.fromiter(mt, dtype=np.int64, count=len(mt))).view(torch.uint8),
             torch.from_numpy(key.astype(np.int64)).view(torch.uint8), torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts += torch.cuda.get_rng_state_all()
    return {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)],
            "sizes": [p.numel() for p in parts], "bytes": torch.cat(parts)}


def restore(state: RNGState) -> None:
    if "bytes" not in state:
        return _restore_unpacked(state)
    mt, key, cpu, *cuda = torch.split(state["bytes"], state["sizes"])
    version, gauss = state["python"]
    random.setstate((version, tuple(mt.view(torch.int64).tolist()), gauss))
    kind, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.view(torch.int64).numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(cpu.clone())
    _restore_cuda([c.clone() for c in cuda])


def _restore_unpacked(state: RNGState) -> None:
    """Checkpoints written before the states were packed into one tensor."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt.tolist()), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    _restore_cuda(state.get("cuda", []))


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not states or not torch.cuda.is_available():
        return
    if len(states) != torch.cuda.device_count():
        raise ValueError(f"the checkpoint holds {len(states)} CUDA generator states but this "
                         f"process sees {torch.cuda.device_count()} devices")
    torch.cuda.set_rng_state_all(states)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (every CUDA device's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def from_composer(state: dict[str, Any]) -> RNGState:
    """One rank's RNG state as Composer 0.32.1 saves it (``reproducibility.get_rng_state()``:
    ``python`` as ``random.getstate()``, ``numpy`` as ``np.random.get_state()``, ``torch``, and
    ``cuda`` for the current device) in the form :func:`restore` takes."""
    try:
        version, mt, gauss = state["python"]
        kind, key, pos, has_gauss, cached = state["numpy"]
        cpu = state["torch"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not an RNG state as Composer saves it: {e}") from None
    parts = [torch.tensor(list(mt), dtype=torch.int64).view(torch.uint8),
             torch.from_numpy(np.asarray(key).astype(np.int64)).view(torch.uint8), cpu.to(torch.uint8)]
    if state.get("cuda") is not None:
        parts.append(state["cuda"])
    return {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)],
            "sizes": [p.numel() for p in parts], "bytes": torch.cat(parts)}
