"""Exact resume at 4 ranks, where the order of a gradient sum shows (issue 37).

Two ranks cannot see a change in how an all-reduce groups its sum (a + b is b + a); from three
ranks on, gloo's ring all-reduce sums each element in an order set by where the element sits in
the buffer it reduces. DDP starts with one bucket of every gradient and rebuilds its buckets
after the first step, in the order the gradients became ready; a resumed run must reduce with the
rebuilt buckets from its first step, as the uninterrupted run does, to end bit for bit equal.
:class:`Reordered` registers its layers in another order than it uses them, so the two layouts
differ (in ``tests.trainer.common.MLP`` they happen to be the same).

3 and 8 ranks were checked by hand: ``python -m tests.trainer.test_resume_world_sizes ddp 8``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Callback, Model, Trainer, dist
from lockstep.testing import run_distributed
from tests.trainer.common import dataset, full_params

PER_RANK_BATCH = 2
SAMPLES = 64  # 8 batches per epoch at 4 ranks
REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("resume_job.py")
# DDP's buckets once rebuilt: gradients as they become ready, each layer's bias before its weight
REBUILT = [["head.bias", "head.weight", "mid.bias", "mid.weight", "inp.bias", "inp.weight", "scale"]]


class Reordered(Model):
    """Parameters of four sizes, registered head first but used head last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(32, 3)
        self.mid = torch.nn.Linear(24, 32)
        self.inp = torch.nn.Linear(6, 24)
        self.scale = torch.nn.Parameter(torch.ones(6))

    def forward(self, batch):
        hidden = torch.tanh(self.mid(torch.tanh(self.inp(batch[0] * self.scale))))
        return self.head(hidden)

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch[1])

    def fsdp_wrap_fn(self, module):
        return isinstance(module, torch.nn.Linear)  # a unit per layer: several reduce-scatters


BACKENDS = {"ddp": {}, "fsdp": {"fsdp_config": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "sharded"}},
            "zero2": {"deepspeed_config": {"zero_optimization": {"stage": 2}}}}


def name(kind: str, batch: int | str) -> str:
    """The checkpoint of ``batch`` (in the first epoch), with a ``{rank}`` field under DDP."""
    return f"ep0-ba{batch}-rank{{rank}}.pt" if kind == "ddp" else f"ep0-ba{batch}"


def fit(kind: str, duration: str, folder: str | None = None, load: str | None = None,
        **kwargs) -> dict[str, torch.Tensor]:
    model = Reordered()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = dataset(SAMPLES)
    trainer = Trainer(model=model, optimizers=optimizer, max_duration=duration, progress_bar=False, seed=7,
                      train_dataloader=DataLoader(data, batch_size=PER_RANK_BATCH,
                                                  sampler=dist.get_sampler(data, shuffle=True)),
                      save_folder=folder, save_filename=name(kind, "{batch}").replace("ep0", "ep{epoch}"),
                      save_interval=kwargs.pop("save_interval", "3ba"), load_path=load, **BACKENDS[kind], **kwargs)
    trainer.fit()
    if kind == "zero2":
        from lockstep.parallel.deepspeed import full_state_dict
        return full_state_dict(model)
    return full_params(model)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest difference of each parameter that is not bitwise equal."""
    assert a.keys() == b.keys()
    return {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


def _resume(kind: str, folder: str, **kwargs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The uninterrupted run (which saves after batch 3), and a run resumed from that checkpoint."""
    uninterrupted = fit(kind, "6ba", folder, **kwargs)
    return uninterrupted, fit(kind, "6ba", load=os.path.join(folder, name(kind, 3)), **kwargs)


def _assert_exact(results: list) -> None:
    for rank, (uninterrupted, resumed) in enumerate(results):
        assert differences(resumed, uninterrupted) == {}, f"rank {rank}"


def _ddp_resumes(folder: str) -> tuple[dict, list[dict], list]:
    """Saves after every batch; resumes after the first (DDP has not rebuilt its buckets at the
    next forward yet) and mid-epoch."""
    uninterrupted = fit("ddp", "7ba", folder, save_interval="1ba")
    resumed = [fit("ddp", "7ba", load=os.path.join(folder, name("ddp", b))) for b in (1, 4)]
    headers = [torch.load(os.path.join(folder, name("ddp", b).format(rank=0)), weights_only=True)["lockstep"]
               for b in (1, 4)]
    return uninterrupted, resumed, [h.get("ddp_buckets") for h in headers]


@pytest.mark.timeout(120)
def test_ddp_resumes_exactly_after_the_first_batch_and_mid_epoch(tmp_path: Path) -> None:
    for rank, (uninterrupted, resumed, layouts) in enumerate(
            run_distributed(_ddp_resumes, world_size=4, args=(str(tmp_path),), timeout=110)):
        for after, params in zip((1, 4), resumed):
            assert differences(params, uninterrupted) == {}, f"rank {rank}, resumed after batch {after}"
        assert layouts == [REBUILT, REBUILT]  # what each checkpoint records for the resumed DDP


def _resume_syncing_every_microbatch(folder: str) -> tuple[dict, dict]:
    return _resume("ddp", folder, ddp_sync_strategy="multi_auto_sync", device_train_microbatch_size=1)


@pytest.mark.timeout(120)
def test_ddp_with_a_sync_per_microbatch_on_two_nodes_of_two(tmp_path: Path) -> None:
    # multi_auto_sync: DDP rebuilds its buckets at the second microbatch of the first step
    _assert_exact(run_distributed(_resume_syncing_every_microbatch, world_size=4, local_world_size=2,
                                  args=(str(tmp_path),), timeout=110))


@pytest.mark.timeout(120)
def test_fsdp_full_shard_resumes_exactly_at_four_ranks(tmp_path: Path) -> None:
    _assert_exact(run_distributed(_resume, world_size=4, args=("fsdp", str(tmp_path)), timeout=110))


@pytest.mark.timeout(150)
def test_deepspeed_zero2_resumes_exactly_at_four_ranks(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    _assert_exact(run_distributed(_resume, world_size=4, args=("zero2", str(tmp_path)), timeout=140))


class _Layouts(Callback):
    """The layout of DDP's buckets each step reduced with, as the gradients show it."""

    def __init__(self) -> None:
        self.seen: list = []

    def after_backward(self, state, logger) -> None:
        from lockstep.parallel import ddp_buckets
        self.seen.append(ddp_buckets.read(state.model, set()))


def _layouts_per_step(folder: str) -> tuple[list, list]:
    data = dataset(SAMPLES)
    runs = []
    for duration, load in (("2ba", None), ("4ba", os.path.join(folder, "ep0-ba2-rank{rank}.pt"))):
        model, probe = Reordered(), _Layouts()
        Trainer(model=model, optimizers=torch.optim.AdamW(model.parameters(), lr=0.01), max_duration=duration,
                train_dataloader=DataLoader(data, batch_size=2, sampler=dist.get_sampler(data)),
                progress_bar=False, save_folder=None if load else folder, load_path=load, callbacks=[probe]).fit()
        runs.append(probe.seen)
    return runs[0], runs[1]


@pytest.mark.timeout(60)
def test_the_resumed_ddp_reduces_with_the_rebuilt_buckets_from_its_first_step(tmp_path: Path) -> None:
    fresh, resumed = run_distributed(_layouts_per_step, world_size=2, args=(str(tmp_path),), timeout=50)[0]
    initial = [["scale", "head.weight", "head.bias", "mid.weight", "mid.bias", "inp.weight", "inp.bias"]]
    assert fresh == [initial, REBUILT]  # DDP's first bucket: every gradient, in registration order
    assert resumed == [REBUILT, REBUILT]


def _launch(tmp: Path, run: str, *extra: str) -> tuple[str, dict[str, torch.Tensor]]:
    result = subprocess.run(
        [sys.executable, "-m", "lockstep", "-n", "4", "--max_restarts", "1", str(JOB), str(tmp / run),
         str(tmp / f"{run}.pt"), *extra], cwd=REPO, capture_output=True, text=True, timeout=140,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return result.stdout, torch.load(tmp / f"{run}.pt", weights_only=True)


@pytest.mark.timeout(150)
def test_kill_9_at_four_ranks_autoresumes_exactly(tmp_path: Path) -> None:
    # the first attempt's ranks train the uninterrupted job, then the job whose rank 3 dies after batch 5
    out, killed = _launch(tmp_path, "killed", "5", str(tmp_path / "clean.pt"))
    assert out.count("attempt 0 resumed at batch 0") == 2, out
    assert "attempt 1 resumed at batch 2" in out or "attempt 1 resumed at batch 4" in out, out
    assert differences(killed, torch.load(tmp_path / "clean.pt", weights_only=True)) == {}


def check_by_hand(kind: str, world_size: int) -> None:
    """Prints each rank's differences between a resumed and an uninterrupted run."""
    with tempfile.TemporaryDirectory() as folder:
        for rank, (uninterrupted, resumed) in enumerate(
                run_distributed(_resume, world_size=world_size, args=(kind, folder), timeout=1200)):
            print(f"{kind} rank {rank} of {world_size}: differences {differences(resumed, uninterrupted)}")


if __name__ == "__main__":
    check_by_hand(sys.argv[1], int(sys.argv[2]))
