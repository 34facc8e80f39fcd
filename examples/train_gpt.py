"""Train a small GPT on the Python standard library's source, byte by byte, over 2 processes.

    lockstep -n 2 examples/train_gpt.py                     # FSDP (FULL_SHARD), about 3.5 minutes
    lockstep -n 2 examples/train_gpt.py --parallel ddp
    lockstep -n 2 examples/train_gpt.py --max_duration 2e5tok --save_folder ckpt --autoresume --run_name gpt

The model is nanoGPT's decoder: token and position embeddings, pre-norm blocks of causal
self-attention (``scaled_dot_product_attention``) and an MLP, a final LayerNorm, and an output layer
that shares the token embedding's weights. Each ``Block`` is an FSDP unit and, with
``--activation_checkpointing``, an activation-checkpointing unit.

Data needs no download: the ``*.py`` files of the running Python's standard library, sorted by path,
read as UTF-8 bytes (a vocabulary of 256). Every 20th file is held out for validation, so the split
is the same on every machine with the same Python. Each split is packed into one stream of bytes,
with a 0 byte between files, and cut into sequences of ``--block_size + 1`` bytes.

The dataloader counts tokens, so ``--max_duration``, the warmup + cosine schedule, evaluation and
throughput are all in tokens. Validation reports ``metrics/eval/LanguageCrossEntropy`` (nats per
byte) and ``metrics/eval/LanguagePerplexity``; at the end rank 0 prints a sample that the model
writes after a fixed prompt.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lockstep
from lockstep import dist
from lockstep.algorithms import GradientClipping
from lockstep.callbacks import LRMonitor, SpeedMonitor
from lockstep.loggers import TensorboardLogger
from lockstep.optim import CosineAnnealingWithWarmupScheduler

VOCAB = 256
PROMPT = "import os\n\n\ndef "


# -- data -------------------------------------------------------------------------------------

def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's ``*.py`` files, sorted, without site-packages and test suites."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts))


def load_split(files: list[Path], split: str, max_bytes: int | None = None) -> torch.Tensor:
    """One split's files as a uint8 stream: every 20th file is validation, the rest training."""
    chosen = [p for i, p in enumerate(files) if (i % 20 == 0) == (split == "val")]
    parts, total = [], 0
    for path in chosen:
        data = path.read_bytes() + b"\0"
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8)


class PackedBytes(Dataset):
    """Consecutive, non-overlapping windows of ``block_size + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, stream: torch.Tensor, block_size: int) -> None:
        self.stream, self.block_size = stream, block_size

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.block_size

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block_size
        return self.stream[start:start + self.block_size + 1].long()


class TokenLoader(DataLoader):
    """A DataLoader that tells the Trainer how many tokens a batch holds (inputs, not targets)."""

    @staticmethod
    def get_num_tokens_in_batch(batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)


# -- model ------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LanguageCrossEntropy(torchmetrics.Metric):
    """Mean next-token cross entropy over every token seen (nats), summed over ranks."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
        self.total += losses.double()
        self.count += targets.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count


class LanguagePerplexity(LanguageCrossEntropy):
    """``exp`` of :class:`LanguageCrossEntropy`."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class GPT(lockstep.Model):
    """A decoder-only transformer over bytes. A batch is a ``(B, T + 1)`` tensor of byte values."""

    def __init__(self, layers: int = 4, heads: int = 4, dim: int = 128, block_size: int = 128) -> None:
        super().__init__()
        self.layers, self.heads, self.dim, self.block_size = layers, heads, dim, block_size
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied embeddings
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.logits(batch[:, :-1])

    def loss(self, outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))

    def get_metrics(self, is_train: bool = False) -> dict[str, torchmetrics.Metric]:
        return {"LanguageCrossEntropy": LanguageCrossEntropy(), "LanguagePerplexity": LanguagePerplexity()}

    def update_metric(self, batch: torch.Tensor, outputs: torch.Tensor, metric: torchmetrics.Metric) -> None:
        metric.update(outputs, batch[:, 1:])

    def num_tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        return isinstance(module, Block)

    def activation_checkpointing_fn(self, module: nn.Module) -> bool:
        return isinstance(module, Block)

    def num_params(self) -> int:
        """Parameters counted once (the tied output layer is the embedding), positions excluded."""
        return sum(p.numel() for p in self.parameters()) - self.position.weight.numel()

    def flops_per_batch(self, batch: torch.Tensor) -> float:
        """Training FLOPs (forward + backward) as in the PaLM paper's appendix B and nanoGPT:
        ``6 N`` per token for the weights, plus ``12 L d T`` per token for attention."""
        tokens = batch.shape[1] - 1
        per_token = 6 * self.num_params() + 12 * self.layers * self.dim * tokens
        return float(per_token * batch.shape[0] * tokens)

    @torch.no_grad()
    def generate(self, module: nn.Module, prompt: bytes, length: int, temperature: float = 0.8,
                 top_k: int = 20, seed: int = 0) -> bytes:
        """Sample ``length`` bytes after ``prompt``. Every rank calls it with the same seed, so under
        FSDP every rank runs the same forwards (each gathers the shards)."""
        generator = torch.Generator().manual_seed(seed)
        device = next(module.parameters()).device
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        for _ in range(length):
            window = idx[:, -self.block_size:]
            # forward() drops a batch's last column (the targets): append a placeholder for it
            logits = module(torch.cat([window, window[:, -1:]], dim=1))[:, -1, :].float().cpu() / temperature
            cutoff = torch.topk(logits, top_k).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < cutoff, -math.inf), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator).to(device)], dim=1)
        return bytes(idx[0, len(prompt):].tolist())


# -- the job ----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a byte-level GPT on the Python standard library with lockstep.")
    p.add_argument("--parallel", choices=("ddp", "fsdp", "zero2"), default="fsdp",
                   help="DDP, FSDP FULL_SHARD (default) or DeepSpeed ZeRO-2")
    p.add_argument("--precision", choices=("fp32", "amp_bf16"), default="fp32")
    p.add_argument("--activation_checkpointing", action="store_true", help="recompute each Block in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile each Block (inductor)")
    p.add_argument("--checkpoint_layout", choices=("sharded", "full"), default="sharded",
                   help="FSDP checkpoints: one folder of shards that loads at any world size (default), "
                        "or one file of full tensors")
    p.add_argument("--max_duration", default="1.8e6tok", help="a Time string (default 1.8e6tok)")
    p.add_argument("--eval_interval", default="0.5dur", help="a Time string (default 0.5dur)")
    p.add_argument("--batch_size", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--microbatch_size", type=int, default=None, help="sequences per forward/backward")
    p.add_argument("--block_size", type=int, default=128, help="bytes per sequence (default 128)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--warmup", default="0.05dur", help="linear warmup, a Time string (default 0.05dur)")
    p.add_argument("--eval_bytes", type=int, default=65536, help="validation bytes (default 64 KiB)")
    p.add_argument("--train_bytes", type=int, default=None, help="cap on training bytes (default: all)")
    p.add_argument("--sample_bytes", type=int, default=200, help="bytes generated at the end (0: none)")
    p.add_argument("--save_folder", default=None)
    p.add_argument("--save_interval", default="0.5dur")
    p.add_argument("--autoresume", action="store_true")
    p.add_argument("--run_name", default=None)
    p.add_argument("--run_folder", default=None, help="logs, metrics.jsonl, loss_curve.png, tensorboard/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=None, help="another folder of *.py files to train on")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> tuple[lockstep.Trainer, GPT]:
    torch.manual_seed(args.seed)
    files = stdlib_files(args.stdlib)
    if not files:
        sys.exit(f"train_gpt.py: no *.py files under {args.stdlib or sysconfig.get_paths()['stdlib']}")
    train_set = PackedBytes(load_split(files, "train", args.train_bytes), args.block_size)
    val_set = PackedBytes(load_split(files, "val", args.eval_bytes), args.block_size)
    train_loader = TokenLoader(train_set, batch_size=args.batch_size, drop_last=True,
                               sampler=dist.get_sampler(train_set, shuffle=True, seed=args.seed, drop_last=True))
    val_loader = DataLoader(val_set, batch_size=64, sampler=dist.get_sampler(val_set, shuffle=False))

    model = GPT(args.layers, args.heads, args.dim, args.block_size)
    # no weight decay on biases, norms and embeddings, as in nanoGPT
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if not (p.dim() >= 2 and p is not model.embed.weight)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    parallel: dict = {}
    if args.parallel == "fsdp":
        # BACKWARD_PRE: FSDP2's own prefetch, about 5% faster here than the default BACKWARD_POST
        parallel["fsdp_config"] = {"sharding_strategy": "FULL_SHARD", "state_dict_type": args.checkpoint_layout,
                                   "backward_prefetch": "BACKWARD_PRE",
                                   "activation_checkpointing": args.activation_checkpointing}
    elif args.parallel == "zero2":
        parallel["deepspeed_config"] = {"zero_optimization": {"stage": 2}}
    loggers = []
    try:
        loggers.append(TensorboardLogger())
    except ImportError:
        pass  # pip install 'lockstep[tensorboard]' for TensorBoard logs
    trainer = lockstep.Trainer(
        model=model, train_dataloader=train_loader, eval_dataloader=val_loader,
        max_duration=args.max_duration, eval_interval=args.eval_interval, optimizers=optimizer,
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup=args.warmup, alpha_f=0.1),
        algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=1.0)],
        callbacks=[SpeedMonitor(window_size=20), LRMonitor()], loggers=loggers,
        device="cpu" if not torch.cuda.is_available() else None, precision=args.precision,
        device_train_microbatch_size=args.microbatch_size, seed=args.seed, run_name=args.run_name,
        run_folder=args.run_folder, save_folder=args.save_folder, save_interval=args.save_interval,
        autoresume=args.autoresume, compile_config={} if args.compile else None, **parallel)
    return trainer, model


def main(argv: list[str] | None = None) -> lockstep.Trainer:
    args = parse_args(argv)
    start = time.perf_counter()
    trainer, model = build_trainer(args)
    rank0 = dist.get_global_rank() == 0
    if trainer.state.timestamp.batch == 0:
        first = trainer.eval()["LanguageCrossEntropy"]
        if rank0:
            print(f"step 0: validation cross entropy {first:.3f} nats/byte (ln 256 = {math.log(256):.3f})", flush=True)
    trainer.fit()
    final = trainer.state.eval_metrics
    if rank0:
        print(f"end ({trainer.state.timestamp.token:,} tokens, {time.perf_counter() - start:.0f} s): validation "
              f"cross entropy {final['LanguageCrossEntropy']:.3f} nats/byte "
              f"({final['LanguageCrossEntropy'] / math.log(2):.2f} bits/byte), "
              f"perplexity {final['LanguagePerplexity']:.2f}", flush=True)
    if args.sample_bytes:
        module = trainer.strategy.eval_module
        module.eval()
        text = model.generate(module, PROMPT.encode(), args.sample_bytes, seed=args.seed)
        if rank0:
            print(f"sample:\n{PROMPT}{text.decode('utf-8', errors='replace')}", flush=True)
    if rank0 and trainer.state.run_folder:
        folder = Path(trainer.state.run_folder)
        print(f"run folder: {folder}\n  loss curve: {folder / 'loss_curve.png'}\n  TensorBoard: "
              f"tensorboard --logdir {folder / 'tensorboard'}", flush=True)
    trainer.close()
    return trainer


if __name__ == "__main__":
    main()
