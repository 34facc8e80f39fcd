"""lockstep.profiler: Composer's cyclic_schedule against a table of batches (and Composer's own
schedule's answers), and torch.profiler traces that real runs write: which files, what is in
them, gzip, the memory timeline, retention, uploads, overwrite, two ranks and a resumed run."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lockstep import Trainer
from lockstep.loggers import LoggerDestination
from lockstep.profiler import Profiler, ProfilerAction, TorchProfiler, cyclic_schedule
from lockstep.testing import run_distributed
from lockstep.time import Timestamp
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(120)

SKIP, WARMUP, ACTIVE, SAVE = (ProfilerAction.SKIP, ProfilerAction.WARMUP, ProfilerAction.ACTIVE,
                              ProfilerAction.ACTIVE_AND_SAVE)


def _state(batch_in_epoch: int, batches_per_epoch: int | None = None, resumed_at: int = 0) -> SimpleNamespace:
    return SimpleNamespace(timestamp=Timestamp(batch=batch_in_epoch, batch_in_epoch=batch_in_epoch),
                           batches_per_epoch=batches_per_epoch,
                           profiler=SimpleNamespace(resumption_batch_idx=resumed_at))


# -- the schedule alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, batches_per_epoch, resumed_at, actions", [
    # wait 1, warmup 1, active 2, twice; then nothing for the rest of the epoch
    (dict(wait=1, warmup=1, active=2, repeat=2), None, 0,
     [SKIP, WARMUP, ACTIVE, SAVE, SKIP, WARMUP, ACTIVE, SAVE, SKIP, SKIP]),
    # Composer's defaults: warmup 1, active 4, once
    ({}, None, 0, [WARMUP, ACTIVE, ACTIVE, ACTIVE, SAVE, SKIP, SKIP]),
    (dict(skip_first=2, wait=0, warmup=1, active=1, repeat=1), None, 0, [SKIP, SKIP, WARMUP, SAVE, SKIP]),
    # repeat=0: cycles to the end of the epoch; an active batch that ends the epoch saves
    (dict(wait=0, warmup=1, active=2, repeat=0), 5, 0, [WARMUP, ACTIVE, SAVE, WARMUP, SAVE]),
    # a run resumed at batch 3 of its epoch counts its windows from there (in every epoch, as Composer)
    (dict(wait=1, warmup=1, active=2, repeat=1), None, 3, [SKIP, SKIP, SKIP, SKIP, WARMUP, ACTIVE, SAVE, SKIP]),
    (dict(skip_first=1, wait=0, warmup=0, active=1, repeat=2), None, 2, [SKIP, SKIP, SKIP, SAVE, SAVE, SKIP]),
])
def test_cyclic_schedule_gives_composers_action_for_each_batch_of_the_epoch(
        kwargs: dict, batches_per_epoch: int | None, resumed_at: int, actions: list[ProfilerAction]) -> None:
    schedule = cyclic_schedule(**kwargs)
    got = [schedule(_state(b, batches_per_epoch, resumed_at)) for b in range(len(actions))]  # type: ignore[arg-type]
    assert got == actions


def test_at_the_end_of_an_epoch_the_schedule_answers_for_the_next_epochs_first_batch() -> None:
    # At BATCH_END of an epoch's last batch the timestamp counts 5 batches in the epoch of 5; the
    # next batch is the next epoch's first (Composer asks about a batch 5 that does not exist).
    schedule = cyclic_schedule(wait=0, warmup=1, active=2, repeat=1)
    assert schedule(_state(5, batches_per_epoch=5)) == schedule(_state(0, batches_per_epoch=5)) == WARMUP  # type: ignore[arg-type]
    assert schedule(_state(5)) == SKIP  # type: ignore[arg-type]  # epoch length unknown: as Composer


def test_cyclic_schedule_and_profiler_reject_bad_arguments() -> None:
    assert error_of(cyclic_schedule, active=0) == "cyclic_schedule: active must be an int >= 1, got 0"
    assert "wait must be an int >= 0" in error_of(cyclic_schedule, wait=-1)
    assert "trace_handlers" in error_of(Profiler, cyclic_schedule(), trace_handlers=[object()])
    assert "torch_prof_memory_filename needs" in error_of(Profiler, cyclic_schedule(), torch_prof_memory_filename="m.html")
    assert "unknown field(s) ['step']" in error_of(Profiler, cyclic_schedule(), torch_prof_filename="{step}.json")
    assert "cannot use ['batch']" in error_of(Profiler, cyclic_schedule(), torch_prof_folder="{batch}")
    assert "schedule must be a function" in error_of(Profiler, "2ba")
    assert ProfilerAction("ACTIVE_AND_SAVE") is SAVE and SAVE == "active_and_save"
    # as in Composer: no torch profiler unless one of its four flags is set
    quiet = Profiler(cyclic_schedule(), torch_prof_profile_memory=False, torch_prof_with_flops=False)
    assert quiet.callbacks == [quiet]
    loud = Profiler(cyclic_schedule())
    assert loud.callbacks[0] is loud and isinstance(loud.callbacks[1], TorchProfiler)


# -- traces written by real runs ------------------------------------------------------------------

def fit(profiler: Profiler, max_duration: str = "12ba", **kwargs) -> Trainer:
    """10 batches per epoch (40 samples, batches of 4)."""
    model = MLP()
    kwargs.setdefault("progress_bar", False)
    trainer = Trainer(model=model, train_dataloader=loader(4, n=40), max_duration=max_duration,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[*kwargs.pop("callbacks", []), *profiler.callbacks], **kwargs)
    trainer.fit()
    return trainer


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def names_in(trace: dict) -> set[str]:
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_each_window_writes_one_chrome_trace_of_its_active_batches(tmp_path: Path) -> None:
    profiler = Profiler(cyclic_schedule(wait=1, warmup=1, active=2, repeat=2))
    trainer = fit(profiler, run_name="prof", run_folder=str(tmp_path))
    # relative torch_prof_folder: in the run folder. Windows end after batches 4 and 8 (the file's
    # {batch} counts the batches done); the cycles are used up before batches 9-10, and the
    # window that opens after the run's last batch (batch 13 of the next epoch's cycle) holds nothing.
    folder = tmp_path / "prof" / "torch_traces"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.4.pt.trace.json", "rank0.8.pt.trace.json"]
    assert trainer.state.profiler is profiler and profiler.resumption_batch_idx == 0
    for path, steps in ((folder / "rank0.4.pt.trace.json", {2, 3}), (folder / "rank0.8.pt.trace.json", {6, 7})):
        trace = read_trace(path)
        names = names_in(trace)
        assert {"aten::addmm", "aten::linear", "aten::tanh"} <= names
        assert {n for n in names if n.startswith("ProfilerStep#")} == {f"ProfilerStep#{s}" for s in steps}
        assert trace["global_rank"] == 0 and trace["profile_memory"] == 1


@pytest.mark.filterwarnings("ignore:`export_memory_timeline` is deprecated")
def test_gzip_and_the_memory_timeline(tmp_path: Path) -> None:
    profiler = Profiler(cyclic_schedule(wait=0, warmup=1, active=1, repeat=1), torch_prof_folder=str(tmp_path),
                        torch_prof_use_gzip=True, torch_prof_memory_filename="mem{rank}.{batch}.html",
                        torch_prof_record_shapes=True, torch_prof_with_stack=True)
    fit(profiler, "3ba")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem0.2.html", "rank0.2.pt.trace.json.gz"]
    assert "aten::addmm" in names_in(read_trace(tmp_path / "rank0.2.pt.trace.json.gz"))
    assert (tmp_path / "mem0.2.html").read_text().startswith("<html>")


def test_a_memory_timeline_without_matplotlib_is_refused_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    with pytest.raises(ImportError, match=r"^torch_prof_memory_filename needs the 'matplotlib' package: "
                                          r"pip install 'torch-lockstep\[profiler\]'$"):
        Profiler(cyclic_schedule(), torch_prof_memory_filename="mem{rank}.{batch}.html",
                 torch_prof_record_shapes=True, torch_prof_with_stack=True)


class Uploads(LoggerDestination):
    def __init__(self) -> None:
        self.uploads: list[tuple[str, str, bool]] = []

    def upload_file(self, state, remote_file_name, file_path, *, overwrite) -> None:
        self.uploads.append((remote_file_name, Path(file_path).name, Path(file_path).exists()))


def test_retention_keeps_the_newest_traces_after_their_upload(tmp_path: Path) -> None:
    uploads = Uploads()
    profiler = Profiler(cyclic_schedule(wait=0, warmup=0, active=2, repeat=0), torch_prof_folder=str(tmp_path),
                        torch_prof_num_traces_to_keep=2, torch_prof_remote_file_name="s3://bucket/t/{run_name}-{batch}.json")
    fit(profiler, "8ba", run_name="keep", loggers=[uploads])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.6.pt.trace.json", "rank0.8.pt.trace.json"]
    torch_profiler = profiler.callbacks[1]
    assert [int(t.batch) for t, _ in torch_profiler.saved_traces] == [6, 8]  # type: ignore[attr-defined]
    assert uploads.uploads == [(f"t/keep-{b}.json", f"rank0.{b}.pt.trace.json", True) for b in (2, 4, 6, 8)]
    assert profiler.remote_filenames[0] == "s3://bucket/t/{run_name}-{batch}.json"


def test_no_trace_replaces_a_file_unless_asked(tmp_path: Path) -> None:
    schedule = cyclic_schedule(wait=0, warmup=0, active=1, repeat=1)
    fit(Profiler(schedule, torch_prof_folder=str(tmp_path)), "2ba")
    message = error_of(fit, Profiler(schedule, torch_prof_folder=str(tmp_path)), "2ba")
    assert message == (f"Profiler: {tmp_path / 'rank0.1.pt.trace.json'} exists in the trace folder; "
                       "pass torch_prof_overwrite=True or another torch_prof_folder")
    fit(Profiler(schedule, torch_prof_folder=str(tmp_path), torch_prof_overwrite=True), "2ba")
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.1.pt.trace.json"]


def test_fit_end_writes_the_open_window_and_a_later_fit_may_not_replace_it(tmp_path: Path) -> None:
    profiler = Profiler(cyclic_schedule(wait=0, warmup=1, active=4), torch_prof_folder=str(tmp_path))
    trainer = fit(profiler, "3ba")  # batches 2 and 3 recorded when the run ends
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.3.pt.trace.json"]
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names_in(read_trace(tmp_path / "rank0.3.pt.trace.json"))
    message = error_of(trainer.fit, duration="3ba", reset_time=True)  # the same window again
    assert message == (f"Profiler: trace file {tmp_path / 'rank0.3.pt.trace.json'} exists; "
                       "pass torch_prof_overwrite=True or another torch_prof_folder")
    trainer.close()


def test_a_resumed_run_counts_its_windows_from_where_it_resumed(tmp_path: Path) -> None:
    schedule = cyclic_schedule(wait=1, warmup=1, active=2, repeat=1)
    fit(Profiler(schedule, torch_prof_folder=str(tmp_path / "first")), "5ba", save_folder=str(tmp_path / "ck"),
        save_interval="5ba", save_filename="ba{batch}.pt")
    profiler = Profiler(schedule, torch_prof_folder=str(tmp_path / "resumed"))
    fit(profiler, "12ba", load_path=str(tmp_path / "ck" / "ba5.pt"))
    # resumed at batch 5 of the epoch: wait 6th, warm up 7th, record 8th-9th: saved after batch 9
    assert profiler.resumption_batch_idx == 5
    assert [p.name for p in (tmp_path / "resumed").iterdir()] == ["rank0.9.pt.trace.json"]
    assert [p.name for p in (tmp_path / "first").iterdir()] == ["rank0.4.pt.trace.json"]


def _profile_on_each_rank(folder: str) -> list[str]:
    profiler = Profiler(cyclic_schedule(wait=1, warmup=1, active=2, repeat=1), torch_prof_folder=folder)
    fit(profiler, "5ba", run_name="two")
    return [str(read_trace(path)["global_rank"]) for _, paths in profiler.callbacks[1].saved_traces  # type: ignore[attr-defined]
            for path in paths]


def test_two_ranks_write_one_trace_each_per_window(tmp_path: Path) -> None:
    results = run_distributed(_profile_on_each_rank, world_size=2, args=(str(tmp_path / "{run_name}"),), timeout=100)
    assert results == [["0"], ["1"]]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["rank0.4.pt.trace.json", "rank1.4.pt.trace.json"]
    assert "aten::addmm" in names_in(read_trace(tmp_path / "two" / "rank1.4.pt.trace.json"))


def test_the_trainers_profiler_argument_writes_traces(tmp_path) -> None:
    from lockstep.profiler import Profiler, cyclic_schedule

    profiler = Profiler(schedule=cyclic_schedule(wait=0, warmup=1, active=2, repeat=1), torch_prof_folder=str(tmp_path))
    trainer = _trainer_for_profiler(profiler)
    trainer.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.3.pt.trace.json"]
    assert "device_train_microbatch_size='auto' does not work with the profiler" in _error(
        lambda: _trainer_for_profiler(profiler, device_train_microbatch_size="auto"))
    assert "must be a lockstep.profiler.Profiler" in _error(lambda: _trainer_for_profiler(object()))


def _trainer_for_profiler(profiler, **kwargs):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lockstep import Model, Trainer

    class Linear(Model):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, batch):
            return self.linear(batch[0])

        def loss(self, outputs, batch):
            return torch.nn.functional.mse_loss(outputs, batch[1])

    model = Linear()
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    return Trainer(model=model, train_dataloader=data, max_duration="4ba", device="cpu", progress_bar=False,
                   optimizers=torch.optim.SGD(model.parameters(), lr=0.1), profiler=profiler, **kwargs)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"
