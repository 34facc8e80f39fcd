"""Composer's ``State`` and ``Engine``, driven by hand as Composer users' tests of their callbacks
and algorithms drive them: the constructor, its attributes, ``state_dict`` in Composer's keys,
and the order in which an Engine runs algorithms, callbacks and logger destinations."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep.algorithms import EMA
from lockstep.core import Algorithm, Callback, Engine, Event, Precision, State, Time, TimeUnit
from lockstep.devices import DeviceCPU
from lockstep.loggers import Logger, LoggerDestination


def _state(**kwargs) -> State:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    state = State(model=model, rank_zero_seed=7, run_name="run", device=DeviceCPU(), max_duration="3ep",
                  optimizers=optimizer, train_dataloader=DataLoader(data, batch_size=4), **kwargs)
    state.set_dataloader(state.train_dataloader, "train")
    state.schedulers = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return state


def _step(state: State) -> None:
    x, y = next(iter(state.train_dataloader))
    for optimizer in state.optimizers:
        optimizer.zero_grad()
    torch.nn.functional.cross_entropy(state.model(x), y).backward()
    for optimizer in state.optimizers:
        optimizer.step()
    for scheduler in state.schedulers:
        scheduler.step()
    state.timestamp = state.timestamp.to_next_batch(len(x))


def test_composers_constructor_and_attributes() -> None:
    state = _state(precision="amp_bf16", device_train_microbatch_size=2)
    assert state.optimizers == [state.optimizers[0]] and len(state.schedulers) == 1  # one object -> a list
    assert state.max_duration == Time(3, TimeUnit.EPOCH) and state.precision is Precision.AMP_BF16
    assert state.device == DeviceCPU() and state.device == torch.device("cpu") and state.seed == 7
    assert state.dataloader_label == "train" and state.dataloader_len == Time(4, TimeUnit.BATCH)
    assert state.eval_timestamp.batch == 0 and state.previous_timestamp is None
    assert state.callbacks == [] and state.algorithms == [] and state.train_metrics == {}
    state.timestamp = state.timestamp.to_next_batch(4)
    assert state.get_elapsed_duration() == Time(0.0, TimeUnit.DURATION)  # 0 of 3 epochs done
    state.max_duration = "10sp"
    state.stop_training()  # not in epochs: the amount done in its own unit
    assert state.max_duration == Time(4, TimeUnit.SAMPLE)
    with pytest.raises(ValueError, match="'dur'"):
        state.max_duration = "0.5dur"
    state.batch = ({"a": 1}, [2, 3])
    assert state.batch_get_item(lambda b: b[1][0]) == 2
    state.batch_set_item(0, {"a": 9})
    assert state.batch_get_item(0) == {"a": 9} and isinstance(state.batch, tuple)
    with pytest.raises(ValueError, match="dataloader_label"):
        state.set_dataloader(state.train_dataloader)


def test_state_dict_uses_composers_keys_and_loads_back_exactly(tmp_path) -> None:
    first, second = _state(), _state()
    _step(first)
    saved = first.state_dict()
    assert {"model", "optimizers", "schedulers", "algorithms", "callbacks", "timestamp", "rank_zero_seed",
            "run_name", "dataset_state", "integrations", "metadata"} <= saved.keys()
    assert list(saved["optimizers"]) == ["Adam"] and list(saved["schedulers"]) == ["StepLR"]
    assert saved["metadata"]["precision"] == "fp32" and saved["metadata"]["train_dataloader_batch_size"] == 4
    torch.save(saved, tmp_path / "state.pt")
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False), Logger(second))
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert second.timestamp == first.timestamp and second.schedulers[0].last_epoch == 1
    _step(first)
    _step(second)  # the optimizer's moments were restored too: the next step is the same
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


class Recorder(Callback):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.closed = self.post_closed = 0

    def run_event(self, event, state, logger) -> None:
        self.log.append(f"{self.name}:{event.value}")

    def close(self, state, logger) -> None:
        self.closed += 1

    def post_close(self) -> None:
        self.post_closed += 1


class Destination(LoggerDestination):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def run_event(self, event, state, logger) -> None:
        self.log.append(f"logger:{event.value}")


class Marks(Algorithm):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def match(self, event, state) -> bool:
        return event in (Event.INIT, Event.BEFORE_LOSS, Event.AFTER_LOSS)

    def apply(self, event, state, logger) -> int:
        self.log.append(f"{self.name}:{event.value}")
        return len(self.log)


def test_an_engine_runs_composers_order_and_closes_once() -> None:
    log: list[str] = []
    state = _state(callbacks=[Recorder("cb", log), Destination(log)], algorithms=[Marks("a", log), Marks("b", log)])
    engine = Engine(state, Logger(state))
    engine.run_event("init")  # destinations first at INIT, algorithms last
    assert log == ["logger:init", "cb:init", "a:init", "b:init"]
    log.clear()
    traces = engine.run_event(Event.BEFORE_LOSS)
    assert log == ["a:before_loss", "b:before_loss", "cb:before_loss", "logger:before_loss"]
    assert [t.order for t in traces.values()] == [0, 1] and all(t.run for t in traces.values())
    log.clear()
    engine.run_event(Event.AFTER_LOSS)  # an event that closes a pair: the algorithms in reverse
    assert log == ["b:after_loss", "a:after_loss", "cb:after_loss", "logger:after_loss"]
    with pytest.raises(RuntimeError, match="open callback"):
        Engine(state, Logger(state)).run_event(Event.INIT)  # the same callbacks, not yet closed
    engine.close()
    engine.close()
    recorder = state.callbacks[0]
    assert (recorder.closed, recorder.post_closed) == (1, 1)
    with pytest.raises(RuntimeError, match="closed"):
        engine.run_event(Event.FIT_START)
    Engine(state, Logger(state)).run_event(Event.INIT)  # closed: a new engine may start them again


def test_an_engine_needs_a_dataloader_after_init() -> None:
    state = State(model=torch.nn.Linear(1, 1), rank_zero_seed=0, run_name="r", device="cpu", max_duration="1ep")
    engine = Engine(state, Logger(state))
    engine.run_event(Event.INIT)
    with pytest.raises(AssertionError, match="set_dataloader"):
        engine.run_event(Event.BATCH_START)
    engine.close()


def test_ema_averages_by_the_formula_and_swaps_for_evaluation() -> None:
    state = _state(algorithms=EMA(half_life="2ba"))
    ema = state.algorithms[0]
    engine = Engine(state, Logger(state))
    engine.run_event(Event.INIT)
    expected = None
    for _ in range(3):
        engine.run_event(Event.BATCH_START)
        _step(state)
        engine.run_event(Event.BATCH_END)
        live = [p.detach().clone() for p in state.model.parameters()]
        expected = live if expected is None else [e * 2 ** -0.5 + w * (1 - 2 ** -0.5) for e, w in zip(expected, live)]
    averages = list(ema.parameters.values())
    for e, a in zip(expected, averages):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-6)
    training = [p.detach().clone() for p in state.model.parameters()]
    engine.run_event(Event.EVAL_START)
    for p, a in zip(state.model.parameters(), expected):
        torch.testing.assert_close(p.detach(), a, rtol=0, atol=1e-6)
    engine.run_event(Event.EVAL_END)
    for p, t in zip(state.model.parameters(), training):
        assert torch.equal(p.detach(), t)
    restored = EMA(half_life="2ba")
    restored.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.parameters.values(), averages))
    engine.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"half_life": None}, "exactly one"), ({"smoothing": 0.9}, "exactly one"),
    ({"half_life": "10ba", "update_interval": "1ep"}, "same unit"), ({"half_life": None, "smoothing": 1.5}, "(0, 1)")])
def test_ema_refuses_what_cannot_work(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EMA(**kwargs)


def test_composers_algorithms_beyond_clipping_and_ema_say_so() -> None:
    with pytest.raises(ImportError, match="LabelSmoothing is one of Composer's algorithms.*label_smoothing"):
        from lockstep.algorithms import LabelSmoothing  # noqa: F401
    with pytest.raises(ImportError, match="apply_gradient_clipping is one of Composer's functional algorithms.*"
                                          "lockstep.algorithms.GradientClipping"):
        from lockstep.functional import apply_gradient_clipping  # noqa: F401
    with pytest.raises(ImportError, match="apply_blurpool is one of Composer's functional algorithms"):
        import lockstep.functional as functional
        functional.apply_blurpool  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lockstep.algorithms import EMA as Imported  # noqa: F401
