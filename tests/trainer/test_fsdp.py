"""FSDP: equality with DDP per strategy, wrap rules, process groups, mixed precision, config errors."""

from __future__ import annotations

import pytest
import torch

from lockstep import Trainer, dist
from lockstep.testing import run_distributed
from tests.trainer.common import Block, BlockMLP, assert_same_params, error_of, full_params, loader, sgd

GLOBAL_BATCH = 8


def train(fsdp_config: dict | None, microbatch_size: int | None = None, model: BlockMLP | None = None,
          precision: str = "fp32") -> dict[str, torch.Tensor]:
    model = model or BlockMLP()
    trainer = Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size()),
                      max_duration="2ep", optimizers=sgd(model), progress_bar=False, precision=precision,
                      fsdp_config=fsdp_config, device_train_microbatch_size=microbatch_size)
    trainer.fit()
    return full_params(model)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """One process, no FSDP: the plain global-batch math that DDP matches."""
    return train(None)


def _every_strategy() -> list[dict[str, torch.Tensor]]:
    configs = [
        {"sharding_strategy": "FULL_SHARD"},
        {"sharding_strategy": "SHARD_GRAD_OP"},
        {"sharding_strategy": "NO_SHARD"},
        {"sharding_strategy": "HYBRID_SHARD"},  # one node: shards within it
    ]
    results = [train(c) for c in configs]
    # microbatches skip gradient sync until the last one; with activation checkpointing, activation
    # and parameter offload and no backward prefetch the math is unchanged
    results.append(train({"activation_checkpointing": True}, microbatch_size=2))
    results.append(train({"activation_cpu_offload": True, "cpu_offload": True, "backward_prefetch": "NONE"},
                         microbatch_size=3))
    return results


@pytest.mark.timeout(240)
def test_every_strategy_matches_ddp(reference) -> None:
    for rank_results in run_distributed(_every_strategy, world_size=2, timeout=220):
        for result in rank_results:
            assert_same_params(result, reference, atol=1e-5)


def _hybrid() -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    model = BlockMLP()
    result = train({"sharding_strategy": "HYBRID_SHARD"}, model=model)
    return result, model.net[0].linear.weight.device_mesh.mesh.tolist()


@pytest.mark.timeout(180)
def test_hybrid_shard_over_two_nodes_matches_ddp(reference) -> None:
    # 4 ranks as 2 nodes of 2: shard within a node, replicate across nodes
    for result, mesh in run_distributed(_hybrid, world_size=4, local_world_size=2, timeout=160):
        assert mesh == [[0, 1], [2, 3]]
        assert_same_params(result, reference, atol=1e-5)


# -- wrap rules ------------------------------------------------------------------------------------


class AttributeRules(BlockMLP):
    """Block 0 opts out by attribute although fsdp_wrap_fn says yes; the head opts in."""

    def __init__(self) -> None:
        super().__init__(wrap=True)
        self.net[0]._fsdp_wrap = False
        self.net[3]._fsdp_wrap = True


class DictRules(BlockMLP):
    def fsdp_wrap_fn(self, module):
        if isinstance(module, Block):
            return {"sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "FULL"}
        return False


def _wrapped_names(model_name: str, config: dict) -> list[str]:
    from torch.distributed.fsdp import FSDPModule
    model = {"fn": BlockMLP(wrap=True), "attr": AttributeRules(), "dict": DictRules(),
             "size": BlockMLP(wrap=None)}[model_name]
    Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
            progress_bar=False, fsdp_config=config)
    return sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))


def _all_wrap_rules() -> dict[str, list[str]]:
    return {
        "fn": _wrapped_names("fn", {}),
        "attr": _wrapped_names("attr", {}),
        "dict": _wrapped_names("dict", {}),
        # the deepest module reaching min_params is wrapped: a Block's Linear, so not the Block
        "size_large": _wrapped_names("size", {"min_params": 200}),  # blocks 1, 2 (272 each)
        "size_small": _wrapped_names("size", {"min_params": 100}),  # every block (112, 272, 272)
        "size_huge": _wrapped_names("size", {}),                    # default 1e8: the root only
    }


@pytest.mark.timeout(120)
def test_wrap_rules_in_order() -> None:
    [result] = run_distributed(_all_wrap_rules, world_size=1, timeout=100)
    assert result["fn"] == ["", "net.0", "net.1", "net.2"]
    assert result["attr"] == ["", "net.1", "net.2", "net.3"]
    assert result["dict"] == ["", "net.0", "net.1", "net.2"]
    assert result["size_large"] == ["", "net.1.linear", "net.2.linear"]
    assert result["size_small"] == ["", "net.0.linear", "net.1.linear", "net.2.linear"]
    assert result["size_huge"] == [""]


def _dict_settings() -> tuple[bool, bool]:
    model = DictRules()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                      progress_bar=False, fsdp_config={"sharding_strategy": "FULL_SHARD"})
    units = {u.name: u for u in trainer.strategy.fsdp.units}
    return units["net.0"].strategy == "SHARD_GRAD_OP", units[""].strategy == "FULL_SHARD"


@pytest.mark.timeout(120)
def test_per_module_settings_from_a_dict() -> None:
    assert run_distributed(_dict_settings, world_size=2, timeout=100) == [(True, True)] * 2


class CheckpointedBlocks(BlockMLP):
    def __init__(self) -> None:
        super().__init__(wrap=True, checkpoint=True)


def _checkpointed() -> tuple[list[str], dict[str, torch.Tensor]]:
    model = CheckpointedBlocks()
    model.net[1]._activation_checkpointing = False  # the attribute wins over the function
    result = train({"activation_checkpointing": True}, model=model)
    wrapped = sorted(n for n, m in model.named_modules() if type(m).__name__ == "FSDPCheckpointWrapper")
    return wrapped, result


@pytest.mark.timeout(120)
def test_activation_checkpointing_rules(reference) -> None:
    for wrapped, result in run_distributed(_checkpointed, world_size=2, timeout=100):
        assert wrapped == ["net.0", "net.2"]
        assert_same_params(result, reference, atol=1e-5)


# -- process groups ----------------------------------------------------------------------------------


class GroupedBlocks(BlockMLP):
    GROUPS = ("self", "node", "local_rank_across_nodes")

    def fsdp_wrap_fn(self, module):
        for block, group in zip(self.net, self.GROUPS):
            if module is block:
                return {"process_group": group}
        return False


def _grouped() -> dict[str, object]:
    model = GroupedBlocks()
    # every rank draws different data, so a block synchronised over fewer ranks drifts apart
    torch.manual_seed(dist.get_global_rank())
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    dl = torch.utils.data.DataLoader(data, batch_size=4, sampler=dist.get_sampler(data, shuffle=True))
    trainer = Trainer(model=model, train_dataloader=dl, max_duration="4ba", optimizers=sgd(model),
                      progress_bar=False, fsdp_config={})
    trainer.fit()
    meshes = {i: model.net[i].linear.weight.device_mesh.mesh.tolist() for i in range(3)}
    local = {i: model.net[i].linear.weight.full_tensor().clone() for i in range(3)}
    return {"meshes": meshes, "weights": local}


@pytest.mark.timeout(180)
def test_process_groups_on_four_ranks() -> None:
    # 2 nodes of 2: 'node' = set2 = {0,1},{2,3}; 'local_rank_across_nodes' = mod2 = {0,2},{1,3}
    results = run_distributed(_grouped, world_size=4, local_world_size=2, timeout=160)
    assert [r["meshes"][0] for r in results] == [[0], [1], [2], [3]]
    assert [r["meshes"][1] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["meshes"][2] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    w = [r["weights"] for r in results]

    def same(block: int, a: int, b: int) -> bool:
        return torch.equal(w[a][block], w[b][block])

    assert not any(same(0, a, b) for a in range(4) for b in range(a + 1, 4))  # 'self': each its own
    assert same(1, 0, 1) and same(1, 2, 3) and not same(1, 0, 2)
    assert same(2, 0, 2) and same(2, 1, 3) and not same(2, 0, 1)


# -- mixed precision ---------------------------------------------------------------------------------


def _dtypes(mixed_precision, precision: str) -> tuple[str, str]:
    from lockstep.parallel.fsdp_config import resolve_precision
    model = BlockMLP()
    seen = []
    model.net[1].linear.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    result = train({"mixed_precision": mixed_precision}, model=model, precision=precision)
    assert all(torch.isfinite(v).all() for v in result.values())
    return str(seen[0]), str(resolve_precision(mixed_precision, precision).reduce_dtype)


def _mixed_precisions() -> list[tuple[str, str]]:
    return [_dtypes("DEFAULT", "amp_bf16"), _dtypes("PURE", "amp_bf16"), _dtypes("FULL", "amp_bf16"),
            _dtypes({"param_dtype": "bf16"}, "fp32"), _dtypes("DEFAULT", "fp32")]


@pytest.mark.timeout(180)
def test_mixed_precision_follows_the_trainer_precision() -> None:
    for result in run_distributed(_mixed_precisions, world_size=2, timeout=160):
        assert result == [("torch.bfloat16", "torch.float32"), ("torch.bfloat16", "torch.bfloat16"),
                          ("torch.float32", "torch.float32"), ("torch.bfloat16", "torch.float32"),
                          ("torch.float32", "torch.float32")]


def _prefetch_order(mode: str) -> list[str]:
    model = BlockMLP()
    events: list[str] = []
    trainer = Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size()),
                      max_duration="1ba", optimizers=sgd(model), progress_bar=False,
                      fsdp_config={"backward_prefetch": mode})
    for i, block in enumerate(model.net[:3]):
        block.register_full_backward_pre_hook(lambda module, grads, i=i: events.append(f"backward b{i}"))
        unshard = block.unshard
        block.unshard = lambda async_op=False, i=i, unshard=unshard: (events.append(f"gather b{i}"),
                                                                      unshard(async_op))[1]
    trainer.fit()
    return events


def _prefetch_orders() -> tuple[list[str], list[str]]:
    return _prefetch_order("BACKWARD_POST"), _prefetch_order("BACKWARD_PRE")


@pytest.mark.timeout(120)
def test_backward_post_gathers_the_next_unit_once_gradients_are_computed() -> None:
    # BACKWARD_POST asks for each block's parameters after the next block's backward computed its
    # gradients and before its own backward starts; BACKWARD_PRE leaves it to FSDP's pre-backward
    post, pre = run_distributed(_prefetch_orders, world_size=2, timeout=100)[0]
    assert post == ["backward b2", "gather b1", "backward b1", "gather b0", "backward b0"]
    assert pre == ["backward b2", "backward b1", "backward b0"]


class LoudBlocks(BlockMLP):
    """A loss large enough that fp16 gradients overflow at GradScaler's first scales, so that the
    first steps are skipped and the scale drops."""

    def loss(self, outputs, batch):
        return super().loss(outputs, batch) * 4.0


def _fp16_runs() -> list[tuple[dict[str, torch.Tensor], float]]:
    results = []
    for config in (None, {"sharding_strategy": "FULL_SHARD"}, {"sharding_strategy": "SHARD_GRAD_OP"},
                   {"mixed_precision": "FULL"}):
        model = LoudBlocks()
        trainer = Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // dist.get_world_size()),
                          max_duration="2ep", optimizers=sgd(model), progress_bar=False, precision="amp_fp16",
                          fsdp_config=config)
        trainer.fit()
        results.append((full_params(model), trainer.state.scaler.get_scale()))
    return results


@pytest.mark.timeout(180)
def test_amp_fp16_skips_the_same_steps_as_ddp() -> None:
    # A skip must be agreed on: an overflow in one rank's gradient shard skips the step on every rank.
    initial = LoudBlocks().state_dict()
    for (ddp, ddp_scale), *sharded in run_distributed(_fp16_runs, world_size=2, timeout=160):
        assert ddp_scale < 2.0 ** 16  # GradScaler's initial scale: some steps overflowed and were skipped
        assert any(not torch.equal(ddp[k], initial[k]) for k in initial)  # and later steps trained
        for params, scale in sharded:
            assert scale == ddp_scale
            assert_same_params(params, ddp, atol=1e-5)


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    ({"sharding": "FULL_SHARD"}, "unknown key(s) 'sharding'; valid keys: sharding_strategy"),
    ({"sharding_strategy": "ZERO3"}, "'ZERO3' is not supported; use one of FULL_SHARD"),
    ({"mixed_precision": "HALF"}, "'HALF' is not supported; use one of FULL, DEFAULT, PURE"),
    ({"mixed_precision": {"param_dtype": "fp8"}}, "'fp8' is not supported; use one of fp32, fp16, bf16"),
    ({"mixed_precision": {"grad_dtype": "fp32"}}, "unknown key(s) 'grad_dtype'"),
    ({"backward_prefetch": "EARLY"}, "use one of BACKWARD_PRE, BACKWARD_POST, NONE"),
    ({"state_dict_type": "shard"}, "use one of full, local, sharded"),
    ({"cpu_offload": "yes"}, "'cpu_offload'] must be True or False"),
    ({"min_params": -1}, "'min_params'] must be a number >= 0"),
])
def test_config_errors_before_training(config, message) -> None:
    model = BlockMLP()
    with pytest.raises(ValueError) as e:
        Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                fsdp_config=config)
    assert message in str(e.value)


def test_fsdp_with_deepspeed_is_an_error() -> None:
    model = BlockMLP()
    with pytest.raises(ValueError, match="fsdp_config and deepspeed_config were both given"):
        Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                fsdp_config={}, deepspeed_config={})


class BadGroup(BlockMLP):
    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def fsdp_wrap_fn(self, module):
        return {"process_group": self.group} if isinstance(module, Block) else False


def _group_error(group) -> str:
    model = BadGroup(group)
    return error_of(Trainer, model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                    progress_bar=False, fsdp_config={}, expected=(ValueError,))


@pytest.mark.timeout(120)
def test_process_group_errors() -> None:
    errors = run_distributed(_group_error, world_size=2, args=("set3",), timeout=100)
    assert "process_group='set3' needs a world size divisible by 3, but the world size is 2" in errors[0]
    errors = run_distributed(_group_error, world_size=2, args=("ring",), timeout=100)
    assert "process_group='ring' is not supported; use 'self', 'node'" in errors[0]


def test_local_checkpoints_need_rank_in_the_filename(tmp_path) -> None:
    model = BlockMLP()
    with pytest.raises(ValueError, match=r"save_filename='ba\{batch\}.pt' must contain \{rank\}"):
        Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                fsdp_config={"state_dict_type": "local"}, save_folder=str(tmp_path), save_filename="ba{batch}.pt")


def _gathered_after_forward(strategy: str) -> dict[str, bool]:
    model = BlockMLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                      progress_bar=False, fsdp_config={"sharding_strategy": strategy})
    trainer.strategy.module(next(iter(loader(4))))
    return {u.name: u.module._get_fsdp_state()._fsdp_param_group.is_unsharded for u in trainer.strategy.fsdp.units}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_only_the_root_keeps_its_parameters_gathered_for_backward_under_full_shard(strategy: str) -> None:
    # as FSDP1: the root's backward begins as its forward ends, so it is not resharded in between
    for gathered in run_distributed(_gathered_after_forward, world_size=2, args=(strategy,), timeout=100):
        assert gathered == {"": True, "net.0": strategy == "SHARD_GRAD_OP", "net.1": strategy == "SHARD_GRAD_OP",
                            "net.2": strategy == "SHARD_GRAD_OP"}
