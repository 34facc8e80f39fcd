"""GradientClipping against one process calling torch's clipping, parameter by parameter."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Trainer, dist
from lockstep.algorithms import GradientClipping
from lockstep.algorithms.gradient_clipping import for_deepspeed
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, assert_same_params, dataset, full_params, loader, params, sgd

THRESHOLD = {"norm": 0.05, "value": 0.01, "adaptive": 0.002}  # small enough that every step clips
GLOBAL_BATCH = 8
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _unit_norms(t: torch.Tensor) -> torch.Tensor:
    return t.norm() if t.ndim <= 1 else t.flatten(1).norm(dim=1).reshape(-1, *[1] * (t.ndim - 1))


def reference(clipping_type: str | None, clipped: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """Two epochs of plain single-process SGD on the global batch, clipped with torch's functions
    (adaptive written out by hand); ``clipped`` records whether each step changed a gradient."""
    model = MLP()
    optimizer = sgd(model)
    for _ in range(2):
        for batch in DataLoader(dataset(), batch_size=GLOBAL_BATCH):
            model.loss(model(batch), batch).backward()
            before = [p.grad.clone() for p in model.parameters()]
            threshold = THRESHOLD.get(clipping_type or "", 0.0)
            if clipping_type == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), threshold)
            elif clipping_type == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), threshold)
            elif clipping_type == "adaptive":
                for p in model.parameters():
                    bound = _unit_norms(p.detach()).clamp(min=1e-3) * threshold
                    norm = _unit_norms(p.grad)
                    p.grad = torch.where(norm > bound, p.grad * bound / norm.clamp(min=1e-6), p.grad)
            if clipped is not None:
                clipped.append(any(not torch.equal(b, p.grad) for b, p in zip(before, model.parameters())))
            optimizer.step()
            optimizer.zero_grad()
    return params(model)


def fit(clipping_type: str, **kwargs) -> dict[str, torch.Tensor]:
    model = MLP()
    Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size()), max_duration="2ep",
            optimizers=sgd(model), progress_bar=False,
            algorithms=[GradientClipping(clipping_type=clipping_type, clipping_threshold=THRESHOLD[clipping_type])],
            **kwargs).fit()
    return full_params(model)


def test_every_step_of_the_reference_clips_and_clipping_changes_the_result() -> None:
    unclipped = reference(None)
    for clipping_type in THRESHOLD:
        clipped: list[bool] = []
        result = reference(clipping_type, clipped)
        assert len(clipped) == 8 and all(clipped), clipping_type
        assert any(not torch.allclose(result[k], unclipped[k], atol=1e-4) for k in result), clipping_type


def test_one_process_with_microbatches_matches_torch() -> None:
    for clipping_type in THRESHOLD:
        assert_same_params(fit(clipping_type, device_train_microbatch_size=3), reference(clipping_type))


def _every_backend() -> dict[str, dict[str, torch.Tensor]]:
    out = {f"ddp 2x2 {t}": fit(t, device_train_microbatch_size=2) for t in THRESHOLD}
    out["ddp forced_sync norm"] = fit("norm", device_train_microbatch_size=2, ddp_sync_strategy="forced_sync")
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for t in ("norm", "value"):
            out[f"fsdp {sharding} {t}"] = fit(t, device_train_microbatch_size=2,
                                              fsdp_config={"sharding_strategy": sharding})
    out["fsdp cpu_offload norm"] = fit("norm", fsdp_config={"cpu_offload": True})
    return out


@pytest.mark.timeout(300)
def test_ddp_and_fsdp_match_one_process_clipping() -> None:
    expected = {t: reference(t) for t in THRESHOLD}
    for results in run_distributed(_every_backend, world_size=2, timeout=280):
        for name, result in results.items():
            assert_same_params(result, expected[name.rsplit(" ", 1)[1]], atol=1e-6)


def _deepspeed_stages() -> dict[int, dict[str, torch.Tensor]]:
    return {stage: fit("norm", device_train_microbatch_size=2, deepspeed_config={"zero_optimization": {"stage": stage}})
            for stage in (1, 2, 3)}


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs DeepSpeed")
@pytest.mark.timeout(400)
def test_deepspeed_zero_1_2_3_clip_through_the_engine_like_torch() -> None:
    expected = reference("norm")
    for results in run_distributed(_deepspeed_stages, world_size=2, timeout=380):
        for result in results.values():
            assert_same_params(result, expected, atol=1e-5)


def test_deepspeed_mapping_and_its_conflicts() -> None:
    norm = GradientClipping("norm", 0.5)
    config, left = for_deepspeed({"zero_optimization": {"stage": 2}}, [norm])
    assert config == {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5} and left == []
    assert for_deepspeed(None, [norm]) == (None, [norm])  # not DeepSpeed: the Trainer clips
    with pytest.raises(ValueError, match="keep one of them"):
        for_deepspeed({"gradient_clipping": 1.0}, [norm])
    with pytest.raises(ValueError, match="clips gradients by their norm only.*use clipping_type='norm'"):
        for_deepspeed({}, [GradientClipping("value", 0.5)])


@pytest.mark.parametrize(("args", "message"), [
    (("norms", 1.0), "clipping_type='norms' is not supported; use one of norm, value, adaptive"),
    (("norm", 0), "clipping_threshold must be a finite number > 0, got 0"),
    (("norm", float("inf")), "clipping_threshold must be a finite number > 0, got inf"),
])
def test_bad_arguments(args, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GradientClipping(*args)


def test_something_that_is_not_an_algorithm_is_refused() -> None:
    model = MLP()
    with pytest.raises(TypeError, match=r"algorithms\[0\] is a str, not a lockstep.algorithms.Algorithm"):
        Trainer(model=model, train_dataloader=loader(4), max_duration="1ep", optimizers=sgd(model),
                algorithms=["norm"])
