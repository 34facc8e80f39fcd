"""Composer's ``Precision`` names and ``get_precision_context``, at ``lockstep.core``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lockstep.core.types import StringEnum


class Precision(StringEnum):
    """The numerical precision of training: ``Trainer(precision=Precision.AMP_BF16)`` is
    ``precision='amp_bf16'``."""

    FP32 = "fp32"
    AMP_FP16 = "amp_fp16"
    AMP_BF16 = "amp_bf16"
    AMP_FP8 = "amp_fp8"


def precision_name(precision: Any) -> Any:
    """A :class:`Precision` as its plain name (``'amp_bf16'``); anything else as it is, to be checked."""
    return precision.value if isinstance(precision, Precision) else precision


_DTYPES = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}


@contextlib.contextmanager
def get_precision_context(precision: str | Precision, precision_config: dict[str, Any] | None = None,
                          fp8_autocast_enabled: bool = True) -> Iterator[None]:
    """Autocast to ``precision`` inside the block, on CUDA when it is there, else on the CPU (as the
    Trainer does on either); for fp32, no autocast, even inside an enclosing one. ``amp_fp8`` needs NVIDIA's Transformer Engine,
    which lockstep does not use: a ValueError."""
    try:
        chosen = Precision(precision)
    except ValueError:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(p.value for p in Precision)}") from None
    if chosen is Precision.AMP_FP8:
        raise ValueError("precision='amp_fp8' needs NVIDIA's Transformer Engine, which lockstep does not use; "
                         "use 'amp_bf16'")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if chosen is Precision.FP32:  # also inside an autocast block: fp32 here
        with torch.autocast(device_type=device, enabled=False):
            yield
        return
    with torch.autocast(device_type=device, dtype=_DTYPES[chosen]):
        yield
