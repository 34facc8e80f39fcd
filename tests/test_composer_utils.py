"""Composer's small public names at their paths: ``Precision`` and ``get_precision_context``,
``TrainerMode`` and the type names in ``lockstep.core``; name formatting in ``lockstep.utils``."""

from __future__ import annotations

import datetime

import pytest
import torch

from lockstep import Timestamp, Trainer
from lockstep.core import JSON, Batch, Dataset, Precision, TrainerMode, get_precision_context
from lockstep.utils import StringEnum, format_name_with_dist, format_name_with_dist_and_time, partial_format
from tests.trainer.common import MLP, error_of, loader


def test_precision_members_are_their_names_and_match_in_any_case() -> None:
    assert [p.value for p in Precision] == ["fp32", "amp_fp16", "amp_bf16", "amp_fp8"]
    assert Precision("AMP_BF16") is Precision("Amp_Bf16") is Precision(Precision.AMP_BF16) is Precision.AMP_BF16
    assert Precision.FP32 == "fp32" and f"{Precision.AMP_FP16}" == str(Precision.AMP_FP16) == "amp_fp16"
    assert TrainerMode("EVAL") is TrainerMode.EVAL == "eval" and issubclass(TrainerMode, StringEnum)
    assert Batch is not None and Dataset == torch.utils.data.Dataset[Batch] and JSON is not None


def test_the_trainer_takes_a_precision_member() -> None:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(7), max_duration="1ba", precision=Precision.AMP_BF16,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False)
    assert trainer.state.precision == "amp_bf16" and trainer.state.precision is Precision.AMP_BF16  # Composer's member
    trainer.fit(precision=Precision.FP32)
    assert trainer.state.precision == Precision.FP32


def test_get_precision_context_autocasts_on_this_device() -> None:
    a = torch.ones(4, 4)
    with get_precision_context(Precision.AMP_BF16):
        assert (a @ a).dtype is torch.bfloat16
    with get_precision_context("fp32"):
        assert (a @ a).dtype is torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16), get_precision_context(Precision.FP32):
        assert (a @ a).dtype is torch.float32  # fp32 inside an enclosing autocast too
    assert error_of(lambda: get_precision_context("amp_fp8").__enter__()) == (
        "precision='amp_fp8' needs NVIDIA's Transformer Engine, which lockstep does not use; use 'amp_bf16'")
    assert error_of(lambda: get_precision_context("fp64").__enter__()) == (
        "precision='fp64' is not one of fp32, amp_fp16, amp_bf16, amp_fp8")


def test_names_are_formatted_with_the_ranks_and_the_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Composer's own docstring example, and its time fields; a field with no value stays as it is
    assert format_name_with_dist("{run_name}/rank{rank}.{extension}", run_name="awesome_training_run",
                                 extension="json") == "awesome_training_run/rank0.json"
    assert error_of(format_name_with_dist, "{rank}", "r", rank=3, expected=(TypeError,)).endswith(
        "got multiple values for keyword argument 'rank'")  # as in Composer
    timestamp = Timestamp(epoch=2, batch=37, batch_in_epoch=5, sample=296, token=0,
                          total_wct=datetime.timedelta(seconds=90))
    assert format_name_with_dist_and_time("{run_name}/ep{epoch}-ba{batch:05d}-{batch_in_epoch}-{sample}-"
                                          "rank{rank}-of-{world_size}-{total_wct:.0f}s-{later}", "r", timestamp) \
        == "r/ep2-ba00037-5-296-rank0-of-1-90s-{later}"
    monkeypatch.setenv("WORLD_SIZE", "2")  # and no RANK: the values the environment lacks stay too
    assert format_name_with_dist("{run_name}-{rank}-{world_size}", "r") == "r-{rank}-2"
    assert partial_format("{a}-{}-{b!r:>4}-{{x}}", 1, a=2) == "2-1-{b!r:>4}-{x}"
    assert partial_format("{}-{}", 1) == "1-{}" and partial_format("{}-{}") == "{}-{}"


def test_composer_metadata_file_says_what_the_run_ran_on(tmp_path) -> None:
    import json

    import lockstep
    from lockstep.checkpoint.save import save_composer_metadata_to_disk
    from tests.trainer.common import MLP

    path = save_composer_metadata_to_disk(str(tmp_path / "deep" / "composer_metadata.json"), model=MLP(),
                                          sharded_state_dict=False, precision=torch.bfloat16,
                                          device_train_microbatch_size=4)
    written = json.loads(open(path).read())
    assert written["composer_version"] == lockstep.__version__ and written["torch_version"] == torch.__version__
    assert written["model_name"] == "MLP" and written["precision"] == "bfloat16"
    assert written["sharded_state_dict"] is False and written["device_train_microbatch_size"] == 4
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["composer_metadata.json"]  # no temp file left
