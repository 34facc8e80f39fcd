"""A first run with autoresume on an empty bucket starts fresh without a word (issue 49): in the
folder layouts it used to warn about local copies of a stopped job that never existed."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from lockstep.testing import run_distributed

pytestmark = pytest.mark.timeout(180)

LAYOUTS = {"ddp": {}, "sharded": {"fsdp_config": {"state_dict_type": "sharded"}},
           "local": {"fsdp_config": {"state_dict_type": "local"}},
           "zero2": {"deepspeed_config": {"zero_optimization": {"stage": 2}}}}


def _build(cwd: str, folder: str, layout: str) -> list[str]:
    """One rank: build the Trainer; the warnings that name autoresume."""
    os.chdir(cwd)
    from lockstep import Trainer
    from tests.trainer.common import MLP, loader

    model = MLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(model=model, train_dataloader=loader(2), optimizers=torch.optim.AdamW(model.parameters()),
                          device="cpu", progress_bar=False, max_duration="2ba", run_name="r", autoresume=True,
                          save_folder=folder, **LAYOUTS[layout])
    trainer.close()
    return [str(w.message) for w in seen if "autoresume" in str(w.message)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_first_run_on_an_empty_bucket_starts_fresh_silently(bucket: str, tmp_path: Path, layout: str) -> None:
    if layout == "zero2" and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.importorskip("deepspeed")
    warned = run_distributed(_build, 2, args=(str(tmp_path), f"s3://{bucket}/fresh/{{run_name}}", layout),
                             timeout=150, env={"OMP_NUM_THREADS": "1"})
    assert warned == [[], []]
