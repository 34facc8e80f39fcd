"""Precision: the autocast context and the GradScaler for 'fp32' | 'amp_bf16' | 'amp_fp16'."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
_DTYPES = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Mixed-precision autocast for forward and loss; nothing for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_DTYPES[precision]):
        yield


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients can underflow, so amp_fp16 scales the loss; bf16 has fp32's range and needs none."""
    if precision != "amp_fp16":
        return None
    return torch.amp.GradScaler(device.type)
