"""DeepSpeed checkpoints: exact resume per ZeRO stage, autoresume (past a damaged checkpoint too),
export, weights across layouts, and damaged or foreign files refused before DeepSpeed unpickles them."""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch

from lockstep import Trainer, dist
from lockstep.checkpoint import export_state_dict
from lockstep.checkpoint.files import CheckpointError
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, assert_fell_back, assert_same_params, damage, error_of, loader
from tests.trainer.test_deepspeed import needs_deepspeed

pytestmark = needs_deepspeed
GLOBAL_BATCH = 8  # 28 samples: 4 batches per epoch
NAME = "ep{epoch}-ba{batch}"


class DropoutMLP(MLP):
    """Dropout draws from each rank's RNG every step: an exact resume must restore it."""

    def forward(self, batch):
        return self.net(torch.nn.functional.dropout(batch[0], 0.2, training=self.training))


def fit(stage: int | None, folder: str | None, duration: str, load: str | None = None, autoresume: bool = False,
        weights_only: bool = False, train: bool = True) -> dict[str, torch.Tensor]:
    from lockstep.parallel.deepspeed import full_state_dict

    model = DropoutMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = Trainer(
        model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size(), shuffle=True),
        max_duration=duration, optimizers=optimizer,
        schedulers=torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5),
        progress_bar=False, seed=7, device_train_microbatch_size=2,
        deepspeed_config=None if stage is None else {"zero_optimization": {"stage": stage}},
        save_folder=folder, save_filename=NAME, save_interval="3ba", load_path=load,
        load_weights_only=weights_only, autoresume=autoresume, run_name="ds-ck" if autoresume else None)
    if train:
        trainer.fit()
    return full_state_dict(model)


def _resume_exactly(stage: int, folder: str) -> tuple[dict, dict, dict]:
    from lockstep.checkpoint.deepspeed import DeepSpeedLayout

    uninterrupted = fit(stage, None, "2ep")
    writers, write = [], DeepSpeedLayout.write_captured

    def recorded(self, captured):
        writers.append(threading.current_thread().name)
        write(self, captured)

    DeepSpeedLayout.write_captured = recorded
    try:
        fit(stage, folder, "6ba")  # saves at ba3 (mid-epoch) and ba6
    finally:
        DeepSpeedLayout.write_captured = write
    resumed = fit(stage, None, "2ep", load=os.path.join(folder, "ep0-ba3"))
    exported = export_state_dict(os.path.join(folder, "ep1-ba6"))
    at_ba6 = fit(stage, None, "6ba", load=os.path.join(folder, "ep0-ba3"))
    return uninterrupted, resumed, {"exported": exported, "at_ba6": at_ba6, "writers": writers}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # 0: no partitions, the weights whole in the model states file
def test_exact_resume_and_export(stage: int, tmp_path: Path) -> None:
    results = run_distributed(_resume_exactly, world_size=2, args=(stage, str(tmp_path)), timeout=220)
    for uninterrupted, resumed, extra in results:
        # both saves are written by every rank's writer thread while training goes on, from a copy
        assert len(extra["writers"]) == 2 and all(w.startswith("lockstep-checkpoint") for w in extra["writers"])
        assert_same_params(resumed, uninterrupted, atol=0)
        assert_same_params(extra["exported"], extra["at_ba6"], atol=0)
    folder = tmp_path / "ep0-ba3"
    assert (folder / "lockstep.pt").is_file() and (folder / "deepspeed").is_dir()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary folder left


def _autoresume(folder: str) -> tuple[dict, dict]:
    uninterrupted = fit(3, None, "2ep")
    fit(3, folder, "5ba", autoresume=True)  # saves ba3 and the end, ba5
    resumed = fit(3, folder, "2ep", autoresume=True)
    return uninterrupted, resumed


@pytest.mark.timeout(180)
def test_autoresume(tmp_path: Path) -> None:
    for uninterrupted, resumed in run_distributed(_autoresume, world_size=2, args=(str(tmp_path),), timeout=160):
        assert_same_params(resumed, uninterrupted, atol=0)


def _past_damage(folder: str, cases: list[tuple[str, str]]) -> tuple[dict, list[tuple]]:
    """ZeRO-2: save ba3 and ba6 once, and a run loaded from ba3; then for each (file pattern,
    damage), in a copy of the saved folder: damage that file of ba6, then load_path at it and
    autoresume."""
    saved = Path(folder) / "saved"
    fit(2, str(saved), "6ba", autoresume=True)
    from_ba3 = fit(2, None, "2ep", load=str(saved / "ep0-ba3"))
    tried = []
    for n, (pattern, how) in enumerate(cases):
        copy = Path(folder) / f"copy{n}"
        dist.barrier()
        if dist.get_global_rank() == 0:
            shutil.copytree(saved, copy, symlinks=True)
            damage(next((copy / "ep1-ba6" / "deepspeed").glob(pattern)), how)
        dist.barrier()
        error = error_of(fit, 2, None, "2ep", load=str(copy / "ep1-ba6"), train=False, expected=(CheckpointError,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = fit(2, str(copy), "2ep", autoresume=True)  # from ba3, and saves ba6 again
        tried.append((resumed, error, [str(w.message) for w in caught if "autoresume" in str(w.message)],
                      sorted(os.listdir(copy))))
    return from_ba3, tried


_LOAD_OLDER = ": load an older checkpoint or delete this one"
DEEPSPEED_DAMAGE = {  # (file, damage) -> what the one-line error says after "rank N: "
    ("*rank_1_*optim_states.pt", "delete"): r"deepspeed/\S*rank_1_\S*optim_states\.pt is missing \(deleted\?\)",
    ("*rank_0_*optim_states.pt", "flip"): r"deepspeed/\S*rank_0_\S*optim_states\.pt fails its CRC32 check "
                                         r"\(flipped bytes\?\)",
    ("*model_states.pt", "truncate"): r"deepspeed/\S*model_states\.pt is \d+ bytes, expected \d+ \(truncated\?\)",
}


@pytest.mark.timeout(400)
def test_autoresume_falls_back_past_a_damaged_checkpoint(tmp_path: Path) -> None:
    from_ba3, tried = zip(*run_distributed(_past_damage, world_size=2, args=(str(tmp_path), list(DEEPSPEED_DAMAGE)),
                                           timeout=380))
    for rank, cases_tried in enumerate(tried):
        for n, (case, (resumed, error, warned, listed)) in enumerate(zip(DEEPSPEED_DAMAGE, cases_tried)):
            newest = re.escape(str(tmp_path / f"copy{n}" / "ep1-ba6"))
            said = rf"checkpoint {newest} is damaged: {DEEPSPEED_DAMAGE[case]}{_LOAD_OLDER}"
            assert re.fullmatch(rf"rank \d: {said}", error), (case, error)  # load_path: one line, on every rank
            assert_fell_back(rank, resumed, from_ba3[rank], warned, listed, said=said, older="ep0-ba3",
                             newest="ep1-ba6")


def _weights_across_layouts(folder: str) -> dict[str, dict]:
    ds_folder, ddp_folder = os.path.join(folder, "ds"), os.path.join(folder, "ddp")
    fit(3, ds_folder, "3ba")
    fit(None, ddp_folder, "3ba")
    return {
        "ds3": export_state_dict(os.path.join(ds_folder, "ep0-ba3")),
        "ddp": export_state_dict(os.path.join(ddp_folder, "ep0-ba3")),
        # a ZeRO-3 checkpoint's weights into ZeRO-1 and into DDP; DDP's into ZeRO-3
        "ds3->ds1": fit(1, None, "1ep", load=os.path.join(ds_folder, "ep0-ba3"), weights_only=True, train=False),
        "ds3->ddp": fit(None, None, "1ep", load=os.path.join(ds_folder, "ep0-ba3"), weights_only=True, train=False),
        "ddp->ds3": fit(3, None, "1ep", load=os.path.join(ddp_folder, "ep0-ba3"), weights_only=True, train=False),
    }


@pytest.mark.timeout(180)
def test_weights_load_across_layouts(tmp_path: Path) -> None:
    for result in run_distributed(_weights_across_layouts, world_size=2, args=(str(tmp_path),), timeout=160):
        assert_same_params(result["ds3->ds1"], result["ds3"], atol=0)
        assert_same_params(result["ds3->ddp"], result["ds3"], atol=0)
        assert_same_params(result["ddp->ds3"], result["ddp"], atol=0)
    # the training went somewhere: the two runs differ from a fresh model
    assert not torch.equal(result["ds3"]["net.0.weight"], MLP().net[0].weight)


def _error_of(stage: int | None, load: str) -> str:
    return error_of(fit, stage, None, "1ep", load=load, train=False, expected=(CheckpointError, ValueError))


def _refusals(folder: str) -> dict[str, str]:
    """Save, then ask for the refusals one after the other in the same two processes (DeepSpeed's
    import and setup cost seconds per launch): another stage, DDP, then a truncated and a foreign
    partition written by rank 0. An intact copy is kept for the one-rank check."""
    import shutil

    fit(2, folder, "3ba")
    checkpoint = Path(folder) / "ep0-ba3"
    out = {"stage": _error_of(3, str(checkpoint)), "ddp": _error_of(None, str(checkpoint))}
    partition = next((checkpoint / "deepspeed").glob("*rank_1*optim_states.pt"))
    size = partition.stat().st_size
    dist.barrier()
    if dist.get_global_rank() == 0:
        shutil.copytree(checkpoint, Path(folder) / "intact")
        partition.write_bytes(partition.read_bytes()[: size // 2])
    dist.barrier()
    out.update(truncated=_error_of(2, str(checkpoint)), partition=str(partition), size=str(size))
    dist.barrier()
    if dist.get_global_rank() == 0:
        torch.save({"optimizer_state_dict": Foreign()}, partition)
        _rewrite_sizes(checkpoint)
    dist.barrier()
    out["foreign"] = _error_of(2, str(checkpoint))
    return out


class Foreign:
    """Not something a checkpoint may unpickle."""


def _rewrite_sizes(folder: Path) -> None:
    """Record the files' current sizes and CRC32s in lockstep.pt, as a crafted checkpoint would."""
    from lockstep.checkpoint import files, integrity
    meta_path = folder / "lockstep.pt"
    content = files.read(meta_path)
    content["lockstep"]["files"] = {k: (folder / k).stat().st_size for k in content["lockstep"]["files"]}
    content["lockstep"]["parts"] = integrity.record(folder, content["lockstep"]["parts"])
    torch.save(content, folder / "new.pt")  # not over meta_path: content is mapped from it
    os.replace(folder / "new.pt", meta_path)


@pytest.mark.timeout(240)
def test_bad_checkpoints_are_refused_with_the_file_named(tmp_path: Path) -> None:
    for e in run_distributed(_refusals, world_size=2, args=(str(tmp_path),), timeout=200):
        assert "saved with ZeRO stage 2 and this run uses stage 3" in e["stage"]
        assert "is a DeepSpeed checkpoint: resume it with deepspeed_config" in e["ddp"]
        size = int(e["size"])
        partition = Path(e["partition"])
        assert f"checkpoint {partition.parents[1]} is damaged: deepspeed/{partition.name} is {size // 2} bytes, " \
               f"expected {size} (truncated?)" in e["truncated"]
        assert "would unpickle [" in e["foreign"] and "Foreign'], which lockstep does not load" in e["foreign"]
    one_rank = run_distributed(_error_of, world_size=1, args=(2, str(tmp_path / "intact")), timeout=120)[0]
    assert "saved by 2 rank(s) and this run has 1" in one_rank
    with pytest.raises(CheckpointError, match="would unpickle"):
        export_state_dict(tmp_path / "ep0-ba3")
