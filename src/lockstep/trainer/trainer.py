"""The Trainer: the same training loop on every rank, with DDP, exact microbatching and checkpoints."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from lockstep import dist
from lockstep.callbacks import Callback, Event
from lockstep.checkpoint import rng
from lockstep.checkpoint.saver import SaveInterval
from lockstep.checkpoint.states import layout_for
from lockstep.model import Model
from lockstep.parallel import deepspeed as ds
from lockstep.parallel.ddp import (
    DDPSyncStrategy, forced_sync_gradients, prepare_ddp, resolve_sync_strategy, sync_context)
from lockstep.parallel.fsdp import gradient_sync, prepare_fsdp
from lockstep.parallel.fsdp_config import parse_config
from lockstep.time import Time, check_max_duration, is_interval_due, is_reached
from lockstep.trainer import checkpointing, data, setup
from lockstep.trainer.microbatch import take_first
from lockstep.trainer.precision import autocast, check_precision, make_grad_scaler
from lockstep.trainer.preemption import Preempted, StopSignal
from lockstep.trainer.state import State


class Trainer:
    """Train a :class:`~lockstep.Model` data-parallel over every rank of the run.

    The dataloader yields each rank's batch; ``device_train_microbatch_size`` (or ``grad_accum``,
    a count) splits it into microbatches whose gradients accumulate before one optimizer step.
    Each microbatch's mean loss is weighted by its share of the global batch, so the parameters
    after a step do not depend on how the global batch was spread over ranks and microbatches.
    See :mod:`lockstep.callbacks` for the loop as pseudocode.

    Checkpoints: with ``save_folder``, rank 0 writes ``save_filename`` every ``save_interval`` and
    at the end, each holding the model, optimizers, schedulers, timestamp and every rank's RNG and
    data position, so a resumed run continues bit for bit. ``load_path`` loads one at construction;
    ``autoresume`` (with ``run_name``) continues from the newest checkpoint of the run. While
    saving is on, SIGTERM makes every rank stop at the same step, save, and exit with 143.

    ``fsdp_config`` shards the model with FSDP instead of DDP (see :mod:`lockstep.parallel.fsdp`);
    the optimizers given are pointed at the sharded parameters. ``deepspeed_config`` trains with a
    DeepSpeed engine (ZeRO stages 0-3) around the model and its one optimizer instead (see
    :mod:`lockstep.parallel.deepspeed`); batch sizes and precision in it are filled in from the Trainer.
    """

    def __init__(
        self,
        *,
        model: Model,
        train_dataloader: Any = None,
        max_duration: Time | str | int | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        eval_dataloader: Any = None,
        eval_interval: Time | str = "1ep",
        device: str | torch.device | None = None,
        precision: str = "fp32",
        device_train_microbatch_size: int | None = None,
        grad_accum: int | None = None,
        ddp_sync_strategy: str | None = None,
        find_unused_parameters: bool = False,
        schedulers: Any = None,
        callbacks: Sequence[Callback] = (),
        run_name: str | None = None,
        run_folder: str | None = None,
        progress_bar: bool = True,
        seed: int | None = None,
        save_folder: str | None = None,
        save_filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
        save_latest_filename: str | None = "latest-rank{rank}.pt",
        save_interval: SaveInterval = "1ep",
        save_num_checkpoints_to_keep: int = -1,
        save_overwrite: bool = False,
        load_path: str | None = None,
        load_weights_only: bool = False,
        load_strict_model_weights: bool = True,
        autoresume: bool = False,
        fsdp_config: dict | None = None,
        deepspeed_config: dict | None = None,
    ) -> None:
        if fsdp_config is not None and deepspeed_config is not None:
            raise ValueError("fsdp_config and deepspeed_config were both given: pick one way to shard the model")
        self.fsdp_config = None if fsdp_config is None else parse_config(fsdp_config)
        setup.check_model(model)
        self.device = setup.resolve_device(device)
        self.precision = check_precision(precision)
        self.microbatch_size = setup.check_positive_int("device_train_microbatch_size", device_train_microbatch_size)
        self.grad_accum = setup.check_positive_int("grad_accum", grad_accum)
        if self.microbatch_size is not None and self.grad_accum is not None:
            raise ValueError("give device_train_microbatch_size or grad_accum, not both")
        self.sync_strategy = resolve_sync_strategy(ddp_sync_strategy, find_unused_parameters)
        self.max_duration = None if max_duration is None else check_max_duration(max_duration)
        self.eval_interval = Time.from_input(eval_interval).require_positive("eval_interval")
        optimizer_list = setup.as_list(optimizers)
        setup.check_optimizers(model, optimizer_list)
        for name, loader in (("train_dataloader", train_dataloader), ("eval_dataloader", eval_dataloader)):
            if loader is not None:
                data.check_distributed_sampler(loader, name)
        self.deepspeed_config = None if deepspeed_config is None else ds.fill_config(
            deepspeed_config, batch_size=ds.batch_size_of(train_dataloader), microbatch_size=self.microbatch_size,
            grad_accum=self.grad_accum, world_size=dist.get_world_size(), precision=self.precision,
            optimizers=len(optimizer_list))
        if self.deepspeed_config is not None:
            ds.import_deepspeed(self.device)  # not installed: say how, before any process group exists

        sharding = self.fsdp_config is not None or self.deepspeed_config is not None
        dist.initialize_dist(self.device, single_process_group=sharding)
        if seed is not None:
            setup.seed_everything(seed + dist.get_global_rank())
        model.to(self.device)
        self.fsdp = None if self.fsdp_config is None else prepare_fsdp(
            model, self.fsdp_config, self.precision, self.device, optimizer_list)
        self.deepspeed = None if self.deepspeed_config is None else ds.prepare_deepspeed(
            model, optimizer_list, self.deepspeed_config, self.device)
        self._engine = self.deepspeed.engine if self.deepspeed else None
        # Under FSDP and ZeRO-3 each forward gathers parameters: every rank must run every one.
        self._gathering_forward = bool(self.fsdp) or bool(self.deepspeed and self.deepspeed.stage == 3)
        self.train_dataloader = train_dataloader
        self.eval_dataloader = eval_dataloader
        self.scaler = None if self.deepspeed else make_grad_scaler(self.precision, self.device)
        self.eval_metrics = {k: m.to(self.device) for k, m in model.get_metrics(is_train=False).items()}
        self._step_sync = dist.get_world_size() > 1 and not (
            data.equal_batches_guaranteed(train_dataloader) and not setup.counts_tokens(model))
        run_folder = setup.resolve_run_folder(run_folder)
        self.state = State(
            model=model,
            wrapped_model=self._wrap(model, find_unused_parameters),
            optimizers=optimizer_list,
            schedulers=setup.as_list(schedulers),
            max_duration=self.max_duration,
            run_name=setup.resolve_run_name(run_name),
            device=self.device,
            precision=self.precision,
            batches_per_epoch=setup.safe_len(train_dataloader),
        )
        self.layout = layout_for(model, optimizer_list, self.fsdp_config and self.fsdp_config.state_dict_type,
                                 self.deepspeed, buffer_dtypes=self.fsdp.buffer_dtypes if self.fsdp else None)
        self.saver = checkpointing.make_saver(
            save_folder=save_folder, save_filename=save_filename, save_latest_filename=save_latest_filename,
            save_interval=save_interval, save_num_checkpoints_to_keep=save_num_checkpoints_to_keep,
            save_overwrite=save_overwrite, run_name=self.state.run_name, max_duration=self.max_duration,
            layout=self.layout, device=self.state.device)
        loaded = checkpointing.load_at_start(
            self.state, self.scaler, self.saver, self.layout, load_path=load_path, autoresume=autoresume,
            run_name_given=run_name is not None, weights_only=load_weights_only,
            strict=load_strict_model_weights)
        self._resume_entry = None if loaded is None or loaded.weights_only else loaded.rank_entry or {}
        if self._resume_entry is not None and dist.get_global_rank() == 0:
            caveat = data.resume_caveat(train_dataloader, self.state.timestamp.epoch)
            if caveat:
                warnings.warn(caveat, stacklevel=2)
        self._position = data.DataPosition()
        self.callbacks = setup.default_callbacks(run_folder, progress_bar) + list(callbacks)
        self._run_event(Event.INIT)

    def _wrap(self, model: Model, find_unused_parameters: bool) -> torch.nn.Module:
        """What the step calls: the DeepSpeed engine, the FSDP-sharded model itself, or DDP."""
        if self._engine is not None:
            return self._engine
        return model if self.fsdp else prepare_ddp(model, find_unused_parameters, self.device)

    # -- the loop -----------------------------------------------------------------------------

    def fit(self) -> None:
        """Train until ``max_duration``, evaluating every ``eval_interval`` and saving every
        ``save_interval``. Raises :class:`~lockstep.trainer.preemption.Preempted` (exit code
        143) after saving, when SIGTERM arrived."""
        s = self.state
        if self.train_dataloader is None or s.max_duration is None or not s.optimizers:
            raise ValueError("fit() needs train_dataloader, max_duration and optimizers passed to Trainer(...)")
        s.model.train()
        resume = self._take_resume()
        self._run_event(Event.FIT_START)
        with StopSignal() if self.saver else contextlib.nullcontext() as stop:
            while not is_reached(s.timestamp, s.max_duration):
                data.set_epoch(self.train_dataloader, s.timestamp.epoch)
                self._run_event(Event.EPOCH_START)
                batches = data.epoch_batches(
                    self.train_dataloader, self._count, self._step_sync, self.device,
                    track=self._position if self.saver else None, resume=resume)
                trained, resume = resume is not None, None
                for batch, samples, tokens, is_last in batches:
                    trained = True
                    self._run_event(Event.BATCH_START)
                    s.loss_tensor = self._train_batch(batch, samples)
                    before = s.timestamp
                    s.timestamp = before.to_next_batch(samples, tokens)
                    if is_last:  # {epoch} counts completed epochs, also at the epoch's last BATCH_END
                        s.timestamp = s.timestamp.to_next_epoch()
                    self._run_event(Event.BATCH_END)
                    if is_last:
                        self._run_event(Event.EPOCH_END)
                    if self.eval_dataloader is not None and is_interval_due(
                            before, s.timestamp, self.eval_interval, s.max_duration):
                        self.eval()
                    if self.saver and (self.saver.due(before, s.timestamp, Event.BATCH_END, s) or (
                            is_last and self.saver.due(before, s.timestamp, Event.EPOCH_END, s))):
                        self._save(is_last)
                    if stop and stop.agreed():
                        self._preempt(is_last)
                    if is_reached(s.timestamp, s.max_duration):
                        break
                batches.close()  # puts back a sampler the resume skipped through
                if not trained:
                    raise ValueError("train_dataloader yielded no batches: check the dataset and batch_size")
            if self.saver:
                if self.saver.last_saved_batch != s.timestamp.batch:
                    self._save(s.timestamp.batch_in_epoch == 0, wait=True)
                self.saver.wait()
        self._run_event(Event.FIT_END)

    def _train_batch(self, batch: Any, global_samples: int) -> torch.Tensor:
        s = self.state
        batch = setup.to_device(batch, self.device)
        if self.deepspeed:
            batch = ds.cast_batch(batch, self.deepspeed.dtype)
        microbatches = self._split(batch)
        world_size = dist.get_world_size()
        local_samples = 0
        loss_sum = torch.zeros((), device=self.device)
        for i, micro in enumerate(microbatches):
            n = s.model.num_samples(micro)
            with self._gradient_sync(i == len(microbatches) - 1):
                with autocast(self.precision, self.device):
                    outputs = s.wrapped_model(micro)
                    loss = s.model.loss(outputs, micro)
                # DDP averages over ranks, so scale by world_size * this microbatch's share.
                scaled = loss * (n * world_size / global_samples)
                if self._engine is not None:  # it scales an fp16 loss itself; the share is ours
                    self._engine.backward(scaled, scale_wrt_gas=False)
                else:
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach().float() * n
            local_samples += n
        if self._engine is not None:
            self._engine.step()  # the optimizer step and zero_grad
            for scheduler in s.schedulers:
                scheduler.step()
            return loss_sum / max(local_samples, 1)
        if self.sync_strategy is DDPSyncStrategy.FORCED_SYNC and world_size > 1 and not self.fsdp:
            forced_sync_gradients(s.model.parameters())
        for optimizer in s.optimizers:
            if self.scaler:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler:
            self.scaler.update()
        for scheduler in s.schedulers:
            scheduler.step()
        for optimizer in s.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return loss_sum / max(local_samples, 1)

    def _gradient_sync(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[None]:
        if self.fsdp:
            return gradient_sync(self.state.model, is_last_microbatch)
        if self._engine is not None:
            return ds.accumulation_boundary(self._engine, is_last_microbatch)
        return sync_context(self.state.wrapped_model, self.sync_strategy, is_last_microbatch)

    def _split(self, batch: Any) -> list[Any]:
        model = self.state.model
        if self.microbatch_size is not None:
            return model.split_batch(batch, self.microbatch_size)
        if self.grad_accum is not None:
            return model.split_batch(batch, math.ceil(model.num_samples(batch) / self.grad_accum))
        return [batch]

    def _count(self, batch: Any) -> tuple[int, int]:
        model = self.state.model
        return model.num_samples(batch), model.num_tokens(batch)

    # -- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def eval(self) -> dict[str, float]:
        """Evaluate on ``eval_dataloader`` over all ranks; returns and stores ``state.eval_metrics``.

        Samples a DistributedSampler repeats to pad the ranks' shares are left out, so the metrics
        equal those of one process over the whole dataset.
        """
        s = self.state
        if self.eval_dataloader is None:
            raise ValueError("eval() needs eval_dataloader passed to Trainer(...)")
        was_training = s.model.training
        s.model.eval()
        self._run_event(Event.EVAL_START)
        for metric in self.eval_metrics.values():
            metric.reset()
        remaining = data.real_eval_samples(self.eval_dataloader)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        for batch in self.eval_dataloader:
            batch = setup.to_device(batch, self.device)
            if self.deepspeed:
                batch = ds.cast_batch(batch, self.deepspeed.dtype)
            n = s.model.num_samples(batch)
            if remaining is not None:
                if remaining <= 0:
                    if self._gathering_forward:  # every rank must take part in each gather
                        s.model(batch)
                    continue
                if n > remaining:
                    batch, n = take_first(batch, remaining), remaining
                remaining -= n
            with autocast(self.precision, self.device):
                outputs = s.model(batch)  # the bare module: no DDP hooks, nothing to hang on
                totals[0] += s.model.loss(outputs, batch).double() * n
                totals[1] += n
                eval_outputs = s.model.eval_forward(batch, outputs)
            for metric in self.eval_metrics.values():
                s.model.update_metric(batch, eval_outputs, metric)
        dist.all_reduce(totals, "SUM")
        results = {"loss": float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")}
        results.update({name: float(m.compute()) for name, m in self.eval_metrics.items()})
        s.eval_metrics = results
        self._run_event(Event.EVAL_END)
        s.model.train(was_training)
        return results

    # -- checkpoints --------------------------------------------------------------------------

    def _take_resume(self) -> data.DataPosition | None:
        """Apply a loaded checkpoint's RNG state, or return the data position to resume mid-epoch."""
        entry, self._resume_entry = self._resume_entry, None
        if entry is None:
            return None
        # An empty entry: a sharded checkpoint of another world size, whose RNG streams do not map
        # onto these ranks. The data position still does when the global batch is the same.
        skip = self.state.timestamp.batch_in_epoch
        if skip == 0:
            if entry:
                rng.restore(entry["rng"])
            return None
        return data.DataPosition(epoch_rng=entry.get("epoch_rng"), fetch_rng=entry.get("fetch_rng"), skip=skip,
                                 rng_after=entry.get("rng"), loader_state=entry.get("loader_state"))

    def _save(self, at_epoch_end: bool, wait: bool = False) -> None:
        position = self._position
        entry = {"rng": rng.capture(),
                 "epoch_rng": None if at_epoch_end else position.epoch_rng,
                 "fetch_rng": None if at_epoch_end else position.fetch_rng,
                 "loader_state": None if at_epoch_end else position.loader_state}
        self.saver.save(self.state, self.scaler, entry, self.layout, wait=wait)  # type: ignore[union-attr]

    def _preempt(self, at_epoch_end: bool) -> None:
        s = self.state
        if self.saver.last_saved_batch != s.timestamp.batch:  # type: ignore[union-attr]
            self._save(at_epoch_end, wait=True)
        self.saver.wait()  # type: ignore[union-attr]
        self._run_event(Event.FIT_END)
        message = (f"lockstep: stopped by SIGTERM after batch {s.timestamp.batch}; the checkpoint is in "
                   f"{self.saver.folder}")  # type: ignore[union-attr]
        if dist.get_global_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        raise Preempted(message)

    def _run_event(self, event: Event) -> None:
        for callback in self.callbacks:
            callback.run_event(event, self.state)
