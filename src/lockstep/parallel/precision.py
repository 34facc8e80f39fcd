"""Precision: the autocast context and the GradScaler for 'fp32' | 'amp_bf16' | 'amp_fp16'."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
_DTYPES = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}
NULL_CONTEXT = contextlib.nullcontext()
"""One do-nothing context for every microbatch (``nullcontext`` may be entered again and again)."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision autocast for forward and loss; nothing for fp32."""
    if precision == "fp32":
        return NULL_CONTEXT
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients can underflow, so amp_fp16 scales the loss; bf16 has fp32's range and needs none."""
    if precision != "amp_fp16":
        return None
    return torch.amp.GradScaler(device.type)
