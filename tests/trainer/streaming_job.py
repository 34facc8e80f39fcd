"""A job on mosaicml-streaming's StreamingDataset, built before the Trainer as its users build it,
for ``test_streaming.py``: ``write DATA`` writes 64 samples as MDS shards; ``train DATA OUT
PER_RANK [LOAD_PATH]`` trains 2 epochs over them (PER_RANK samples a rank per batch, saving every
3 batches into OUT/ck, resuming from LOAD_PATH), writing each rank's samples of each batch to
OUT/samples<rank> and the parameters to OUT/params.pt. Runs with the streaming folder that ``make
setup`` installs on the PYTHONPATH (``scripts/install_streaming.sh``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from streaming import MDSWriter, StreamingDataset
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lockstep import Callback, Trainer, dist  # noqa: E402
from tests.trainer.common import MLP  # noqa: E402

SAMPLES = 64


def write(folder: str) -> None:
    g = np.random.default_rng(0)
    with MDSWriter(out=folder, columns={"x": "ndarray:float32:6", "y": "int", "i": "int"}, size_limit=1 << 10) as w:
        for i in range(SAMPLES):
            w.write({"x": g.standard_normal(6).astype(np.float32), "y": int(g.integers(0, 3)), "i": i})


class Rows(StreamingDataset):
    def __getitem__(self, index: int):
        row = super().__getitem__(index)
        return torch.from_numpy(row["x"].copy()), torch.tensor(row["y"]), torch.tensor(row["i"])


class Samples(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def after_dataloader(self, state, logger) -> None:
        with open(self.out / f"samples{dist.get_global_rank()}", "a") as f:
            f.write(json.dumps([int(state.timestamp.batch), state.batch[2].tolist()]) + "\n")


def train(data: str, out: Path, per_rank: int, load_path: str | None) -> None:
    rows = Rows(local=data, batch_size=per_rank, shuffle=True, shuffle_seed=3, num_canonical_nodes=1)
    torch.manual_seed(0)
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=DataLoader(rows, batch_size=per_rank), max_duration="2ep",
                      optimizers=torch.optim.AdamW(model.parameters(), lr=0.01), progress_bar=False, seed=1,
                      save_folder=str(out / "ck"), save_interval="3ba", load_path=load_path, callbacks=[Samples(out)])
    trainer.fit()
    if dist.get_global_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}, out / "params.pt")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        train(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
