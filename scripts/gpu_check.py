"""The GPU checks, for a machine with one CUDA device (CI has none): ``python -m lockstep -n 1
scripts/gpu_check.py OUT_FOLDER`` from the repository root, with ``src`` and the root on PYTHONPATH.

Each check prints one ``PASS``/``FAIL`` line; the exit status is the number of failures.

- exact resume on NCCL: DDP with ``amp_bf16``, and FSDP with bf16 mixed precision, activation
  checkpointing and sharded checkpoints — stopped at batch 4 and resumed to 8, bit for bit equal to
  one run of 8;
- the Composer port's CUDA-only parts: ``MemorySnapshot`` and ``OOMObserver`` write their files,
  ``Profiler`` writes a trace with CUDA kernels, ``DeviceGPU`` and ``DecoupledAdamW`` on CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Model, Trainer, dist

FAILURES: list[str] = []
DEVICE = os.environ.get("LOCKSTEP_CHECK_DEVICE", "gpu")  # cpu: a dry run of the script itself


class Net(Model):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                          for _ in range(3))
        self.head = torch.nn.Linear(64, 5)

    def forward(self, batch):
        x = batch[0]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs.float(), batch[1])

    def fsdp_wrap_fn(self, module):
        return isinstance(module, torch.nn.Sequential)

    def activation_checkpointing_fn(self, module):
        return isinstance(module, torch.nn.Sequential)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 5, (256,), generator=g))
    return DataLoader(ds, batch_size=16, sampler=dist.get_sampler(ds, shuffle=True))


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if any(hasattr(v, "full_tensor") for v in state.values()):
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def fit(folder: Path, duration: str, load: str | None = None, **kwargs) -> dict[str, torch.Tensor]:
    model = Net()
    trainer = Trainer(model=model, optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device=DEVICE,
                      train_dataloader=data(), max_duration=duration, seed=11, progress_bar=False,
                      save_folder=str(folder), save_interval="4ba", save_overwrite=True, load_path=load,
                      save_filename="ep{epoch}-ba{batch}" + ("" if "fsdp_config" in kwargs else "-rank{rank}.pt"),
                      **kwargs)
    trainer.fit()
    out = params(model)
    trainer.close()
    return out


def check(name: str, fn: Callable[[], str]) -> None:
    try:
        detail = fn()
        print(f"PASS {name}: {detail}", flush=True)
    except Exception:  # every check runs and reports, whatever the others do
        FAILURES.append(name)
        print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)


def exact_resume(out: Path, kind: str, **kwargs) -> Callable[[], str]:
    def run() -> str:
        whole = fit(out / f"{kind}-whole", "8ba", **kwargs)
        fit(out / f"{kind}-half", "4ba", **kwargs)
        name = "ep0-ba4-rank0.pt" if "fsdp_config" not in kwargs else "ep0-ba4"
        resumed = fit(out / f"{kind}-resumed", "8ba", load=str(out / f"{kind}-half" / name), **kwargs)
        differing = [k for k in whole if not torch.equal(whole[k], resumed[k])]
        assert not differing, f"resumed differs from uninterrupted in {differing}"
        moved = max((whole[k] - Net().state_dict()[k].float()).abs().max().item() for k in whole)
        return f"{len(whole)} tensors bitwise equal after resume (trained {moved:.3g} from init)"
    return run


def memory_snapshot(out: Path) -> str:
    from lockstep.callbacks import MemorySnapshot
    fit(out / "snap", "4ba", run_name="snap",
        callbacks=[MemorySnapshot(skip_batches=1, interval="2ba", folder=str(out / "snapshots"))])
    files = sorted(p.name for p in (out / "snapshots").iterdir())
    assert any(f.endswith(".pickle") for f in files) and any(f.endswith(".html") for f in files), files
    return ", ".join(files)


def oom_observer(out: Path) -> str:
    from lockstep.callbacks import OOMObserver

    class Greedy(Net):
        def forward(self, batch):
            if self.training and not hasattr(self, "_tried"):
                self._tried = True
                try:
                    torch.empty(1 << 50, dtype=torch.uint8, device=batch[0].device)  # 1 PiB
                except torch.OutOfMemoryError:
                    pass
            return super().forward(batch)

    model = Greedy()
    Trainer(model=model, optimizers=torch.optim.AdamW(model.parameters()), device=DEVICE, train_dataloader=data(),
            max_duration="1ba", progress_bar=False, callbacks=[OOMObserver(folder=str(out / "oom"))]).fit()
    files = sorted(p.name for p in (out / "oom").iterdir())
    expected = {"rank0_oom_snapshot.pickle", "rank0_oom_trace_plot.html", "rank0_oom_segment_plot.html"}
    assert expected <= set(files) and all((out / "oom" / f).stat().st_size > 0 for f in files), files
    return ", ".join(files)


def profiler(out: Path) -> str:
    from lockstep.profiler import Profiler, cyclic_schedule
    prof = Profiler(schedule=cyclic_schedule(wait=0, warmup=1, active=2, repeat=1),
                    torch_prof_folder=str(out / "traces"), torch_prof_memory_filename=None)
    fit(out / "prof", "4ba", profiler=prof, run_name="prof")
    traces = sorted((out / "traces").glob("*.json"))
    assert traces, "no trace written"
    events = json.loads(traces[0].read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "the trace has no CUDA kernel"
    return f"{traces[0].name}: {len(kernels)} CUDA kernel events"


def decoupled_adamw() -> str:
    from lockstep.devices import DeviceGPU
    from lockstep.optim import DecoupledAdamW
    device = DeviceGPU()
    assert device.torch_device.type == "cuda", device
    results = []
    for where in ("cpu", "cuda"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(32, 32).to(where)
        opt = DecoupledAdamW(layer.parameters(), lr=1e-2, weight_decay=1e-2)
        for _ in range(5):
            opt.zero_grad()
            layer(torch.ones(4, 32, device=where)).square().sum().backward()
            opt.step()
        results.append(layer.weight.detach().cpu())
    gap = (results[0] - results[1]).abs().max().item()
    assert gap < 1e-5, gap
    return f"CUDA and CPU steps agree within {gap:.2g}"


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if DEVICE == 'gpu' else DEVICE}", flush=True)
    check("ddp amp_bf16 exact resume", exact_resume(out, "ddp", precision="amp_bf16"))
    check("fsdp bf16 + activation checkpointing, sharded, exact resume",
          exact_resume(out, "fsdp", precision="amp_bf16",
                       fsdp_config={"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE",
                                    "activation_checkpointing": True, "state_dict_type": "sharded"}))
    check("MemorySnapshot", lambda: memory_snapshot(out))
    check("OOMObserver", lambda: oom_observer(out))
    check("Profiler", lambda: profiler(out))
    check("DeviceGPU + DecoupledAdamW", decoupled_adamw)
    print(f"{len(FAILURES)} failed: {FAILURES}" if FAILURES else "all passed", flush=True)
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
