"""Composer's meshes on 4 CPU ranks: HSDP (replicate 2 x shard 2) and FSDP + tensor parallelism
(shard 2 x tensor 2) train the GPT example to DDP's parameters, resume bitwise, and their
checkpoints load on other meshes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lockstep.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# 20 steps of 4 sequences x 32 tokens on each of 4 ranks
TINY = ["--layers", "2", "--heads", "2", "--dim", "32", "--block_size", "32", "--batch_size", "4",
        "--train_bytes", "40000", "--eval_bytes", "2000", "--max_duration", "20ba", "--eval_interval", "1dur",
        "--warmup", "4ba", "--sample_bytes", "0", "--seed", "3"]
MESHES = {"ddp": ["--parallel", "ddp"], "hsdp": ["--parallel", "fsdp", "--hsdp", "2"],
          "tp": ["--parallel", "fsdp", "--tp", "2"]}


def _gpt():
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt

    return train_gpt


def full_params(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in trainer.state.model.state_dict().items()}


def _train_each(names: list[str], folder: str) -> dict:
    gpt = _gpt()
    out = {}
    for name in names:
        trainer = gpt.main([*TINY, *MESHES[name], "--run_folder", f"{folder}/{name}"])
        out[name] = full_params(trainer)
        out[f"{name} mesh"] = trainer.strategy.describe().get("mesh")
        out[f"{name} samples"] = trainer.state.timestamp.sample.value
    return out


@pytest.mark.timeout(400)
def test_hsdp_and_tensor_parallel_train_to_ddps_parameters(tmp_path: Path) -> None:
    results = run_distributed(_train_each, world_size=4, args=(list(MESHES), str(tmp_path)), timeout=380)
    rank0 = results[0]
    assert rank0["hsdp mesh"] == "data_parallel_replicate 2 x data_parallel_shard 2"
    assert rank0["tp mesh"] == "data_parallel_shard 2 x tensor_parallel 2"
    assert rank0["ddp samples"] == rank0["tp samples"] == rank0["hsdp samples"] == 20 * 4 * 4
    for name in ("hsdp", "tp"):
        assert rank0[name].keys() == rank0["ddp"].keys()
        for key, value in rank0["ddp"].items():
            torch.testing.assert_close(rank0[name][key], value, rtol=0, atol=1e-5, msg=f"{name}: {key}")
    for rank in results[1:]:  # every rank holds the same full parameters
        for key, value in rank0["tp"].items():
            assert torch.equal(rank["tp"][key], value)



def _crash_at(batch: int):
    from lockstep import Callback

    class Crash(Callback):
        """Dies at a batch, after the checkpoint of an earlier one (a stand-in for kill -9)."""

        def batch_start(self, state, logger) -> None:
            if state.timestamp.batch == batch:
                raise RuntimeError("crash")

    return Crash()


def _resume(name: str, folder: str) -> dict:
    """The mesh's run crashes at batch 13 and autoresumes from batch 10's sharded checkpoint."""
    gpt = _gpt()
    common = [*TINY, *MESHES[name], "--checkpoint_layout", "sharded"]
    reference = full_params(gpt.main([*common, "--run_folder", f"{folder}/ref"]))
    run = [*common, "--save_folder", f"{folder}/ckpt", "--save_interval", "10ba", "--autoresume", "--run_name", name]
    trainer, _ = gpt.build_trainer(gpt.parse_args(run))
    trainer.callbacks.append(_crash_at(13))
    try:
        trainer.fit()
    except RuntimeError:
        trainer.close()
    resumed = gpt.main(run)
    return {"reference": reference, "resumed": full_params(resumed), "batches": resumed.state.timestamp.batch.value}


def _load(checkpoint: str, mesh: list[str]) -> dict[str, torch.Tensor]:
    gpt = _gpt()
    trainer, _ = gpt.build_trainer(gpt.parse_args([*TINY, *mesh, "--load_path", checkpoint]))
    return full_params(trainer)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["tp", "hsdp"])
def test_a_mesh_resumes_bitwise_and_its_checkpoint_loads_on_other_meshes(name: str, tmp_path: Path) -> None:
    from lockstep.checkpoint.export import export_state_dict

    results = run_distributed(_resume, world_size=4, args=(name, str(tmp_path)), timeout=380)
    for rank in results:
        assert rank["batches"] == 20
        assert rank["reference"].keys() == rank["resumed"].keys()
        for key, value in rank["reference"].items():
            assert torch.equal(value, rank["resumed"][key]), key
    checkpoint = str(tmp_path / "ckpt" / "ep0-ba10-rank0.pt")
    saved = export_state_dict(checkpoint)  # the full weights of batch 10
    four = run_distributed(_load, world_size=4, args=(checkpoint, ["--parallel", "fsdp"]), timeout=200)[0]
    one = run_distributed(_load, world_size=1, args=(checkpoint, ["--parallel", "fsdp"]), timeout=200)[0]
    other = "hsdp" if name == "tp" else "tp"
    across = run_distributed(_load, world_size=4, args=(checkpoint, MESHES[other]), timeout=200)[0]
    assert saved.keys() == four.keys() == one.keys() == across.keys()
    for key, value in saved.items():
        for where, loaded in (("4 x 1", four), ("1 rank", one), (other, across)):
            assert torch.equal(loaded[key], value), f"{where}: {key}"
