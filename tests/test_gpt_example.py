"""The GPT job (examples/train_gpt.py) on a tiny configuration: it learns, and a run that crashes
mid-epoch and autoresumes ends with the uninterrupted run's exact parameters (FSDP sharded, DDP)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lockstep import Callback
from lockstep.core.eval_metrics import values
from lockstep.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--layers", "1", "--heads", "2", "--dim", "32", "--block_size", "32", "--batch_size", "4",
        "--train_bytes", "40000", "--eval_bytes", "4000", "--max_duration", "3072tok",  # 12 steps of 256 tokens
        "--eval_interval", "0.5dur", "--warmup", "768tok", "--sample_bytes", "0", "--seed", "3"]


def _gpt():
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt

    return train_gpt


class Crash(Callback):
    """Dies at a batch, after the checkpoint of the batch before (a stand-in for kill -9)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def batch_start(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            raise RuntimeError("crash")


def full_params(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in trainer.state.model.state_dict().items()}


def _crash_and_resume(parallel: str, folder: str) -> dict:
    gpt = _gpt()
    common = [*TINY, "--parallel", parallel]
    reference = gpt.main([*common, "--run_folder", f"{folder}/ref"])
    out = {"reference": full_params(reference), "eval": values(reference.state.eval_metrics)["eval"]}
    run = [*common, "--save_folder", f"{folder}/ckpt", "--save_interval", "2ba", "--autoresume", "--run_name", "gpt"]
    trainer, _ = gpt.build_trainer(gpt.parse_args(run))
    trainer.callbacks.append(Crash(at=7))  # the last checkpoint is at batch 6, mid-epoch
    try:
        trainer.fit()
    except RuntimeError:
        pass
    resumed = gpt.main(run)
    out["resumed_from"] = 6
    out["resumed"] = full_params(resumed)
    out["batches"] = resumed.state.timestamp.batch
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_gpt_crashes_mid_epoch_and_autoresumes_exactly(parallel: str, tmp_path: Path) -> None:
    results = run_distributed(_crash_and_resume, world_size=2, args=(parallel, str(tmp_path)), timeout=280)
    for rank in results:
        assert rank["batches"] == 12
        assert rank["reference"].keys() == rank["resumed"].keys()
        for name, value in rank["reference"].items():
            assert torch.equal(value, rank["resumed"][name]), name
    # it learned: 5.5 nats per byte at random, clearly below after 12 tiny steps
    assert results[0]["eval"]["LanguageCrossEntropy"] < 5.0
    assert results[0]["eval"]["LanguagePerplexity"] == pytest.approx(
        torch.tensor(results[0]["eval"]["LanguageCrossEntropy"]).exp().item(), rel=1e-5)


def _bpe(folder: str, stdlib: str) -> dict:
    gpt = _gpt()
    args = [*TINY, "--parallel", "ddp", "--tokenizer", "bpe", "--vocab_size", "300", "--stdlib", stdlib,
            "--data_cache", f"{folder}/cache", "--run_folder", f"{folder}/run", "--max_duration", "5120tok"]
    trainer = gpt.build_trainer(gpt.parse_args(args))[0]
    first = trainer.eval()["eval"]
    trainer.fit()
    model = trainer.state.model
    model = getattr(model, "module", model)
    text = "def f(x):\n    return x  # é\n"
    return {"first": first, "last": values(trainer.state.eval_metrics)["eval"], "vocab": model.vocab_size,
            "round trip": model.codec.decode(model.codec.encode(text)) == text,
            "tokens": len(model.codec.encode(text)), "chars": len(text), "params": full_params(trainer)}


@pytest.mark.timeout(200)
def test_a_bpe_learned_from_the_training_split_trains_on_every_rank_alike(tmp_path: Path) -> None:
    import sysconfig

    pytest.importorskip("tokenizers")
    stdlib = str(Path(sysconfig.get_paths()["stdlib"]) / "json")  # a few files: the tokenizer learns in a second
    results = run_distributed(_bpe, world_size=2, args=(str(tmp_path), stdlib), timeout=180)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # learned once, by local rank 0, and shared
    for rank in results:
        assert rank["vocab"] == 300 and rank["round trip"] and rank["tokens"] < rank["chars"]
        assert rank["last"]["LanguageCrossEntropy"] < rank["first"]["LanguageCrossEntropy"] - 0.3
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
