"""Scripts written for torchrun, from Lightning Fabric and Accelerate, run unchanged under lockstep."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.launcher.conftest import launch

FABRIC = textwrap.dedent("""
    import sys
    from lightning_fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy="ddp")
    fabric.launch()
    environment = type(fabric._connector.cluster_environment).__name__
    print(f"environment {environment} rank {fabric.global_rank} world {fabric.world_size}", flush=True)
""")

ACCELERATE = textwrap.dedent("""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    print(f"num_processes {accelerator.num_processes} index {accelerator.process_index}", flush=True)
""")


@pytest.mark.timeout(120)
def test_lightning_fabric_picks_the_torchelastic_environment(tmp_path: Path, write_script) -> None:
    pytest.importorskip("lightning_fabric")
    script = write_script("fabric_env.py", FABRIC)
    result = launch(["-n", "2", "--tee", "3", str(script), "2"], cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"environment TorchElasticEnvironment rank {rank} world 2" in result.stdout


@pytest.mark.timeout(120)
def test_lightning_fabric_fails_clearly_on_a_device_count_mismatch(tmp_path: Path, write_script) -> None:
    pytest.importorskip("lightning_fabric")
    script = write_script("fabric_env.py", FABRIC)
    result = launch(["-n", "2", str(script), "3"], cwd=tmp_path, timeout=100)
    assert result.returncode == 1
    assert "You set `devices=3`" in result.stderr and "does not match the world size (2)" in result.stderr
    assert "environment" not in result.stdout  # no rank went on training alone


@pytest.mark.timeout(120)
def test_accelerate_sees_two_processes(tmp_path: Path, write_script) -> None:
    pytest.importorskip("accelerate")
    script = write_script("accel.py", ACCELERATE)
    result = launch(["-n", "2", "--tee", "3", str(script)], cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"num_processes 2 index {rank}" in result.stdout
