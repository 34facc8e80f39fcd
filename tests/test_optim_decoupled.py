"""DecoupledAdamW and DecoupledSGDW against the numbers Composer 0.32.1's own optimizers produce.

The fixture (scripts/composer_reference/make_optimizer_fixture.py, run in a venv with Composer) holds
the gradient of every step and Composer's parameters after it; replaying the gradients through
lockstep's optimizers must give the same parameters bit for bit. Where the machine computes
``sqrt`` with other bits than the one that made the fixture (MKL's code path follows the CPU), the
copy Composer made on such a machine is the reference (``tests/fixtures/numerics.py``).
"""

from __future__ import annotations

import io
import logging
import pathlib
import types

import pytest
import torch

import lockstep.optim.decoupled as decoupled
from lockstep import Trainer
from lockstep.optim import (
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    DecoupledSGDW,
    compile_composer_scheduler,
)
from tests.fixtures.numerics import for_this_machine
from tests.trainer.common import MLP, error_of, loader

FIXTURE = for_this_machine(pathlib.Path(__file__).parent / "fixtures" / "composer" / "decoupled_optimizers.pt")
REFERENCE = torch.load(FIXTURE, weights_only=True)
NAMES = REFERENCE["names"]
OPTIMIZERS = {"DecoupledAdamW": DecoupledAdamW, "DecoupledSGDW": DecoupledSGDW}
SHAPES = [(3, 4), (3,), (3,)]  # weight, bias, gain: the fixture's flattening order


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, REFERENCE["cases"][name]["dtype"])


def _params(flat: torch.Tensor, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(chunk.view(shape).to(dtype, copy=True))
            for chunk, shape in zip(flat.split([12, 3, 3]), SHAPES, strict=True)]


def _start(name: str, step: int = 0) -> list[torch.nn.Parameter]:
    return _params(REFERENCE["params"][NAMES.index(name), step], _dtype(name))


def _optimizer(name: str, params: list[torch.nn.Parameter], **overrides: float) -> torch.optim.Optimizer:
    case = REFERENCE["cases"][name]
    groups = [{"params": params[:2]}, {"params": params[2:], **case["gain_group"]}]
    return OPTIMIZERS[case["optimizer"]](groups, **{**case["kwargs"], **overrides})


def _replay(name: str, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
            steps: range) -> list[torch.Tensor]:
    """Run ``steps`` of the fixture's case: its gradients, its lr multipliers; the flat params after each."""
    after = []
    for step in steps:
        grads = REFERENCE["grads"][NAMES.index(name), step].split([12, 3, 3])
        for param, grad, shape in zip(params, grads, SHAPES, strict=True):
            param.grad = grad.view(shape).to(param.dtype, copy=True)
        if step < REFERENCE["bias_frozen_steps"]:
            params[1].grad = None
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * REFERENCE["lr_multipliers"][step]
        optimizer.step()
        after.append(torch.cat([p.detach().flatten() for p in params]).float())  # exact for bf16, fp16
    return after


def _expected(name: str, steps: range) -> list[torch.Tensor]:
    return [REFERENCE["params"][NAMES.index(name), step + 1] for step in steps]


def _assert_same(name: str, ours: list[torch.Tensor], composers: list[torch.Tensor], steps: range) -> None:
    for step, a, b in zip(steps, ours, composers, strict=True):
        assert torch.equal(a, b), f"{name}: after step {step + 1}, max difference {(a - b).abs().max().item()}"


STEPS = range(len(REFERENCE["lr_multipliers"]))
HALF = REFERENCE["save_state_at"]


@pytest.mark.parametrize("name", NAMES)
def test_matches_composer_bit_for_bit(name: str) -> None:
    params = _start(name)
    _assert_same(name, _replay(name, _optimizer(name, params), params, STEPS), _expected(name, STEPS), STEPS)


def test_the_fixture_gradients_are_the_models() -> None:
    """The recorded gradients are those of the fixture's model at the recorded parameters."""
    for i, name in enumerate(NAMES):
        if _dtype(name) != torch.float32:
            continue
        for step in STEPS:
            weight, bias, gain = _params(REFERENCE["params"][i, step])
            loss = torch.nn.functional.mse_loss(
                torch.nn.functional.linear(REFERENCE["x"], weight, bias) * gain, REFERENCE["y"])
            grads = list(torch.autograd.grad(loss, [weight, bias, gain]))
            if step < REFERENCE["bias_frozen_steps"]:
                grads[1] = torch.zeros_like(grads[1])  # recorded as zeros: the bias had no gradient
            torch.testing.assert_close(torch.cat([g.flatten() for g in grads]), REFERENCE["grads"][i, step])


def _round_trip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_a_state_dict_round_trip_resumes_identically(name: str) -> None:
    params = _start(name)
    optimizer = _optimizer(name, params)
    _replay(name, optimizer, params, range(HALF))
    state_dict = _round_trip(optimizer.state_dict())
    assert [g["initial_lr"] for g in state_dict["param_groups"]] == [g["initial_lr"] for g in optimizer.param_groups]

    resumed_params = _params(torch.cat([p.detach().flatten() for p in params]).float(), _dtype(name))
    resumed = _optimizer(name, resumed_params, lr=0.5)  # a resumed run may build it at the scheduled lr
    resumed.load_state_dict(state_dict)
    assert [g["initial_lr"] for g in resumed.param_groups] == [g["initial_lr"] for g in optimizer.param_groups]
    rest = range(HALF, len(STEPS))
    _assert_same(name, _replay(name, resumed, resumed_params, rest), _expected(name, rest), rest)


@pytest.mark.parametrize("name", [n for n in NAMES if "state_dict" in REFERENCE["cases"][n]])
def test_composers_state_dict_loads_and_continues_as_composer(name: str) -> None:
    """An optimizer state saved by Composer (as in a Composer checkpoint) continues bit for bit."""
    params = _start(name, HALF)
    optimizer = _optimizer(name, params, lr=0.5)
    optimizer.load_state_dict(REFERENCE["cases"][name]["state_dict"])
    composer_groups = REFERENCE["cases"][name]["state_dict"]["param_groups"]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [g["initial_lr"] for g in composer_groups]
    rest = range(HALF, len(STEPS))
    _assert_same(name, _replay(name, optimizer, params, rest), _expected(name, rest), rest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [
    lambda ps: DecoupledAdamW(ps, lr=0.01, weight_decay=1e-4, amsgrad=True),
    lambda ps: DecoupledSGDW(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-4),
    lambda ps: DecoupledSGDW(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
], ids=["adamw", "sgdw", "nesterov"])
def test_cache_sized_chunks_do_not_change_the_numbers(make, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path splits the parameter list; one tensor per op (Composer's loop) gives the same bits."""
    def run(chunk_numel: int) -> list[torch.Tensor]:
        monkeypatch.setattr(decoupled, "_CPU_CHUNK_NUMEL", chunk_numel)
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype))
                  for n in (7, 300, 5, 70000, 1, 40)]
        optimizer = make(params)
        for step in range(4):
            for i, param in enumerate(params):
                skip = step == 0 and i % 2  # some parameters start later: mixed step counts and buffers
                param.grad = None if skip else torch.randn(param.shape, generator=generator).to(dtype)
            optimizer.step()
        return [p.detach() for p in params]

    for a, b in zip(run(1), run(decoupled._CPU_CHUNK_NUMEL), strict=True):
        assert torch.equal(a, b)


def test_the_accelerator_divisor_is_the_float32_reciprocal_torch_uses() -> None:
    """On CUDA, ``tensor / x`` multiplies by ``1 / x`` rounded to float32; the foreach path does the same."""
    generator = torch.Generator().manual_seed(0)
    for value in [1.0, 3.0, 0.1, 1e-30, *(torch.rand(2000, generator=generator, dtype=torch.float64) * 2).tolist()]:
        expected = (torch.tensor(1.0) / torch.tensor(value, dtype=torch.float32)).item()
        assert decoupled._float32_reciprocal(value) == expected, value


def test_defaults_and_signatures_are_composers() -> None:
    param = [torch.nn.Parameter(torch.zeros(2))]
    adamw = DecoupledAdamW(param)
    assert adamw.defaults["lr"] == 1e-3 and adamw.defaults["betas"] == (0.9, 0.95)
    assert adamw.defaults["eps"] == 1e-8 and adamw.defaults["weight_decay"] == 1e-5 and not adamw.amsgrad
    assert adamw.param_groups[0]["initial_lr"] == 1e-3
    sgdw = DecoupledSGDW(param, 0.1, 0.9, 0.1, 1e-4, False)  # positionally, in Composer's order
    assert (sgdw.defaults["momentum"], sgdw.defaults["dampening"], sgdw.defaults["weight_decay"]) == (0.9, 0.1, 1e-4)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(sgdw, torch.optim.SGD)
    with pytest.raises(TypeError, match="lr"):
        DecoupledSGDW(param)  # type: ignore[call-arg]  # Composer's SGDW has no default lr


@pytest.mark.parametrize("make, expected", [
    (lambda p: DecoupledAdamW(p, lr=-1.0), "lr=-1.0"),
    (lambda p: DecoupledAdamW(p, lr=torch.tensor(0.1)), "give lr as a float"),
    (lambda p: DecoupledAdamW(p, betas=(1.0, 0.9)), "betas[0] must be in [0, 1)"),
    (lambda p: DecoupledAdamW(p, betas=(0.9, -0.1)), "betas[1] must be in [0, 1)"),
    (lambda p: DecoupledAdamW(p, eps=-1e-8), "eps must be >= 0"),
    (lambda p: DecoupledAdamW(p, weight_decay=-1e-5), "weight decay must be >= 0"),
    (lambda p: DecoupledSGDW(p, lr=-0.1), "the learning rate must be >= 0"),
    (lambda p: DecoupledSGDW(p, lr=0.1, momentum=-0.9), "momentum must be >= 0"),
    (lambda p: DecoupledSGDW(p, lr=0.1, weight_decay=-1.0), "weight decay must be >= 0"),
    (lambda p: DecoupledSGDW(p, lr=0.1, nesterov=True), "needs momentum > 0 and dampening=0"),
    (lambda p: DecoupledSGDW(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening=0.1"),
])
def test_bad_arguments_are_one_line_errors(make, expected: str) -> None:
    message = error_of(make, [torch.nn.Parameter(torch.zeros(2))])
    assert expected in message and "\n" not in message, message
    assert "empty parameter list" in error_of(DecoupledAdamW, [])


def test_sparse_gradients_are_refused() -> None:
    for optimizer_class, kwargs in ((DecoupledAdamW, {}), (DecoupledSGDW, {"lr": 0.1})):
        param = torch.nn.Parameter(torch.zeros(4))
        optimizer = optimizer_class([param], **kwargs)
        param.grad = torch.zeros(4).to_sparse()
        assert "dense gradients" in error_of(optimizer.step)


def test_a_high_weight_decay_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lockstep.optim.decoupled"):
        DecoupledAdamW([torch.nn.Parameter(torch.zeros(2))], weight_decay=1e-5)
        assert not caplog.records
        DecoupledSGDW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.01)
    assert "0.99" in caplog.text


def test_a_group_added_later_decays_from_its_own_initial_lr() -> None:
    first, later = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = DecoupledSGDW([first], lr=0.1, weight_decay=0.01)
    optimizer.add_param_group({"params": [later], "lr": 0.2})
    first.grad, later.grad = torch.zeros(2), torch.zeros(2)
    optimizer.step()
    assert optimizer.param_groups[1]["initial_lr"] == 0.2
    assert torch.equal(later.detach(), torch.full((2,), 0.99))  # decay factor 1 at the initial lr


def test_closure_and_parameters_without_gradients() -> None:
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    for optimizer in (DecoupledAdamW([used, unused]), DecoupledSGDW([used, unused], lr=0.1, momentum=0.9)):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = (used * used).sum()
            loss.backward()
            return loss
        assert optimizer.step(closure).item() > 0
        assert unused not in optimizer.state and torch.equal(unused.detach(), torch.ones(2))


def test_metrics_for_the_optimizer_monitor() -> None:
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    optimizer = DecoupledAdamW([param], lr=0.1, weight_decay=1e-5)
    assert optimizer.report_per_parameter_metrics(param, "w", {}) == {}  # no state before the first step
    param.grad = torch.tensor([1.0, 1.0])
    optimizer.step()
    metrics = optimizer.report_per_parameter_metrics(param, "w", {})
    assert sorted(metrics) == ["l2_norm/grad/w", "l2_norm/moment/w", "l2_norm/param/w", "l2_norm/update/w"]
    assert metrics["l2_norm/grad/w"].item() == pytest.approx(2 ** 0.5)
    reduced = optimizer.dist_reduce_metrics(optimizer.pre_reduce_metrics(dict(metrics)))
    assert reduced["l2_norm/param/w"] == pytest.approx(metrics["l2_norm/param/w"].item())


def test_compile_composer_scheduler_binds_a_schedule_to_the_only_optimizer() -> None:
    optimizer = DecoupledAdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.2)
    compiled = compile_composer_scheduler(lambda state: 0.5, types.SimpleNamespace(optimizers=[optimizer]))
    assert optimizer.param_groups[0]["lr"] == 0.1 and compiled.get_last_lr() == [0.1]
    two = types.SimpleNamespace(optimizers=[optimizer, optimizer])
    assert "has 2" in error_of(compile_composer_scheduler, lambda state: 1.0, two)


def test_under_the_trainer_with_a_schedule_the_decay_follows_the_lr() -> None:
    """One short fit: the lr each step used follows the schedule, and the weights are what a hand-written
    loop with the same optimizer and those lrs gives."""
    model = MLP()
    optimizer = DecoupledAdamW(model.parameters(), lr=0.01, weight_decay=1e-4)
    lrs: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    Trainer(model=model, train_dataloader=loader(4), max_duration="6ba", optimizers=optimizer, device="cpu",
            schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="2ba"), progress_bar=False).fit()
    assert lrs[:3] == pytest.approx([0.0, 0.005, 0.01]) and lrs[3] < 0.01 and len(lrs) == 6
    assert optimizer.param_groups[0]["initial_lr"] == 0.01

    by_hand = MLP()
    reference = DecoupledAdamW(by_hand.parameters(), lr=0.01, weight_decay=1e-4)
    for lr, batch in zip(lrs, loader(4), strict=False):
        reference.zero_grad()
        by_hand.loss(by_hand(batch), batch).backward()
        reference.param_groups[0]["lr"] = lr
        reference.step()
    for (key, a), b in zip(model.state_dict().items(), by_hand.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{key} differs")
