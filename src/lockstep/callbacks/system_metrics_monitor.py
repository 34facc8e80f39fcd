"""SystemMetricsMonitor: CPU, memory, disk and network use of the node, and each GPU's load."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil
import torch

from lockstep import dist
from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["SystemMetricsMonitor"]

GPU_METRICS = ("gpu_percentage", "memory_percentage", "gpu_temperature_C", "gpu_power_usage_W")
"""Per GPU, read through NVML: busy time and memory-busy time (percent), temperature, power."""


class SystemMetricsMonitor(Callback):
    """Logs the node's ``cpu_percentage``, ``cpu_memory_<field>`` (psutil's virtual_memory:
    ``total``, ``available``, ``percent``, ``used``, ``free``, ...), ``disk_memory_<field>`` (of
    ``/``: ``total``, ``used``, ``free``, ``percent``) and ``network_<field>`` (``bytes_sent``,
    ``bytes_recv``, ``packets_sent``, ...) at every BATCH_START, EVAL_BATCH_START and
    PREDICT_BATCH_START.

    With a GPU (needs ``pip install nvidia-ml-py``), also :data:`GPU_METRICS` of each rank's GPU: at
    BATCH_START gathered from all ranks and logged as ``min_<name>_rank_<r>`` and
    ``max_<name>_rank_<r>``, or as ``<name>_rank_<r>`` for every rank with ``log_all_data``.
    Evaluation and prediction batches may differ in number between ranks, so there each rank
    reports only its own (no collective). Node-wide values come from the last rank gathered.
    """

    def __init__(self, log_all_data: bool = False) -> None:
        self.log_all_data = log_all_data
        self.gpu_available = torch.cuda.is_available()
        if self.gpu_available:
            try:
                import pynvml
            except ImportError:
                raise ImportError("SystemMetricsMonitor reads GPU metrics through NVML: "
                                  "pip install nvidia-ml-py") from None
            pynvml.nvmlInit()

    def batch_start(self, state: State, logger: Logger) -> None:
        logger.log_metrics(self._combine(list(enumerate(dist.all_gather_object(self.compute_system_metrics())))))

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        logger.log_metrics(self._combine([(dist.get_global_rank(), self.compute_system_metrics())]))

    def predict_batch_start(self, state: State, logger: Logger) -> None:
        self.eval_batch_start(state, logger)

    def compute_system_metrics(self) -> dict[str, float]:
        """This rank's GPU metrics (if any) and the node's CPU, memory, disk and network counters."""
        metrics: dict[str, float] = self._gpu_metrics() if self.gpu_available else {}
        metrics["cpu_percentage"] = psutil.cpu_percent()
        for prefix, values in (("cpu_memory", psutil.virtual_memory()), ("disk_memory", psutil.disk_usage(os.sep)),
                               ("network", psutil.net_io_counters())):
            metrics.update({f"{prefix}_{k}": v for k, v in values._asdict().items()})
        return metrics

    def _gpu_metrics(self) -> dict[str, float]:
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(dist.get_local_rank())
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return {"gpu_percentage": rates.gpu, "memory_percentage": rates.memory,
                "gpu_temperature_C": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "gpu_power_usage_W": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}  # mW

    def _combine(self, by_rank: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
        """Node-wide values as they are; the GPU metrics per rank, or their minimum and maximum."""
        combined: dict[str, float] = {}
        for rank, metrics in by_rank:
            for key, value in metrics.items():
                if key not in GPU_METRICS:
                    combined[key] = value
                elif self.log_all_data:
                    combined[f"{key}_rank_{rank}"] = value
        if self.gpu_available and not self.log_all_data:
            for key in GPU_METRICS:
                low = min(by_rank, key=lambda item: item[1][key])
                high = max(by_rank, key=lambda item: item[1][key])
                combined[f"min_{key}_rank_{low[0]}"] = low[1][key]
                combined[f"max_{key}_rank_{high[0]}"] = high[1][key]
        return combined
