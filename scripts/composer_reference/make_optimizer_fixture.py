"""Record what Composer 0.32.1's DecoupledAdamW and DecoupledSGDW do to a tiny model, step by step.

Runs in the reference environment (``bash scripts/composer_reference/setup.sh``), never in lockstep's:

    /tmp/composer-venv/bin/python scripts/composer_reference/make_optimizer_fixture.py

The model is ``Linear(4, 3)(x) * gain`` with fixed weights and inputs, trained for 10 steps per
case on a mean squared error. Two param groups: the Linear's weight and bias (one list of two
tensors), and ``gain`` with its own lr and weight decay. The bias gets no gradient in the first two
steps (as a frozen layer), so within a group the parameters have taken different numbers of steps.
Before every step each group's lr is set to ``initial_lr * multiplier`` (a warmup, then a decay), as
a scheduler does. The fixture holds, per case, the gradient each step used (so that replaying it
needs no matrix product, whose rounding may vary with the CPU) and the parameters after each step
(flattened: weight, bias, gain; float32, which holds the bf16 and fp16 cases' values exactly), plus
Composer's optimizer ``state_dict`` after half the steps for some cases.
``tests/test_optim_decoupled.py`` replays the same gradients through lockstep's optimizers.

With ``--this-machine`` it writes, instead, the copy for machines whose floating-point results are
this one's (``tests/fixtures/numerics.py``), beside the fixture under ``numerics/<tag>/``.
"""

from __future__ import annotations

import copy
import pathlib
import sys

import composer
import torch
from composer.optim import DecoupledAdamW, DecoupledSGDW

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.fixtures import numerics  # noqa: E402  (the repository, on the path above)

OUT = REPO / "tests" / "fixtures" / "composer" / "decoupled_optimizers.pt"
SAVE_STATE_AT = 5
LR_MULTIPLIERS = [0.25, 0.5, 0.75, 1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1]
BIAS_FROZEN_STEPS = 2

# name: (optimizer, its keyword arguments, the gain group's own settings, keep the state dict, dtype)
CASES: dict[str, tuple[str, dict, dict, bool, str]] = {
    "adamw": ("DecoupledAdamW", {"lr": 0.02, "weight_decay": 5e-4}, {"lr": 0.01, "weight_decay": 0.0}, False, "float32"),
    "adamw_amsgrad": ("DecoupledAdamW", {"lr": 0.03, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 2e-4,
                                         "amsgrad": True}, {"lr": 0.05}, True, "float32"),
    "sgdw_momentum": ("DecoupledSGDW", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 5e-4},
                      {"lr": 0.05, "weight_decay": 0.0}, True, "float32"),
    "sgdw_nesterov": ("DecoupledSGDW", {"lr": 0.1, "momentum": 0.8, "nesterov": True, "weight_decay": 3e-4},
                      {"lr": 0.2}, False, "float32"),
    "sgdw_plain": ("DecoupledSGDW", {"lr": 0.1, "weight_decay": 1e-4}, {"lr": 0.1}, False, "float32"),
    # In bf16 and fp16 a factor such as beta1 must be applied in float32, not first rounded to 16 bits.
    "adamw_bf16": ("DecoupledAdamW", {"lr": 0.02, "weight_decay": 5e-4}, {"lr": 0.01}, False, "bfloat16"),
    "sgdw_momentum_fp16": ("DecoupledSGDW", {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}, {"lr": 0.05},
                           False, "float16"),
}
OPTIMIZERS = {"DecoupledAdamW": DecoupledAdamW, "DecoupledSGDW": DecoupledSGDW}


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def run_case(optimizer_name: str, kwargs: dict, gain_group: dict, keep_state: bool, dtype_name: str,
             x: torch.Tensor, y: torch.Tensor) -> dict:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3).to(dtype)
    gain = torch.nn.Parameter((1 + 0.1 * torch.randn(3)).to(dtype))
    x, y = x.to(dtype), y.to(dtype)
    tensors = [linear.weight, linear.bias, gain]
    groups = [{"params": [linear.weight, linear.bias]}, {"params": [gain], **gain_group}]
    optimizer = OPTIMIZERS[optimizer_name](groups, **kwargs)
    params, grads, record = [flat(tensors)], [], {}
    for step, multiplier in enumerate(LR_MULTIPLIERS):
        if step == SAVE_STATE_AT and keep_state:
            record["state_dict"] = copy.deepcopy(optimizer.state_dict())  # it holds the live tensors
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(linear(x) * gain, y).backward()
        if step < BIAS_FROZEN_STEPS:
            linear.bias.grad = None
        grads.append(flat([t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]))
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
        optimizer.step()
        params.append(flat(tensors))
    record.update(optimizer=optimizer_name, kwargs=kwargs, gain_group=gain_group, dtype=dtype_name,
                  params=torch.stack(params).float(), grads=torch.stack(grads).float())
    return record


def stack_cases(cases: dict[str, dict]) -> dict:
    """One tensor of parameters and one of gradients for all cases (``[case, step, value]``, in the
    order of ``names``): a few large tensors keep the file small."""
    names = list(cases)
    return {
        "names": names,
        "params": torch.stack([cases[name].pop("params") for name in names]),
        "grads": torch.stack([cases[name].pop("grads") for name in names]),
        "cases": cases,
    }


def main() -> None:
    out = numerics.this_machines(OUT) if "--this-machine" in sys.argv[1:] else OUT
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=generator)
    y = torch.randn(8, 3, generator=generator)
    fixture = {
        "composer_version": composer.__version__,
        "torch_version": str(torch.__version__),
        "lr_multipliers": LR_MULTIPLIERS,
        "save_state_at": SAVE_STATE_AT,
        "bias_frozen_steps": BIAS_FROZEN_STEPS,
        "x": x,
        "y": y,
        **stack_cases({name: run_case(*case, x, y) for name, case in CASES.items()}),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, out)
    print(f"{out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
