"""FSDP checkpoints: full, local and sharded layouts resume exactly; sharded reshards 2 <-> 4 ranks;
autoresume, past a damaged sharded or local checkpoint too; export of each layout to full tensors."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer, dist
from lockstep.checkpoint import CheckpointError, export_state_dict, files
from lockstep.optim import CosineAnnealingWithWarmupScheduler
from lockstep.testing import run_distributed
from tests.trainer.common import BlockMLP, assert_fell_back, assert_same_params, damage, error_of, full_params, loader

GLOBAL_BATCH = 8  # 28 samples: 4 batches per epoch
NAMES = {"full": "ep{epoch}-ba{batch}-rank{rank}.pt", "local": "ep{epoch}-ba{batch}-rank{rank}.pt",
         "sharded": "ep{epoch}-ba{batch}", "ddp": "ep{epoch}-ba{batch}-rank{rank}.pt"}


class DropoutBlocks(BlockMLP):
    """Dropout draws from each rank's RNG every step: an exact resume must restore it."""

    def forward(self, batch):
        return self.net(torch.nn.functional.dropout(batch[0], 0.2, training=self.training))


class NormBlocks(DropoutBlocks):
    """With a BatchNorm, whose float buffers FSDP's PURE mixed precision keeps in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(self.net[0], torch.nn.BatchNorm1d(16), *self.net[1:])


def fit(kind: str, folder: str | None, duration: str, load: str | None = None, autoresume: bool = False,
        dropout: bool = True, keep: int = -1, pure_bf16: bool = False,
        schedule_in_samples: bool = False, callbacks: tuple = ()) -> dict[str, torch.Tensor]:
    model = NormBlocks() if pure_bf16 else DropoutBlocks() if dropout else BlockMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    fsdp_config = {"state_dict_type": kind, **({"mixed_precision": "PURE"} if pure_bf16 else {})}
    trainer = Trainer(
        model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size(), shuffle=True),
        max_duration=duration, optimizers=optimizer,
        # a schedule in samples (counted over all ranks) continues exactly when resharded to other ranks
        schedulers=(CosineAnnealingWithWarmupScheduler("16sp", t_max="56sp", alpha_f=0.2) if schedule_in_samples
                    else torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)),
        precision="amp_bf16" if pure_bf16 else "fp32",
        progress_bar=False, seed=7, fsdp_config=None if kind == "ddp" else fsdp_config,
        save_folder=folder, save_filename=NAMES[kind], save_interval="3ba",
        load_path=load, autoresume=autoresume, run_name="fsdp-ck" if autoresume else None,
        save_num_checkpoints_to_keep=keep, callbacks=list(callbacks))
    trainer.fit()
    return full_params(model)


def _resume_exactly(kind: str, folder: str) -> tuple[dict, dict, dict]:
    uninterrupted = fit(kind, None, "2ep")
    fit(kind, folder, "6ba")  # saves at ba3 (mid-epoch) and ba6
    ba3 = os.path.join(folder, NAMES[kind].format(epoch=0, batch=3, rank="{rank}"))
    resumed = fit(kind, None, "2ep", load=ba3)
    exported = export_state_dict(os.path.join(folder, NAMES[kind].format(epoch=1, batch=6, rank=0)))
    at_ba6 = fit(kind, None, "6ba", load=ba3)
    return uninterrupted, resumed, {"exported": exported, "at_ba6": at_ba6}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["full", "local", "sharded"])
def test_exact_resume_and_export(kind: str, tmp_path: Path) -> None:
    results = run_distributed(_resume_exactly, world_size=2, args=(kind, str(tmp_path)), timeout=220)
    for uninterrupted, resumed, extra in results:
        assert_same_params(resumed, uninterrupted, atol=0)
        assert_same_params(extra["exported"], extra["at_ba6"], atol=0)
    files = sorted(os.listdir(tmp_path))
    if kind == "local":
        assert "ep0-ba3-rank0.pt" in files and "ep0-ba3-rank1.pt" in files
        assert "latest-rank1.pt" in files
    if kind == "sharded":
        assert (tmp_path / "ep0-ba3").is_dir() and (tmp_path / "ep0-ba3" / "lockstep.pt").is_file()
    if kind == "full":
        assert "ep0-ba3-rank1.pt" not in files  # rank 0 writes one file


def _pure_bf16(kind: str, folder: str) -> tuple[dict, dict, dict[str, torch.dtype]]:
    uninterrupted = fit(kind, None, "2ep", pure_bf16=True)
    fit(kind, folder, "3ba", pure_bf16=True)
    ba3 = os.path.join(folder, NAMES[kind].format(epoch=0, batch=3, rank="{rank}"))
    resumed = fit(kind, None, "2ep", load=ba3, pure_bf16=True)
    saved = export_state_dict(ba3.format(rank=0))
    return uninterrupted, resumed, {k: v.dtype for k, v in saved.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_buffers_kept_in_bf16_are_saved_in_their_own_dtype(kind: str, tmp_path: Path) -> None:
    # FSDP1's rule: full and sharded checkpoints hold buffers in full precision; the resume is exact
    for uninterrupted, resumed, saved in run_distributed(_pure_bf16, world_size=2, args=(kind, str(tmp_path)),
                                                         timeout=160):
        assert uninterrupted["net.1.running_mean"].dtype == torch.bfloat16  # live, in the buffer dtype
        assert saved["net.1.running_mean"] == saved["net.1.running_var"] == torch.float32
        assert saved["net.1.num_batches_tracked"] == torch.int64
        assert_same_params(resumed, uninterrupted, atol=0)


class _BatchEnds(Callback):
    def __init__(self) -> None:
        self.ended: dict[int, float] = {}

    def batch_end(self, state, logger) -> None:
        self.ended[state.timestamp.batch] = time.monotonic()


def _slow_sharded_writes(folder: str) -> tuple[dict, dict, list, dict]:
    from lockstep.checkpoint.fsdp_states import ShardedLayout

    writes, write = [], ShardedLayout.write_tensors

    def slow_write(temp, tensors, group):
        began = time.monotonic()
        if not writes:
            time.sleep(1.0)  # long enough for training to take steps meanwhile
        parts = write(temp, tensors, group)
        writes.append((temp.name, threading.current_thread().name, began, time.monotonic()))
        return parts

    uninterrupted = fit("sharded", None, "2ep")
    ends = _BatchEnds()
    ShardedLayout.write_tensors = staticmethod(slow_write)
    try:
        fit("sharded", folder, "6ba", callbacks=(ends,))  # ba3 and ba6 in the background
    finally:
        ShardedLayout.write_tensors = staticmethod(write)
    resumed = fit("sharded", None, "2ep", load=os.path.join(folder, "ep0-ba3"))
    return uninterrupted, resumed, writes, ends.ended


@pytest.mark.timeout(180)
def test_sharded_saves_write_in_the_background_and_resume_exactly(tmp_path: Path) -> None:
    for uninterrupted, resumed, writes, ended in run_distributed(_slow_sharded_writes, world_size=2,
                                                                 args=(str(tmp_path),), timeout=160):
        (ba3, thread3, _, done3), (ba6, thread6, _, _) = writes
        assert ba3.startswith(".ep0-ba3.tmp.") and ba6.startswith(".ep1-ba6.tmp.")
        assert thread3.startswith("lockstep-checkpoint") and thread6.startswith("lockstep-checkpoint")
        assert ended[5] < done3  # training went on while the shards of ba3 were written
        assert_same_params(resumed, uninterrupted, atol=0)  # from a copy taken before those steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep0-ba3", "ep1-ba6", "latest-rank0.pt"]


def _resume_sharded(folder: str) -> dict[str, torch.Tensor]:
    return fit("sharded", None, "2ep", load=os.path.join(folder, "ep0-ba3"), dropout=False, schedule_in_samples=True)


def _uninterrupted(folder: str) -> dict[str, torch.Tensor]:
    """The whole run, which saves ep0-ba3 (and ba6, ba8) on its way."""
    return fit("sharded", folder, "2ep", dropout=False, schedule_in_samples=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_at, resumed_at", [(2, 4), (4, 2)])
def test_sharded_checkpoint_reshards(saved_at: int, resumed_at: int, tmp_path: Path) -> None:
    # same global batch at both world sizes: the DistributedSampler yields the same global batches
    reference = run_distributed(_uninterrupted, world_size=saved_at, args=(str(tmp_path),), timeout=120)[0]
    assert (tmp_path / "ep0-ba3" / "lockstep.pt").is_file()
    for resumed in run_distributed(_resume_sharded, world_size=resumed_at, args=(str(tmp_path),), timeout=120):
        assert_same_params(resumed, reference, atol=1e-5)


def _autoresume(folder: str) -> tuple[dict, dict]:
    uninterrupted = fit("local", None, "2ep")
    fit("local", folder, "5ba", autoresume=True)  # saves ba3 and the end, ba5
    resumed = fit("local", folder, "2ep", autoresume=True)
    return uninterrupted, resumed


@pytest.mark.timeout(180)
def test_autoresume_with_local_files(tmp_path: Path) -> None:
    for uninterrupted, resumed in run_distributed(_autoresume, world_size=2, args=(str(tmp_path),), timeout=160):
        assert_same_params(resumed, uninterrupted, atol=0)


def _crash_between_publishes(folder: str, crash_at: int) -> tuple[dict, dict, str, list[str]]:
    from lockstep.checkpoint import files

    uninterrupted = fit("local", None, "2ep")
    if dist.get_global_rank() == 1:
        def crash(path: Path) -> None:
            if f"-ba{crash_at}-" in path.name:
                raise OSError("rank 1 went down before publishing")
        files._before_publish = crash
    message = "no error"
    try:  # saves ba3, then ba5 at the end; rank 1 does not publish crash_at's
        fit("local", folder, "5ba", autoresume=True, keep=1)
    except RuntimeError as e:
        message = str(e)
    finally:
        files._before_publish = None
    kept = sorted(os.listdir(folder))
    dist.barrier()
    resumed = fit("local", folder, "2ep", autoresume=True, keep=1)
    return uninterrupted, resumed, message, kept


@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash_at", [5, 3])
def test_autoresume_of_local_files_goes_back_to_the_step_every_rank_has(crash_at: int, tmp_path: Path) -> None:
    # at 5, the ranks resume from ba3, which every rank has; at 3 (the first save) they start over
    results = run_distributed(_crash_between_publishes, world_size=2, args=(str(tmp_path), crash_at), timeout=160)
    for uninterrupted, resumed, message, kept in results:
        assert "failed on rank 1" in message and "went down before publishing" in message
        if crash_at == 5:  # rank 0 published ba5 but kept ba3 (keep=1 prunes once every rank has published)
            assert {"ep0-ba3-rank0.pt", "ep1-ba5-rank0.pt", "ep0-ba3-rank1.pt"} <= set(kept)
            assert "ep1-ba5-rank1.pt" not in kept
        else:
            assert {"ep0-ba3-rank0.pt", "latest-rank0.pt"} <= set(kept)
            assert "latest-rank1.pt" not in kept and "ep0-ba3-rank1.pt" not in kept
        assert_same_params(resumed, uninterrupted, atol=0)
    assert sorted(os.listdir(tmp_path)) == ["ep2-ba8-rank0.pt", "ep2-ba8-rank1.pt", "latest-rank0.pt",
                                            "latest-rank1.pt"]


def _across_ddp_and_fsdp(folder: str) -> dict[str, dict]:
    out = {"ddp": fit("ddp", None, "2ep"), "fsdp": fit("full", None, "2ep")}
    fit("ddp", os.path.join(folder, "ddp"), "3ba")
    fit("full", os.path.join(folder, "full"), "3ba")
    ddp_ba3 = os.path.join(folder, "ddp", "ep0-ba3-rank{rank}.pt")
    out["ddp into full"] = fit("full", None, "2ep", load=ddp_ba3)
    out["ddp into sharded"] = fit("sharded", None, "2ep", load=ddp_ba3)
    out["full into ddp"] = fit("ddp", None, "2ep", load=os.path.join(folder, "full", "ep0-ba3-rank{rank}.pt"))
    return out


@pytest.mark.timeout(240)
def test_a_ddp_checkpoint_resumes_under_fsdp_and_back(tmp_path: Path) -> None:
    # the optimizer state is keyed by parameter index under DDP and by name under FSDP
    for out in run_distributed(_across_ddp_and_fsdp, world_size=2, args=(str(tmp_path),), timeout=220):
        assert_same_params(out["ddp"], out["fsdp"], atol=1e-5)
        for key in ("ddp into full", "ddp into sharded", "full into ddp"):
            assert_same_params(out[key], out["ddp"], atol=1e-5)


def _wrong_layout(folder: str) -> str:
    fit("local", folder, "3ba")
    return error_of(fit, "sharded", None, "2ep", load=os.path.join(folder, "ep0-ba3-rank{rank}.pt"),
                    expected=(ValueError,))


@pytest.mark.timeout(120)
def test_loading_another_layout_names_the_setting(tmp_path: Path) -> None:
    errors = run_distributed(_wrong_layout, world_size=2, args=(str(tmp_path),), timeout=100)
    assert "is a 'local' checkpoint but this run uses 'sharded' checkpoints" in errors[0]
    assert "fsdp_config={'state_dict_type': 'local'}" in errors[0]


def _past_sharded_damage(folder: str, cases: list[tuple[str, str, bool]]) -> tuple[dict, list[tuple]]:
    """Save ba3 and ba6 once, and a run loaded from ba3; then for each (file, damage, unrecorded),
    in a copy of the saved folder: damage that file of ba6, then load_path at it, its export and
    autoresume. ``unrecorded``: ba3 and ba6 as saved before lockstep.pt recorded the files' sizes
    and CRC32s."""
    saved = Path(folder) / "saved"
    fit("sharded", str(saved), "6ba", autoresume=True)
    from_ba3 = fit("sharded", None, "2ep", load=str(saved / "ep0-ba3"))
    tried = []
    for n, (target, how, unrecorded) in enumerate(cases):
        copy = Path(folder) / f"copy{n}"
        dist.barrier()
        if dist.get_global_rank() == 0:
            shutil.copytree(saved, copy, symlinks=True)
            for name in ("ep0-ba3", "ep1-ba6") if unrecorded else ():
                _forget_parts(copy / name)
            damage(copy / "ep1-ba6" / target, how)
        dist.barrier()
        error = error_of(fit, "sharded", None, "2ep", load=str(copy / "ep1-ba6"), expected=(CheckpointError,))
        exported = error_of(export_state_dict, str(copy / "ep1-ba6"), expected=(CheckpointError,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = fit("sharded", str(copy), "2ep", autoresume=True)  # from ba3, and saves ba6 again
        tried.append((resumed, error, exported, [str(w.message) for w in caught if "autoresume" in str(w.message)],
                      sorted(os.listdir(copy))))
    return from_ba3, tried


def _forget_parts(checkpoint: Path) -> None:
    from lockstep.checkpoint import files
    content = files.read(checkpoint / "lockstep.pt")
    del content["lockstep"]["parts"]
    torch.save(content, checkpoint / "new.pt")  # not over lockstep.pt: content is mapped from it
    os.replace(checkpoint / "new.pt", checkpoint / "lockstep.pt")


_LOAD_OLDER = ": load an older checkpoint or delete this one"
SHARDED_DAMAGE = {  # (file, damage) -> what the one-line error says after "rank N: "
    ("__1_0.distcp", "delete"): r"checkpoint {ck} is damaged: __1_0\.distcp is missing \(deleted\?\)" + _LOAD_OLDER,
    ("__0_0.distcp", "flip"): r"checkpoint {ck} is damaged: __0_0\.distcp fails its CRC32 check \(flipped bytes\?\)"
                              + _LOAD_OLDER,
    ("__1_0.distcp", "truncate"): r"checkpoint {ck} is damaged: __1_0\.distcp is \d+ bytes, expected \d+ "
                                  r"\(truncated\?\)" + _LOAD_OLDER,
    (".metadata", "delete"): r"checkpoint {ck} is damaged: \.metadata is missing \(deleted\?\)" + _LOAD_OLDER,
    ("lockstep.pt", "flip"): r"checkpoint {ck}/lockstep\.pt is corrupt: record \S+ fails its CRC check; "
                             r"load an earlier checkpoint",
    ("lockstep.pt", "delete"): r"checkpoint {ck} is damaged: lockstep\.pt is missing \(deleted\?\)" + _LOAD_OLDER,
}


# what DCP's .metadata says each file holds, for a checkpoint without lockstep.pt's records of them:
# the truncated one is too short; ba3 still loads
_UNRECORDED = (r"checkpoint {ck} is damaged: __1_0\.distcp is \d+ bytes, expected at least \d+ \(truncated\?\)"
               + _LOAD_OLDER)


@pytest.mark.timeout(400)
def test_autoresume_falls_back_past_a_damaged_sharded_checkpoint(tmp_path: Path) -> None:
    cases = [(target, how, False) for target, how in SHARDED_DAMAGE] + [("__1_0.distcp", "truncate", True)]
    saids = list(SHARDED_DAMAGE.values()) + [_UNRECORDED]
    from_ba3, tried = zip(*run_distributed(_past_sharded_damage, world_size=2, args=(str(tmp_path), cases),
                                           timeout=380))
    for rank, cases_tried in enumerate(tried):
        for n, (said, (resumed, error, exported, warned, listed)) in enumerate(zip(saids, cases_tried)):
            said = said.replace("{ck}", re.escape(str(tmp_path / f"copy{n}" / "ep1-ba6")))
            assert re.fullmatch(rf"rank \d: {said}", error), (cases[n], error)  # load_path: one line, every rank
            assert re.fullmatch(said, exported), (cases[n], exported)  # export checks every file in one process
            assert_fell_back(rank, resumed, from_ba3[rank], warned, listed, said=said, older="ep0-ba3",
                             newest="ep1-ba6")


_CORRUPT = r"checkpoint {ck} is corrupt: record \S+ fails its CRC check; load an earlier checkpoint"
_TRUNCATED = (r"checkpoint {ck} is truncated or not a torch checkpoint \(File is not a zip file\); "
              r"load an earlier checkpoint")
_MISSING = r"load_path '{template}': {ck} does not exist while other ranks found theirs: is it on a file system " \
           r"every node sees\?"
LOCAL_DAMAGE = {  # (rank whose file of ba6 is damaged, damage) -> what load_path and autoresume say after
    # "rank N: ", and the ranks whose file of ba6 autoresume sets aside (each its own: the one its pointer names)
    (1, "flip"): (_CORRUPT, _CORRUPT, {0, 1}),
    (0, "truncate"): (_TRUNCATED, _TRUNCATED, {0, 1}),
    (1, "delete"): (_MISSING, r"latest pointer \S+/latest-rank1\.pt names {ck}, which does not exist", {0}),
    # rank 1 went down before it published ba6 (its pointer names ba3), and rank 0's ba6 is damaged
    (0, "flip-behind"): (_CORRUPT, _CORRUPT, {0}),
}


def _damage_local(copy: Path, rank: int, how: str) -> None:
    if how == "flip-behind":
        (copy / "ep1-ba6-rank1.pt").unlink()
        files.point_latest(copy / "latest-rank1.pt", copy / "ep0-ba3-rank1.pt")
        how = "flip"
    damage(copy / f"ep1-ba6-rank{rank}.pt", how)


def _past_local_damage(folder: str) -> tuple[dict, list[tuple[dict, str, list[str], list[str]]]]:
    """FSDP local: save ba3 and ba6 once, and a run loaded from ba3; then for each damage, in a copy
    of the saved folder, damage one rank's file of ba6 and: load_path at it, and autoresume."""
    fit("local", os.path.join(folder, "saved"), "6ba", autoresume=True)
    from_ba3 = fit("local", None, "2ep", load=os.path.join(folder, "saved", "ep0-ba3-rank{rank}.pt"))
    out = []
    for n, (rank, how) in enumerate(LOCAL_DAMAGE):
        copy = Path(folder) / f"copy{n}"
        dist.barrier()
        if dist.get_global_rank() == 0:
            shutil.copytree(Path(folder) / "saved", copy, symlinks=True)
            _damage_local(copy, rank, how)
        dist.barrier()
        error = error_of(fit, "local", None, "2ep", load=str(copy / "ep1-ba6-rank{rank}.pt"),
                         expected=(CheckpointError,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = fit("local", str(copy), "2ep", autoresume=True)  # from ba3, and saves ba6 again
        out.append((resumed, error, [str(w.message) for w in caught if "autoresume" in str(w.message)],
                    sorted(os.listdir(copy))))
    return from_ba3, out


@pytest.mark.timeout(200)
def test_autoresume_of_local_files_falls_back_past_a_damaged_one(tmp_path: Path) -> None:
    results = run_distributed(_past_local_damage, world_size=2, args=(str(tmp_path),), timeout=180)
    for rank, (from_ba3, cases) in enumerate(results):
        for n, ((damaged, _), (loading, resuming, aside)) in enumerate(LOCAL_DAMAGE.items()):
            resumed, error, warned, listed = cases[n]
            ck, template = (re.escape(str(tmp_path / f"copy{n}" / name))
                            for name in (f"ep1-ba6-rank{damaged}.pt", "ep1-ba6-rank{rank}.pt"))
            loading, resuming = (s.replace("{ck}", ck).replace("{template}", template) for s in (loading, resuming))
            assert re.fullmatch(rf"rank {damaged}: {loading}", error), error  # load_path: one line, on every rank
            # every rank goes back to ba3 and rank 0 says why; the resumed run saves ba6 again
            assert_fell_back(rank, resumed, from_ba3, warned, listed, said=resuming, older="ep0-ba3-rank0.pt",
                             newest="ep1-ba6-rank0.pt")
            assert {r for r in (0, 1) if f"ep1-ba6-rank{r}.pt.damaged" in listed} == aside, (n, listed)
            assert {"ep1-ba6-rank1.pt", "ep2-ba8-rank0.pt", "ep2-ba8-rank1.pt"} <= set(listed), (n, listed)
            assert [os.readlink(tmp_path / f"copy{n}" / f"latest-rank{r}.pt") for r in (0, 1)] == \
                ["ep2-ba8-rank0.pt", "ep2-ba8-rank1.pt"]
