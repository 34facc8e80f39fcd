"""The Trainer: the same training loop on every rank, with DDP, exact microbatching and checkpoints."""

from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, SupportsInt

import torch

from lockstep import dist, elastic, errors, progress, rng
from lockstep.core.algorithm import Algorithm
from lockstep.core.callback import Callback
from lockstep.core.data_spec import DataSpec, ensure_data_spec
from lockstep.core.event import Event
from lockstep.callbacks.checkpoint_saver import CheckpointSaver as CheckpointSaverCallback
from lockstep.checkpoint.config import CheckpointConfig, SaveInterval
from lockstep.loggers.console import ConsoleLogger
from lockstep.loggers.logger import Logger
from lockstep.loggers.logger_destination import LoggerDestination
from lockstep.model import Model
from lockstep.optim.stepper import ScheduledLR, compile_schedulers
from lockstep.algorithms.gradient_clipping import for_deepspeed
from lockstep.parallel.config import ParallelConfig, build_strategy
from lockstep.parallel.mesh import DataParallel, data_parallel, set_data_parallel
from lockstep.parallel.precision import make_grad_scaler
from lockstep.state import State
from lockstep.time import Time, Timestamp, TimeUnit, is_reached
from lockstep.trainer import (
    checkpointing, data, evaluation, fit_arguments, microbatch, options, predict, rejoin, setup, train_metrics)
from lockstep.trainer.batch_end import BatchEnd
from lockstep.trainer.config import LoopConfig, subset
from lockstep.trainer.events import Events
from lockstep.trainer.preemption import Preempted, StopSignal


class Trainer:
    """Train a :class:`~lockstep.Model` data-parallel over every rank of the run.

    The dataloader yields each rank's batch; ``device_train_microbatch_size`` (or ``grad_accum``,
    a count) splits it into microbatches whose gradients accumulate before one optimizer step.
    Each microbatch's mean loss is weighted by its share of the global batch, so the parameters
    after a step do not depend on how the global batch was spread over ranks and microbatches.
    See :mod:`lockstep.core.event` for the loop as pseudocode.

    Checkpoints: with ``save_folder``, rank 0 writes ``save_filename`` every ``save_interval`` and
    at the end, each holding the model, optimizers, schedulers, timestamp and every rank's RNG and
    data position, so a resumed run continues bit for bit. ``load_path`` loads one at construction;
    ``autoresume`` (with ``run_name``) continues from the newest checkpoint of the run. While
    saving is on, SIGTERM makes every rank stop at the same step, save, and exit with 143.

    ``fsdp_config`` shards the model with FSDP instead of DDP (see :mod:`lockstep.parallel.fsdp_sharding`);
    the optimizers given are pointed at the sharded parameters. ``deepspeed_config`` trains with a
    DeepSpeed engine (ZeRO stages 0-3) around the model and its one optimizer instead (see
    :mod:`lockstep.parallel.deepspeed`); batch sizes and precision in it are filled in from the Trainer.
    ``compile_config`` (a dict of ``torch.compile`` arguments) compiles the model after it is wrapped
    (see :mod:`lockstep.parallel.compile`).

    ``precision`` defaults to ``'fp32'`` (``None``: Composer's default for the device, amp_fp16 on
    a GPU). Every other argument has Composer 0.32.1's meaning (the run options are in
    :mod:`lockstep.trainer.options`); docs/porting-from-composer.md lists them, with the few that
    lockstep refuses and why.

    Args:
        model: The :class:`~lockstep.Model` (an ``nn.Module`` with ``forward(batch)`` and
            ``loss(outputs, batch)``) to train; wrapped by DDP, FSDP or DeepSpeed on every rank.
        train_dataloader: Yields this rank's batches (a ``DataLoader``, any iterable, or a
            ``DataSpec``); a map-style dataset needs a ``DistributedSampler`` over several ranks.
        max_duration: How long to train: a Time string (``'2ep'``, ``'100ba'``, ``'1e6tok'``,
            ``'1h'``) or an int of epochs; ``fit(duration=...)`` may give it instead.
        optimizers: One optimizer (or a list) over the model's parameters; None builds Composer's
            default, ``DecoupledSGDW(lr=0.1)``, with a warning.
        eval_dataloader: A dataloader, an ``Evaluator``, or a list of either, to evaluate on.
        eval_interval: When to evaluate: a Time string, an int of epochs, or a function
            ``(state, event) -> bool``.
        device: ``'cpu'``, ``'gpu'``/``'cuda'``, a ``torch.device`` or a ``Device``; None: this
            rank's GPU if there is one, else the CPU.
        precision: ``'fp32'``, ``'amp_bf16'`` or ``'amp_fp16'``; None: Composer's default for the
            device.
        device_train_microbatch_size: Samples per microbatch (the rank's batch is split into
            microbatches whose gradients accumulate), or ``'auto'`` to find the largest that fits.
        grad_accum: The number of microbatches per batch, instead of their size.
        ddp_sync_strategy: When DDP all-reduces gradients: ``'single_auto_sync'`` (once, on the
            last microbatch), ``'multi_auto_sync'`` (every microbatch) or ``'forced_sync'``.
        find_unused_parameters: DDP's: let parameters that get no gradient in a step be.
        schedulers: Learning-rate schedulers: torch schedulers, Composer's
            ``ComposerScheduler`` objects or functions ``(state) -> float``, one or a list.
        scale_schedule_ratio: Scales ``max_duration`` and every schedule's times by this ratio.
        step_schedulers_every_batch: Step torch schedulers every batch (True) or every epoch
            (False, or None); schedules of training time (Composer's) step every batch.
        train_subset_num_batches: Batches per epoch to train on; -1: the whole dataloader.
        eval_subset_num_batches: Batches per evaluation; -1: the whole dataloader.
        callbacks: A :class:`~lockstep.Callback` or a list of them, run at every event.
        loggers: A :class:`~lockstep.loggers.LoggerDestination` or a list of them (TensorBoard,
            MLflow, W&B, files, memory, a bucket).
        algorithms: An :class:`~lockstep.Algorithm` or a list of them (``GradientClipping``, ``EMA``).
        run_name: The run's name, in checkpoint names and logs; None: ``COMPOSER_RUN_NAME``,
            ``RUN_NAME`` or ``LOCKSTEP_RUN_NAME``, else one made from the time (the same on every
            rank).
        run_folder: Where the run's logs, ``metrics.jsonl`` and ``loss_curve.png`` go; None: the
            launcher's run directory, or none outside the launcher.
        progress_bar: Show a progress bar on rank 0.
        log_to_console: Print logged metrics to the console every ``console_log_interval``.
        console_log_interval: How often ``log_to_console`` prints (a Time string or int of epochs).
        console_stream: ``'stdout'``, ``'stderr'`` or a text stream, for console metrics.
        python_log_level: The level of Python's ``logging`` for ``lockstep`` (``'info'``, ...).
        seed: Seeds python, numpy and torch with ``seed + rank`` at the start; None: the seed torch
            was started from, and every generator is seeded at the end of construction.
        dist_timeout: Seconds a collective may wait for the other ranks before failing.
        save_folder: Where checkpoints go: a folder, or an ``s3://``, ``gs://`` or ``azure://``
            URI (format fields such as ``{run_name}`` allowed); None saves nothing.
        save_filename: Each checkpoint's name (``{epoch}``, ``{batch}``, ``{rank}``, ... fields).
        save_latest_filename: The pointer to the newest checkpoint; None: no pointer.
        save_interval: When to save: a Time string, an int of epochs, or ``(state, event) -> bool``.
        save_num_checkpoints_to_keep: How many of the newest checkpoints to keep (also in a
            bucket); -1: all; 0: each is deleted once written (a local folder only).
        save_overwrite: Replace checkpoints already in ``save_folder`` instead of refusing it.
        save_weights_only: Save only the model's weights.
        save_metrics: Save the latest evaluation and train metrics' values in checkpoints too.
        load_path: A checkpoint to load at construction (a path or URI; a Composer checkpoint
            too); with ``autoresume``, used only when the run has no checkpoint of its own.
        load_weights_only: Load only the model's weights from ``load_path``.
        load_strict_model_weights: Refuse weights whose names do not match the model's.
        load_ignore_keys: Parts of the checkpoint not to load: globs of ``state/...`` paths, or a
            function that edits the checkpoint's dict.
        autoresume: Continue from the newest checkpoint of ``run_name`` in ``save_folder`` (the
            local one, else the bucket's), if there is one.
        fsdp_config: Shard the model with FSDP: a dict of FSDP settings (sharding strategy, mixed
            precision, wrapping, activation checkpointing, ``state_dict_type``, ...).
        parallelism_config: Composer 0.32's ``{'fsdp': {...}, 'tp': {...}}``: FSDP settings (as
            ``fsdp_config``) and tensor parallelism (``tensor_parallel_degree``, ``layer_plan``).
        deepspeed_config: Train with DeepSpeed ZeRO (stages 0-3): DeepSpeed's config dict.
        compile_config: Compile the model with ``torch.compile`` and these arguments (``{}``:
            the defaults).
        train_dataloader_label: The training dataloader's name in logged metrics.
        spin_dataloaders: On a resume, read each evaluation dataloader's and each finished
            epoch's first batch before training, as Composer does.
        algorithm_passes: Functions that reorder the algorithms for an event (Composer's).
        log_traces: Log when each algorithm runs at each event.
        auto_log_hparams: Log the Trainer's arguments as hyperparameters.
        load_object_store: An object store to read ``load_path`` from (an object name in it).
        load_progress_bar: Show a progress bar while a checkpoint downloads.
        load_exclude_algorithms: Algorithms (by class name) whose saved state is not loaded.
        save_ignore_keys: Parts left out of saved checkpoints: globs of ``state/...`` paths, or a
            function that edits the checkpoint's dict.
        precision_config: Composer's settings of ``amp_fp8``, which lockstep does not have: an
            error unless empty.
        accumulate_train_batch_on_tokens: Weight each microbatch's loss by its tokens rather than
            its samples.
        deterministic_mode: Use deterministic algorithms only (``torch.use_deterministic_algorithms``
            and cuDNN's settings), for bit-reproducible runs at some cost in speed.
        profiler: A :class:`~lockstep.profiler.Profiler` that records a schedule of steps with
            ``torch.profiler``.
    """

    @errors.configuration_checks()
    @options.keeps_arguments
    def __init__(
        self,
        *,
        model: Model,
        train_dataloader: Any = None,
        max_duration: Time | str | int | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        eval_dataloader: Any = None,
        eval_interval: Time | str | int | Callable[[State, Event], bool] = "1ep",
        device: str | torch.device | None = None,
        precision: str | None = "fp32",
        device_train_microbatch_size: int | str | None = None,
        grad_accum: int | None = None,
        ddp_sync_strategy: str | None = None,
        find_unused_parameters: bool = False,
        schedulers: Any = None,
        scale_schedule_ratio: float = 1.0,
        step_schedulers_every_batch: bool | None = None,
        train_subset_num_batches: int = -1,
        eval_subset_num_batches: int = -1,
        callbacks: Callback | Sequence[Callback] | None = None,
        loggers: LoggerDestination | Sequence[LoggerDestination] | None = None,
        algorithms: Algorithm | Sequence[Algorithm] | None = None,
        run_name: str | None = None,
        run_folder: str | None = None,
        progress_bar: bool = True,
        log_to_console: bool = False,
        console_log_interval: Time | str | int = "1ba",
        console_stream: str | IO[str] = "stderr",
        python_log_level: str | None = None,
        seed: int | None = None,
        dist_timeout: float = 300.0,
        save_folder: str | None = None,
        save_filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
        save_latest_filename: str | None = "latest-rank{rank}.pt",
        save_interval: SaveInterval = "1ep",
        save_num_checkpoints_to_keep: int = -1,
        save_overwrite: bool = False,
        save_weights_only: bool = False,
        save_metrics: bool = False,
        load_path: str | None = None,
        load_weights_only: bool = False,
        load_strict_model_weights: bool = True,
        load_ignore_keys: Any = None,
        autoresume: bool = False,
        fsdp_config: dict | None = None,
        parallelism_config: dict | None = None,
        deepspeed_config: dict | None = None,
        compile_config: dict | None = None,
        train_dataloader_label: str = "train",
        spin_dataloaders: bool = True,
        algorithm_passes: Any = None,
        log_traces: bool = False,
        auto_log_hparams: bool = False,
        load_object_store: Any = None,
        load_progress_bar: bool = True,
        load_exclude_algorithms: list[str] | None = None,
        save_ignore_keys: Any = None,
        precision_config: dict | None = None,
        accumulate_train_batch_on_tokens: bool = False,
        deterministic_mode: bool = False,
        profiler: Any = None,
    ) -> None:
        self.options = options.RunOptions(
            train_dataloader_label=train_dataloader_label, spin_dataloaders=spin_dataloaders,
            algorithm_passes=algorithm_passes, log_traces=log_traces, auto_log_hparams=auto_log_hparams,
            load_progress_bar=load_progress_bar, load_exclude_algorithms=load_exclude_algorithms,
            accumulate_train_batch_on_tokens=accumulate_train_batch_on_tokens,
            deterministic_mode=deterministic_mode, profiler=profiler)
        options.check_unsupported(precision_config=precision_config, profiler=profiler,
                                  device_train_microbatch_size=device_train_microbatch_size)
        options.start(self.options)  # deterministic_mode acts here, before any kernel
        setup.set_python_log_level(python_log_level)
        callbacks, loggers = setup.as_list(callbacks), setup.as_list(loggers)
        self.loop = LoopConfig(
            max_duration=max_duration, eval_interval=eval_interval, device=device, precision=precision,
            device_train_microbatch_size=device_train_microbatch_size, grad_accum=grad_accum, seed=seed,
            scale_schedule_ratio=scale_schedule_ratio, train_subset_num_batches=train_subset_num_batches,
            eval_subset_num_batches=eval_subset_num_batches)
        saving = checkpointing.saving_arguments(callbacks, dict(
            save_folder=save_folder, save_filename=save_filename, save_latest_filename=save_latest_filename,
            save_interval=save_interval, save_num_checkpoints_to_keep=save_num_checkpoints_to_keep,
            save_overwrite=save_overwrite, save_weights_only=save_weights_only, save_ignore_keys=save_ignore_keys))
        self.checkpoints = CheckpointConfig(
            **saving, save_metrics=save_metrics, load_path=load_path, load_object_store=load_object_store,
            load_weights_only=load_weights_only, load_ignore_keys=load_ignore_keys,
            load_strict_model_weights=load_strict_model_weights, autoresume=autoresume)
        deepspeed_config, self.algorithms = for_deepspeed(deepspeed_config, setup.check_algorithms(algorithms))
        self.parallel = ParallelConfig(
            ddp_sync_strategy=ddp_sync_strategy, find_unused_parameters=find_unused_parameters,
            fsdp_config=setup.fsdp_from_parallelism_config(parallelism_config, fsdp_config),
            tp_config=setup.tp_from_parallelism_config(parallelism_config),
            deepspeed_config=deepspeed_config, compile_config=compile_config)
        callbacks = checkpointing.with_saver_callback(callbacks, self.checkpoints)
        run_name = setup.run_name_from_environment(run_name)
        self._assemble(model, setup.default_optimizer(model) if optimizers is None else optimizers,
                       train_dataloader, eval_dataloader, schedulers, step_schedulers_every_batch, run_name,
                       dist_timeout, callbacks)
        console = ConsoleLogger(console_log_interval, console_stream) if log_to_console else None
        self._set_up_outputs(run_folder, loggers, callbacks, progress_bar, console)
        self._begin(model, callbacks, compile_config, run_name_given=run_name is not None)

    def _assemble(self, model: Model, optimizers: Any, train_dataloader: Any, eval_dataloader: Any, schedulers: Any,
                  step_schedulers_every_batch: bool | None, run_name: str | None, dist_timeout: float,
                  callbacks: list[Callback]) -> None:
        """The backend, the process group, the state, the training data and the checkpoint savers."""
        self._train_spec = None if train_dataloader is None else ensure_data_spec(train_dataloader)
        train_dataloader = None if self._train_spec is None else self._train_spec.dataloader
        optimizer_list = setup.check_inputs(model, optimizers, train_dataloader, None)
        self.train_dataloader = data.shielded(train_dataloader)
        self._eval_dataloader = eval_dataloader  # made into evaluators once the device is known
        self.strategy = build_strategy(
            self.parallel, device=self.loop.device, precision=self.loop.precision,  # type: ignore[arg-type]
            train_dataloader=train_dataloader, microbatch_size=self.loop.fixed_microbatch_size,
            grad_accum=self.loop.grad_accum, num_optimizers=len(optimizer_list))
        self.state = self._start_distributed(model, optimizer_list, schedulers, run_name, dist_timeout)
        train_metrics.build(self.state)
        self.algorithms = self.state.algorithms  # one list: what state.algorithms shows is what runs
        self.state.device_train_microbatch_size = self.loop.fixed_microbatch_size
        if self.state.device_train_microbatch_size is None:  # Composer reports the whole batch
            self.state.device_train_microbatch_size = getattr(train_dataloader, "batch_size", None)
        self._set_train_dataloader()
        self._batch_schedulers, self._epoch_schedulers = setup.split_schedulers(
            self.state.schedulers, step_schedulers_every_batch)
        self._set_up_checkpoints(checkpointing.more_savers(callbacks, self.checkpoints))
        checkpointing.bind_callbacks(callbacks, self.layout, self._every_save)
        self._checkpoint_saver = next((c for c in callbacks if isinstance(c, CheckpointSaverCallback)), None)
        """Composer's name for the ``CheckpointSaver`` callback that stands for ``save_folder``."""
        self._follow_loader(self._train_spec)

    def _begin(self, model: Model, callbacks: list[Callback], compile_config: Any, *, run_name_given: bool) -> None:
        """Microbatching, hyperparameters, the INIT event and the checkpoint the run starts from."""
        on_tokens = self.options.accumulate_train_batch_on_tokens
        self._microbatches = microbatch.Microbatches(
            self.state, self.strategy, self._run_event, self.loop, setup.auto_microbatching(self.loop, self.parallel),
            count=(lambda micro: self._num_tokens(micro)) if on_tokens else None)
        self._microbatches.spec = self._train_spec
        self._logging, self._closed, self._fitting, self._check_groups = False, False, False, False
        self._unended: tuple | None = None
        """The batch whose optimizer step ran and whose timestamp has not moved yet: (samples, tokens, is_last)."""
        self._tail: BatchEnd | None = None
        """The end of a batch after its BATCH_END, while under way."""
        self._ended_at_change = False
        """Whether the latest change of an elastic job's ranks ended such a batch on the new group."""
        self._went_back = False
        """Whether the latest change of an elastic job's ranks took the job back to a checkpoint's step."""
        self.fit_count = 0
        """How many times ``fit`` ran (a second one that would train nothing is refused, as in Composer)."""
        self._events.index()
        self.local_hparams["is_model_compiled"] = compile_config is not None or setup.already_compiled(model)
        if self.options.auto_log_hparams:
            self.logger.log_hyperparameters(self.local_hparams)
        self.logger.log_hyperparameters(setup.placement(self.state))
        # As in Composer, callbacks and loggers close at close() or, failing that, when the process
        # exits: after an error that ends the script, so that what it prints (the traceback) is
        # still in the loggers that copy stderr.
        atexit.register(_close_at_exit, weakref.ref(self))
        self._run_event(Event.INIT)
        self._run_event(Event.BEFORE_LOAD)
        self._resume_entry = checkpointing.load_at_start(self.checkpoints, self.state, self.layout, self.saver,
                                                         self.train_dataloader, run_name_given=run_name_given)
        for saver in self._savers[1:]:  # only the run's save_folder resumes
            saver.begin(None)
        self._run_event(Event.AFTER_LOAD)
        if self._resume_entry is None:  # a LoadCheckpoint callback may have loaded the training state
            self._resume_entry = checkpointing.entry_of_callbacks(callbacks)
        if self.loop.seed is None:
            # As Composer: seeded now, after a load with the seed the run started with, so what
            # fit draws before a resumed run's RNG state is put back (the dataloader spin: a
            # dataset made at random on its first read) is drawn as the run that saved drew it.
            rng.seed_everything(self.state.seed)

    def _set_up_checkpoints(self, more: list[tuple[Any, CheckpointConfig]]) -> None:
        """The run's saver (``save_folder``'s) and one more for each further ``CheckpointSaver``
        callback in ``more``."""
        self.layout = self.strategy.layout()
        self.saver = checkpointing.make_saver(self.checkpoints, run_name=self.state.run_name,
                                              max_duration=self.state.max_duration, layout=self.layout,
                                              device=self.state.device.torch_device)
        self._position = data.DataPosition()
        self.saved_checkpoints: list[str] = []
        """The checkpoints this rank wrote in this process, oldest first (retention may have removed some)."""
        self._saves = None if self.saver is None else checkpointing.FitSaves(
            self.saver, self.state, self.layout, self._position, self.saved_checkpoints)
        self._every_save = [] if self._saves is None else [self._saves]
        for _, config in more:
            saver = checkpointing.make_saver(config, run_name=self.state.run_name, max_duration=self.state.max_duration,
                                             layout=self.layout, device=self.state.device.torch_device)
            assert saver is not None  # a CheckpointSaver callback has a folder
            self._every_save.append(checkpointing.FitSaves(saver, self.state, self.layout, self._position, []))
        self._savers = [saves.saver for saves in self._every_save]
        # The one hook before the weights change in place (the optimizer step; whatever acts at an
        # event): a checkpoint's background copy may still be reading them.
        hooks = [saver.before_weights_change for saver in self._savers]
        self._before_weights_change = _nothing if not hooks else hooks[0] if len(hooks) == 1 \
            else functools.partial(_each, hooks)

    def _set_up_outputs(self, run_folder: str | None, loggers: Sequence[LoggerDestination],
                        callbacks: Sequence[Callback], progress_bar: bool, console: ConsoleLogger | None) -> None:
        """The run folder, the logger destinations and the callbacks (the defaults first)."""
        folder = setup.resolve_run_folder(run_folder)
        self.state.run_folder = None if folder is None else str(folder)
        destinations = setup.check_loggers(loggers) + ([console] if console is not None else [])
        self.logger = Logger(self.state, destinations)
        self._events = Events(self.state, self.logger, self.state.algorithms, self._before_weights_change,
                              passes=self.options.algorithm_passes, log_traces=self.options.log_traces)
        self._run_event = self._events.run
        profiler = self.options.profiler
        profiling = [c for c in profiler.callbacks if c not in callbacks] if profiler is not None else []
        self.callbacks = setup.default_callbacks(folder, progress_bar, destinations) + list(callbacks) + profiling + \
            destinations + setup.upload_callbacks(folder, destinations)

    @property
    def callbacks(self) -> list[Callback]:
        """Every callback, in the order they run (the defaults and the logger destinations too).
        Changing this list during ``fit``, or putting another in its place, takes effect from the
        next event."""
        return self._events.callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[Callback]) -> None:
        self._events.set_callbacks(callbacks)

    def _set_train_dataloader(self) -> None:
        """Make the training dataloader ``state.dataloader`` (and ``state.train_dataloader``), as Composer does."""
        s = self.state
        s.train_dataloader = self.train_dataloader
        if self.train_dataloader is not None:
            data.split_over_data_parallel(self.train_dataloader, "train_dataloader")
            limit = self.loop.train_subset_num_batches
            s.set_dataloader(self.train_dataloader, self.options.train_dataloader_label, -1 if limit is None else limit)

    def _follow_loader(self, spec: DataSpec | None) -> None:
        """What the loop needs to know of the training data: whether ranks must agree on each
        batch, and how to count its samples and tokens (the DataSpec's rules, else the model's)."""
        loader = None if spec is None else spec.dataloader
        model = self.state.model
        self._num_tokens = ((spec.get_num_tokens_in_batch if spec is not None else None)
                            or getattr(loader, "get_num_tokens_in_batch", None) or model.num_tokens)
        self._num_samples = (spec.get_num_samples_in_batch if spec is not None else None) or model.num_samples
        self._batch_transforms = None if spec is None else spec.batch_transforms
        self._step_sync, self._sum_tokens = setup.step_agreement(
            loader, model, counts_tokens=spec is not None and spec.get_num_tokens_in_batch is not None)

    def _start_distributed(self, model: Model, optimizers: list[torch.optim.Optimizer], schedulers: Any,
                           run_name: str | None, dist_timeout: float) -> State:
        """Join the process group, seed, and prepare the model on every rank (collectives)."""
        loop = self.loop
        dist.initialize_dist(loop.device, dist_timeout, single_process_group=self.strategy.needs_process_group)
        if elastic.join(dist_timeout) is not None:
            setup.check_elastic(self.strategy, self.parallel, self.checkpoints.save_folder)
        split = self.strategy.data_parallel()
        set_data_parallel(split)
        if loop.seed is not None:  # the ranks of a tensor-parallel group draw the same numbers
            rng.seed_everything(loop.seed + split.rank)
        self.strategy.setup(model, optimizers)
        if self.parallel.compile_config is not None:
            self.strategy.compile(self.parallel.compile_config)
        self._evaluated_at: dict[str, int] = {}
        """Each evaluator's batch count at its latest evaluation during fit, by label."""
        self.evaluators, eval_metrics = evaluation.build_evaluators(
            self._eval_dataloader, model, loop.device, loop.eval_interval, loop.eval_subset_num_batches)
        rank_zero_seed = loop.seed if loop.seed is not None else setup.seed_the_script_started_from()
        state = State(model=model, rank_zero_seed=rank_zero_seed, run_name=setup.resolve_run_name(run_name),
                      device=loop.device, max_duration=loop.max_duration, train_dataloader=self.train_dataloader,
                      evaluators=self.evaluators, precision=loop.precision,  # type: ignore[arg-type]
                      optimizers=optimizers, scaler=self.strategy.scaler, save_metrics=self.checkpoints.save_metrics,
                      algorithms=self.algorithms, strategy=self.strategy, eval_metrics=eval_metrics,
                      batches_per_epoch=setup.epoch_length(self.train_dataloader, loop.train_subset_num_batches))
        state.schedulers = compile_schedulers(setup.as_list(schedulers), state, loop.scale_schedule_ratio)
        if state.max_duration is not None:
            self._follow_schedules(state)
        return state

    # -- the loop -----------------------------------------------------------------------------

    def fit(self, *, train_dataloader: Any = None, train_dataloader_label: str = "train",
            train_subset_num_batches: int | None = None, spin_dataloaders: bool | None = None,
            duration: Time | str | int | None = None, reset_time: bool = False, schedulers: Any = None,
            scale_schedule_ratio: float = 1.0, step_schedulers_every_batch: bool | None = None,
            eval_dataloader: Any = None, eval_subset_num_batches: int = -1,
            eval_interval: Time | str | int | Callable[[State, Event], bool] = 1,
            device_train_microbatch_size: int | str | None = None, precision: str | None = None) -> None:
        """Train until ``max_duration``, evaluating every ``eval_interval`` and saving every
        ``save_interval``. Raises :class:`~lockstep.trainer.preemption.Preempted` (exit code
        143) after saving, when SIGTERM arrived.

        As in Composer: ``train_dataloader`` replaces the Trainer's (labelled
        ``train_dataloader_label``); ``duration`` trains that much more (an int counts epochs), or
        that much from zero with ``reset_time=True``, which also starts the timestamp over. The
        other arguments replace the Trainer's of that name from this ``fit`` on (``eval_interval``
        and ``eval_subset_num_batches`` go with ``eval_dataloader``, ``scale_schedule_ratio`` and
        ``step_schedulers_every_batch`` with ``schedulers``); under FSDP or DeepSpeed the precision,
        and under DeepSpeed the microbatch size, stay the Trainer's.
        """
        if self._closed:
            raise RuntimeError("fit() after close(): build a new Trainer")
        with errors.configuration_checks():  # fit's arguments are checked as the Trainer's are
            given = fit_arguments.FitArguments(
                train_dataloader=train_dataloader, train_dataloader_label=train_dataloader_label,
                duration=duration, reset_time=reset_time, train_subset_num_batches=train_subset_num_batches,
                spin_dataloaders=spin_dataloaders, eval_dataloader=eval_dataloader, eval_interval=eval_interval,
                eval_subset_num_batches=eval_subset_num_batches, schedulers=schedulers,
                scale_schedule_ratio=scale_schedule_ratio, step_schedulers_every_batch=step_schedulers_every_batch,
                device_train_microbatch_size=device_train_microbatch_size, precision=precision)
            self._apply_fit_arguments(given)
        self._start_fit()
        with setup.kept_out_of_gc():
            try:
                self._fit()
            except BaseException:
                for saver in self._savers:
                    with contextlib.suppress(Exception):  # the error training raised is the one to see
                        saver.settle()
                self._events.flush_logs()  # what the run folder holds so far; the rest closes later
                raise
            finally:
                self._fitting = False
                progress.stop_heartbeat()  # what the script does next may wait on other ranks
                for saver in self._savers:  # every save is durable by now
                    saver.folder_claim.release()

    def _start_fit(self) -> None:
        """Claim the save folders again (held since Trainer(...) until the first fit ends) and read
        once what every step of this fit needs."""
        for saver in self._savers:
            saver.folder_claim.take()
        self._fitting = True
        self.fit_count += 1
        split = data_parallel()
        self._data_parallel_size = split.size
        self._check_groups = split.copies > 1  # at the first step of this fit
        self._share_global_batch(split)

    def _share_global_batch(self, split: DataParallel) -> None:
        """In an elastic job (``LOCKSTEP_FULL_WORLD_SIZE``) where fewer ranks train than the full
        world, train on this rank's share of each global batch of the full world, in microbatches
        of at most the loader's batch size (DESIGN.md section 14)."""
        full = elastic.full_world_size()
        if full is None or self.train_dataloader is None:
            return
        if split.copies > 1:
            raise ValueError(f"{elastic.FULL_WORLD_ENV} with tensor parallelism: lockstep does not split a global "
                             f"batch over tensor-parallel groups yet; unset it or train without tensor parallelism")
        membership = elastic.current()
        shared = elastic.share_loader(self.train_dataloader, "train_dataloader", full, split.size, split.rank,
                                      regrouped=membership is not None and membership.generation > 0)
        if shared is self.train_dataloader:
            return
        self.train_dataloader = shared
        if self._train_spec is not None:
            self._train_spec.dataloader = shared
        self._microbatches.cap = shared.batch_sampler.per_rank_batch
        self._follow_loader(self._train_spec)

    def _apply_fit_arguments(self, given: fit_arguments.FitArguments) -> None:
        """Change the run as ``fit``'s arguments ask, before its loop starts (on every rank). Every
        check comes first: a call that fails changes nothing."""
        s, loop = self.state, self.loop
        changes = fit_arguments.check(given, state=s, loop=loop, parallel=self.parallel,
                                      train_dataloader=self.train_dataloader, fit_count=self.fit_count)
        if changes.spec is not None:
            self._use_train_dataloader(changes.spec)
            self.options.train_dataloader_label = given.train_dataloader_label
        s.timestamp, s.max_duration = changes.timestamp, changes.max_duration  # type: ignore[assignment]
        if given.train_subset_num_batches is not None:
            loop.train_subset_num_batches = changes.subset
            s.batches_per_epoch = setup.epoch_length(self.train_dataloader, loop.train_subset_num_batches)
        if given.spin_dataloaders is not None:
            self.options.spin_dataloaders = given.spin_dataloaders
        if changes.schedulers is not None and changes.split is not None:
            s.schedulers = changes.schedulers
            self._batch_schedulers, self._epoch_schedulers = changes.split
        if changes.evaluators is not None:  # Composer replaces the evaluators and their metrics
            self.evaluators, s.eval_metrics = changes.evaluators
            s.evaluators = self.evaluators
            self._evaluated_at.clear()
        if given.device_train_microbatch_size is not None:
            loop.device_train_microbatch_size, loop.grad_accum = given.device_train_microbatch_size, None
            self._microbatches.auto = setup.auto_microbatching(loop, self.parallel)
            s.device_train_microbatch_size = loop.fixed_microbatch_size
        if given.precision is not None and given.precision != s.precision:
            self.strategy.precision = given.precision
            self.strategy.scaler = s.scaler = make_grad_scaler(given.precision, self.strategy.device)
            s.precision = given.precision
        for saver in self._savers:  # 'dur' save intervals follow the new max_duration
            saver.max_duration = s.max_duration

    def _fit(self) -> None:
        s = self.state
        started_at = s.timestamp.batch.value
        s.model.train()
        self._events.index()  # callbacks added since the Trainer was built
        entry, self._resume_entry = self._resume_entry, None
        resume = self._data_resumed(entry)
        self._follow_schedules(s)
        self._logging = bool(self.logger.active)
        if self._logging:
            self.logger.log_hyperparameters(setup.hyperparameters(self))
        self._clock = time.perf_counter()  # wall clock of the batches: Timestamp.total_wct, batch_wct
        self._set_train_dataloader()
        self._run_event(Event.FIT_START)
        with StopSignal() if self.saver else contextlib.nullcontext() as stop:
            started_epoch = None  # the epoch whose EPOCH_START ran (an elastic job may start it over)
            membership = elastic.current()
            if membership is not None and membership.fresh:  # joined a running job: the others' step
                resume = self._rejoin_and_end(stop)
                # the others ran this epoch's EPOCH_START, unless the batch they just ended ended an epoch
                if s.timestamp.batch_in_epoch.value or not self._ended_at_change:
                    started_epoch = s.timestamp.epoch.value
            while not is_reached(s.timestamp, s.max_duration):
                data.set_epoch(self.train_dataloader, s.timestamp.epoch.value)
                # as in Composer, not when resuming mid-epoch
                if s.timestamp.batch_in_epoch.value == 0 and started_epoch != s.timestamp.epoch.value:
                    started_epoch = s.timestamp.epoch.value
                    if s.timestamp.epoch.value == 0:  # the run is one iteration
                        self._run_event(Event.ITERATION_START)
                    self._run_event(Event.EPOCH_START)
                resume = self._epoch(resume, stop)
            for saves in self._every_save:
                saves.finish()
        if self.evaluators and s.timestamp.batch.value > started_at:
            # As in Composer, once more at the end unless the last batch just evaluated; before
            # FIT_END (Composer: after it), so that what closes at FIT_END has the last results.
            self._evaluate([e for e in self.evaluators
                            if evaluation.is_due_at_fit_end(e.eval_interval, s, self._evaluated_at.get(e.label))])
        self._end_fit()

    def _data_resumed(self, entry: dict[str, Any] | None) -> data.DataPosition | None:
        """The dataloaders spun to the epoch a loaded checkpoint (``entry``: this rank's part)
        was saved in, and where ``fit`` starts the train data (:func:`data.resume_position`)."""
        s = self.state
        # as in Composer, a train dataset that the checkpoint put back in place itself is neither
        # spun through the epochs before (each pass would be one of its epochs) nor passed over
        by_dataset = bool(s.dataset_resumption.get("train"))
        if self.options.spin_dataloaders:
            spun = self.train_dataloader if entry is not None and not data.is_stateful(self.train_dataloader) \
                and not by_dataset else None
            data.spin(spun, s.timestamp.epoch.value, [e.dataloader.dataloader for e in self.evaluators])
        return data.resume_position(entry, s.timestamp.batch_in_epoch.value, self._position, by_dataset=by_dataset)

    def _end_fit(self) -> None:
        """FIT_END, once every batch, evaluation and save of this fit is over."""
        # What runs at FIT_END is a rank's own work (a loss curve drawn, a model exported, a logger's
        # last uploads), as long as it takes: not watched for stalls, as after fit
        progress.stop_heartbeat()
        self._run_event(Event.FIT_END)

    def _epoch(self, resume: data.DataPosition | None, stop: StopSignal | None) -> data.DataPosition | None:
        """Train the rest of the epoch from ``resume``; None, or where the epoch goes on after the
        job's ranks changed (an elastic job)."""
        s = self.state
        batches = data.epoch_batches(
            self.train_dataloader, self._count, self._step_sync, s.device.torch_device, sum_tokens=self._sum_tokens,
            track=self._position if self.saver else None, resume=resume,
            limit=self.loop.train_subset_num_batches, transform=self._batch_transforms)
        try:
            if not self._train_epoch(batches, stop) and resume is None:
                raise ValueError("train_dataloader yielded no batches: check the dataset and batch_size")
        except (elastic.MembershipChanged, RuntimeError) as error:
            if not self._after_a_change(error):
                raise
            return self._rejoin_and_end(stop)  # the step in flight again, on the ranks left
        finally:
            batches.close()  # puts back a sampler the resume skipped through
        return None

    def _rejoin_and_end(self, stop: StopSignal | None) -> data.DataPosition | None:
        """:meth:`_rejoin`, and then the end of the batch the change interrupted after its
        BATCH_END (its evaluations, saves, its epoch's end), on the new process group, where every
        rank left had it to do; again after each change meanwhile. Where the epoch goes on."""
        membership = elastic.current()
        joined = membership is not None and membership.fresh  # no end of a batch of its own, until it takes theirs
        while True:
            resume = self._rejoin(stop)
            tail = None if self._went_back else self._tail  # back at a checkpoint's step: no batch to end
            try:
                taken, made_from = rejoin.end_pending(tail, joined, self.state.timestamp.batch.value)
            except (elastic.MembershipChanged, RuntimeError) as error:
                if not self._after_a_change(error):
                    raise
                continue
            if taken < 0:
                self._tail = None
                return resume
            if joined:  # the others' end of the batch, from the step they are at
                self._tail, joined = self._batch_end_of_others(made_from, taken), False
            try:
                self._tail.run()  # type: ignore[union-attr]
            except (elastic.MembershipChanged, RuntimeError) as error:
                if not self._after_a_change(error):
                    raise
                continue
            self._tail = None
            return self._where_the_epoch_goes_on()

    def _batch_end_of_others(self, made_from: tuple | None, taken: int) -> BatchEnd:
        """A rank that joined while the others were in a batch's end: the same end (its steps made
        from what theirs were, :meth:`BatchEnd.described`), with the steps they took taken. It
        ends the batch at the change, as they do (an epoch it ends starts again on every rank)."""
        assert made_from is not None, "the ranks in a batch's end describe it"
        before, after = (Timestamp.from_state_dict(made) for made in made_from[:2])
        is_last = made_from[2]
        tail = BatchEnd(self._tail_steps(before, after, is_last, self._loud), is_last, before, after)
        tail.taken, self._ended_at_change = taken, True
        return tail

    @property
    def _loud(self) -> bool:
        """Whether a callback or an algorithm acts at the events of a step before BATCH_END and
        between BATCH_END and the next (otherwise they are not dispatched at all)."""
        return self._events.step_heard or bool(self.algorithms)

    def _after_change(self, unended: tuple | None, stop: StopSignal | None) -> None:
        """On the new process group: the data split over its ranks, and the end of the batch the
        ranks took the optimizer step of, if they did (its timestamp, BATCH_END, ...)."""
        self._unended = unended  # this rank's now, until its end moves the timestamp
        self._ended_at_change = unended is not None
        split = self.strategy.data_parallel()
        set_data_parallel(split)
        self._data_parallel_size = split.size
        self._share_global_batch(split)
        self._set_train_dataloader()
        if unended is not None:
            samples, tokens, is_last = unended
            self._end_batch(samples, tokens, is_last, stop, self._loud)

    @staticmethod
    def _after_a_change(error: BaseException) -> bool:
        """Whether ``error`` ended the step because the job's ranks changed (an elastic job)."""
        membership = elastic.current()
        return membership is not None and (isinstance(error, elastic.MembershipChanged) or membership.follows(error))

    def _rejoin(self, stop: StopSignal | None) -> data.DataPosition | None:
        """After the job's ranks changed (an elastic job): a process group of the ranks left, every
        rank at the step the furthest reached (ending together a batch whose optimizer step was
        taken) or, under FSDP, at the last checkpoint's, the global batch split over them; where
        the epoch's data starts again (its global batches already trained are read and dropped)."""
        membership = elastic.current()
        assert membership is not None
        s, started = self.state, time.monotonic()
        trained = list(membership.ranks if membership.before is None else membership.before)
        reached, first = s.timestamp.batch.value, True
        while True:
            try:
                if self.saver is not None:  # a write in flight meets in the old group: over before it goes
                    self.saver.settle_after_change()
                membership.reform()
                for optimizer in s.optimizers:  # the abandoned step's partial gradients
                    optimizer.zero_grad(set_to_none=True)
                reloaded, self._went_back = None, False
                if self.strategy.shards_state:  # a try that another change ends may leave a new model
                    first, peers = False, first
                    behind, unended, reloaded = self._reshard_after_change(trained, peers)
                else:
                    self.strategy.regroup()
                    behind, unended = rejoin.catch_up(s, self._unended, fresh=membership.fresh)
                membership.caught_up()
                if stop is not None:
                    stop.regroup()
                self._after_change(unended, stop)
                break
            except (elastic.MembershipChanged, RuntimeError) as error:
                if not self._after_a_change(error):
                    raise
                # another rank was lost meanwhile: the newest generation
        now = membership.ranks
        self._tell_ranks_changed(elastic.RanksChanged(
            generation=membership.generation, world_size=len(now), previous_world_size=len(trained),
            left=tuple(r for r in trained if r not in now), joined=tuple(r for r in now if r not in trained),
            batch=s.timestamp.batch.value, seconds=round(time.monotonic() - started, 3), ranks_behind=behind,
            trained_again=max(0, reached - s.timestamp.batch.value)))
        return reloaded if reloaded is not None else self._where_the_epoch_goes_on()

    def _where_the_epoch_goes_on(self) -> data.DataPosition | None:
        """After a change of an elastic job's ranks: the epoch's batches already trained, skipped."""
        done = self.state.timestamp.batch_in_epoch.value
        return data.DataPosition(skip=done) if done else None

    def _reshard_after_change(self, trained: list[int], first: bool) -> tuple[int, tuple | None,
                                                                             data.DataPosition | None]:
        """Under a backend that :attr:`~Strategy.shards_state`, on the new process group: from the
        shards of the ranks that ``trained`` when ranks only joined (on the ``first`` try: one
        interrupted by another change may have left some ranks with the new model), else from the
        last checkpoint (a lost rank's shards are nowhere else). As :func:`rejoin.catch_up`: how
        many ranks were behind, the batch left to end, and where the data goes on if reloaded."""
        membership = elastic.current()
        assert membership is not None
        can = first and self.strategy.whole_from_peers and set(trained) <= set(membership.ranks)
        # Each agreement below is a polled gather, which a rank may give up on seeing a change that
        # the others completed; the resharding after it meets in torch's own waits (DeepSpeed makes
        # process groups), where they would wait for that rank until dist_timeout: all or none first.
        if not rejoin.peers_hold_the_state(self.state, self._unended, can, fresh=membership.fresh):
            membership.all_or_none("the model's resharding for the last checkpoint")
            return 0, None, self._reshard_from_checkpoint()
        s = self.state
        own = None if membership.fresh else self.strategy.held_state()
        held = dist.all_gather_object(own)
        behind, unended = rejoin.catch_up(s, self._unended, fresh=membership.fresh, weights=False)
        membership.all_or_none("the model's resharding from its peers' state")
        s.model = self.layout.model = self.strategy.reshard_from(held, own)
        if self.parallel.compile_config is not None:
            self.strategy.compile(self.parallel.compile_config)
        return behind, unended, None

    def _reshard_from_checkpoint(self) -> data.DataPosition | None:
        """On the new process group of a backend that :attr:`~Strategy.shards_state` (FSDP,
        DeepSpeed): the model sharded anew over the ranks now in the job and the newest checkpoint
        of ``save_folder`` loaded into it, resharded; where the data goes on. Under FSDP the model
        object is a new one (``state.model``): FSDP cannot move the old one's shards onto another
        group."""
        s, self._went_back = self.state, True
        s.model = self.layout.model = self.strategy.reshard()
        if self.parallel.compile_config is not None:
            self.strategy.compile(self.parallel.compile_config)
        entry = checkpointing.load_after_change(self.checkpoints, s, self.layout, self.saver)
        return data.resume_position(entry, s.timestamp.batch_in_epoch.value, self._position)

    def _tell_ranks_changed(self, change: elastic.RanksChanged) -> None:
        """A change of an elastic job's ranks: a line from each node's lowest rank left, the
        loggers' metrics, and every callback's :meth:`~lockstep.Callback.ranks_changed`."""
        membership = elastic.current()
        if membership is not None and membership.leads_node():
            print(change.describe(), file=sys.stderr, flush=True)
        self.logger.log_metrics(change.metrics())
        for callback in self.state.callbacks:
            told = getattr(callback, "ranks_changed", None)  # a callback need not subclass Callback
            if told is not None:
                told(self.state, self.logger, change)

    def _train_epoch(self, batches: Iterator[tuple[Any, int, SupportsInt, bool]], stop: StopSignal | None) -> bool:
        """Train on ``batches`` until the epoch or the run ends; whether there was a batch."""
        s, run, trained = self.state, self._run_event, False
        while True:
            # Most steps have no callback at the events between BATCH_END and the next BATCH_END;
            # then they are not dispatched at all (callbacks and algorithms are what add one, and
            # none of them runs in between).
            loud = self._loud
            if loud:
                run(Event.BEFORE_DATALOADER)
            item = next(batches, None)
            if item is None:
                return trained
            batch, samples, tokens, is_last = item
            trained = True
            s.batch = batch
            if loud:
                run(Event.AFTER_DATALOADER)
                run(Event.BATCH_START)
            try:
                self._train_batch(s.batch, samples, tokens, loud)
            except BaseException:
                if self.strategy.updated_before_failing():  # the step counts as taken: only its end is left
                    self._unended = (samples, tokens, is_last)
                raise
            self._unended = (samples, tokens, is_last)  # until the timestamp moves (an elastic job's rejoin)
            self._end_batch(samples, tokens, is_last, stop, loud)
            if is_last or is_reached(s.timestamp, s.max_duration):
                return trained

    def _end_batch(self, samples: int, tokens: SupportsInt, is_last: bool, stop: StopSignal | None,
                   loud: bool) -> None:
        """After a step, in Composer's order: move the timestamp and the schedules, log, then
        BATCH_END, evaluate and save when due, BATCH_CHECKPOINT; after the epoch's last batch,
        BEFORE_DATALOADER once more (Composer asks its exhausted dataloader for one more batch) and
        the epoch's turn (:meth:`_tail_steps`); then stop if SIGTERM arrived."""
        s = self.state
        before = s.timestamp
        tokens = int(tokens)  # a sum over the ranks may still be on its way
        now = time.perf_counter()
        # Composer's order: computed over the ranks before the timestamp moves; logged with the batch
        trained = train_metrics.compute(s) if s.train_metrics else None
        s.previous_timestamp = before
        s.timestamp = after = before.to_next_batch(samples, tokens, now - self._clock)
        self._unended = None
        self._clock = now
        progress.heartbeat(after.batch.value)
        if not tokens and s.max_duration.unit is TimeUnit.TOKEN:  # type: ignore[union-attr]
            raise ValueError(setup.NO_TOKENS)
        for scheduler in self._batch_schedulers:  # after the timestamp: the lr of the next batch
            scheduler.step()
        if self._logging:
            self._log_batch(trained)
        self._run_event(Event.BATCH_END)
        self._tail = BatchEnd(self._tail_steps(before, after, is_last, loud), is_last, before, after)
        self._tail.run()
        self._tail = None
        if stop and stop.agreed():
            self._preempt()

    def _tail_steps(self, before: Timestamp, after: Timestamp, is_last: bool, loud: bool) -> list[Callable[[], object]]:
        """The rest of a batch's end, after BATCH_END, as steps (:class:`BatchEnd`): evaluate and
        save when due, BATCH_CHECKPOINT; after the epoch's last batch, BEFORE_DATALOADER once more
        and the epoch's turn (:meth:`_epoch_end_steps`). An elastic job takes a step interrupted by
        a change of its ranks up again on the new process group (:meth:`_rejoin_and_end`)."""
        steps: list[Callable[[], object]] = []
        if self.evaluators:
            steps.append(functools.partial(self._evaluate_due, before, Event.BATCH_END))
        if not is_last:  # the epoch's last batch saves after the epoch ends, so that {epoch} counts that epoch
            steps += [functools.partial(saves.after_batch, before, after) for saves in self._every_save]
        steps.append(functools.partial(self._run_event, Event.BATCH_CHECKPOINT))
        if is_last:
            if loud:
                steps.append(functools.partial(self._run_event, Event.BEFORE_DATALOADER))
            steps += self._epoch_end_steps(before, after)
        return steps

    def _epoch_end_steps(self, before_batch: Timestamp, after_batch: Timestamp) -> list[Callable[[], object]]:
        """After the epoch's last batch: the timestamp counts the epoch and the per-epoch schedulers
        step (one step: no collective in it), EPOCH_END, evaluate and save when due (a save the
        last batch was due included), EPOCH_CHECKPOINT."""
        s = self.state

        def count() -> None:
            s.previous_timestamp = s.timestamp
            s.timestamp = s.timestamp.to_next_epoch()
            for scheduler in self._epoch_schedulers:
                scheduler.step()
        steps: list[Callable[[], object]] = [count, functools.partial(self._run_event, Event.EPOCH_END)]
        if self.evaluators:
            steps.append(functools.partial(self._evaluate_due, after_batch, Event.EPOCH_END))
        steps += [functools.partial(saves.after_epoch, before_batch) for saves in self._every_save]
        steps.append(functools.partial(self._run_event, Event.EPOCH_CHECKPOINT))
        return steps

    def _train_batch(self, batch: Any, global_samples: int, global_tokens: SupportsInt, loud: bool) -> None:
        """One optimizer step on this rank's batch; its mean loss in ``state.loss_tensor`` (a tensor:
        no device sync), before the step. Without ``loud``, no callback or algorithm acts at the
        events of the step before BATCH_END."""
        s, strategy, run = self.state, self.strategy, self._run_event
        if loud:
            run(Event.BEFORE_TRAIN_BATCH)
        if self._check_groups:
            self._check_groups = False
            data.check_groups_share_batches(s.batch)
        prepared = strategy.prepare_batch(s.batch)
        # gradients are averaged over ranks; each sample (or token) weighs the same
        share = self._data_parallel_size / (global_samples if self._microbatches.count is None else
                                    setup.tokens_of(global_tokens))
        loss = self._microbatches.forward_backward(prepared, share, loud)
        s.batch, s.outputs = batch, None
        if loud:
            run(Event.AFTER_TRAIN_BATCH)
        self._before_weights_change()
        s.loss_tensor = loss
        strategy.optimizer_step()

    def _log_batch(self, trained: dict[str, Any] | None) -> None:
        """Rank 0's loss of this batch (a tensor: destinations read it off the training thread), and
        the training metrics (``trained``) when the model has some."""
        s = self.state
        self.logger.log_metrics({"loss/train/total": s.loss_tensor, "time/batch": s.timestamp.batch.value,
                                 "time/epoch": s.timestamp.epoch.value, **(trained or {})})

    def _count(self, batch: Any) -> tuple[int, int]:
        return self._num_samples(batch), self._num_tokens(batch)

    @staticmethod
    def _follow_schedules(state: State) -> None:
        """Set the lr that the schedules of training time give at the current timestamp."""
        for scheduler in state.schedulers:
            if isinstance(scheduler, ScheduledLR):
                scheduler.step()

    # -- evaluation ---------------------------------------------------------------------------

    def eval(self, eval_dataloader: Any = None, subset_num_batches: int = -1) -> dict[str, dict[str, float]]:
        """Evaluate every evaluator over all ranks (Composer's ``Trainer.eval``); the metrics are in
        ``state.eval_metrics`` and logged, and their values are returned as ``{label: {name: value}}``.

        ``eval_dataloader`` (a dataloader, DataSpec, Evaluator or list of Evaluators, with labels
        not in use) evaluates those instead; their metrics stay in ``state.eval_metrics``.
        ``subset_num_batches`` (-1: each evaluator's own) evaluates only the first batches of each
        rank. Samples a DistributedSampler repeats to pad the ranks' shares are left out, so the
        metrics equal those of one process over the whole dataset.
        """
        evaluators = self.evaluators
        if eval_dataloader is not None:
            evaluators, metrics = evaluation.build_evaluators(
                eval_dataloader, self.state.model, self.state.device.torch_device, self.loop.eval_interval,
                self.loop.eval_subset_num_batches)
            taken = sorted(set(metrics) & set(self.state.eval_metrics))
            if taken:
                raise ValueError(f"eval(eval_dataloader=...): the label(s) {taken} are already the Trainer's "
                                 f"evaluators; give the new ones other labels")
            self.state.eval_metrics.update(metrics)
        if not evaluators:
            raise ValueError("eval() needs eval_dataloader, given to Trainer(...) or to eval(...)")
        if subset_num_batches != -1:
            subset("subset_num_batches", subset_num_batches)
        if self._fitting:  # a callback evaluating during fit
            return self._eval_all(evaluators, subset_num_batches)
        try:
            self._run_event(Event.EVAL_STANDALONE_START)
            results = self._eval_all(evaluators, subset_num_batches)
            self._run_event(Event.EVAL_STANDALONE_END)
        finally:
            progress.stop_heartbeat()  # its batches reported progress; what follows may not
        return results

    def predict(self, dataloader: Any, subset_num_batches: int = -1, *, return_outputs: bool = True) -> list[Any]:
        """The model's outputs on this rank's batches of ``dataloader``, on CPU, one entry per
        batch (Composer's ``Trainer.predict``, with its PREDICT events); an empty list without
        ``return_outputs`` (callbacks still see each ``state.outputs``). Give the dataloader a
        sampler from ``lockstep.dist.get_sampler`` to split a dataset over the ranks; under FSDP
        every rank must run the same number of batches, since each forward gathers parameters."""
        limit = subset("subset_num_batches", subset_num_batches)
        return predict.predict(self.state, self.strategy, self._run_event, dataloader, limit, return_outputs)

    def _evaluate_due(self, before: Timestamp, event: Event) -> None:
        """The evaluators whose interval asks for an evaluation at ``event`` (BATCH_END or
        EPOCH_END), during fit (their time is not the batches')."""
        s = self.state
        self._evaluate([e for e in self.evaluators
                        if evaluation.is_due(e.eval_interval, s, before, event)])  # type: ignore[arg-type]

    def _evaluate(self, due: list[Any]) -> None:
        """Run the ``due`` evaluators during fit, between the events around them all."""
        if not due:
            return
        for evaluator in due:
            self._evaluated_at[evaluator.label] = self.state.timestamp.batch.value
        started = time.perf_counter()
        self._run_event(Event.EVAL_BEFORE_ALL)
        self._eval_all(due, -1)
        self._run_event(Event.EVAL_AFTER_ALL)
        self._clock += time.perf_counter() - started

    def _eval_all(self, evaluators: list[Any], subset_num_batches: int) -> dict[str, dict[str, float]]:
        results = {}
        for evaluator in evaluators:
            count = evaluator.subset_num_batches if subset_num_batches == -1 else subset_num_batches
            results[evaluator.label] = evaluation.evaluate(
                self.state, self.strategy, evaluator, self.state.eval_metrics[evaluator.label],
                evaluation.batch_limit(count), self._run_event, self.logger)
        return results

    # -- checkpoints --------------------------------------------------------------------------

    def _use_train_dataloader(self, spec: DataSpec) -> None:
        """Train on ``spec`` from now on (``fit(train_dataloader=...)``, which checked it)."""
        loader = spec.dataloader
        s = self.state
        self._train_spec = self._microbatches.spec = spec
        self.train_dataloader = data.shielded(loader)
        data.split_over_data_parallel(loader, "train_dataloader")
        s.batches_per_epoch = setup.epoch_length(loader, self.loop.train_subset_num_batches)
        if self.loop.fixed_microbatch_size is None:  # Composer reports the whole batch
            s.device_train_microbatch_size = getattr(loader, "batch_size", None)
        self._follow_loader(spec)

    def _preempt(self) -> None:
        s = self.state
        assert self.saver is not None
        for saves in self._every_save:
            saves.finish()
        self._end_fit()
        message = (f"lockstep: stopped by SIGTERM after batch {s.timestamp.batch.value}; the checkpoint is in "
                   f"{self.saver.where.local}")
        if dist.get_global_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        raise Preempted(message)

    def save_checkpoint(self, name: str = "ep{epoch}-ba{batch}-rank{rank}", *,
                        weights_only: bool = False) -> str | None:
        """Composer's: write a checkpoint of the training state now at ``name`` (a template, a path
        or an ``s3://`` URI; a folder under FSDP sharded and DeepSpeed), on every rank. Returns the
        path on the ranks that wrote a part of it (as in Composer: rank 0 for one file, every rank
        for a folder), else None."""
        return checkpointing.save_named(name, self.state, self.layout, self._position, weights_only=weights_only)

    def save_checkpoint_to_save_folder(self) -> None:
        """Composer's: write a checkpoint of the training state now into ``save_folder``, named
        and kept as the run's saves are, and point ``latest`` at it (on every rank)."""
        checkpointing.save_to_folder(self._saves, self.saver, fitting=self._fitting)

    def export_for_inference(self, save_format: str, save_path: str, save_object_store: Any = None,
                             sample_input: Any = None, transforms: Any = None, input_names: list[str] | None = None,
                             output_names: list[str] | None = None) -> None:
        """Composer's: write the model for inference as TorchScript or ONNX (on rank 0; see
        :func:`lockstep.utils.inference.export_for_inference`). Without ``sample_input``, the last
        training batch is the sample to trace with."""
        from lockstep.utils.inference import export_with_logger

        if dist.get_global_rank() != 0:
            return
        if sample_input is None and self.state.batch is not None:
            sample_input = (self.state.batch,)
        export_with_logger(self.state.model, save_format, save_path, self.logger, save_object_store, sample_input,
                           transforms=transforms, input_names=input_names, output_names=output_names)

    def close(self) -> None:
        """Finish: every callback and logger writes what it holds and releases what it opened (logger
        runs are ended). Safe to call more than once; ``fit`` cannot run after it."""
        if not self._closed:
            self._closed = True
            self._events.close()
            for saver in self._savers:
                saver.close()


def _nothing() -> None:
    pass


def _close_at_exit(trainer: weakref.ref[Trainer]) -> None:
    """What ``close`` does for the callbacks and loggers (the saver's uploads are not waited for:
    the process may be ending on an error)."""
    alive = trainer()
    if alive is not None and not alive._closed:
        alive._closed = True
        alive._events.close()


def _each(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        hook()
