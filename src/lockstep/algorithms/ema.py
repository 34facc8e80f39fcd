"""EMA: an exponential moving average of the model's weights, used for evaluation (Composer's ``EMA``).

After each update interval, every trainable parameter's average moves toward it:
``average = smoothing * average + (1 - smoothing) * weight``, with ``smoothing = 2 ** (-interval /
half_life)`` (or given). Floating-point buffers are averaged the same way; others (a batch
count) are copied. Evaluation (``EVAL_START`` to ``EVAL_END``) runs on the averages: they are
swapped into the model and back, so no second model is kept on the device.

Unlike Composer, which swaps the averages into the model at checkpoint events, a lockstep
checkpoint always holds the training weights as the model and the averages as this algorithm's
state (``state['algorithms']``, in Composer's keys), so an exact resume needs no swapping back;
:meth:`EMA.get_ema_model` writes the averages into a model to export them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lockstep.core.algorithm import Algorithm
from lockstep.core.event import Event
from lockstep.time import Time, TimeUnit

if TYPE_CHECKING:
    from lockstep.core.state import State

__all__ = ["EMA"]


class EMA(Algorithm):
    """Keep an exponential moving average of the weights; evaluate with it.

    ``half_life`` (``'1000ba'``; ``ba`` or ``ep``) or ``smoothing`` (in (0, 1)) sets how fast the
    average forgets; ``ema_start`` (a Time, ``'0.0dur'`` by default) when averaging begins;
    ``update_interval`` (one ``half_life`` unit by default, ``'1ba'`` with ``smoothing``) how often
    it updates. Under FSDP and DeepSpeed it is refused (its averages would be sharded).
    """

    def __init__(self, half_life: str | None = "1000ba", smoothing: float | None = None,
                 ema_start: str = "0.0dur", update_interval: str | None = None) -> None:
        if (half_life is None) == (smoothing is None):
            raise ValueError("EMA needs exactly one of half_life (e.g. '1000ba') and smoothing (in (0, 1))")
        self.half_life = None if half_life is None else Time.from_timestring(half_life)
        self.ema_start = _start_time(ema_start)
        if update_interval is not None and not isinstance(update_interval, str):
            raise ValueError(f"EMA(update_interval={update_interval!r}): give a time string such as '1ba', or None")
        default_unit = self.half_life.unit if self.half_life is not None else TimeUnit.BATCH
        self.update_interval = Time(1, default_unit) if update_interval is None \
            else Time.from_timestring(update_interval)
        if self.update_interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise ValueError(f"EMA(update_interval='{self.update_interval}'): give it in ba or ep")
        if self.half_life is not None and self.half_life.unit is not self.update_interval.unit:
            raise ValueError(f"EMA: half_life '{self.half_life}' and update_interval '{self.update_interval}' "
                             f"must be in the same unit")
        if smoothing is not None and not 0 < smoothing < 1:
            raise ValueError(f"EMA(smoothing={smoothing}): it must be in (0, 1)")
        self.smoothing = float(smoothing) if smoothing is not None else \
            2 ** (-(self.update_interval.value / self.half_life.value))  # type: ignore[union-attr]
        self.update_event = Event.BATCH_END if self.update_interval.unit is TimeUnit.BATCH else Event.EPOCH_END
        self.ema_started = False
        self.ema_weights_active = False
        self.parameters: dict[str, torch.Tensor] = {}
        """The averages of the trainable parameters, by name."""
        self.buffers: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"EMA(half_life={None if self.half_life is None else str(self.half_life)!r}, "
                f"smoothing={self.smoothing}, ema_start={str(self.ema_start)!r}, "
                f"update_interval={str(self.update_interval)!r})")

    # -- when it acts -------------------------------------------------------------------------

    def match(self, event: Event, state: State) -> bool:
        if event is Event.INIT:
            return True
        if event is self.update_event:
            return self.ema_started or self._due_to_start(state)
        return self.ema_started and event in (Event.EVAL_START, Event.EVAL_END, Event.BATCH_START)

    def _due_to_start(self, state: State) -> bool:
        if self.ema_start.unit is TimeUnit.DURATION:
            elapsed = state.get_elapsed_duration()
            return elapsed is not None and elapsed.value >= self.ema_start.value
        return state.timestamp.get(self.ema_start.unit).value >= self.ema_start.value

    def apply(self, event: Event, state: State, logger: Any = None) -> None:
        if event is Event.INIT:
            self._check_backend(state)
            return
        if event is self.update_event:
            if not self.ema_started:
                self._start(state.model)
            elif state.timestamp.get(self.update_interval.unit).value % self.update_interval.value == 0:
                self._update(state.model)
        elif event is Event.EVAL_START:
            self._use_averages(state.model, True)
        elif event in (Event.EVAL_END, Event.BATCH_START):
            self._use_averages(state.model, False)

    @staticmethod
    def _check_backend(state: State) -> None:
        if state.fsdp_enabled or state.deepspeed_enabled:
            raise ValueError("EMA under FSDP or DeepSpeed is not in lockstep yet (its averages would be sharded): "
                             "train with DDP, or average in a callback of your own")

    # -- the averages -------------------------------------------------------------------------

    def _start(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            self.parameters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.ema_started = True

    def _update(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            live = dict(model.named_parameters())
            names = [n for n in self.parameters if n in live]
            if names:
                torch._foreach_lerp_([self.parameters[n] for n in names], [live[n].detach() for n in names],
                                     1.0 - self.smoothing)
            for name, buffer in model.named_buffers():
                average = self.buffers.get(name)
                if average is None:
                    continue
                if average.is_floating_point():
                    average.lerp_(buffer, 1.0 - self.smoothing)
                else:
                    average.copy_(buffer)

    def _use_averages(self, model: torch.nn.Module, averages: bool) -> None:
        """Swap the averages into ``model`` (``averages``) or the training weights back."""
        if self.ema_weights_active is averages:
            return
        self._swap(model)
        self.ema_weights_active = averages

    def _swap(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for table, named in ((self.parameters, model.named_parameters()), (self.buffers, model.named_buffers())):
                for name, tensor in named:
                    other = table.get(name)
                    if other is not None:
                        kept = tensor.detach().clone()
                        tensor.copy_(other)
                        other.copy_(kept)

    def get_ema_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the averages copied into it (its training weights are overwritten)."""
        if self.ema_weights_active:
            raise ValueError("the averages are in the model already (during evaluation)")
        self._copy_into(model)
        return model

    def get_training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the training weights copied into it, while the averages are in it."""
        if not self.ema_weights_active:
            raise ValueError("the training weights are in the model already")
        self._copy_into(model)
        return model

    def _copy_into(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for table, named in ((self.parameters, model.named_parameters()), (self.buffers, model.named_buffers())):
                for name, tensor in named:
                    if name in table:
                        tensor.copy_(table[name])

    # -- checkpoints (Composer's keys) ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"repr": repr(self), "ema_started": self.ema_started, "ema_weights_active": self.ema_weights_active,
                "ema_model": {"named_parameters_dict": self.parameters, "named_buffers_dict": self.buffers}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_started = bool(state.get("ema_started", False))
        self.ema_weights_active = bool(state.get("ema_weights_active", False))
        saved = state.get("ema_model") or {}
        self.parameters = {n: t.clone() for n, t in saved.get("named_parameters_dict", {}).items()}
        self.buffers = {n: t.clone() for n, t in saved.get("named_buffers_dict", {}).items()}


def _start_time(text: str) -> Time:
    """``ema_start`` as a Time; ``'0dur'`` (the start of training, Composer's default) too, which a
    duration string may not be elsewhere."""
    stripped = text.strip()
    if stripped.endswith("dur") and stripped[:-3].replace(".", "", 1).isdigit() and float(stripped[:-3]) == 0:
        return Time(0.0, TimeUnit.DURATION)
    return Time.from_timestring(text)
