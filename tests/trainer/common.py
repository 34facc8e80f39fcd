"""A tiny model and dataset shared by the Trainer tests; module-level so spawned ranks can import it."""

from __future__ import annotations

import re

import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Model, dist


class MLP(Model):
    """Its metric is accuracy, for evaluation; with ``train_accuracy`` for training too. Only then does
    training import torchmetrics, which (importing transformers and scipy) costs a process ~2 s of CPU."""

    def __init__(self, unused_branch: bool = False, train_accuracy: bool = False) -> None:
        super().__init__()
        self.train_accuracy = train_accuracy
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(6, 3) if unused_branch else None

    def forward(self, batch):
        x = batch[0]
        out = self.net(x)
        # With unused_branch, samples with x0 > 1 add a branch; a microbatch without any such
        # sample leaves it out of the graph entirely (unused parameters), yet the math per sample
        # is the same however the batch is split.
        mask = x[:, 0] > 1
        if self.unused is not None and bool(mask.any()):
            out = out + self.unused(x) * mask[:, None]
        return out

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train=False):
        if is_train and not self.train_accuracy:
            return {}
        from torchmetrics.classification import MulticlassAccuracy

        return {"accuracy": MulticlassAccuracy(num_classes=3, average="micro")}

    def update_metric(self, batch, outputs, metric):
        metric.update(outputs.argmax(dim=1), batch[1])


def dataset(n: int = 28) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def loader(batch_size: int, n: int = 28, shuffle: bool = False) -> DataLoader:
    ds = dataset(n)
    return DataLoader(ds, batch_size=batch_size, sampler=dist.get_sampler(ds, shuffle=shuffle))


def error_of(fn, *args, expected: tuple[type[BaseException], ...] = (Exception,), **kwargs) -> str:
    """The message of the ``expected`` error that ``fn(*args, **kwargs)`` raises, or 'no error'."""
    try:
        fn(*args, **kwargs)
    except expected as e:
        return str(e)
    return "no error"


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=f"parameter {k} differs")


def assert_fell_back(rank: int, resumed: dict[str, torch.Tensor], from_older: dict[str, torch.Tensor],
                     warned: list[str], listed: list[str], *, said: str, older: str, newest: str) -> None:
    """Autoresume past a damaged newest checkpoint ``newest`` (a name in the save folder): exactly as
    a load of ``older``; rank 0 warns once, with ``said`` (a pattern) naming the damage, and sets
    ``newest`` aside, which the resumed run then saves again (``listed``: the folder afterwards)."""
    assert_same_params(resumed, from_older, atol=0)
    assert len(warned) == (1 if rank == 0 else 0)
    if rank == 0:
        pattern = (rf"autoresume skipped the newest checkpoint, which does not load \(rank \d: {said}\); resumed from "
                   rf"\S+/{re.escape(older)} instead; renamed the damaged one to {re.escape(newest)}\.damaged")
        assert re.fullmatch(pattern, warned[0]), warned[0]
    assert f"{newest}.damaged" in listed and newest in listed


class DropoutMLP(MLP):
    """Draws from the torch RNG every step, so a resume that misses the RNG state diverges."""

    def forward(self, batch):
        return self.net(torch.nn.functional.dropout(batch[0], 0.3, training=self.training))


class NoisyDataset(torch.utils.data.Dataset):
    """Random augmentation on every read (torch, numpy and python RNGs), in whichever process reads."""

    def __init__(self, n: int = 28) -> None:
        self.base = dataset(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        import random

        import numpy as np
        x, y = self.base[i]
        noise = torch.randn(6) * 0.1 + float(np.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
        return x + noise, y


class Block(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class BlockMLP(MLP):
    """Three blocks and a head: FSDP wrap rules have units to choose. ``wrap`` is what
    ``fsdp_wrap_fn`` answers for a Block (None: no answer, so ``min_params`` decides)."""

    def __init__(self, wrap=True, checkpoint=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(Block(6, 16), Block(16, 16), Block(16, 16), torch.nn.Linear(16, 3))
        self.wrap, self.checkpoint = wrap, checkpoint

    def fsdp_wrap_fn(self, module):
        if self.wrap is None:  # no rule: the size rule decides
            return None
        return self.wrap if isinstance(module, Block) else False

    def activation_checkpointing_fn(self, module):
        return self.checkpoint is not None and isinstance(module, Block)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as full tensors on every rank (gathers sharded ones: a collective)."""
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def damage(path, how: str) -> None:
    """Real damage to a real file: ``delete`` it, ``flip`` the bits of its middle byte, or ``truncate``
    it to half its size."""
    from pathlib import Path
    path = Path(path)
    if how == "delete":
        path.unlink()
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:
        raise ValueError(f"damage how={how!r}: 'delete', 'flip' or 'truncate'")
