"""save_num_checkpoints_to_keep in a bucket (issue 49): after a 2-rank run, exactly the newest
``keep`` checkpoints and the latest pointer are in the bucket, in every layout (DDP's single file,
FSDP ``sharded`` and ``local``, DeepSpeed ZeRO-2), also when uploads lag behind the local rotation,
and across a restart, where checkpoints an earlier attempt left count."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from lockstep.objectstore import S3ObjectStore
from lockstep.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

LAYOUTS = {"ddp": {}, "sharded": {"fsdp_config": {"state_dict_type": "sharded"}},
           "local": {"fsdp_config": {"state_dict_type": "local"}},
           "zero2": {"deepspeed_config": {"zero_optimization": {"stage": 2}}}}


def _train(cwd: str, folder: str, layout: str, batches: int, autoresume: bool) -> None:
    """One rank: train to ``batches``, saving every 2 batches into ``folder``, keeping 2."""
    os.chdir(cwd)
    from lockstep import Trainer
    from tests.trainer.common import MLP, loader

    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = Trainer(model=model, train_dataloader=loader(2), optimizers=optimizer, device="cpu", progress_bar=False,
                      seed=3, max_duration=f"{batches}ba", run_name="r", save_folder=folder, save_interval="2ba",
                      save_num_checkpoints_to_keep=2, autoresume=autoresume, **LAYOUTS[layout])
    trainer.fit()
    trainer.close()


def _run(cwd: Path, folder: str, layout: str, batches: int, *, autoresume: bool = False) -> None:
    cwd.mkdir(parents=True, exist_ok=True)
    run_distributed(_train, 2, args=(str(cwd), folder, layout, batches, autoresume), timeout=200,
                    env={"OMP_NUM_THREADS": "1"})


def _checkpoints(store: S3ObjectStore, prefix: str) -> dict[str, list[int]]:
    """The names under ``prefix``: each checkpoint's batch by rank suffix, and the pointers."""
    names = {key[len(prefix):].split("/", 1)[0] for key in store.list_objects(prefix)}
    found: dict[str, list[int]] = {}
    for name in names:
        match = re.fullmatch(r"ep\d+-ba(\d+)-(rank\d)\.pt", name)
        kind = match[2] if match else name
        found.setdefault(kind, []).extend([int(match[1])] if match else [])
    return {k: sorted(v) for k, v in found.items()}


def _expected(layout: str, batches: list[int]) -> dict[str, list[int]]:
    ranks = ["rank0", "rank1"] if layout == "local" else ["rank0"]
    return {**{r: batches for r in ranks}, **{f"latest-{r}.pt.symlink": [] for r in ranks}}


def _skip_without(layout: str) -> None:
    if layout == "zero2" and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.importorskip("deepspeed")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_bucket_keeps_exactly_the_newest_checkpoints(bucket: str, tmp_path: Path, layout: str) -> None:
    _skip_without(layout)
    _run(tmp_path / "node", f"s3://{bucket}/rot/{{run_name}}", layout, 8)
    store = S3ObjectStore(bucket)
    assert _checkpoints(store, "rot/r/") == _expected(layout, [6, 8])
    assert store.read_bytes("rot/r/latest-rank0.pt.symlink").decode() == "rot/r/ep1-ba8-rank0.pt"
    if layout == "sharded":  # the kept folders are whole: rotation deleted nothing of theirs
        local = tmp_path / "node" / ".lockstep" / "s3" / bucket / "rot" / "r" / "ep1-ba8-rank0.pt"
        files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
        assert {k.split("ep1-ba8-rank0.pt/", 1)[1] for k in store.list_objects("rot/r/ep1-ba8-rank0.pt/")} == files


@pytest.mark.parametrize("layout", ["ddp", "local"])
def test_a_restart_rotates_what_an_earlier_attempt_left(bucket: str, tmp_path: Path, layout: str) -> None:
    """The first attempt saved to batch 6; what a killed attempt leaves when its uploads lag is added
    by hand: batch 2, which the resumed checkpoint's history no longer names (the local rotation
    dropped it), and batch 12, past the resume point, half uploaded. The restart, on a machine
    without the staging folder, resumes from batch 6 and trains to 10: batches 8 and 10 are left."""
    _run(tmp_path / "first", f"s3://{bucket}/rot/{{run_name}}", layout, 6, autoresume=True)
    store = S3ObjectStore(bucket)
    assert _checkpoints(store, "rot/r/") == _expected(layout, [4, 6])
    ranks = [0, 1] if layout == "local" else [0]
    for rank in ranks:
        for leftover in (f"ep0-ba2-rank{rank}.pt", f"ep1-ba12-rank{rank}.pt"):
            store.upload_bytes(f"rot/r/{leftover}", b"what an earlier attempt left")
    _run(tmp_path / "second", f"s3://{bucket}/rot/{{run_name}}", layout, 10, autoresume=True)
    assert _checkpoints(store, "rot/r/") == _expected(layout, [8, 10])
    assert store.read_bytes("rot/r/latest-rank0.pt.symlink").decode() == "rot/r/ep1-ba10-rank0.pt"
