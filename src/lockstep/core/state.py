"""State: everything the training loop reads and changes, shared with callbacks and algorithms.

It is Composer 0.32.1's ``State`` (constructor, attributes, ``state_dict`` / ``load_state_dict``),
so code written against Composer's -- a callback, an algorithm, a test that builds a State and
fires events through an :class:`~lockstep.core.engine.Engine` -- runs unchanged. The Trainer adds a
few attributes of its own (``strategy``, ``run_folder``, ``batches_per_epoch``). Serialization is
in :mod:`lockstep.core.state_dict`; ``lockstep.state`` is this module's other name.
"""

from __future__ import annotations

import collections.abc
import contextlib
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep import dist
from lockstep.core.precision import Precision
from lockstep.devices.device import Device, as_device
from lockstep.core import state_dict as serialization
from lockstep.time import Time, Timestamp, TimeUnit
from lockstep.batch import batch_get, batch_set, ensure_tuple

if TYPE_CHECKING:
    from lockstep.core.log import Logger

SERIALIZED_ATTRIBUTES = ("model", "optimizers", "schedulers", "algorithms", "callbacks", "scaler", "timestamp",
                         "rank_zero_seed", "train_metrics", "eval_metrics", "run_name", "dataset_state")
"""What :meth:`State.state_dict` holds, in Composer's order."""


class State:
    """The training run's live state, as Composer's ``State``: the model, optimizers, schedulers,
    time, data, and what the current step has produced (``batch``, ``outputs``, ``loss``).

    ``model`` is the user's module (sharded in place under FSDP); the module the Trainer's step
    calls is ``strategy.module``. ``device`` is a :class:`lockstep.devices.Device` (a string or
    ``torch.device`` is turned into one); ``precision`` a :class:`~lockstep.core.Precision`.
    ``optimizers``, ``schedulers``, ``algorithms``, ``callbacks`` and ``evaluators`` take one object, a
    sequence or None, and are lists.
    """

    def __init__(
        self,
        model: nn.Module,
        rank_zero_seed: int | None = None,
        run_name: str = "",
        device: Device | str | torch.device | None = None,
        max_duration: str | Time | int | None = None,
        device_train_microbatch_size: int | float | None = None,
        auto_microbatching: bool = False,
        train_dataloader: Iterable | None = None,
        evaluators: Any = None,
        dataloader: Iterable | None = None,
        dataloader_label: str | None = None,
        dataloader_len: int | Time = -1,
        dataset_state: dict[str, Any] | None = None,
        dataset_resumption: dict[str, Any] | None = None,
        precision: str | Precision = Precision.FP32,
        precision_config: dict[str, Any] | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        save_metrics: bool = False,
        algorithms: Any = None,
        callbacks: Any = None,
        parallelism_config: Any = None,
        *,
        schedulers: Any = None,
        strategy: Any = None,
        batches_per_epoch: int | None = None,
        eval_metrics: dict[str, dict[str, Any]] | None = None,
        run_folder: str | None = None,
    ) -> None:
        self.model = model
        self.rank_zero_seed = random.SystemRandom().randrange(2**31) if rank_zero_seed is None else rank_zero_seed
        """Rank 0's seed (``seed`` adds the global rank); a random number when none was given."""
        self.run_name = run_name
        self.device = as_device(device)
        self.device_train_microbatch_size = device_train_microbatch_size
        self.auto_microbatching = auto_microbatching
        self._max_duration: Time | None = None
        self.max_duration = max_duration
        self._dataloader: Any = None
        self._dataloader_label: str | None = None
        self._dataloader_len: Time | None = None
        self.set_dataloader(dataloader, dataloader_label, dataloader_len)
        self.dataset_state = dataset_state
        """Composer's ``{'train': ..., 'eval': {}}``: a train dataset state loaded before its dataset was set."""
        self.dataset_resumption: dict[str, Any] = dataset_resumption or {}
        self._train_dataloader = train_dataloader
        self._evaluators = list(ensure_tuple(evaluators))
        self._precision = Precision(precision)
        self._precision_config = precision_config
        self.load_path: str | None = None
        self._optimizers: list[torch.optim.Optimizer] = list(ensure_tuple(optimizers))
        self._schedulers: list[Any] = list(ensure_tuple(schedulers))
        self.scaler = scaler
        """The loss scaler of ``amp_fp16`` (None otherwise, and under DeepSpeed, which scales itself)."""
        self.save_metrics = save_metrics
        self._algorithms: list[Any] = list(ensure_tuple(algorithms))
        self._callbacks: list[Any] = list(ensure_tuple(callbacks))
        self.parallelism_config = parallelism_config
        self.profiler: Any = None
        """The run's :class:`lockstep.profiler.Profiler` (Composer's ``state.profiler``), or None."""
        self._empty_run(eval_metrics)
        # lockstep's own
        self.strategy = strategy
        """The backend (:class:`lockstep.parallel.strategy.Strategy`): gradient clipping goes through it."""
        self.batches_per_epoch = batches_per_epoch
        """Training batches per epoch (None: unknown), which ``ep`` schedules are counted in."""
        self.run_folder = run_folder
        """The run's folder (``run_folder=`` or the launcher's run directory), where loggers put files."""

    def _empty_run(self, eval_metrics: dict[str, dict[str, Any]] | None) -> None:
        """What the loop fills in as it runs: the clocks at zero, no metrics, no batch yet."""
        self.previous_timestamp: Timestamp | None = None
        self.timestamp = Timestamp()
        self.eval_timestamp = Timestamp()
        self.predict_timestamp = Timestamp()
        self.serialized_attributes = list(SERIALIZED_ATTRIBUTES)
        self.train_metrics: dict[str, Any] | None = {}
        self.eval_metrics: dict[str, dict[str, Any]] = eval_metrics if eval_metrics is not None else {}
        """Composer's ``{label: {name: Metric}}``: each evaluator's metrics (torchmetrics objects;
        ``compute()`` gives the last evaluation's value), with lockstep's ``'loss'`` among them."""
        self.train_metric_values: dict[str, float] = {}
        self.eval_metric_values: dict[str, float] = {}
        self.total_loss_dict: dict[str, float] = {}
        self.metric_outputs: dict[str, Any] = {}
        self.batch: Any = None
        """This rank's current training batch (from BATCH_START to BATCH_END; the microbatch in the
        microbatch loop; the evaluation batch during evaluation)."""
        self.outputs: Any = None
        """The model's outputs of the current microbatch (or evaluation batch), from AFTER_FORWARD on."""
        self.loss_tensor: Any = None
        """This rank's mean training loss of the last batch (kept as a tensor: no device sync per step);
        in the microbatch loop, from AFTER_LOSS on, the microbatch's loss."""

    # -- time ---------------------------------------------------------------------------------

    @property
    def max_duration(self) -> Time | None:
        """How long to train (a Time; ``dur`` is not allowed): strings and ints (epochs) are converted."""
        return self._max_duration

    @max_duration.setter
    def max_duration(self, max_duration: str | Time | int | None) -> None:
        if max_duration is None:
            self._max_duration = None
            return
        if isinstance(max_duration, str):
            max_duration = Time.from_timestring(max_duration)
        elif isinstance(max_duration, int):
            max_duration = Time(max_duration, TimeUnit.EPOCH)
        if max_duration.unit is TimeUnit.DURATION:
            raise ValueError("max_duration cannot be in 'dur' (a fraction of itself): give it in ep, ba, sp or tok")
        self._max_duration = max_duration

    def get_elapsed_duration(self) -> Time | None:
        """How much of ``max_duration`` is done, as a ``dur`` Time (None without a max_duration)."""
        if self._max_duration is None:
            return None
        return Time(self.timestamp.get(self._max_duration.unit).value / self._max_duration.value, TimeUnit.DURATION)

    def stop_training(self) -> None:
        """End training after the current batch, as Composer's ``state.stop_training()``: an
        ``ep`` max_duration becomes the batches done, any other the amount done in its own unit
        (the loop checks it after each batch; what runs after the batch, evaluation and checkpoints
        included, still runs). Call it on every rank (a decision the ranks agree on), or ranks stop
        at different batches."""
        unit = None if self._max_duration is None else self._max_duration.unit
        if unit is None or unit is TimeUnit.EPOCH:
            self.max_duration = Time(int(self.timestamp.batch), TimeUnit.BATCH)
        else:
            self.max_duration = self.timestamp.get(unit)

    @property
    def seed(self) -> int:
        """This rank's seed: ``rank_zero_seed`` plus the global rank."""
        return self.rank_zero_seed + dist.get_global_rank()

    # -- what the step produced -----------------------------------------------------------------

    @property
    def loss(self) -> Any:
        """As Composer's ``state.loss``: a tensor (``float(state.loss)`` reads it). A callback or
        algorithm may set it at AFTER_LOSS to change what is backpropagated."""
        return self.loss_tensor

    @loss.setter
    def loss(self, value: Any) -> None:
        self.loss_tensor = value

    @property
    def lr(self) -> float:
        """The first optimizer's first parameter group's learning rate."""
        return float(self._optimizers[0].param_groups[0]["lr"]) if self._optimizers else float("nan")

    def batch_get_item(self, key: Any) -> Any:
        """The part of ``batch`` that ``key`` names (:func:`lockstep.utils.batch_helpers.batch_get`)."""
        return batch_get(self.batch, key)

    def batch_set_item(self, key: Any, value: Any) -> None:
        """Replace the part of ``batch`` that ``key`` names (:func:`lockstep.utils.batch_helpers.batch_set`)."""
        self.batch = batch_set(self.batch, key=key, value=value)

    # -- the lists ----------------------------------------------------------------------------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: Any) -> None:
        self._optimizers[:] = ensure_tuple(optimizers)

    @property
    def schedulers(self) -> list[Any]:
        return self._schedulers

    @schedulers.setter
    def schedulers(self, schedulers: Any) -> None:
        self._schedulers[:] = ensure_tuple(schedulers)

    @property
    def callbacks(self) -> list[Any]:
        """The run's callbacks (the Trainer's, in the order they run)."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Any) -> None:
        self._callbacks[:] = ensure_tuple(callbacks)

    @property
    def algorithms(self) -> list[Any]:
        return self._algorithms

    @algorithms.setter
    def algorithms(self, algorithms: Any) -> None:
        self._algorithms[:] = ensure_tuple(algorithms)

    @property
    def evaluators(self) -> list[Any]:
        """The run's :class:`lockstep.core.Evaluator` objects."""
        return self._evaluators

    @evaluators.setter
    def evaluators(self, evaluators: Any) -> None:
        self._evaluators[:] = ensure_tuple(evaluators)

    # -- data ---------------------------------------------------------------------------------

    @property
    def train_dataloader(self) -> Any:
        return self._train_dataloader

    @train_dataloader.setter
    def train_dataloader(self, train_dataloader: Any) -> None:
        """A train dataset state loaded before the dataset was known is applied to it now."""
        self._train_dataloader = train_dataloader
        if self.dataset_state is not None and self.dataset_state.get("train") is not None:
            serialization.load_dataset_state(self, self.dataset_state)

    @property
    def dataloader(self) -> Any:
        """The dataloader being iterated: the training one during ``fit``, an evaluator's during its evaluation."""
        return self._dataloader

    @dataloader.setter
    def dataloader(self, dataloader: Any) -> None:
        self._dataloader = dataloader

    @property
    def dataloader_label(self) -> str | None:
        """The label of ``dataloader``: ``train_dataloader_label`` during ``fit``, the evaluator's label
        during its evaluation."""
        return self._dataloader_label

    @dataloader_label.setter
    def dataloader_label(self, label: str | None) -> None:
        self._dataloader_label = label

    def set_dataloader(self, dataloader: Iterable | None = None, dataloader_label: str | None = None,
                       dataloader_len: int | Time = -1) -> None:
        """Make ``dataloader`` (labelled ``dataloader_label``) the active one; ``dataloader_len``
        batches of it make an iteration (-1: all of it)."""
        if dataloader is not None and dataloader_label is None:
            raise ValueError("set_dataloader: a dataloader needs a dataloader_label (such as 'train')")
        self._dataloader = dataloader
        self._dataloader_label = None if dataloader is None else dataloader_label
        if dataloader is None:
            self._dataloader_len = None
        else:
            self.dataloader_len = dataloader_len

    def active_dataloader(self) -> tuple[Any, str | None, Time | None]:
        """``(dataloader, dataloader_label, dataloader_len)``, to put back with :meth:`restore_dataloader`."""
        return self._dataloader, self._dataloader_label, self._dataloader_len

    def restore_dataloader(self, active: tuple[Any, str | None, Time | None]) -> None:
        """Make what :meth:`active_dataloader` returned active again, as it was (nothing recounted)."""
        self._dataloader, self._dataloader_label, self._dataloader_len = active

    @property
    def dataloader_len(self) -> Time | None:
        """Batches per iteration of the active dataloader (None: unknown, or no dataloader)."""
        return self._dataloader_len

    @dataloader_len.setter
    def dataloader_len(self, num_batches: int | Time) -> None:
        if self._dataloader is None:
            raise RuntimeError("state.dataloader_len cannot be set without a dataloader: call set_dataloader first")
        wanted = int(num_batches)
        try:
            length = len(self._dataloader) if isinstance(self._dataloader, collections.abc.Sized) else None
        except (TypeError, NotImplementedError):
            length = None
        if length is not None and wanted > length:
            warnings.warn(f"DataloaderNumBatchesWarning: dataloader_len {wanted} is more than the dataloader's "
                          f"{length} batches; using {length}", stacklevel=2)
            wanted = length
        if wanted < 0:
            self._dataloader_len = None if length is None else Time(length, TimeUnit.BATCH)
        else:
            self._dataloader_len = Time(wanted, TimeUnit.BATCH)

    # -- precision and parallelism -------------------------------------------------------------

    @property
    def precision(self) -> Precision:
        return self._precision

    @precision.setter
    def precision(self, precision: str | Precision) -> None:
        self._precision = Precision(precision)

    @property
    def precision_config(self) -> dict[str, Any] | None:
        return self._precision_config

    @property
    def is_model_ddp(self) -> bool:
        """Whether ``model`` is wrapped in DistributedDataParallel (lockstep never wraps ``model``
        itself: its DDP wrapper is ``strategy.module``)."""
        return isinstance(self.model, nn.parallel.DistributedDataParallel)

    @property
    def fsdp_enabled(self) -> bool:
        """Whether some module of ``model`` is sharded with FSDP."""
        from torch.distributed.fsdp import FSDPModule
        return any(isinstance(m, FSDPModule) for m in self.model.modules())

    @property
    def fsdp_config(self) -> Any:
        """The FSDP configuration in use (None without FSDP)."""
        return getattr(self.strategy, "config", None) if self.fsdp_enabled else None

    @property
    def fsdp_state_dict_type(self) -> str | None:
        """``'full'``, ``'sharded'`` or ``'local'`` under FSDP, else None."""
        if not self.fsdp_enabled:
            return None
        return getattr(self.fsdp_config, "state_dict_type", "full")

    @property
    def fsdp_sharded_state_dict_enabled(self) -> bool:
        return self.fsdp_state_dict_type == "sharded"

    @property
    def deepspeed_enabled(self) -> bool:
        return type(self.strategy).__name__ == "DeepSpeedStrategy"

    # -- serialization ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Composer's form: ``model``, ``optimizers`` and ``schedulers`` (by class name),
        ``algorithms`` (a list of ``(name, state)``), ``callbacks``, ``scaler``, ``timestamp``,
        ``rank_zero_seed``, ``run_name``, ``dataset_state``, the metrics (with ``save_metrics``),
        ``integrations`` and ``metadata``."""
        return serialization.of(self)

    def load_state_dict(self, state: dict[str, Any], logger: Logger | None = None, strict: bool = False,
                        exclude_algorithms: list[str] | None = None, algorithm_passes: Any = None) -> None:
        """Load what :meth:`state_dict` made (or a Composer checkpoint's ``state``) into this State."""
        serialization.load(self, state, strict=strict)

    def load_model_state(self, state_dict: dict[str, Any], logger: Logger | None = None, strict: bool = False,
                         exclude_algorithms: list[str] | None = None, algorithm_passes: Any = None) -> None:
        """Load ``state_dict['model']`` into the model."""
        serialization.load_model(self, state_dict, strict=strict)

    def load_optim_state(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load ``state_dict['optimizers']`` (keyed by class name) into the optimizers."""
        serialization.load_optimizers(self, state_dict)

    def get_model_state_dict(self) -> dict[str, Any]:
        return serialization.model_of(self)

    def get_optim_state_dict(self) -> dict[str, Any]:
        return serialization.optimizers_of(self)



@contextlib.contextmanager
def fsdp_state_dict_type_context(module: nn.Module, state_dict_type: str = "full") -> Iterator[None]:
    """Composer's: inside the block, a module wrapped with torch's first FSDP (``FullyShardedDataParallel``)
    gives ``full``, ``sharded`` or ``local`` state dicts. lockstep shards with FSDP2 (``fully_shard``),
    whose state dicts are always DTensors: such a module is left as it is."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    kinds = {"full": StateDictType.FULL_STATE_DICT, "sharded": StateDictType.SHARDED_STATE_DICT,
             "local": StateDictType.LOCAL_STATE_DICT}
    if state_dict_type not in kinds:
        raise NotImplementedError(f"state_dict_type={state_dict_type!r}: use one of {', '.join(kinds)}")
    if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        yield
        return
    with FullyShardedDataParallel.state_dict_type(module, kinds[state_dict_type]):
        yield
