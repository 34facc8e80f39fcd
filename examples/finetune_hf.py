"""Fine-tune a small Hugging Face causal LM under FSDP, save, export to Hugging Face format, reload.

    lockstep -n 2 examples/finetune_hf.py                       # FSDP on 2 ranks, CPU or GPU
    lockstep -n 2 examples/finetune_hf.py --parallel ddp --max_duration 200ba

A GPT-2 built from a config (nothing downloaded) learns the bytes of the running Python's standard
library (its ``*.py`` files, sorted; every 20th held out) through a byte-level tokenizer built here.
It trains through ``lockstep.models.HuggingFaceModel`` (each ``GPT2Block`` an FSDP unit), logs a
``Generate`` sample at the end, saves a checkpoint, and rank 0 writes it as a Hugging Face folder
(``write_huggingface_pretrained_from_composer_checkpoint``) that ``from_pretrained`` loads back; the
script checks that the reloaded model gives the trained model's logits. Needs ``torch-lockstep[huggingface]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader, Dataset

from lockstep import Trainer, dist
from lockstep.callbacks import Generate
from lockstep.loggers import InMemoryLogger
from lockstep.metrics import LanguageCrossEntropy
from lockstep.models import HuggingFaceModel, write_huggingface_pretrained_from_composer_checkpoint
from lockstep.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW

PROMPTS = ["def ", "import os\n"]
SAMPLING = {"max_new_tokens": 24, "do_sample": False, "no_repeat_ngram_size": 3}
"""Greedy, so every rank generates the same tokens (FSDP's forwards must match); no 3-gram twice keeps
a model this small from answering with spaces only."""


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Every byte is a token (GPT-2's byte-to-character map), plus an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


class Windows(Dataset):
    """Non-overlapping windows of ``length`` tokens; each sample is a dict, as transformers takes them."""

    def __init__(self, ids: torch.Tensor, length: int) -> None:
        self.ids, self.length = ids, length

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.ids[i * self.length:(i + 1) * self.length]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


def stdlib_text(limit: int) -> tuple[str, str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    texts = [f.read_text(errors="replace") for f in files]
    return "".join(t for i, t in enumerate(texts) if i % 20), "".join(t for i, t in enumerate(texts) if not i % 20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp")
    p.add_argument("--max_duration", default="60ba")
    p.add_argument("--files", type=int, default=40, help="how many stdlib files to read")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8, help="per rank")
    p.add_argument("--save_folder", default="runs/finetune_hf")
    args = p.parse_args()

    tokenizer = byte_tokenizer()
    train_text, eval_text = stdlib_text(args.files)
    train = Windows(torch.tensor(tokenizer(train_text)["input_ids"]), args.seq_len)
    evaluation = Windows(torch.tensor(tokenizer(eval_text)["input_ids"][:20 * args.seq_len]), args.seq_len)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=tokenizer.eos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = HuggingFaceModel(transformers.GPT2LMHeadModel(config), tokenizer=tokenizer, use_logits=True,
                             metrics=[LanguageCrossEntropy()])
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(train, batch_size=args.batch_size, sampler=dist.get_sampler(train, shuffle=True)),
        eval_dataloader=DataLoader(evaluation, batch_size=args.batch_size, sampler=dist.get_sampler(evaluation)),
        eval_interval="0.5dur", max_duration=args.max_duration,
        optimizers=DecoupledAdamW(model.parameters(), lr=3e-3, weight_decay=1e-5),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur", alpha_f=0.1),
        fsdp_config={"state_dict_type": "sharded"} if args.parallel == "fsdp" else None,
        callbacks=[Generate(PROMPTS, interval="1dur", **SAMPLING)], loggers=[memory],
        save_folder=args.save_folder, save_interval="1dur", save_overwrite=True, seed=17, progress_bar=False)
    trainer.fit()
    losses = [float(v) for _, v in memory.data["loss/train/total"]]

    probe = torch.stack([evaluation[i]["input_ids"] for i in range(2)]).to(trainer.state.device.torch_device)
    model.eval()
    with torch.no_grad():  # every rank: under FSDP a forward gathers the shards
        trained_logits = model({"input_ids": probe}).logits.float().cpu()
    if dist.get_global_rank() == 0:  # rank 0 wrote the checkpoint (every rank wrote its shards)
        checkpoint = trainer.saved_checkpoints[-1]
        out = Path(args.save_folder) / "huggingface"
        write_huggingface_pretrained_from_composer_checkpoint(checkpoint, out)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        with torch.no_grad():
            logits = reloaded(input_ids=probe.cpu()).logits
        diff = (logits - trained_logits).abs().max().item()
        print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
              f"eval LanguageCrossEntropy {float(memory.most_recent_values['metrics/eval/LanguageCrossEntropy']):.3f}")
        print(f"checkpoint {checkpoint} -> {out}: from_pretrained's logits "
              f"{'equal' if torch.equal(logits, trained_logits) else f'differ by {diff:.3g}'} the trained model's")
        print("generations:", json.loads(memory.tables["generations"])["data"])
        ids = reloaded_tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
        again = reloaded.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=reloaded_tokenizer.eos_token_id,
                                  **SAMPLING)
        print("reloaded model and tokenizer:", repr(reloaded_tokenizer.decode(again[0])))
        if not torch.equal(logits, trained_logits):
            sys.exit("finetune_hf.py: the reloaded model's logits differ from the trained model's")


if __name__ == "__main__":
    main()
