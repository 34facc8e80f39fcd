"""Composer's ``composer.devices``: where a run's tensors live. The Trainer takes one as
``device=`` as well as ``'cpu'``/``'gpu'``."""

from lockstep.devices.device import Device, DeviceCPU, DeviceGPU

__all__ = ["Device", "DeviceCPU", "DeviceGPU"]
