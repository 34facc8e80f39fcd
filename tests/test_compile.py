"""compile_config: torch.compile after DDP/FSDP wrapping (with activation checkpointing) gives the
parameters of eager mode, and compiles nothing after the first step, short last batches included. The tests use torch.compile's ``aot_eager`` backend: the same tracing, autograd and
recompilation as inductor, without generating C++ (seconds instead of minutes on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from lockstep import Callback, Trainer, dist
from lockstep.testing import run_distributed
from tests.trainer.common import BlockMLP, error_of, full_params, loader

# 28 samples over 2 ranks: 14 each, batches of 4, 4, 4, 2 (a short last batch every epoch)


class GraphCount(Callback):
    """Graphs compiled so far, at every BATCH_END."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def batch_end(self, state, logger) -> None:
        from torch._dynamo.utils import counters

        self.counts.append(counters["stats"]["unique_graphs"])


def _train(fsdp: dict | None, compile_config: dict | None) -> tuple[dict, list[int]]:
    import torch._dynamo

    torch._dynamo.reset()
    model = BlockMLP()
    graphs = GraphCount()
    trainer = Trainer(model=model, train_dataloader=loader(4, shuffle=True), max_duration="3ep", seed=3,
                      optimizers=torch.optim.AdamW(model.parameters(), lr=0.01), fsdp_config=fsdp,
                      compile_config=compile_config, callbacks=[graphs], progress_bar=False,
                      device_train_microbatch_size=2)
    trainer.fit()
    return full_params(model), graphs.counts


def _compiled_vs_eager(fsdp: dict | None) -> dict:
    eager, _ = _train(fsdp, None)
    compiled, graphs = _train(fsdp, {"backend": "aot_eager"})
    worst = max((eager[k] - compiled[k]).abs().max().item() for k in eager)
    return {"worst": worst, "graphs": graphs, "rank": dist.get_global_rank()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fsdp", [None, {"activation_checkpointing": True}], ids=["ddp", "fsdp-ac"])
def test_compiled_training_matches_eager_and_stops_compiling(fsdp) -> None:
    for result in run_distributed(_compiled_vs_eager, world_size=2, args=(fsdp,), timeout=280):
        assert result["worst"] < 1e-5, result
        # everything is compiled in the first step; the short last batches compile nothing more
        graphs = result["graphs"]
        assert len(graphs) == 12 and graphs[0] > 0 and set(graphs) == {graphs[0]}, result


def test_compile_config_errors_name_the_fix() -> None:
    model = BlockMLP()
    make = dict(model=model, train_dataloader=loader(4), max_duration="1ba", progress_bar=False,
                optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    assert "unknown keys ['backnd']" in error_of(Trainer, **make, compile_config={"backnd": "eager"})
    assert "not supported with deepspeed_config" in error_of(Trainer, **make, compile_config={},
                                                             deepspeed_config={})
