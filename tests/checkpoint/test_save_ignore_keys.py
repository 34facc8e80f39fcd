"""save_ignore_keys that leave nothing to load are refused, and those that lose an exact resume are
warned about (issue 49): ``['**']`` used to write checkpoints holding ``{'state': {}}`` and no RNG
without a word, and move the latest pointer to them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(120)


def _trainer(folder: Path, **kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters()),
                   device="cpu", progress_bar=False, max_duration="4ba", save_folder=str(folder),
                   save_interval="2ba", **kwargs)


@pytest.mark.parametrize("globs", [["**"], ["*"], ["state"], ["state/*", "rng"], ["state/model"], ["state/model/*"],
                                   ["state/model/net.0.*", "state/model/net.2.*"]])
@pytest.mark.parametrize("weights_only", [False, True])
def test_globs_that_leave_out_every_weight_are_refused_at_construction(tmp_path: Path, globs: list[str],
                                                                        weights_only: bool) -> None:
    error = error_of(_trainer, tmp_path / "ckpt", save_ignore_keys=globs, save_weights_only=weights_only,
                     expected=(ValueError,))
    assert error.startswith(f"save_ignore_keys={globs!r} leaves every model weight out") and "\n" not in error, error
    assert not list(tmp_path.rglob("*.pt"))


@pytest.mark.parametrize(("globs", "lost"), [
    (["rng"], "'rng'"), (["state/timestamp"], "'state/timestamp'"), (["rng/0/numpy"], "'rng'"),
    (["state/optimizers", "r*", "state/time*"], "'rng' and 'state/timestamp'")])
def test_globs_that_lose_an_exact_resume_are_warned_about_once_at_construction(tmp_path: Path, globs: list[str],
                                                                              lost: str) -> None:
    with pytest.warns(UserWarning, match="does not continue exactly") as seen:
        trainer = _trainer(tmp_path / "ckpt", save_ignore_keys=globs)
    assert sum("does not continue exactly" in str(w.message) for w in seen) == 1
    assert f"leaves {lost} out" in str(seen[0].message)
    trainer.fit()
    assert torch.load(trainer.saved_checkpoints[-1], weights_only=True)["state"]["model"]


def test_partial_globs_change_nothing_else(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer(tmp_path / "ckpt", save_ignore_keys=["state/optimizers", "state/model/net.2.*"])
        trainer.fit()
    assert sorted(torch.load(trainer.saved_checkpoints[-1], weights_only=True)["state"]["model"]) == \
        ["net.0.bias", "net.0.weight"]


def _strip_everything(tree: dict) -> None:
    tree.clear()
    tree["state"] = {}


def _strip_rng(tree: dict) -> None:
    del tree["rng"]


def test_a_function_that_strips_the_model_fails_the_run_and_writes_nothing(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "ckpt", save_ignore_keys=_strip_everything)
    error = error_of(trainer.fit, expected=(RuntimeError,))
    assert "save_ignore_keys=_strip_everything left no model weight" in error and "\n" not in error, error
    assert trainer.state.timestamp.batch <= 4
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("latest*"))


def test_a_function_that_strips_the_rng_is_warned_about(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "ckpt", save_ignore_keys=_strip_rng)
    with pytest.warns(UserWarning, match="_strip_rng leaves 'rng' out of the checkpoints"):
        trainer.fit()
    assert "rng" not in torch.load(trainer.saved_checkpoints[-1], weights_only=True)


def _fit_stripped(folder: str) -> str:
    try:
        _trainer(Path(folder), save_ignore_keys=_strip_everything).fit()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_every_rank_of_a_ddp_run_fails_alike(tmp_path: Path) -> None:
    errors = run_distributed(_fit_stripped, 2, args=(str(tmp_path / "ckpt"),), timeout=100,
                             env={"OMP_NUM_THREADS": "1"})
    assert all("left no model weight" in e and "on rank 0" in e for e in errors), errors
    assert not list(tmp_path.rglob("*.pt"))
