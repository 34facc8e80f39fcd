"""DeepSpeed ZeRO: equality with DDP per stage, the config lockstep fills in, and its errors."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from lockstep import Trainer, dist
from lockstep.parallel.deepspeed import fill_config
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, assert_same_params, loader, sgd

GLOBAL_BATCH = 8
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# `make test` (and so CI) installs the extra and sets this: there the DeepSpeed tests must run.
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"),
    reason="DeepSpeed is not installed (pip install 'torch-lockstep[deepspeed]')")


def train(deepspeed_config: dict | None, microbatch_size: int | None = None, adamw: bool = False,
          precision: str = "fp32") -> dict[str, torch.Tensor]:
    from lockstep.parallel.deepspeed import full_state_dict

    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01) if adamw else sgd(model)
    trainer = Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size()),
                      max_duration="2ep", optimizers=optimizer, progress_bar=False, precision=precision,
                      deepspeed_config=deepspeed_config, device_train_microbatch_size=microbatch_size)
    trainer.fit()
    return full_state_dict(model)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """One process, no DeepSpeed: the plain global-batch math that DDP matches."""
    return train(None)


@pytest.fixture(scope="module")
def reference_adamw() -> dict[str, torch.Tensor]:
    return train(None, adamw=True)


def _every_stage() -> list[dict[str, torch.Tensor]]:
    # 28 samples, 14 per rank in batches of 4: the last batch of each epoch has 2 samples, so
    # with microbatches of 2 the steps have 2, 2, 2 and 1 microbatches.
    results = [train({}), train({}, microbatch_size=2)]  # DeepSpeed's defaults: no ZeRO
    results += [train({"zero_optimization": {"stage": stage}}) for stage in (1, 2, 3)]
    results += [train({"zero_optimization": {"stage": stage}}, microbatch_size=2) for stage in (1, 2, 3)]
    from deepspeed.comm import comm

    # the engines' backend went without DeepSpeed's shared-memory op, which compiles on first use
    return results, comm.cdb.shm_comm_op is None


@needs_deepspeed
@pytest.mark.timeout(400)
def test_every_stage_matches_ddp(reference) -> None:
    for rank_results, no_shared_memory_op in run_distributed(_every_stage, world_size=2, timeout=380):
        assert no_shared_memory_op
        for result in rank_results:
            assert_same_params(result, reference, atol=1e-5)


def _adamw_stages() -> list[dict[str, torch.Tensor]]:
    return [train({"zero_optimization": {"stage": stage}}, microbatch_size=2, adamw=True) for stage in (2, 3)]


@needs_deepspeed
@pytest.mark.timeout(300)
def test_adamw_with_microbatches_matches_ddp(reference_adamw) -> None:
    for rank_results in run_distributed(_adamw_stages, world_size=2, timeout=280):
        for result in rank_results:
            assert_same_params(result, reference_adamw, atol=1e-5)


def evaluate(deepspeed_config: dict | None) -> dict[str, float]:
    from torch.utils.data import DataLoader

    from tests.trainer.common import dataset
    model = MLP()
    eval_set = dataset(27)  # 2 ranks: the sampler pads one rank's share with a repeated sample
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", optimizers=sgd(model),
                      progress_bar=False, deepspeed_config=deepspeed_config,
                      eval_dataloader=DataLoader(eval_set, batch_size=4, sampler=dist.get_sampler(eval_set, shuffle=True)))
    trainer.fit()
    from lockstep.core.eval_metrics import values
    return values(trainer.state.eval_metrics)["eval"]


def _zero3_eval() -> dict[str, float]:
    return evaluate({"zero_optimization": {"stage": 3}})


@needs_deepspeed
@pytest.mark.timeout(180)
def test_eval_under_zero3_matches_ddp() -> None:
    # Under ZeRO-3 each forward gathers parameters, so the rank with fewer real samples still runs
    # the padded batches' forward; the metrics leave the padding out.
    reference = run_distributed(evaluate, world_size=2, args=(None,), timeout=120)[0]
    for metrics in run_distributed(_zero3_eval, world_size=2, timeout=160):
        assert metrics.keys() == reference.keys()
        for name, value in metrics.items():
            assert abs(value - reference[name]) < 1e-6, name


def _without_mlflow() -> tuple[bool, bool, bool]:
    before = "mlflow" in sys.modules
    model = MLP()
    Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model), progress_bar=False,
            deepspeed_config={"zero_optimization": {"stage": 2}}).fit()
    during = "mlflow" in sys.modules
    import mlflow  # still importable by the user's own code (and lockstep's MLFlowLogger)

    return before, during, hasattr(mlflow, "log_metric")


@needs_deepspeed
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs mlflow installed")
@pytest.mark.timeout(120)
def test_deepspeed_comes_in_without_the_mlflow_its_autotuner_would_import() -> None:
    # DeepSpeed's autotuner imports mlflow when installed: ~1.8 s of CPU in every rank, for a log
    # lockstep never writes.
    assert run_distributed(_without_mlflow, world_size=1, timeout=100) == [(False, False, True)]


def _bf16() -> tuple[dict, torch.dtype, list[float]]:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", optimizers=sgd(model),
                      progress_bar=False, precision="amp_bf16", deepspeed_config={"zero_optimization": {"stage": 2}})
    before = next(iter(model.parameters())).detach().float().clone()
    trainer.fit()
    after = next(iter(model.parameters())).detach().float()
    return trainer.strategy.config, next(iter(model.parameters())).dtype, [float((after - before).abs().max())]


@needs_deepspeed
@pytest.mark.timeout(180)
def test_bf16_fills_the_section_and_trains() -> None:
    for config, dtype, (moved,) in run_distributed(_bf16, world_size=2, timeout=160):
        assert config["bf16"] == {"enabled": True} and "fp16" not in config
        assert dtype == torch.bfloat16  # DeepSpeed keeps bf16 weights and fp32 masters
        assert moved > 0


def _fp16() -> str:
    model = MLP()
    try:
        Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", optimizers=sgd(model),
                progress_bar=False, precision="amp_fp16", deepspeed_config={}).fit()
    except ValueError as e:
        return str(e)
    return "trained"


@needs_deepspeed
@pytest.mark.timeout(180)
def test_fp16_trains_or_says_the_cpu_lacks_it() -> None:
    from deepspeed.accelerator import get_accelerator
    supported = bool(get_accelerator().is_fp16_supported())
    for outcome in run_distributed(_fp16, world_size=2, timeout=160):
        if supported:
            assert outcome == "trained"
        else:
            assert "precision='amp_fp16' under DeepSpeed needs fp16 support" in outcome
            assert "use precision='amp_bf16'" in outcome


# -- the config lockstep fills in -------------------------------------------------------------

def _fill(config: dict, **kwargs) -> dict:
    args = {"batch_size": 8, "microbatch_size": None, "grad_accum": None, "world_size": 2,
            "precision": "fp32", "optimizers": 1, **kwargs}
    return fill_config(config, **args)


def test_empty_config_is_filled_from_the_trainer() -> None:
    filled = _fill({}, microbatch_size=2)
    assert filled == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                      "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
                      "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    assert _fill({}, grad_accum=2)["train_micro_batch_size_per_gpu"] == 4


def test_user_values_that_agree_or_say_auto_are_kept() -> None:
    given = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    filled = _fill(given, precision="amp_bf16")
    assert filled["train_micro_batch_size_per_gpu"] == 8 and filled["gradient_accumulation_steps"] == 1
    assert filled["gradient_clipping"] == 1.0 and filled["zero_optimization"] == {"stage": 3}
    assert filled["bf16"] == {"enabled": True}
    assert given["train_micro_batch_size_per_gpu"] == "auto"  # the user's dict is not changed


@pytest.mark.parametrize(("precision", "sections"), [
    ("fp32", {}), ("amp_bf16", {"bf16": {"enabled": True}}), ("amp_fp16", {"fp16": {"enabled": True}}),
])
def test_precision_fills_the_half_sections(precision, sections) -> None:
    filled = _fill({}, precision=precision)
    assert {k: filled[k] for k in ("fp16", "bf16") if k in filled} == sections
    # options without 'enabled' are kept and the section is enabled from precision
    with_options = _fill({"fp16": {"initial_scale_power": 8}}, precision=precision)
    assert with_options["fp16"] == {"initial_scale_power": 8, "enabled": precision == "amp_fp16"}


@pytest.mark.parametrize(("config", "kwargs", "message"), [
    ({"train_batch_size": 32}, {}, r"\['train_batch_size'\]=32 conflicts with the global batch 16"),
    ({"train_micro_batch_size_per_gpu": 4}, {}, r"=4 conflicts with the Trainer's microbatch size 8"),
    ({"gradient_accumulation_steps": 2}, {"microbatch_size": 2}, r"=2 conflicts with the Trainer's 4 microbatch"),
    ({"bf16": {"enabled": True}}, {}, r"\['bf16'\]\['enabled'\]=True conflicts with the Trainer's precision='fp32'"),
    ({"fp16": {"enabled": False}}, {"precision": "amp_fp16"}, r"conflicts with the Trainer's precision='amp_fp16'"),
    ({"bfloat16": {"enabled": True}, "bf16": {}}, {}, "both 'bf16' and 'bfloat16'"),
    ({"optimizer": {"type": "Adam"}}, {}, r"remove 'optimizer' from deepspeed_config and pass optimizers="),
    ({"scheduler": {"type": "WarmupLR"}}, {}, "pass schedulers= to Trainer"),
    ({}, {"optimizers": 2}, "one optimizer, but 2 were given"),
    ({}, {"batch_size": 10, "microbatch_size": 4}, r"batch_size \(10\) must be a multiple of the microbatch size"),
    ({"fp16": True}, {}, "must be a dict such as"),
    ({"zero_optimisation": {"stage": 2}}, {}, r"unknown key\(s\) 'zero_optimisation'.*did you mean 'zero_optimization'"),
    ({"zero_optimization": {"stage": 7}}, {}, r"\['zero_optimization'\]\['stage'\]=7: ZeRO's stages are 0 \(plain "
                                               r"data parallel\), 1 \(optimizer state sharded\), 2 \(and gradients\) "
                                               r"and 3 \(and parameters\)$"),
    ({"zero_optimization": {"stage": "three"}}, {}, r"\['stage'\]='three': ZeRO's stages are 0"),
    ({"zero_optimization": {"stage": -1}}, {}, r"\['stage'\]=-1: ZeRO's stages"),
    ({"zero_optimization": 2}, {}, r"\['zero_optimization'\] must be a dict such as \{'stage': 2\}, got 2"),
])
def test_config_conflicts_name_both_sides(config, kwargs, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        _fill(config, **kwargs)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs DeepSpeed")
def test_every_collective_of_the_installed_deepspeed_is_waited_through_lockstep() -> None:
    """In an elastic job each of DeepSpeed's collectives is issued with ``async_op`` and waited
    for by lockstep; one whose ``async_op`` went unseen would wait inside torch, and a rank lost
    meanwhile would hang the others until the group's timeout."""
    from deepspeed.comm.torch import TorchBackend

    from lockstep.parallel.deepspeed import _WAITED, _signature, _waited

    present = [name for name in _WAITED if hasattr(TorchBackend, name)]
    assert len(present) >= 10  # all_reduce, broadcast, all_gather, reduce_scatter, barrier, ...
    unseen = [name for name in present if "async_op" not in _signature(getattr(TorchBackend, name)).parameters]
    assert unseen == []
    calls, waits = [], []

    class Work:
        def wait(self) -> bool:
            waits.append(self)
            return True

        def is_completed(self) -> bool:
            return True

    def issue(*args, **kwargs):
        calls.append((args, kwargs))
        return Work()

    waited = _waited(issue, _signature(TorchBackend.all_reduce))
    work = waited(torch.ones(1), async_op=True)  # the caller waits for its work, through lockstep.dist
    assert list(calls[-1][1]) == ["tensor", "async_op"] and calls[-1][1]["async_op"] and not waits
    work.wait()
    work.wait()
    assert len(waits) == 1
    assert waited(torch.ones(1)) is None  # issued asynchronously too, and waited for here
    assert calls[-1][1]["async_op"] and len(waits) == 2


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs DeepSpeed")
def test_every_known_top_level_key_is_read_by_the_installed_deepspeed() -> None:
    from pathlib import Path

    from lockstep.parallel.deepspeed import TOP_LEVEL_KEYS

    spec = importlib.util.find_spec("deepspeed")
    source = "".join(p.read_text(errors="replace") for p in Path(spec.origin).parent.rglob("*.py"))
    assert [k for k in TOP_LEVEL_KEYS if f'"{k}"' not in source and f"'{k}'" not in source] == []


def test_config_errors_come_before_any_process_group() -> None:
    model = MLP()
    with pytest.raises(ValueError, match="conflicts with the global batch 4"):
        Trainer(model=model, train_dataloader=loader(4), optimizers=sgd(model),
                deepspeed_config={"train_batch_size": 8})
    with pytest.raises(ValueError, match=r"\['stage'\]=7: ZeRO's stages are 0") as info:
        Trainer(model=model, train_dataloader=loader(4), optimizers=sgd(model),
                deepspeed_config={"zero_optimization": {"stage": 7}})
    assert "\n" not in str(info.value)  # one line, not DeepSpeed's validation dump
    assert not dist.is_initialized()


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "2", 2.0, True])
def test_zero_stages_deepspeed_takes_are_kept(stage) -> None:
    assert _fill({"zero_optimization": {"stage": stage}})["zero_optimization"] == {"stage": stage}
    assert _fill({"zero_optimization": True})["zero_optimization"] is True  # DeepSpeed's old stage-1 switch


def test_missing_deepspeed_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    model = MLP()
    with pytest.raises(ImportError, match=r"pip install 'torch-lockstep\[deepspeed\]'"):
        Trainer(model=model, train_dataloader=loader(4), optimizers=sgd(model), deepspeed_config={})
    assert not dist.is_initialized()


def test_deepspeed_with_fsdp_is_an_error() -> None:
    model = MLP()
    with pytest.raises(ValueError, match="fsdp_config and deepspeed_config were both given"):
        Trainer(model=model, deepspeed_config={}, fsdp_config={})
