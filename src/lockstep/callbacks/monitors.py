"""Monitors with Composer's names: throughput and MFU, learning rates, memory, time left."""

from __future__ import annotations

import os
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from lockstep import dist
from lockstep.core.callback import Callback
from lockstep.time import fraction_done

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

# Dense peak FLOP/s (no sparsity) per precision, by a substring of torch.cuda.get_device_name().
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "amp_bf16": 989e12, "amp_fp16": 989e12},
    "H100": {"fp32": 67e12, "amp_bf16": 989e12, "amp_fp16": 989e12},
    "A100": {"fp32": 19.5e12, "amp_bf16": 312e12, "amp_fp16": 312e12},
    "L40S": {"fp32": 91.6e12, "amp_bf16": 362e12, "amp_fp16": 362e12},
    "A10": {"fp32": 31.2e12, "amp_bf16": 125e12, "amp_fp16": 125e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The vendor's dense peak FLOP/s of this rank's GPU in ``precision``; None when not known (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in GPU_PEAK_FLOPS.items():
        if key in name:
            return table.get(precision)
    return None


class SpeedMonitor(Callback):
    """Throughput over the last ``window_size`` batches, logged at every BATCH_END:
    ``throughput/batches_per_sec``, ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` (all
    ranks) and their ``throughput/device/...`` share per rank; with a model that has
    ``flops_per_batch(batch)``, ``throughput/flops_per_sec``, ``throughput/device/flops_per_sec`` and
    ``throughput/device/mfu`` (against ``gpu_flops_available``, else the GPU's known peak).
    Also ``time/train`` (hours of training, evaluation excluded). Time spent in evaluation is left
    out of the window. FLOPs of a batch are rank 0's batch times the world size (no collective).
    """

    def __init__(self, window_size: int = 100, gpu_flops_available: float | None = None) -> None:
        if window_size < 1:
            raise ValueError(f"SpeedMonitor window_size must be >= 1, got {window_size}")
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        # (wall clock, batches, samples, tokens, flops so far) at each BATCH_END
        self._history: deque[tuple[float, int, int, int, float]] = deque(maxlen=window_size + 1)
        self._flops = 0.0
        self._train_seconds = 0.0
        self._last = 0.0
        self._eval_start = 0.0
        self._world = 1

    def fit_start(self, state: State, logger: Logger) -> None:
        self._world = dist.get_world_size()
        if self.gpu_flops_available is None:
            self.gpu_flops_available = peak_flops(state.device.torch_device, state.precision)
        self._restart(state)

    def _restart(self, state: State) -> None:
        t = state.timestamp
        self._last = time.perf_counter()
        self._history.clear()
        self._history.append((self._last, t.batch.value, t.sample.value, t.token.value, self._flops))

    def batch_end(self, state: State, logger: Logger) -> None:
        now = time.perf_counter()
        self._train_seconds += now - self._last
        self._last = now
        model = state.model
        if hasattr(model, "flops_per_batch") and state.batch is not None:
            self._flops += float(model.flops_per_batch(state.batch)) * self._world
        t = state.timestamp
        self._history.append((now, t.batch.value, t.sample.value, t.token.value, self._flops))
        logger.log_metrics({**self._rates(), "time/train": self._train_seconds / 3600})

    def _rates(self) -> dict[str, float]:
        (t0, b0, s0, k0, f0), (t1, b1, s1, k1, f1) = self._history[0], self._history[-1]
        seconds = max(t1 - t0, 1e-9)
        world = self._world
        rates = {"batches_per_sec": (b1 - b0) / seconds, "samples_per_sec": (s1 - s0) / seconds}
        if k1 > k0:
            rates["tokens_per_sec"] = (k1 - k0) / seconds
        if f1 > f0:
            rates["flops_per_sec"] = (f1 - f0) / seconds
        metrics = {f"throughput/{k}": v for k, v in rates.items()}
        metrics.update({f"throughput/device/{k}": v / world for k, v in rates.items()})
        if "flops_per_sec" in rates and self.gpu_flops_available:
            metrics["throughput/device/mfu"] = rates["flops_per_sec"] / world / self.gpu_flops_available
        return metrics

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval_start = time.perf_counter()

    def eval_end(self, state: State, logger: Logger) -> None:
        # shift the window past the evaluation, so that it does not count as training time
        spent = time.perf_counter() - self._eval_start
        self._history = deque(((t + spent, *rest) for t, *rest in self._history), maxlen=self.window_size + 1)
        self._last += spent


class LRMonitor(Callback):
    """Logs each param group's lr at every BATCH_END as ``lr-<Optimizer>/group<i>``."""

    def batch_end(self, state: State, logger: Logger) -> None:
        metrics = {}
        for optimizer in state.optimizers:
            name = type(optimizer).__name__
            for i, group in enumerate(optimizer.param_groups):
                metrics[f"lr-{name}/group{i}"] = group["lr"]
        logger.log_metrics(metrics)


class MemoryMonitor(Callback):
    """Logs this rank's memory at every BATCH_END, in GiB: on GPU the CUDA allocator's
    ``memory/current_allocated_mem``, ``memory/peak_allocated_mem``, ``memory/current_reserved_mem``,
    ``memory/peak_reserved_mem`` and ``memory/alloc_retries``; on CPU ``memory/rss_mem`` and
    ``memory/peak_rss_mem`` of the process."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch.value % self.interval == 0:
            logger.log_metrics(memory_stats(state.device.torch_device))


_GIB = 1024 ** 3


def memory_stats(device: torch.device) -> dict[str, float]:
    """This process's memory on ``device``, in GiB."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"memory/current_allocated_mem": stats.get("allocated_bytes.all.current", 0) / _GIB,
                "memory/peak_allocated_mem": stats.get("allocated_bytes.all.peak", 0) / _GIB,
                "memory/current_reserved_mem": stats.get("reserved_bytes.all.current", 0) / _GIB,
                "memory/peak_reserved_mem": stats.get("reserved_bytes.all.peak", 0) / _GIB,
                "memory/alloc_retries": float(stats.get("num_alloc_retries", 0))}
    import resource

    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    rss = rss_pages * os.sysconf("SC_PAGE_SIZE") / _GIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB; updated lazily by the kernel
    return {"memory/rss_mem": rss, "memory/peak_rss_mem": max(peak, rss)}


class RuntimeEstimator(Callback):
    """Logs ``wall_clock/remaining_estimate`` (hours) at every BATCH_END: the time per share of
    max_duration so far, after the first ``skip_batches`` batches (compiling, warming caches), times
    the share left. Evaluation time counts, as it will again."""

    def __init__(self, skip_batches: int = 1, time_unit: str = "hours") -> None:
        units = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}
        if time_unit not in units:
            raise ValueError(f"RuntimeEstimator time_unit must be one of {', '.join(units)}, got {time_unit!r}")
        self.skip_batches, self.divisor = skip_batches, units[time_unit]
        self._start: tuple[float, float] | None = None
        self._seen = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        now = time.perf_counter()
        done = fraction_done(state.timestamp, state.max_duration, batches_per_epoch=state.batches_per_epoch)
        self._seen += 1
        if self._start is None:
            if self._seen >= self.skip_batches:
                self._start = (now, done)
            return
        if done <= self._start[1]:
            return
        start_time, start_done = self._start
        per_share = (now - start_time) / (done - start_done)
        logger.log_metrics({"wall_clock/remaining_estimate": per_share * (1.0 - done) / self.divisor})


__all__ = ["LRMonitor", "MemoryMonitor", "RuntimeEstimator", "SpeedMonitor", "memory_stats", "peak_flops"]
