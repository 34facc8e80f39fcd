"""The FSDP backend: the model sharded in place by :func:`lockstep.parallel.fsdp_sharding.prepare_fsdp`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep import dist, elastic
from lockstep.parallel import fsdp_elastic, skeleton
from lockstep.parallel.fsdp_sharding import FSDPSetup, prepare_fsdp
from lockstep.parallel.fsdp_config import FSDPConfig
from lockstep.parallel.mesh import DataParallel, MeshShape, resolve_shape
from lockstep.parallel.tensor_parallel import TensorParallel
from lockstep.parallel.precision import NULL_CONTEXT
from lockstep.parallel.strategy import Strategy

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout


class FSDPStrategy(Strategy):
    """``fully_shard`` per the wrapping rules of ``fsdp_config``; the step calls the sharded model
    itself. Gradients are reduce-scattered in the last microbatch's backward only."""

    gathers_in_forward = True
    needs_process_group = True
    shards_state = True

    def __init__(self, device: torch.device, precision: str, config: FSDPConfig,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(device, precision)
        self.config, self.tp = config, tp
        self.shape = _mesh_shape(config, tp)
        """The job's mesh (Composer's degrees, tensor parallelism); None: the sharding strategy's own."""
        self.fsdp = FSDPSetup()
        """The units and checkpointed modules :func:`prepare_fsdp` made."""
        self._skeleton: nn.Module | None = None
        """An elastic job's model before sharding, on the meta device (:meth:`reshard`)."""
        self._names: list[list[list[str]]] = []

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if elastic.current() is not None:
            self._skeleton = skeleton.skeleton(model)
            self._names = skeleton.parameter_names(model, optimizers)
            fsdp_elastic.wait_dcp_through_lockstep()  # sharded checkpoints' writes and loads
        self._shard(model.to(self.device), optimizers)

    def _shard(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.fsdp = prepare_fsdp(model, self.config, self.precision, self.device, optimizers, self.shape, self.tp)
        self.model = self.module = model
        self.optimizers = optimizers
        if self._skeleton is not None:
            fsdp_elastic.wait_through_lockstep([u.module for u in self.fsdp.units])

    def reshard(self) -> nn.Module:
        """After an elastic job's ranks changed, on the new process group: a new model from the
        skeleton, sharded over the ranks now in the job, and the optimizers (the same objects)
        pointed at its parameters, with no state. Its parameters and the optimizers' state are
        for a checkpoint to fill; the model it replaces is left to be freed."""
        assert self._skeleton is not None, "reshard() is for an elastic job's FSDP strategy"
        model = skeleton.materialize(self._skeleton, self.device, self.model)
        skeleton.point_optimizers(model, self.optimizers, self._names)
        self._shard(model, self.optimizers)
        return model

    @property
    def whole_from_peers(self) -> bool:  # type: ignore[override]
        return self._skeleton is not None and self.tp is None and self.shape is None

    def held_state(self) -> Any:
        from lockstep.parallel import fsdp_peers  # DCP's state dicts: only an elastic job's change needs them

        return fsdp_peers.own_shards(self.model, self.optimizers)

    def reshard_from(self, held: list[Any], own: Any) -> nn.Module:
        from lockstep.checkpoint.fsdp_states import FullLayout
        from lockstep.parallel import fsdp_peers

        whole = fsdp_peers.whole_state(held, own)
        model = self.reshard()
        layout = FullLayout(model, self.optimizers, self.fsdp.buffer_dtypes)
        layout.load_model(whole["model"], fsdp_peers.PEERS, strict=True)
        layout.load_optimizers(whole["optimizers"], fsdp_peers.PEERS)
        return model

    def data_parallel(self) -> DataParallel:
        if self.tp is None:
            return super().data_parallel()
        # the ranks of a tensor-parallel group are consecutive, and train on one batch
        return DataParallel(dist.get_global_rank() // self.tp.degree, dist.get_world_size() // self.tp.degree,
                            self.tp.degree)

    def _compile_targets(self) -> list[nn.Module]:
        below_root = [u.module for u in self.fsdp.units if u.module is not self.model]
        return below_root or [self.model]

    def sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(is_last_microbatch)  # type: ignore[operator]
        return NULL_CONTEXT

    def layout(self) -> Layout:
        from lockstep.checkpoint.fsdp_states import FullLayout, LocalLayout, ShardedLayout
        kinds = {"full": FullLayout, "local": LocalLayout, "sharded": ShardedLayout}
        return kinds[self.config.state_dict_type](self.model, self.optimizers, self.fsdp.buffer_dtypes)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "units": self.fsdp.units, "checkpointed": self.fsdp.checkpointed,
                "mesh": None if self.shape is None else self.shape.describe()}


def _mesh_shape(config: FSDPConfig, tp: TensorParallel | None) -> MeshShape | None:
    """The mesh the degrees ask for, checked against the world size before any process group exists."""
    if not config.explicit_mesh and tp is None:
        return None
    if config.sharding_strategy == "HYBRID_SHARD" and config.data_parallel_replicate_degree is None:
        raise ValueError("sharding_strategy HYBRID_SHARD on a mesh of degrees (data_parallel_shard_degree, "
                         "tensor parallelism) needs fsdp_config['data_parallel_replicate_degree']: how many replicas")
    return resolve_shape(dist.get_world_size(), shard=config.data_parallel_shard_degree,
                         replicate=config.data_parallel_replicate_degree, tensor=1 if tp is None else tp.degree)
