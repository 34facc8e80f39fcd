"""Composer's module paths and every one of Composer 0.32.1's Trainer arguments."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import Model, Trainer
from lockstep.algorithms import Algorithm
from lockstep.loggers import InMemoryLogger
from tests.trainer.common import MLP, error_of, loader, params

pytestmark = pytest.mark.timeout(180)

# Composer 0.32.1's Trainer.__init__ keyword arguments, in its order.
COMPOSER_TRAINER_ARGUMENTS = [
    "model", "train_dataloader", "train_dataloader_label", "train_subset_num_batches", "spin_dataloaders",
    "max_duration", "algorithms", "algorithm_passes", "optimizers", "schedulers", "scale_schedule_ratio",
    "step_schedulers_every_batch", "eval_dataloader", "eval_interval", "eval_subset_num_batches", "callbacks",
    "loggers", "run_name", "progress_bar", "log_to_console", "console_stream", "console_log_interval",
    "log_traces", "auto_log_hparams", "load_path", "load_object_store", "load_weights_only",
    "load_strict_model_weights", "load_progress_bar", "load_ignore_keys", "load_exclude_algorithms",
    "save_folder", "save_filename", "save_latest_filename", "save_overwrite", "save_interval",
    "save_weights_only", "save_ignore_keys", "save_num_checkpoints_to_keep", "save_metrics", "autoresume",
    "parallelism_config", "device", "precision", "precision_config", "device_train_microbatch_size",
    "accumulate_train_batch_on_tokens", "seed", "deterministic_mode", "dist_timeout", "ddp_sync_strategy",
    "profiler", "python_log_level", "compile_config",
]


def test_the_trainer_takes_every_composer_argument() -> None:
    ours = set(inspect.signature(Trainer.__init__).parameters)
    assert len(COMPOSER_TRAINER_ARGUMENTS) == 54
    assert [name for name in COMPOSER_TRAINER_ARGUMENTS if name not in ours] == []


@pytest.mark.parametrize("composer_path, lockstep_path, names", [
    ("lockstep.core", "lockstep", ["Callback", "Event", "State", "Time", "TimeUnit", "Timestamp", "Algorithm"]),
    ("lockstep.core.time", "lockstep.time", ["Time", "TimeUnit", "Timestamp", "ensure_time"]),
    ("lockstep.trainer", "lockstep", ["Trainer"]),
    ("lockstep.utils", "lockstep", ["dist"]),
    ("lockstep.utils.reproducibility", "lockstep.utils", ["seed_all", "get_random_seed",
                                                          "configure_deterministic_mode"]),
    ("lockstep.utils.device", "lockstep.utils", ["get_device"]),
    ("lockstep.devices", "lockstep.devices.device", ["DeviceCPU", "DeviceGPU"]),
    ("lockstep.optim.scheduler", "lockstep.optim", ["CosineAnnealingWithWarmupScheduler", "LinearScheduler"]),
])
def test_composers_paths_hold_the_same_objects(composer_path: str, lockstep_path: str, names: list[str]) -> None:
    composer, ours = importlib.import_module(composer_path), importlib.import_module(lockstep_path)
    assert [n for n in names if getattr(composer, n) is not getattr(ours, n)] == []


def test_utils_dist_is_the_dist_module() -> None:
    import lockstep.utils.dist
    from lockstep.utils.dist import get_global_rank

    assert lockstep.utils.dist is lockstep.dist and get_global_rank is lockstep.dist.get_global_rank


def test_a_device_object_chooses_the_device() -> None:
    from lockstep.devices import DeviceCPU
    from lockstep.utils import get_device

    trainer = Trainer(model=MLP(), train_dataloader=loader(4), device=DeviceCPU(), progress_bar=False,
                      optimizers=None, max_duration="1ba")
    assert trainer.state.device == torch.device("cpu") and isinstance(get_device(None), DeviceCPU)
    assert "give 'cpu', 'gpu'" in error_of(get_device, "tpu")


def _trainer(**kwargs) -> Trainer:
    model = kwargs.pop("model", None) or MLP()
    kwargs.setdefault("optimizers", torch.optim.SGD(model.parameters(), lr=0.1))
    return Trainer(model=model, train_dataloader=kwargs.pop("train_dataloader", None) or loader(4), device="cpu",
                   progress_bar=False, **kwargs)


@pytest.mark.parametrize("argument, value, message", [
    ("precision_config", {"fp8_format": "HYBRID"}, "amp_fp8 (Transformer Engine)"),
    ("load_object_store", object(), "load_object_store must be an object store"),
    ("train_dataloader_label", "", "non-empty string"),
    ("deterministic_mode", "yes", "give True or False"),
    ("algorithm_passes", [3], "(function, position) pairs"),
    ("load_exclude_algorithms", "GradientClipping", "list of algorithm class names"),
])
def test_an_argument_lockstep_cannot_honour_is_one_line_at_construction(argument: str, value: object,
                                                                        message: str) -> None:
    error = error_of(_trainer, max_duration="1ba", **{argument: value})
    assert message in error and "\n" not in error


class Named(Algorithm):
    """Records, in ``order``, its name each time it runs at AFTER_TRAIN_BATCH or BEFORE_TRAIN_BATCH."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order = name, order

    def match(self, event, state) -> bool:
        return event.name in ("BEFORE_TRAIN_BATCH", "AFTER_TRAIN_BATCH")

    def apply(self, event, state, logger=None) -> None:
        self.order.append(f"{event.name.split('_')[0]}:{self.name}")


def test_algorithms_run_in_reverse_at_after_events_and_passes_reorder_them() -> None:
    order: list[str] = []
    _trainer(max_duration="1ba", algorithms=[Named("a", order), Named("b", order)]).fit()
    assert order == ["BEFORE:a", "BEFORE:b", "AFTER:b", "AFTER:a"]  # Composer's default pass
    order.clear()
    only_b = lambda algorithms, event: [a for a in algorithms if a.name == "b"]  # noqa: E731
    _trainer(max_duration="1ba", algorithms=[Named("a", order), Named("b", order)], algorithm_passes=only_b).fit()
    assert order == ["BEFORE:b", "AFTER:b"]


def test_log_traces_and_auto_log_hparams_reach_the_loggers() -> None:
    class Traces(InMemoryLogger):
        def __init__(self) -> None:
            super().__init__()
            self.traces: dict[str, int] = {}

        def log_traces(self, traces):
            self.traces.update(traces)

    logger = Traces()
    _trainer(max_duration="1ba", algorithms=[Named("a", [])], loggers=[logger], log_traces=True,
             auto_log_hparams=True, seed=3).fit()
    assert logger.traces == {"algorithm_traces/Named/before_train_batch": 1,
                             "algorithm_traces/Named/after_train_batch": 1}
    assert logger.hyperparameters["seed"] == 3 and logger.hyperparameters["max_duration"] == "1ba"
    assert logger.hyperparameters["model"] == "MLP" and logger.hyperparameters["algorithms"] == ["Named"]


def test_deterministic_mode_turns_on_torchs_deterministic_algorithms() -> None:
    try:
        _trainer(max_duration="1ba", deterministic_mode=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class Tokens(Model):
    """A linear model whose samples carry different numbers of tokens (the second column)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, batch):
        return self.linear(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs.squeeze(1), batch[1])

    def num_tokens(self, batch) -> int:
        return int(batch[0][:, 1].sum())


def test_accumulate_train_batch_on_tokens_weighs_each_microbatch_by_its_tokens() -> None:
    x = torch.tensor([[1.0, 1.0], [2.0, 1.0], [0.5, 5.0], [1.5, 3.0]])
    y = torch.tensor([1.0, -1.0, 2.0, 0.5])
    data = DataLoader(TensorDataset(x, y), batch_size=4)
    model = Tokens()
    reference = Tokens()
    trainer = _trainer(model=model, train_dataloader=data, max_duration="1ba", device_train_microbatch_size=2,
                       accumulate_train_batch_on_tokens=True, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit()
    # by hand: each microbatch's mean loss, weighted by its tokens over the batch's
    tokens = [reference.num_tokens((x[:2],)), reference.num_tokens((x[2:],))]
    loss = sum(reference.loss(reference((x[i:i + 2],)), (x[i:i + 2], y[i:i + 2])) * t / sum(tokens)
               for i, t in zip((0, 2), tokens))
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(params(model).values(),
                                                                      params(reference).values()))
    by_samples = Tokens()
    _trainer(model=by_samples, train_dataloader=data, max_duration="1ba", device_train_microbatch_size=2,
             optimizers=torch.optim.SGD(by_samples.parameters(), lr=0.1)).fit()
    assert not torch.allclose(params(by_samples)["linear.weight"], params(model)["linear.weight"])


def test_accumulating_on_tokens_without_a_token_count_says_what_to_give() -> None:
    trainer = _trainer(max_duration="1ba", accumulate_train_batch_on_tokens=True)
    assert "give the model num_tokens(batch)" in error_of(trainer.fit)


def test_the_run_options_are_kept() -> None:
    trainer = _trainer(max_duration="1ba", train_dataloader_label="pretrain", spin_dataloaders=False,
                       load_progress_bar=False, load_exclude_algorithms=["GradientClipping"])
    options = trainer.options
    assert (options.train_dataloader_label, options.spin_dataloaders, options.load_progress_bar) == \
        ("pretrain", False, False)
    assert options.load_exclude_algorithms == ["GradientClipping"]
    assert lockstep.ensure_time(2, "ep") == lockstep.Time(2, "ep")


def test_composers_parallelism_config_classes_stand_for_their_dicts() -> None:
    from lockstep.parallel.fsdp_config import parse_config
    from lockstep.trainer.setup import fsdp_from_parallelism_config as settings
    from lockstep.utils.parallelism import FSDP2Config, FSDPConfig, ParallelismConfig, TPConfig

    config = FSDPConfig(sharding_strategy="SHARD_GRAD_OP", state_dict_type="sharded", activation_checkpointing=True)
    expected = {"sharding_strategy": "SHARD_GRAD_OP", "state_dict_type": "sharded", "activation_checkpointing": True}
    assert settings(None, config) == expected
    assert settings(ParallelismConfig(fsdp=config), None) == expected == settings({"fsdp": config}, None)
    assert parse_config(settings(None, config)).sharding_strategy == "SHARD_GRAD_OP"
    assert settings(None, FSDP2Config(reshard_after_forward=False)) == \
        {"state_dict_type": "sharded", "sharding_strategy": "SHARD_GRAD_OP"}
    for mesh in ("device_mesh", "_device_mesh"):
        with pytest.raises(ValueError, match="Directly specifying device mesh for FSDP was deprecated"):
            FSDPConfig(**{mesh: [2]})
    with pytest.raises(TypeError, match="FSDPConfig has no field 'nope'"):
        FSDPConfig(nope=1)
    from lockstep.trainer.setup import tp_from_parallelism_config
    with pytest.raises(ValueError, match="needs a layer_plan"):
        tp_from_parallelism_config(ParallelismConfig(fsdp=config, tp=TPConfig(tensor_parallel_degree=2)))
    assert tp_from_parallelism_config(ParallelismConfig(fsdp=config, tp=TPConfig())) is None  # degree 1: none
    assert settings(None, FSDPConfig(data_parallel_shard_degree=2, data_parallel_replicate_degree=2)) == \
        {"data_parallel_shard_degree": 2, "data_parallel_replicate_degree": 2}
    with pytest.raises(ValueError, match="limit_all_gathers"):  # a Composer setting lockstep does not act on
        parse_config(settings(None, FSDPConfig(limit_all_gathers=False)))
