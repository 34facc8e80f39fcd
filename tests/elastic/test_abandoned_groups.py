"""A change of an elastic job's ranks abandons every process group of the old generation, never
destroying one: a group destroyed with a collective in flight (one a peer never joined, having
moved on to the new generation) would make its rank wait for the group's whole timeout."""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from lockstep import dist
from lockstep.elastic import membership
from lockstep.testing import run_distributed


def _drop_a_group_with_a_collective_in_flight(folder: str) -> float:
    """Rank 0: seconds spent freeing a subgroup (as a library drops its own group after the change)
    whose all-reduce rank 1 never joined. Rank 1 stays connected until rank 0 is done."""
    done = Path(folder) / "done"
    group = torch_dist.new_group([0, 1], timeout=timedelta(seconds=60))
    if dist.get_global_rank() == 1:
        deadline = time.monotonic() + 100
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0.0
    work = torch_dist.all_reduce(torch.ones(1), group=group, async_op=True)
    membership._abandon_groups()
    started = time.monotonic()
    del work, group
    gc.collect()
    took = time.monotonic() - started
    done.touch()
    return took


@pytest.mark.timeout(150)
def test_a_group_dropped_after_a_change_with_a_collective_in_flight_is_freed_at_once(tmp_path: Path) -> None:
    took, _ = run_distributed(_drop_a_group_with_a_collective_in_flight, 2, timeout=120, args=(str(tmp_path),))
    assert took < 5, took  # destroyed, it would wait the group's 60 s timeout for rank 1
