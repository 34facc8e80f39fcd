"""HuggingFaceModel: a tiny GPT-2 built from a config (nothing downloaded) trains under DDP, FSDP
and ZeRO on 2 ranks and resumes exactly; its checkpoints become Hugging Face folders that
``from_pretrained`` loads to the trained model's logits."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils.data import DataLoader

from lockstep import Trainer, dist
from lockstep.callbacks import Generate
from lockstep.loggers import InMemoryLogger
from lockstep.models import HuggingFaceModel, write_huggingface_pretrained_from_composer_checkpoint
from lockstep.testing import run_distributed
from tests.trainer.common import assert_same_params, error_of, full_params

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
VOCAB, LENGTH = 48, 10


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config)


def samples(n: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]


def loader(per_rank: int) -> DataLoader:
    data = samples()
    return DataLoader(data, batch_size=per_rank, sampler=dist.get_sampler(data, shuffle=True))


# -- one process --------------------------------------------------------------------------------

def test_dict_batches_go_to_the_model_as_keywords_and_its_own_loss_is_the_loss() -> None:
    model = HuggingFaceModel(gpt2())
    batch = {k: torch.stack([s[k] for s in samples(4)]) for k in ("input_ids", "attention_mask", "labels")}
    batch["not_an_argument"] = torch.zeros(4)  # keys forward() does not take are dropped
    torch.manual_seed(1)
    ours = model.loss(model(batch), batch)
    torch.manual_seed(1)
    theirs = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
    assert torch.equal(ours, theirs) and model.num_tokens(batch) == 4 * LENGTH
    assert model.shift_labels  # GPT2LMHeadModel is a registered causal LM
    assert model.state_dict().keys() == {f"model.{k}" for k in model.model.state_dict()}
    blocks = [m for m in model.modules() if model.fsdp_wrap_fn(m)]
    assert [type(m).__name__ for m in blocks] == ["GPT2Block", "GPT2Block"]
    assert [m for m in model.modules() if model.activation_checkpointing_fn(m)] == blocks
    error = error_of(model, (batch["input_ids"], batch["labels"]))
    assert error.startswith("HuggingFaceModel takes dict batches") and "\n" not in error


def test_use_logits_gives_metrics_the_logits_and_the_shifted_labels() -> None:
    model = HuggingFaceModel(gpt2(), use_logits=True).eval()
    batch = {k: torch.stack([s[k] for s in samples(2)]) for k in ("input_ids", "labels")}
    logits = model.eval_forward(dict(batch))
    assert logits.shape == (2, LENGTH, VOCAB)
    assert torch.equal(model.labels[:, :-1], batch["labels"][:, 1:]) and bool((model.labels[:, -1] == -100).all())


WORDS = ["<pad>", "<eos>", "<unk>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def test_generate_logs_the_models_continuations_of_the_prompts_at_its_interval() -> None:
    tok = tokenizer()
    model = HuggingFaceModel(gpt2(), tokenizer=tok)
    generate = Generate(["the cat sat", "a dog"], interval="2ba", max_new_tokens=4, do_sample=False)
    memory = InMemoryLogger()
    calls: list[int] = []
    original = generate.generate
    generate.generate = lambda state, logger: (calls.append(int(state.timestamp.batch)), original(state, logger))
    Trainer(model=model, train_dataloader=loader(4), max_duration="5ba", device="cpu", progress_bar=False,
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), callbacks=[generate], loggers=[memory]).fit()
    assert calls == [2, 4, 5]  # every 2 batches, and at the end of training
    table = json.loads(memory.tables["generations"])
    assert table["columns"] == ["prompt", "generation"] and [r[0] for r in table["data"]] == ["the cat sat", "a dog"]
    model.eval()
    for prompt, generation in table["data"]:  # the trained model's own greedy continuation
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert generation == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert tok.padding_side == "right"  # as the tokenizer was


def test_a_checkpoint_of_another_model_is_one_line(tmp_path: Path) -> None:
    composers = Path(__file__).parents[1] / "fixtures" / "composer" / "checkpoints" / "monolithic.pt"
    message = error_of(write_huggingface_pretrained_from_composer_checkpoint, composers, tmp_path / "out")
    assert message.endswith("was not saved from a HuggingFaceModel: it holds no "
                            "state['integrations']['huggingface'] (the model's config)") and "\n" not in message
    assert not (tmp_path / "out").exists()


# -- two ranks: DDP, FSDP, ZeRO --------------------------------------------------------------

def fit(kind: str, duration: str, folder: str | None = None, load: str | None = None,
        checkpointing: bool = False) -> dict[str, torch.Tensor]:
    model = HuggingFaceModel(gpt2())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp = {"state_dict_type": "sharded", "activation_checkpointing": checkpointing} if kind == "fsdp" else None
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration=duration, optimizers=optimizer,
                      schedulers=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
                      fsdp_config=fsdp, deepspeed_config={"zero_optimization": {"stage": 2}} if kind == "zero" else None,
                      save_folder=folder, save_interval="3ba", save_filename="ep{epoch}-ba{batch}" + (
                          "" if kind == "fsdp" else "-rank{rank}.pt"),
                      load_path=load, seed=5, progress_bar=False, device="cpu")
    trainer.fit()
    if kind == "fsdp":  # the FSDP units are the GPT2Blocks (and the root), checkpointed when asked
        from torch.distributed.fsdp import FSDPModule
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        blocks = [getattr(m, "_checkpoint_wrapped_module", m) for m in units]
        assert [type(m).__name__.removeprefix("FSDP") for m in blocks] == ["GPT2Block", "GPT2Block"]
        assert [type(m).__name__ == "FSDPCheckpointWrapper" for m in units] == [checkpointing] * 2
    return full_params(model)


def _train_resume_export(kind: str, folder: str) -> dict:
    uninterrupted = fit(kind, "6ba", folder)  # 4 batches an epoch: saves at ba3 (mid-epoch) and ba6
    name = "ep0-ba3" + ("" if kind == "fsdp" else "-rank{rank}.pt")
    resumed = fit(kind, "6ba", load=os.path.join(folder, name), checkpointing=kind == "fsdp")
    out = {"uninterrupted": uninterrupted, "resumed": resumed}
    if dist.get_global_rank() == 0 and kind != "zero":
        saved = os.path.join(folder, "ep1-ba6" + ("" if kind == "fsdp" else "-rank0.pt"))
        write_huggingface_pretrained_from_composer_checkpoint(saved, os.path.join(folder, "hf"))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "fsdp", pytest.param("zero", marks=pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="needs DeepSpeed (the deepspeed extra)"))])
def test_a_tiny_gpt2_trains_resumes_exactly_and_exports(kind: str, tmp_path: Path) -> None:
    """Resumed mid-epoch at batch 3 (under FSDP with the blocks' activations checkpointed on the
    way back, which changes no number) and trained to batch 6: the uninterrupted run's exact
    parameters, dropout included. The DDP and FSDP checkpoints at batch 6 become Hugging Face
    folders whose model gives the trained model's logits."""
    results = run_distributed(_train_resume_export, world_size=2, args=(kind, str(tmp_path)), timeout=280)
    for result in results:
        assert_same_params(result["resumed"], result["uninterrupted"], atol=0)
    if kind == "zero":
        return
    trained = {k.removeprefix("model."): v for k, v in results[0]["uninterrupted"].items()}
    reference = gpt2().eval()
    reference.load_state_dict(trained)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.stack([s["input_ids"] for s in samples(3)])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
