"""Devices with Composer's interface: move modules, tensors, batches and optimizer state."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
from torch import nn

from lockstep.batch import map_tensors

M = TypeVar("M", bound=nn.Module)


class Device:
    """Where tensors live: :attr:`dist_backend` for collectives, and the moves Composer's devices make."""

    dist_backend = ""
    name = ""
    _device: torch.device

    def module_to_device(self, module: M) -> M:
        return module.to(self._device)

    def tensor_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=self._device.type == "cuda")

    def batch_to_device(self, batch: Any) -> Any:
        """``batch`` with every tensor in it (nested in lists, tuples, dicts) on this device."""
        return map_tensors(batch, self.tensor_to_device)

    def optimizer_to_device(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Move the optimizer's state tensors to this device, in place."""
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = self.tensor_to_device(value)
        return optimizer

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` this stands for."""
        return self._device

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        """Equal to a Device or a ``torch.device`` (or its string) that stands for the same place."""
        if isinstance(other, Device):
            return self._device == other._device
        if isinstance(other, (torch.device, str)):
            try:
                return self._device == torch.device(other)
            except RuntimeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._device)


class DeviceCPU(Device):
    """The CPU (collectives over gloo)."""

    dist_backend = "gloo"
    name = "cpu"

    def __init__(self) -> None:
        self._device = torch.device("cpu")


class DeviceGPU(Device):
    """A CUDA device (collectives over NCCL): ``device_id``, or this process's local rank's GPU.
    ``allow_tf32`` sets torch's TF32 switches for matmuls and cuDNN, as Composer does."""

    dist_backend = "nccl"
    name = "gpu"

    def __init__(self, device_id: int | None = None, *, allow_tf32: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("DeviceGPU needs a CUDA device, and torch sees none: use DeviceCPU() or device='cpu'")
        if device_id is None:
            device_id = int(os.environ.get("LOCAL_RANK", "0"))
        self._device = torch.device("cuda", device_id)
        torch.cuda.set_device(self._device)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32


def as_device(device: Device | str | torch.device | None) -> Device:
    """``device`` as a Device: a Device as it is; ``'cpu'``, ``'gpu'``, ``'cuda[:i]'`` or a
    ``torch.device``; None is the GPU of this local rank when CUDA is available, else the CPU.
    Unlike ``DeviceGPU()``, turning an existing ``torch.device`` into one changes no CUDA setting."""
    if isinstance(device, Device):
        return device
    if device is None:
        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "gpu":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: give 'cpu', 'gpu' or a lockstep.devices.Device") from None
    kind = {"cpu": DeviceCPU, "cuda": DeviceGPU}.get(place.type)
    if kind is None:
        raise ValueError(f"device={device!r}: lockstep runs on CPUs and CUDA GPUs ('cpu' or 'gpu')")
    made = kind.__new__(kind)
    made._device = place
    return made
