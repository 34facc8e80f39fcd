"""Train a small MLP on scikit-learn's handwritten digits, data-parallel over 2 processes.

Run it with the launcher (2 ranks, CPU, gloo):

    lockstep -n 2 examples/train_digits.py

or without it, as a single process (world size 1):

    python examples/train_digits.py

The same script works both ways: ``lockstep.dist`` reports rank 0 of 1 outside a run, and the
Trainer only wraps the model in DistributedDataParallel when the world size is above 1.

What happens:

1. Every rank loads the 1,797 8x8 digit images (``sklearn.datasets.load_digits`` ships with
   scikit-learn, so nothing is downloaded), scales the pixels from 0..16 to [0, 1] and makes the
   same fixed 80/20 train/test split.
2. ``lockstep.dist.get_sampler`` gives each rank its own share of the data; the training sampler
   shuffles (reshuffled every epoch by the Trainer), the evaluation sampler does not.
3. The Trainer trains for ``--epochs`` epochs. Each rank's batch of ``--batch-size`` samples is split
   into microbatches of ``--microbatch-size``; gradients are synchronised once per step.
4. After every epoch it evaluates on the test split (accuracy and loss over all ranks), and at the
   end rank 0 prints one line: ``final eval: accuracy 0.9xx, loss 0.xxx``.

``--zero-stage 1|2|3`` trains with DeepSpeed ZeRO instead of DDP (``pip install 'torch-lockstep[deepspeed]'``;
the first DeepSpeed run on a machine compiles a small op for about a minute).

Under the launcher the run folder is ``runs/<timestamp>/`` (``LOCKSTEP_RUN_DIRECTORY``); the Trainer
writes ``metrics.jsonl``, ``loss_curve.png`` and ``trainer-rank{rank}.log`` there. Pass
``--run-folder`` to choose it yourself (also without the launcher, which otherwise writes nothing).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lockstep
from lockstep import dist

NUM_CLASSES = 10


class DigitsMLP(lockstep.Model):
    """64 pixels -> 128 -> 64 -> 10 logits. A batch is an ``(images, labels)`` pair."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, NUM_CLASSES),
        )

    def forward(self, batch):
        images, _ = batch
        return self.net(images)

    def loss(self, outputs, batch):
        _, labels = batch
        return F.cross_entropy(outputs, labels)  # the mean over the batch, as the Trainer expects

    def get_metrics(self, is_train=False):
        # The default update_metric calls metric.update(outputs, batch[1]): logits and labels.
        # average="micro" is the plain share of correct predictions (the default is per-class "macro").
        if is_train:  # evaluation metrics only: training metrics would add a collective every step
            return {}
        return {"accuracy": MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")}


def load_datasets(test_size: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits as float pixels in [0, 1], split the same way on every rank (fixed seed)."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train an MLP on scikit-learn's digits with lockstep.")
    parser.add_argument("--epochs", type=int, default=15, help="training epochs (default 15)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--microbatch-size", type=int, default=16,
                        help="samples per forward/backward; the batch is split into these (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--run-folder", default=None,
                        help="where to write logs, metrics.jsonl and loss_curve.png "
                             "(default: the launcher's runs/<timestamp>, or nothing without it)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model init and shuffling")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="train with DeepSpeed ZeRO at this stage instead of DDP")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()

    # Same seed on every rank, so every rank builds the same initial weights (DDP also broadcasts
    # rank 0's weights when it wraps the model, so this is belt and braces).
    torch.manual_seed(args.seed)
    train_set, test_set = load_datasets(seed=args.seed)

    # Each rank reads its own share: shuffle the training data, keep the test data in order.
    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=dist.get_sampler(train_set, shuffle=True, seed=args.seed))
    eval_loader = DataLoader(test_set, batch_size=256,
                             sampler=dist.get_sampler(test_set, shuffle=False))

    model = DigitsMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)

    trainer = lockstep.Trainer(
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=eval_loader,
        eval_interval="1ep",
        max_duration=f"{args.epochs}ep",
        optimizers=optimizer,
        device="cpu",
        device_train_microbatch_size=args.microbatch_size,
        run_folder=args.run_folder,
        deepspeed_config=None if args.zero_stage is None else {"zero_optimization": {"stage": args.zero_stage}},
    )
    trainer.fit()

    metrics = trainer.state.eval_metrics["eval"]  # the last evaluation, already reduced over all ranks
    if dist.get_global_rank() == 0:
        print(f"final eval: accuracy {metrics['accuracy'].compute():.3f}, loss {metrics['loss'].compute():.3f} "
              f"({len(test_set)} test images, {dist.get_world_size()} rank(s), "
              f"{time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
