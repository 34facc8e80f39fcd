"""Composer's Trainer methods beyond fit, eval and predict: ``save_checkpoint`` and
``save_checkpoint_to_save_folder``, on one process and on 2 ranks; and ``export_for_inference``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer, dist
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, error_of, full_params, loader, params

pytestmark = pytest.mark.timeout(120)


def trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(7 if dist.get_world_size() == 1 else 4),
                   optimizers=torch.optim.Adam(model.parameters(), lr=0.01), progress_bar=False, seed=3, **kwargs)


def test_save_checkpoint_writes_the_state_at_a_name_and_a_load_continues_from_it(tmp_path: Path) -> None:
    uninterrupted = trainer(max_duration="6ba")
    uninterrupted.fit()
    first = trainer(max_duration="6ba")
    first.fit(duration="3ba")
    path = first.save_checkpoint(str(tmp_path / "saved" / "at-ba{batch}.pt"))
    assert path == str(tmp_path / "saved" / "at-ba3.pt") and os.path.isfile(path)
    resumed = trainer(max_duration="6ba", load_path=path)
    assert resumed.state.timestamp.batch == 3
    resumed.fit()
    for name, value in params(uninterrupted.state.model).items():
        assert torch.equal(params(resumed.state.model)[name], value), name
    weights = first.save_checkpoint(str(tmp_path / "weights.pt"), weights_only=True)
    saved = torch.load(weights, weights_only=True)  # the model's state_dict (as save_weights_only writes)
    assert saved.keys() == params(first.state.model).keys()
    assert all(torch.equal(saved[k], v) for k, v in params(first.state.model).items())


class SaveAtBatch(Callback):
    def __init__(self, trainer: Trainer, batch: int) -> None:
        self.trainer, self.batch = trainer, batch

    def batch_end(self, state, logger=None) -> None:
        if state.timestamp.batch == self.batch:
            self.trainer.save_checkpoint_to_save_folder()


def test_save_checkpoint_to_save_folder_saves_as_the_run_does_and_moves_latest(tmp_path: Path) -> None:
    assert error_of(trainer(max_duration="3ba").save_checkpoint_to_save_folder) == (
        "save_checkpoint_to_save_folder() writes into save_folder: give save_folder=... to Trainer(...)")
    run = trainer(max_duration="3ba", save_folder=str(tmp_path), save_interval="10ep")
    run.save_checkpoint_to_save_folder()  # before training
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ep0-ba0-rank0.pt"
    run.callbacks.append(SaveAtBatch(run, 2))
    run.fit()  # saves ba2 from the callback, ba3 at the end
    assert sorted(os.listdir(tmp_path)) == ["ep0-ba0-rank0.pt", "ep0-ba2-rank0.pt", "ep0-ba3-rank0.pt",
                                            "latest-rank0.pt"]
    run.save_checkpoint_to_save_folder()  # ba3 is saved: nothing new
    assert len(os.listdir(tmp_path)) == 4 and os.readlink(tmp_path / "latest-rank0.pt") == "ep0-ba3-rank0.pt"
    from_ba2 = trainer(max_duration="3ba", load_path=str(tmp_path / "ep0-ba2-rank0.pt"))
    from_ba2.fit()
    for name, value in params(run.state.model).items():
        assert torch.equal(params(from_ba2.state.model)[name], value), name


class TypedMLP(MLP):
    """An MLP whose forward TorchScript can compile as it is called: on an (inputs, targets) pair."""

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])


def test_export_for_inference_writes_a_torchscript_model_that_computes_the_same(tmp_path) -> None:
    model = TypedMLP()
    run = Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", progress_bar=False,
                  optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    run.fit()
    run.export_for_inference("torchscript", str(tmp_path / "model.pt"))
    sample = (torch.randn(5, 6), torch.zeros(5, dtype=torch.long))
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(sample), model(sample))
    with pytest.raises(ValueError, match="needs sample_input"):
        from lockstep.utils.inference import export_for_inference
        export_for_inference(model, "onnx", str(tmp_path / "model.onnx"))


def _on_two_ranks(folder: str) -> tuple[str | None, dict, dict]:
    run = trainer(max_duration="2ba", fsdp_config={"state_dict_type": "sharded"})
    run.fit()
    path = run.save_checkpoint(os.path.join(folder, "ba{batch}"))
    resumed = trainer(max_duration="2ba", fsdp_config={"state_dict_type": "sharded"}, load_path=path)
    return path, full_params(run.state.model), full_params(resumed.state.model)


@pytest.mark.timeout(150)
def test_save_checkpoint_under_fsdp_sharded_writes_a_folder_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_on_two_ranks, world_size=2, args=(str(tmp_path),), timeout=130)
    assert (tmp_path / "ba2" / ".metadata").is_file()
    for path, saved, loaded in results:
        assert path == str(tmp_path / "ba2")  # on every rank, as in Composer
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
