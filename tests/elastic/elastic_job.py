"""The job of the elastic tests, run under the launcher: DDP over 44 indexed samples, 3 per rank,
2 epochs (8 global batches of a 4-rank world).

``python elastic_job.py OUT [R:B ...] [--sleep S] [--hold B] [--hold-in-step B] [--hold-full B]
[--join-after B] [--save FOLDER] [--fsdp [TYPE]]``: the rank launched as R SIGKILLs itself after
batch B (with --save, once the checkpoint saved last is published), or raises an error there given
``R:B:raise``; every rank sleeps S seconds after each batch. With ``--hold B``, ranks fewer than
the full world wait after batch B until the ranks change (a node joins), or with ``--hold-in-step
B`` in batch B's optimizer step, after its update; with ``--hold-full B``, the full world waits so
after batch B (a test kills a node at that step, however loaded the machine). ``--fail-to-join``
makes a rank that joins a running job exit 3 as it starts, and ``--join-after B`` wait until
launch rank 0 ended batch B; with ``--change-in-end-pending`` the ranks wait for a second change
as they agree on the end of the batch the first interrupted. With ``--save``, it saves every 2
batches to FOLDER and autoresumes from it (a run under --max_restarts); ``--fsdp [TYPE]`` trains under FSDP instead, saving
checkpoints of that ``state_dict_type`` (full); ``--zero STAGE`` trains with DeepSpeed at that
ZeRO stage; ``--train-accuracy`` gives the model a training metric (torchmetrics, ~3 s of CPU to
import, so only the tests that change the ranks under it ask). Each rank writes its pid to
OUT/pid<launch rank>; appends for each batch it reads a JSON line ``[generation, batch, samples]``
to OUT/samples<launch rank>, for each batch it ends ``batch wall-time`` to OUT/ends<launch rank>,
and for each change of the ranks it is told of a JSON line to OUT/changes<launch rank>; the last
rank 0 saves the parameters of ``trainer.state.model`` (under FSDP a change of the ranks makes a
new model) to OUT/params.pt."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lockstep import Callback, Trainer, dist, elastic  # noqa: E402
from tests.elastic.indexed import PER_RANK_BATCH, Indexed  # noqa: E402
from tests.trainer.common import MLP, dataset, full_params  # noqa: E402

EVAL_SAMPLES = 37
"""Not a multiple of 4 or 3 ranks: the samplers pad each split differently."""


class Record(Callback):
    def __init__(self, out: Path, kills: dict[int, tuple[int, bool]], sleep: float, hold: int | None = None,
                 save: str | None = None, hold_full: int | None = None) -> None:
        self.rank = int(os.environ["RANK"])
        self.kill_after, self.raises = kills.get(self.rank, (None, False))
        self.out, self.sleep, self.hold = out, sleep, hold
        self.save, self.hold_full = save, hold_full
        (out / f"pid{self.rank}").write_text(str(os.getpid()))

    def after_dataloader(self, state, logger) -> None:
        membership = elastic.current()
        line = [membership.generation if membership else 0, int(state.timestamp.batch), state.batch[2].tolist()]
        with open(self.out / f"samples{self.rank}", "a") as f:
            f.write(json.dumps(line) + "\n")

    def ranks_changed(self, state, logger, change) -> None:
        with open(self.out / f"changes{self.rank}", "a") as f:
            f.write(json.dumps({**change.record(), "now": int(state.timestamp.batch)}) + "\n")

    def batch_end(self, state, logger) -> None:
        with open(self.out / f"ends{self.rank}", "a") as f:
            f.write(f"{int(state.timestamp.batch)} {time.time()}\n")
        # once: not again in a restart, nor in the rank started again in place (--rank_restarts),
        # which may train the batch again where the others went back to a checkpoint
        if int(state.timestamp.batch) == self.kill_after and int(os.environ["LOCKSTEP_RESTART_COUNT"]) == 0 \
                and not os.environ.get("LOCKSTEP_ELASTIC_RESPAWN"):
            self._await_saved(self.kill_after - self.kill_after % 2)
            if self.raises:
                raise ValueError(f"launch rank {self.rank} fails after batch {self.kill_after} (the test's error)")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.sleep)
        membership = elastic.current()
        if membership is None:
            return
        full = len(membership.ranks) == int(os.environ["LOCKSTEP_FULL_WORLD_SIZE"])
        # Until the ranks change: the full world until the test has killed a node and the others
        # know; fewer ranks until a node joins (long enough for two launchers to start one after
        # the other on a loaded machine: the first may fail to join).
        if int(state.timestamp.batch) == (self.hold_full if full else self.hold):
            await_change(150)

    def _await_saved(self, batch: int) -> None:
        """With --save, until the checkpoint of ``batch`` (saved every 2 batches) is published: a
        kill during its background write would leave none to go on from on a loaded machine."""
        latest = Path(self.save or "") / "latest-rank0.pt"
        deadline = time.monotonic() + 60
        while self.save and batch and f"-ba{batch}-" not in (os.readlink(latest) if latest.is_symlink() else "") \
                and time.monotonic() < deadline:
            time.sleep(0.01)


class HoldInStep(Callback):
    """``--hold-in-step B``: fewer ranks than the full world, in the optimizer step of batch B,
    wait until the ranks change once this rank's optimizer updated its state and before the step
    ends (under ZeRO: before the gather of the updated weights of every rank); each says so in
    OUT/in-step<launch rank>, and a rank that joins the running job waits for rank 0's."""

    def __init__(self, batch: int, optimizer: torch.optim.Optimizer, out: Path) -> None:
        self.batch, self.armed, self.out = batch, False, out
        optimizer.register_step_post_hook(self._updated)

    def after_train_batch(self, state, logger) -> None:  # the step comes next
        membership = elastic.current()
        self.armed = int(state.timestamp.batch) + 1 == self.batch and membership is not None \
            and len(membership.ranks) < int(os.environ["LOCKSTEP_FULL_WORLD_SIZE"])

    def _updated(self, *_) -> None:
        if self.armed:
            self.armed = False
            (self.out / f"in-step{os.environ['RANK']}").touch()
            await_change(150)


class RecordEvals(Callback):
    """At the end of each evaluation, the rank that is rank 0 now writes the batch, the world size
    and the metrics to OUT/evals, and the parameters evaluated to OUT/eval<batch>.params; with
    ``die_in`` (launch rank, batch), that rank is killed in the evaluation at that batch."""

    def __init__(self, out: Path, die_in: tuple[int, int] | None) -> None:
        self.out, self.die_in = out, die_in
        self.launch_rank = int(os.environ["RANK"])  # RANK follows the rank's place in the job

    def eval_batch_end(self, state, logger) -> None:
        if (self.launch_rank, int(state.timestamp.batch)) == self.die_in and \
                int(os.environ["LOCKSTEP_RESTART_COUNT"]) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def eval_end(self, state, logger) -> None:
        params = full_params(state.model)  # under FSDP a collective
        if dist.get_global_rank() != 0:
            return
        batch = int(state.timestamp.batch)
        values = {name: float(metric.compute()) for name, metric in state.eval_metrics["eval"].items()}
        torch.save(params, self.out / f"eval{batch}.params")
        with open(self.out / "evals", "a") as f:
            f.write(json.dumps({"batch": batch, "world": dist.get_world_size(), **values}) + "\n")


def die_in_reform() -> None:
    """SIGKILL this rank as it starts to form the process group of the ranks left after a loss."""
    from lockstep.elastic.membership import Membership

    def doomed(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    Membership.reform = doomed


def die_in_save(batch: int, where: str) -> None:
    """SIGKILL this rank as the checkpoint of ``batch`` begins (``agree``: its agreement), as it
    gathers FSDP's full state for it (``gather``) or as its writer thread writes DeepSpeed's or
    DCP's files (``write``); the others wait for it there, in collectives of the group it leaves."""
    from lockstep.checkpoint.deepspeed import DeepSpeedLayout
    from lockstep.checkpoint.fsdp_states import FullLayout, ShardedLayout
    from lockstep.checkpoint.writer import CheckpointWriter

    agree, gather, write = CheckpointWriter._agree, FullLayout.gather, DeepSpeedLayout.write_parts
    write_dcp = ShardedLayout.write_parts
    saving = [0]

    def doomed_agree(self, path, name, rank_entry):
        saving[0] = int(name.split("-ba", 1)[1].split("-")[0])
        if where == "agree" and saving[0] == batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return agree(self, path, name, rank_entry)

    def doomed_gather(self):
        if where == "gather" and saving[0] == batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(self)

    def doomed_write(self, temp, captured, group):
        if where == "write" and saving[0] == batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return (write_dcp if isinstance(self, ShardedLayout) else write)(self, temp, captured, group)

    CheckpointWriter._agree, FullLayout.gather = doomed_agree, doomed_gather
    DeepSpeedLayout.write_parts = ShardedLayout.write_parts = doomed_write


def change_in_end_pending() -> None:
    """The first time the ranks that trained agree on the end of the batch a change interrupted,
    each waits until the ranks change again (a rank started again joins) before it agrees."""
    from lockstep.trainer import rejoin

    agree, waited = rejoin.end_pending, []

    def held(tail, joined, batch):
        if not waited and not joined:
            waited.append(True)
            await_change(60)
        return agree(tail, joined, batch)
    rejoin.end_pending = held


def give_up_in_rejoin(gives_up: bool) -> None:
    """The race of a polled collective that some ranks complete while another gives it up, having
    seen a change first, made certain: once the ranks left after a loss have agreed where their
    state comes from (under FSDP or ZeRO), this rank is killed (``gives_up`` False), or waits until
    the ranks change (that death) and then leaves the agreement it completed, as a rank whose wait
    saw the change before the collective's end (``gives_up``)."""
    from lockstep.elastic.membership import MembershipChanged
    from lockstep.trainer import rejoin

    agree, done = rejoin.peers_hold_the_state, []

    def racing(*args, **kwargs):
        held = agree(*args, **kwargs)
        if done:
            return held
        done.append(True)
        if not gives_up:
            os.kill(os.getpid(), signal.SIGKILL)
        await_change(60)
        raise MembershipChanged("the job's ranks changed (the test's rank gave the agreement up)")
    rejoin.peers_hold_the_state = racing


def await_change(seconds: float) -> None:
    """Until the job's ranks change (at most ``seconds``)."""
    membership, deadline = elastic.current(), time.monotonic() + seconds
    while not membership.changed() and time.monotonic() < deadline:
        time.sleep(0.02)


def await_said(path: Path, said: Callable[[str], bool] = lambda text: True) -> None:
    """Until the file at ``path`` exists and ``said`` of its text holds."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists() and said(path.read_text()):
            return
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("kills", nargs="*")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--save", default=None)
    parser.add_argument("--fsdp", nargs="?", const="full", default=None, help="FSDP, with this state_dict_type")
    parser.add_argument("--zero", type=int, default=None, help="DeepSpeed at this ZeRO stage")
    parser.add_argument("--hold", type=int, default=None,
                        help="after this batch, fewer ranks than the full world wait until the ranks change")
    parser.add_argument("--hold-full", type=int, default=None,
                        help="after this batch, the full world waits until the ranks change")
    parser.add_argument("--hold-in-step", type=int, default=None,
                        help="in this batch's optimizer step, fewer ranks than the full world wait for a change")
    parser.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader for training")
    parser.add_argument("--eval", action="store_true", help="evaluate on EVAL_SAMPLES samples every 2 batches")
    parser.add_argument("--train-accuracy", action="store_true",
                        help="training metrics too, which each change of the ranks must gather anew")
    parser.add_argument("--die-in-eval", default=None,
                        help="R:B: launch rank R is killed after its first batch of the evaluation at batch B")
    parser.add_argument("--join-after", type=int, default=None,
                        help="a rank that joins a running job waits until launch rank 0 ended this batch")
    parser.add_argument("--change-in-end-pending", action="store_true",
                        help="the ranks wait for a second change as they agree on the end of the interrupted batch")
    parser.add_argument("--give-up-in-rejoin", default=None,
                        help="G:K: after a loss, launch rank G gives the ranks' agreement on where their state "
                             "comes from up once launch rank K is killed after completing it")
    parser.add_argument("--fail-to-join", action="store_true", help="a rank that joins a running job exits 3")
    parser.add_argument("--die-in-reform", type=int, default=None,
                        help="this launch rank is killed as it starts to form the first new process group")
    parser.add_argument("--die-in-save", default=None,
                        help="R:B:agree|gather|write: launch rank R is killed in that part of the batch-B save")
    args = parser.parse_args()
    if args.fail_to_join and os.environ.get("LOCKSTEP_ELASTIC_JOIN"):
        sys.exit(3)
    if args.join_after is not None and os.environ.get("LOCKSTEP_ELASTIC_JOIN"):
        batch = str(args.join_after)
        await_said(args.out / "ends0", lambda text: batch in (line.split()[0] for line in text.splitlines()))
    if args.hold_in_step is not None and os.environ.get("LOCKSTEP_ELASTIC_JOIN"):
        await_said(args.out / "in-step0")  # once launch rank 0 waits in that step
    if args.change_in_end_pending:
        change_in_end_pending()
    if args.give_up_in_rejoin is not None:
        gives_up, killed = (int(r) for r in args.give_up_in_rejoin.split(":"))
        if int(os.environ["RANK"]) in (gives_up, killed):
            give_up_in_rejoin(int(os.environ["RANK"]) == gives_up)
    if args.die_in_reform == int(os.environ["RANK"]):
        die_in_reform()
    if args.die_in_save is not None and int(args.die_in_save.split(":")[0]) == int(os.environ["RANK"]):
        _, batch, where = args.die_in_save.split(":")
        die_in_save(int(batch), where)
    kills = {int(rank): (int(batch), how == ["raise"]) for rank, batch, *how in (k.split(":") for k in args.kills)}
    model, data = MLP(train_accuracy=args.train_accuracy), Indexed()
    options = {"save_folder": args.save, "save_interval": "2ba", "autoresume": True, "run_name": "elastic"} \
        if args.save else {}
    callbacks = [Record(args.out, kills, args.sleep, args.hold, args.save, args.hold_full)]
    if args.eval:
        held_out = dataset(EVAL_SAMPLES)
        options.update(eval_interval="2ba", eval_dataloader=DataLoader(held_out, batch_size=4,
                                                                      sampler=dist.get_sampler(held_out)))
        die_in = tuple(int(x) for x in args.die_in_eval.split(":")) if args.die_in_eval else None
        callbacks.append(RecordEvals(args.out, die_in))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if args.hold_in_step is not None:
        callbacks.append(HoldInStep(args.hold_in_step, optimizer, args.out))
    trainer = Trainer(model=model, optimizers=optimizer, max_duration="2ep",
                      train_dataloader=(StatefulDataLoader if args.stateful else DataLoader)(
                          data, batch_size=PER_RANK_BATCH, sampler=dist.get_sampler(data, shuffle=True)),
                      seed=7, progress_bar=False, callbacks=callbacks,
                      fsdp_config={"state_dict_type": args.fsdp} if args.fsdp else None,
                      deepspeed_config=None if args.zero is None else {"zero_optimization": {"stage": args.zero}},
                      **options)
    trainer.fit()
    assert not args.stateful or isinstance(trainer.train_dataloader, StatefulDataLoader)  # split or not
    params = full_params(trainer.state.model)  # under FSDP a collective, and a new model after a change
    if dist.get_global_rank() == 0:
        torch.save(params, args.out / "params.pt")


if __name__ == "__main__":
    main()
