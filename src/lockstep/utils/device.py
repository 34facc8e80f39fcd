"""Composer's ``get_device``: a :class:`~lockstep.devices.Device` from a name, or the best available."""

from __future__ import annotations

import torch

from lockstep.devices import Device, DeviceCPU, DeviceGPU


def get_device(device: str | Device | None = None) -> Device:
    """``'cpu'`` or ``'gpu'`` as a Device (a Device is returned as it is); None: the GPU when CUDA
    is available, else the CPU."""
    if isinstance(device, Device):
        return device
    if device is None:
        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return DeviceCPU()
    if device == "gpu":
        return DeviceGPU()
    raise ValueError(f"device={device!r}: give 'cpu', 'gpu' or a lockstep.devices.Device "
                     f"(lockstep runs on CPUs and CUDA GPUs)")
