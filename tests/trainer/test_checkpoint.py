"""Trainer checkpoints: names and intervals, exact resume, autoresume, retention, errors, export."""

from __future__ import annotations

import os
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from lockstep import Callback, Trainer, dist
from lockstep.checkpoint import CheckpointError, export_safetensors, export_state_dict, staging, zipwriter
from lockstep.optim import CosineAnnealingWithWarmupScheduler
from lockstep.testing import run_distributed
from tests.fixtures.numerics import for_this_machine
from tests.trainer.common import MLP, DropoutMLP, NoisyDataset, assert_same_params, error_of, loader, params

# 28 samples, batch 4 per rank at world size 1: 7 batches per epoch


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def make(max_duration: str, folder: Path | str | None, *, model_cls=DropoutMLP, data=None, batch: int = 4,
         microbatch: int | None = None, scheduler: Any = True, **kw) -> Trainer:
    torch.manual_seed(0)
    model = model_cls()
    opt = adamw(model)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)] if scheduler is True else (scheduler or None)
    return Trainer(model=model, train_dataloader=data if data is not None else loader(batch, shuffle=True),
                   max_duration=max_duration, optimizers=opt, schedulers=schedulers, progress_bar=False,
                   save_folder=None if folder is None else str(folder), seed=7,
                   device_train_microbatch_size=microbatch, **kw)


def fit(max_duration: str, folder, **kw) -> dict[str, torch.Tensor]:
    trainer = make(max_duration, folder, **kw)
    trainer.fit()
    return params(trainer.state.model)


def names(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert_same_params(a, b, atol=0)


# -- names and intervals ----------------------------------------------------------------------

def test_epoch_field_counts_completed_epochs_and_end_of_training_saves(tmp_path: Path) -> None:
    fit("10ba", tmp_path, data=loader(7))  # 4 batches per epoch
    assert names(tmp_path) == sorted(["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt", "ep2-ba10-rank0.pt", "latest-rank0.pt"])
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ep2-ba10-rank0.pt"


def test_batch_sample_and_callable_intervals(tmp_path: Path) -> None:
    fit("7ba", tmp_path / "ba", save_interval="3ba", save_filename="b{batch}.pt", save_latest_filename=None)
    assert names(tmp_path / "ba") == sorted(["b3.pt", "b6.pt", "b7.pt"])
    fit("7ba", tmp_path / "sp", save_interval="10sp", save_filename="s{sample}.pt")
    assert names(tmp_path / "sp") == sorted(["latest-rank0.pt", "s12.pt", "s20.pt", "s28.pt"])
    seen = []

    def every_other_epoch(state, event):
        seen.append(event.value)
        return event.value == "epoch_end" and state.timestamp.epoch % 2 == 0

    fit("4ep", tmp_path / "fn", save_interval=every_other_epoch, save_filename="e{epoch}-{run_name}.pt",
        run_name="r1")
    assert names(tmp_path / "fn") == sorted(["e2-r1.pt", "e4-r1.pt", "latest-rank0.pt"])
    assert seen.count("epoch_end") == 4 and seen.count("batch_end") == 28


def test_keep_newest_n_across_a_resume(tmp_path: Path) -> None:
    fit("5ba", tmp_path, save_interval="1ba", save_num_checkpoints_to_keep=2, run_name="k", autoresume=True)
    assert names(tmp_path) == sorted(["ep0-ba4-rank0.pt", "ep0-ba5-rank0.pt", "latest-rank0.pt"])
    fit("8ba", tmp_path, save_interval="1ba", save_num_checkpoints_to_keep=2, run_name="k", autoresume=True)
    assert names(tmp_path) == sorted(["ep1-ba7-rank0.pt", "ep1-ba8-rank0.pt", "latest-rank0.pt"])


def test_save_folder_with_run_name(tmp_path: Path) -> None:
    fit("2ba", str(tmp_path / "{run_name}"), run_name="exp")
    assert names(tmp_path / "exp") == sorted(["ep0-ba2-rank0.pt", "latest-rank0.pt"])


def test_overwrite_is_refused_unless_asked(tmp_path: Path) -> None:
    fit("2ba", tmp_path)
    with pytest.raises(FileExistsError, match="already holds checkpoints .* save_overwrite=True"):
        make("2ba", tmp_path)
    fit("2ba", tmp_path, save_overwrite=True)
    # resuming from a checkpoint of the folder is allowed; replacing one of its files is not
    with pytest.raises(FileExistsError, match=r"ep0-ba2-rank0\.pt already exists: pass save_overwrite=True"):
        fit("2ba", tmp_path, load_path=str(tmp_path / "ep0-ba2-rank0.pt"), load_weights_only=True)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="save_num_checkpoints_to_keep must be -1"):
        make("2ba", tmp_path, save_num_checkpoints_to_keep=-2)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['step'\]"):
        make("2ba", tmp_path, save_filename="{step}.pt")
    with pytest.raises(ValueError, match="autoresume=True needs run_name"):
        make("2ba", tmp_path, autoresume=True)
    with pytest.raises(ValueError, match="autoresume=True needs save_folder"):
        make("2ba", None, autoresume=True, run_name="x")
    with pytest.raises(ValueError, match="save_interval must be positive|must be > 0|positive"):
        make("2ba", tmp_path, save_interval="0ba")


# -- exact resume at world size 1 ---------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    return folder, fit("17ba", folder, save_interval="1ba")


def test_the_checkpoint_has_composers_top_level_layout(uninterrupted) -> None:
    """Code written for Composer's checkpoints reads ckpt['state']['model'] and the rest."""
    folder, _ = uninterrupted
    saved = torch.load(folder / "ep0-ba3-rank0.pt", weights_only=True)
    state = saved["state"]
    assert {"model", "optimizers", "schedulers", "timestamp"} <= state.keys() and len(saved["rng"]) == 1
    assert state["timestamp"]["Timestamp"]["batch"] == 3 and state["model"].keys() == MLP().state_dict().keys()
    assert state["optimizers"][0]["state"][0]["exp_avg"].shape == state["model"]["net.0.weight"].shape


V1_CHECKPOINT = for_this_machine(Path(__file__).parents[1] / "fixtures" / "lockstep_v1" / "ep0-ba3-rank0.pt")


def test_a_checkpoint_of_the_earlier_layout_resumes_bit_identically(uninterrupted, tmp_path: Path) -> None:
    """ep0-ba3-rank0.pt was written by lockstep before checkpoints took Composer's layout (format
    version 1), by the same run as ``uninterrupted`` (tests/fixtures/lockstep_v1/make_fixture.py)."""
    assert "model" in torch.load(V1_CHECKPOINT, weights_only=True)
    _, reference = uninterrupted
    assert_bitwise(fit("17ba", tmp_path, load_path=str(V1_CHECKPOINT)), reference)


@pytest.mark.parametrize("step", ["ep0-ba3", "ep1-ba7", "ep1-ba9", "ep2-ba14"])
def test_resume_is_bit_identical(uninterrupted, tmp_path: Path, step: str) -> None:
    """Mid-epoch (ba3, ba9) and at epoch boundaries (ba7, ba14), with shuffling, dropout, AdamW
    and a scheduler: the resumed run ends with the uninterrupted run's exact parameters."""
    folder, reference = uninterrupted
    resumed = fit("17ba", tmp_path, load_path=str(folder / f"{step}-rank{{rank}}.pt"))
    assert_bitwise(resumed, reference)


def test_checkpoints_written_around_the_page_cache_resume_exactly(
        uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every tensor large enough to go from the stager's page-aligned buffers to the disk with
    O_DIRECT (the threshold lowered to this tiny model), the background saves still resume exactly."""
    monkeypatch.setattr(zipwriter, "DIRECT_MIN", 1)
    fit("17ba", tmp_path / "direct", save_interval="1ba")
    with zipfile.ZipFile(tmp_path / "direct" / "ep1-ba9-rank0.pt") as archive:
        alignment = next(archive.read(r) for r in archive.infolist() if r.filename.endswith("/.storage_alignment"))
    assert alignment == str(zipwriter.PAGE).encode()
    resumed = fit("17ba", tmp_path / "resumed", load_path=str(tmp_path / "direct" / "ep1-ba9-rank{rank}.pt"))
    assert_bitwise(resumed, uninterrupted[1])


class _Seen(Callback):
    """The weights and AdamW moments at every BATCH_END (a save comes right after it)."""

    def __init__(self) -> None:
        self.seen: dict[int, Any] = {}

    def batch_end(self, state: Any, logger: Any) -> None:
        optimizer = state.optimizers[0]
        moments = [optimizer.state[p]["exp_avg"].clone() for p in state.model.parameters()]
        self.seen[int(state.timestamp.batch)] = (params(state.model), moments)


class _Bump(Callback):
    """Changes the weights in place at BATCH_CHECKPOINT, right after a save."""

    def batch_checkpoint(self, state: Any, logger: Any) -> None:
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)


@pytest.mark.parametrize("bump", [False, True], ids=["optimizer-step-waits", "callback-waits"])
def test_a_background_copy_of_the_weights_holds_the_saved_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bump: bool) -> None:
    """The writer thread copies the parameters and optimizer state while training goes on; with
    that copy held back, the next optimizer step (or a callback that changes the weights) waits
    for it, so each checkpoint holds exactly the state of the batch it names."""
    slow = staging.Stager.copy_later

    def copy_late(self: staging.Stager) -> None:
        time.sleep(0.2)  # several steps' time: without the wait, later weights would be copied
        slow(self)

    monkeypatch.setattr(staging.Stager, "copy_later", copy_late)
    probe = _Seen()
    trainer = make("6ba", tmp_path, save_interval="2ba", scheduler=None, callbacks=[probe, _Bump()] if bump else [probe])
    trainer.fit()
    for batch in (2, 4, 6):
        saved = torch.load(tmp_path / f"ep0-ba{batch}-rank0.pt", weights_only=True)
        weights, moments = probe.seen[batch]
        assert_bitwise(saved["state"]["model"], weights)
        for i, moment in enumerate(moments):
            assert torch.equal(saved["state"]["optimizers"][0]["state"][i]["exp_avg"], moment)


def test_a_save_still_being_written_when_training_raises_is_whole_when_fit_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash right after a save, while the writer thread still writes it: fit raises only once that
    checkpoint is on disk whole, so a Trainer the same process builds next resumes from it (and its
    own writes never meet the old thread's temporary file)."""
    slow = staging.Stager.copy_later

    def copy_late(self: staging.Stager) -> None:
        time.sleep(0.5)
        slow(self)

    class Crash(Callback):
        def batch_start(self, state: Any, logger: Any) -> None:
            if state.timestamp.batch == 3:
                raise RuntimeError("crash")

    monkeypatch.setattr(staging.Stager, "copy_later", copy_late)
    trainer = make("6ba", tmp_path, save_interval="2ba", scheduler=None, callbacks=[Crash()], run_name="crash")
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit()
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]
    saved = torch.load(tmp_path / "ep0-ba2-rank0.pt", weights_only=True)
    assert saved["state"]["timestamp"]["Timestamp"]["batch"] == 2
    monkeypatch.undo()
    resumed = make("6ba", tmp_path, save_interval="2ba", scheduler=None, autoresume=True, run_name="crash")
    assert resumed.state.timestamp.batch == 2


def test_a_checkpoint_too_big_to_copy_is_written_before_training_goes_on(
        uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_available_memory", lambda: 100)  # no room for a copy

    class NoCopy(Callback):
        def batch_checkpoint(self, state: Any, logger: Any) -> None:
            assert trainer.saver.copying is None and trainer.saver._stager._buffers == []

    trainer = make("17ba", tmp_path / "direct", save_interval="3ba", callbacks=[NoCopy()])
    trainer.fit()
    resumed = fit("17ba", tmp_path / "resumed", load_path=str(tmp_path / "direct" / "ep1-ba9-rank0.pt"))
    assert_bitwise(resumed, uninterrupted[1])


def test_a_schedule_of_training_time_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    def run(duration: str, folder: Path, **kw) -> tuple[dict[str, torch.Tensor], float]:
        trainer = make(duration, folder, save_interval="3ba",
                       scheduler=CosineAnnealingWithWarmupScheduler("4ba", t_max="17ba", alpha_f=0.1), **kw)
        trainer.fit()
        return params(trainer.state.model), trainer.state.optimizers[0].param_groups[0]["lr"]

    reference, lr = run("17ba", tmp_path / "a")
    assert lr == pytest.approx(0.01 * 0.1)  # the schedule ran to its end
    resumed, _ = run("17ba", tmp_path / "b", load_path=str(tmp_path / "a/ep1-ba9-rank{rank}.pt"))
    assert_bitwise(resumed, reference)


def test_resume_without_rng_would_differ(uninterrupted, tmp_path: Path) -> None:
    """The check above can fail: loading only the weights and optimizer (no RNG) diverges."""
    folder, reference = uninterrupted
    trainer = make("17ba", tmp_path, load_path=str(folder / "ep1-ba9-rank0.pt"))
    trainer._resume_entry = None  # drop the RNG and data position
    trainer.fit()
    assert any(not torch.equal(reference[k], v) for k, v in params(trainer.state.model).items())


def noisy_loader(workers: int = 0) -> DataLoader:
    ds = NoisyDataset()
    return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds), num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_random_augmentation_and_a_global_rng_sampler(tmp_path: Path, workers: int) -> None:
    """A RandomSampler seeded from the global RNG and a dataset drawing from torch, numpy and
    python RNGs in the main process (or in worker processes) still resume exactly."""
    reference = fit("10ba", tmp_path / "a", data=noisy_loader(workers), save_interval="2ba")
    resumed = fit("10ba", tmp_path / "b", data=noisy_loader(workers), load_path=str(tmp_path / "a/ep0-ba4-rank0.pt"))
    assert_bitwise(resumed, reference)
    resumed = fit("10ba", tmp_path / "c", data=noisy_loader(workers), load_path=str(tmp_path / "a/ep1-ba8-rank0.pt"))
    assert_bitwise(resumed, reference)


class LazyRandomDataset(torch.utils.data.Dataset):
    """Made at random on its first read (Composer's test datasets are), so a resumed run reads the
    same data only if it reads the batches before the resumed one as the uninterrupted run did."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def __len__(self) -> int:
        return 28

    def __getitem__(self, i):
        if self.x is None:
            self.x, self.y = torch.randn(28, 6), torch.randint(0, 3, (28,))
        return self.x[i], self.y[i]


def lazy_loader() -> DataLoader:
    ds = LazyRandomDataset()
    return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds))


def test_a_dataset_made_on_its_first_read_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    reference = fit("10ba", tmp_path / "a", data=lazy_loader(), save_interval="2ba")
    data = lazy_loader()
    resumed = fit("10ba", tmp_path / "b", data=data, load_path=str(tmp_path / "a/ep0-ba4-rank0.pt"))
    assert_bitwise(resumed, reference)


class KeepsItsPlace(torch.utils.data.IterableDataset):
    """A dataset that keeps its own place in an epoch, as mosaicml-streaming's StreamingDataset
    does, through the protocol Composer's checkpoints use: ``state_dict(num_samples,
    from_beginning)`` and ``load_state_dict``. Each pass over it is its next epoch, in an order of
    its own; ``read`` lists every sample it yielded."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(28, 6, generator=g), torch.randint(0, 3, (28,), generator=g)
        self.next_epoch, self.resume_at, self.read = 0, 0, []

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        epoch, start = self.next_epoch, self.resume_at
        self.next_epoch, self.resume_at = epoch + 1, 0
        for i in torch.randperm(28, generator=torch.Generator().manual_seed(epoch)).tolist()[start:]:
            self.read.append(i)
            yield self.x[i], self.y[i]

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, int]:
        return {"epoch": self.next_epoch - 1, "sample_in_epoch": num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_epoch, self.resume_at = state["epoch"], state["sample_in_epoch"]


def test_a_dataset_that_keeps_its_own_place_resumes_mid_epoch_without_being_spun_or_passed_over(
        tmp_path: Path) -> None:
    # as in Composer (dataset_resumption['train']): before, the resumed run spun it through epoch 0
    # (a pass of its own) and passed over the batch it had already put itself after
    first = KeepsItsPlace()
    reference = fit("12ba", tmp_path / "a", data=DataLoader(first, batch_size=4), save_interval="9ba")
    again = KeepsItsPlace()
    trainer = make("12ba", None, data=DataLoader(again, batch_size=4), load_path=str(tmp_path / "a/ep1-ba9-rank0.pt"))
    assert trainer.state.dataset_resumption == {"train": True}
    trainer.fit()
    assert again.read == first.read[9 * 4:]  # epoch 1 from its third batch on, as the run that saved read it
    assert_bitwise(params(trainer.state.model), reference)


def test_a_run_without_a_seed_resumes_exactly_in_a_process_that_draws_otherwise(tmp_path: Path) -> None:
    """Without ``seed=``, the Trainer seeds every generator at the end of its construction with
    the seed the run started from (a resumed run: the checkpoint's), so the dataloader spin at
    the start of ``fit`` draws the lazily made dataset as the run that saved did."""
    def run(folder: Path, **kw) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = DropoutMLP()
        opt = adamw(model)
        torch.seed()  # from here on the process draws at random, as a script that never seeds does
        trainer = Trainer(model=model, train_dataloader=lazy_loader(), max_duration="14ba", optimizers=opt,
                          progress_bar=False, save_folder=str(folder), save_interval="1ep", **kw)
        trainer.fit()
        return params(trainer.state.model)

    reference = run(tmp_path / "a")
    resumed = run(tmp_path / "b", load_path=str(tmp_path / "a/ep1-ba7-rank0.pt"))
    assert_bitwise(resumed, reference)


def persistent_loader(persistent: bool = True) -> DataLoader:
    ds = NoisyDataset()
    return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds), num_workers=1, persistent_workers=persistent)


def test_persistent_workers_resume_exactly_in_the_first_epoch_and_warn_after_it(tmp_path: Path) -> None:
    # Their random state carries over from epoch to epoch inside the worker processes, so only a
    # resume in the first epoch (which replays its batches) can be exact; a later one says so.
    reference = fit("10ba", tmp_path, data=persistent_loader(), save_interval="4ba")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit("10ba", None, data=persistent_loader(), load_path=str(tmp_path / "ep0-ba4-rank0.pt"))
        make("10ba", None, data=persistent_loader(False), load_path=str(tmp_path / "ep1-ba8-rank0.pt"))
    assert not [w for w in caught if "persistent_workers" in str(w.message)]
    assert_bitwise(resumed, reference)
    with pytest.warns(UserWarning, match="persistent_workers=True: its workers' random state carries over"):
        make("10ba", None, data=persistent_loader(), load_path=str(tmp_path / "ep1-ba8-rank0.pt"))


def test_autoresume_continues_and_starts_fresh_without_a_checkpoint(uninterrupted, tmp_path: Path) -> None:
    _, reference = uninterrupted
    first = make("9ba", tmp_path, run_name="auto", autoresume=True, save_interval="4ba")
    assert first.state.timestamp.batch == 0  # nothing to resume: fresh start
    first.fit()
    second = make("17ba", tmp_path, run_name="auto", autoresume=True, save_interval="4ba")
    assert second.state.timestamp.batch == 9
    second.fit()
    assert_bitwise(params(second.state.model), reference)
    with pytest.raises(CheckpointError, match="a checkpoint of run 'auto', not of run_name 'other'"):
        make("17ba", tmp_path, run_name="other", autoresume=True)


def test_autoresume_skips_a_damaged_newest_checkpoint(uninterrupted, tmp_path: Path) -> None:
    _, reference = uninterrupted
    make("9ba", tmp_path, run_name="auto", autoresume=True, save_interval="4ba").fit()  # ba4, ba8, ba9
    newest = tmp_path / "ep1-ba9-rank0.pt"
    assert os.readlink(tmp_path / "latest-rank0.pt") == newest.name
    _corrupted(tmp_path / "ep1-ba8-rank0.pt", tmp_path / "ba8.pt", 0)  # a damaged copy, for later
    _corrupted(_keep(newest, newest.read_bytes()), newest, 0)
    with pytest.warns(UserWarning, match=r"skipped the newest checkpoint.*ep1-ba9-rank0\.pt is corrupt.*"
                                         r"resumed from .*ep1-ba8-rank0\.pt instead"):
        resumed = make("17ba", tmp_path, run_name="auto", autoresume=True, save_interval="4ba")
    assert resumed.state.timestamp.batch == 8
    resumed.fit()
    assert_bitwise(params(resumed.state.model), reference)
    with pytest.raises(CheckpointError, match="is corrupt"):  # an explicit load_path does not fall back
        make("17ba", None, load_path=str(tmp_path / "ba8.pt"))


def test_autoresume_skips_a_damaged_newest_checkpoint_in_a_subfolder(uninterrupted, tmp_path: Path) -> None:
    # every checkpoint's file is named model.pt: only its folder tells them apart
    _, reference = uninterrupted
    names = {"run_name": "auto", "autoresume": True, "save_interval": "4ba", "save_filename": "ba{batch}/model.pt"}
    make("9ba", tmp_path, **names).fit()  # ba4/model.pt, ba8/model.pt, ba9/model.pt
    newest = tmp_path / "ba9" / "model.pt"
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ba9/model.pt"
    _corrupted(_keep(newest, newest.read_bytes()), newest, 0)
    with pytest.warns(UserWarning, match=r"ba9/model\.pt is corrupt.*resumed from .*ba8/model\.pt instead; renamed "
                                         r"the damaged one to model\.pt\.damaged"):
        resumed = make("17ba", tmp_path, **names)
    assert resumed.state.timestamp.batch == 8
    resumed.fit()
    assert_bitwise(params(resumed.state.model), reference)


def _keep(path: Path, data: bytes) -> Path:
    """A copy of ``data`` beside ``path`` to corrupt from (``_corrupted`` reads its source)."""
    copy = path.with_name(".source.bin")
    copy.write_bytes(data)
    return copy


def test_autoresume_with_every_checkpoint_damaged_fails_on_the_newest(tmp_path: Path) -> None:
    make("4ba", tmp_path, run_name="auto", autoresume=True, save_interval="2ba").fit()  # ba2, ba4
    for name in ("ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt"):
        _corrupted(_keep(tmp_path / name, (tmp_path / name).read_bytes()), tmp_path / name, 0)
    with pytest.raises(CheckpointError, match=r"ep0-ba4-rank0\.pt is corrupt"):
        make("8ba", tmp_path, run_name="auto", autoresume=True, save_interval="2ba")


# -- loading errors ---------------------------------------------------------------------------

def test_load_errors_name_the_file(uninterrupted, tmp_path: Path) -> None:
    folder, _ = uninterrupted
    with pytest.raises(CheckpointError, match=r"load_path .*nope-rank0\.pt does not exist"):
        make("2ba", None, load_path=str(tmp_path / "nope-rank{rank}.pt"))
    truncated = tmp_path / "truncated.pt"
    data = (folder / "ep0-ba3-rank0.pt").read_bytes()
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"truncated\.pt is truncated or not a torch checkpoint"):
        make("2ba", None, load_path=str(truncated))

    class Wider(MLP):
        def __init__(self):
            super().__init__()
            self.net[0] = torch.nn.Linear(6, 32)
            self.net[2] = torch.nn.Linear(32, 3)

    with pytest.raises(CheckpointError, match=r"ep0-ba3-rank0\.pt does not fit the model: .*size mismatch"):
        make("2ba", None, model_cls=Wider, load_path=str(folder / "ep0-ba3-rank0.pt"))
    with pytest.raises(CheckpointError, match=r"holds 1 schedulers but the Trainer has 0"):
        make("2ba", None, scheduler=False, load_path=str(folder / "ep0-ba3-rank0.pt"))
    plain = tmp_path / "plain.pt"
    torch.save(MLP().state_dict(), plain)
    with pytest.raises(CheckpointError, match="plain state_dict.*load_weights_only=True"):
        make("2ba", None, load_path=str(plain))
    trainer = make("2ba", None, load_path=str(plain), load_weights_only=True)
    assert trainer.state.timestamp.batch == 0


def test_weights_only_and_non_strict_loading(uninterrupted) -> None:
    folder, _ = uninterrupted
    path = str(folder / "ep1-ba9-rank0.pt")
    trainer = make("2ba", None, load_path=path, load_weights_only=True)
    assert trainer.state.timestamp.batch == 0
    saved = export_state_dict(path)
    assert_bitwise(params(trainer.state.model), saved)

    class Extra(MLP):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 3)

    with pytest.raises(CheckpointError, match='Missing key\\(s\\) in state_dict: "head.weight"'):
        make("2ba", None, model_cls=Extra, load_path=path, load_weights_only=True)
    trainer = make("2ba", None, model_cls=Extra, load_path=path, load_weights_only=True,
                   load_strict_model_weights=False)
    assert torch.equal(trainer.state.model.net[0].weight, saved["net.0.weight"])


# -- export -------------------------------------------------------------------------------------

def test_export_to_state_dict_and_safetensors(uninterrupted, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder, reference = uninterrupted
    assert_bitwise(export_state_dict(folder / "latest-rank0.pt"), reference)
    out = export_safetensors(folder / "ep2-ba17-rank0.pt", tmp_path / "model.safetensors")
    assert_bitwise(load_file(out), reference)
    with pytest.raises(ValueError, match="should end with .safetensors"):
        export_safetensors(folder / "ep2-ba17-rank0.pt", tmp_path / "model.bin")


def test_export_command_line(uninterrupted, tmp_path: Path) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file

    folder, reference = uninterrupted
    out = tmp_path / "m.safetensors"
    proc = subprocess.run([sys.executable, "-m", "lockstep.checkpoint", "export",
                           str(folder / "latest-rank0.pt"), str(out)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert_bitwise(load_file(out), reference)
    proc = subprocess.run([sys.executable, "-m", "lockstep.checkpoint", "export", str(tmp_path / "x.pt"),
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "x.pt does not exist" in proc.stderr


# -- two ranks ----------------------------------------------------------------------------------

def _two_rank_resume(folder: str) -> dict:
    """Uninterrupted 2-rank run, then resumes from a mid-epoch and an epoch-boundary checkpoint,
    with microbatches; every rank loads through a {rank} template that names rank 0's file."""
    root = Path(folder)
    out = {"reference": fit("9ba", root / "a", batch=2, microbatch=1, save_interval="1ba")}
    if dist.get_global_rank() == 0:
        out["names"] = names(root / "a")
    out["mid"] = fit("9ba", root / "b", batch=2, microbatch=1, load_path=str(root / "a/ep0-ba5-rank{rank}.pt"))
    out["boundary"] = fit("9ba", root / "c", batch=2, microbatch=1, load_path=str(root / "a/ep1-ba7-rank{rank}.pt"))
    out["autoresume"] = []
    for stop in ("5ba", "9ba"):
        out["autoresume"].append(fit(stop, root / "d", batch=2, microbatch=1, run_name="two", autoresume=True,
                                     save_interval="3ba"))
    return out


def _nodes_without_a_shared_disk(folder: str) -> dict:
    """Each rank works in its own folder, as two nodes with their own disks would: only rank 0's
    holds the checkpoints (under DDP rank 0 writes them), and rank 1 gets them from rank 0."""
    own = Path(folder) / f"node{dist.get_global_rank()}"
    own.mkdir()
    os.chdir(own)
    out = {"reference": fit("9ba", None, batch=2)}
    out["autoresume"] = [fit(stop, "ckpt", batch=2, run_name="nodes", autoresume=True, save_interval="3ba")
                         for stop in ("5ba", "9ba")]
    out["load_path"] = fit("9ba", None, batch=2, load_path="ckpt/ep0-ba3-rank{rank}.pt")
    out["own files"] = sorted(os.listdir(own))
    return out


def _load_at_world_size_one(folder: str) -> str:
    return error_of(make, "2ba", None, load_path=folder, expected=(CheckpointError,))


@pytest.mark.timeout(200)
def test_two_ranks_resume_exactly(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_resume, world_size=2, args=(str(tmp_path),), timeout=180)
    reference = results[0]["reference"]
    # one file per checkpoint, written by rank 0, holding both ranks' RNG states
    assert results[0]["names"] == sorted([f"ep{b // 7}-ba{b}-rank0.pt" for b in range(1, 10)] + ["latest-rank0.pt"])
    for rank in results:
        assert_bitwise(rank["reference"], reference)
        for key in ("mid", "boundary"):
            assert_bitwise(rank[key], reference)
        assert_bitwise(rank["autoresume"][1], reference)
    message = _load_at_world_size_one(str(tmp_path / "a/ep0-ba5-rank0.pt"))
    assert "saved by 2 rank(s) and this run has 1" in message and "load_weights_only=True" in message


@pytest.mark.timeout(200)
def test_ranks_that_do_not_see_rank_0s_disk_resume_from_it(tmp_path: Path) -> None:
    for rank, out in enumerate(run_distributed(_nodes_without_a_shared_disk, world_size=2, args=(str(tmp_path),),
                                               timeout=180)):
        assert_bitwise(out["autoresume"][1], out["reference"])
        assert_bitwise(out["load_path"], out["reference"])
        assert ("ckpt" in out["own files"]) == (rank == 0)


def _corrupted(source: Path, target: Path, nth_largest: int) -> str:
    """Copy ``source`` to ``target`` with one byte flipped in its ``nth_largest`` record."""
    import zipfile
    with zipfile.ZipFile(source) as archive:
        record = sorted(archive.infolist(), key=lambda r: -r.compress_size)[nth_largest]
    data = bytearray(source.read_bytes())
    # past the local header (30 bytes, the name, an extra field that pads the data to 64 bytes)
    data[record.header_offset + 30 + len(record.filename.encode()) + 200] ^= 0xFF
    target.write_bytes(bytes(data))
    return record.filename


def _split_crc_check(folder: str) -> dict:
    root = Path(folder)
    fit("2ba", root / "a", save_interval="2ba")
    good = root / "a/ep0-ba2-rank0.pt"
    if dist.get_global_rank() == 0:
        for n in (0, 1):  # the two largest records: the split gives one to each rank
            _corrupted(good, root / f"bad{n}-rank0.pt", n)
        _corrupted(good, root / "stale-rank0.pt", 1)
        (root / "stale-rank1.pt").write_bytes(good.read_bytes())  # another file for rank 1 voids the split
    dist.barrier()
    return {name: error_of(make, "2ba", None, load_path=str(root / f"{name}-rank{{rank}}.pt"),
                           expected=(CheckpointError,)) for name in ("bad0", "bad1", "stale")}


@pytest.mark.timeout(120)
def test_two_ranks_split_the_crc_check_and_miss_nothing(tmp_path: Path) -> None:
    results = run_distributed(_split_crc_check, world_size=2, args=(str(tmp_path),), timeout=100)
    for rank in results:
        for name in ("bad0", "bad1"):
            assert f"{name}-rank0.pt is corrupt" in rank[name] and "fails its CRC check" in rank[name]
        # rank 0 checked only its half of stale-rank0.pt at first, and the corrupt record is in
        # rank 1's half: when rank 1 turned out to read its own file, rank 0 checked the rest
        assert "stale-rank0.pt is corrupt" in rank["stale"]


def _write_fails_on_rank_0(folder: str) -> str:
    from lockstep.checkpoint import files

    real = files.write_temp

    def disk_full(obj, path):
        if path.name == "ep0-ba2-rank0.pt":
            raise OSError(28, "No space left on device")
        return real(obj, path)

    if dist.get_global_rank() == 0:
        files.write_temp = disk_full
    try:
        return error_of(fit, "4ba", Path(folder), save_interval="1ba", expected=(RuntimeError,))
    finally:
        files.write_temp = real


@pytest.mark.timeout(120)
def test_a_failed_background_write_raises_on_every_rank(tmp_path: Path) -> None:
    # rank 0 writes in a background thread; its failure surfaces at the next save, on both ranks
    results = run_distributed(_write_fails_on_rank_0, world_size=2, args=(str(tmp_path),), timeout=100)
    for message in results:
        assert "writing a checkpoint in" in message and "failed on rank 0" in message
        assert "No space left on device" in message
    assert sorted(os.listdir(tmp_path)) == ["ep0-ba1-rank0.pt", "latest-rank0.pt"]


# -- stateful dataloaders -----------------------------------------------------------------------

class CountingNoisyDataset(NoisyDataset):
    """Counts reads in every process (the counter lives in shared memory, so forked workers add to it)."""

    def __init__(self) -> None:
        import multiprocessing
        super().__init__()
        self.reads = multiprocessing.Value("i", 0)

    def __getitem__(self, i):
        with self.reads.get_lock():
            self.reads.value += 1
        return super().__getitem__(i)


class OwnRNGDataset(CountingNoisyDataset):
    """Augments with its own generator and keeps it in its state_dict, which torchdata saves and
    restores in each worker: how randomness inside workers survives a stateful resume."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)

    def __getitem__(self, i):
        with self.reads.get_lock():
            self.reads.value += 1
        x, y = self.base[i]
        return x + torch.randn(6, generator=self.generator) * 0.1, y

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def stateful_loader(dataset_cls, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return StatefulDataLoader(dataset_cls(), batch_size=4, shuffle=True, num_workers=workers)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("dataset_cls, workers", [(CountingNoisyDataset, 0), (OwnRNGDataset, 2)])
def test_a_stateful_dataloader_resumes_from_its_own_state(tmp_path: Path, dataset_cls, workers: int) -> None:
    """torchdata's StatefulDataLoader: the checkpoint holds its state_dict(), and a resume
    restores it instead of reading the trained batches again."""
    pytest.importorskip("torchdata.stateful_dataloader")
    reference = fit("10ba", tmp_path / "a", data=stateful_loader(dataset_cls, workers), save_interval="2ba")
    entry = torch.load(tmp_path / "a/ep0-ba4-rank0.pt", weights_only=True)["ranks"][0]
    assert entry["loader_state"] is not None
    for name, checkpoint in (("b", "ep0-ba4-rank0.pt"), ("c", "ep1-ba8-rank0.pt")):
        resumed = fit("10ba", tmp_path / name, data=stateful_loader(dataset_cls, workers),
                      load_path=str(tmp_path / "a" / checkpoint))
        assert_bitwise(resumed, reference)
    # to the end of the first epoch (7 batches): only the 3 batches after ba4 are read
    data = stateful_loader(dataset_cls, workers)
    fit("7ba", tmp_path / "d", data=data, load_path=str(tmp_path / "a/ep0-ba4-rank0.pt"))
    assert data.dataset.reads.value == 3 * 4
