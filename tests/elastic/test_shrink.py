"""A lost rank costs one step, not a restart (issue 51, one node): under ``--min_ranks`` the
ranks left go on from the step in flight, without a checkpoint, training the same global batches
as the uninterrupted 4-rank run and ending within 1e-5 of its parameters. Under FSDP, whose lost
shards are nowhere else, they go on from the last checkpoint, resharded over themselves."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.elastic.jobs import JOB, REPO, assert_as_uninterrupted, finish, global_batches, launch
from tests.elastic.elastic_job import EVAL_SAMPLES
from tests.trainer.common import MLP, assert_same_params, dataset

pytestmark = pytest.mark.timeout(150)


def test_rank_0_killed_and_then_another_failing_between_steps_leave_two_ranks_that_finish_as_four_would(
        tmp_path: Path, reference) -> None:
    out = tmp_path / "out"
    err = finish(launch(out, "0:2", "3:5:raise", "--train-accuracy"))  # rank 3 raises an error after batch 5
    assert "rank 0 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert "rank 3 left (exit code 1): 2 of 4 ranks go on at world size 2 (generation 2" in err, err
    # why it left, from its output, under the rank it had at launch (torch's hook, kept over the re-form)
    assert "lines of rank 3's output" in err and "\n  | [rank3]: Traceback (most recent call last):" in err, err
    assert "[rank3]: ValueError: launch rank 3 fails after batch 5 (the test's error)" in err, err
    assert "[rank2]: [rank3]" not in err, err
    assert_as_uninterrupted(out, reference)
    # each change told to every rank left (callbacks), on the console and in the run folder's metrics
    expected = [(1, 3, 4, [0], 2), (2, 2, 3, [3], 5)]  # generation, world, was, left, at batch
    for rank in (1, 2):
        told = [json.loads(line) for line in (out / f"changes{rank}").read_text().splitlines()]
        assert [(c["generation"], c["world_size"], c["previous_world_size"], c["left"], c["batch"]) for c in told] \
            == expected, told
        assert all(c["kind"] == "ranks" and c["joined"] == [] and c["now"] == c["batch"] and c["seconds"] < 30
                   for c in told), told
    assert not (out / "changes0").exists() and (out / "changes3").read_text().count("\n") == 1
    said = (out / "run" / "rank1.stderr.log").read_text()  # rank 1 leads the node once rank 0 is gone
    assert "rank 0 (at launch) left: the job goes on at world size 3 (was 4; generation 1) from batch 2" in said, said
    assert "rank 3 (at launch) left: the job goes on at world size 2 (was 3; generation 2) from batch 5" in said, said
    logged = (out / "run" / "trainer-rank2.log").read_text()  # each rank's own log, under its launch rank
    assert "rank 3 (at launch) left: the job goes on at world size 2 (was 3; generation 2) from batch 5" in logged
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if r["kind"] == "ranks"]
    assert [(c["generation"], c["left"], c["batch"]) for c in changes] == [(1, [0], 2), (2, [3], 5)], changes
    # every batch once: rank 0 writes each record at once in an elastic job, and the new rank 0
    # (launched as 1) writes the file from the change on
    assert [r["batch"] for r in records if r["kind"] == "train"] == list(range(1, 9)), records


@pytest.mark.parametrize("kill,fsdp", [(["2:3"], False), (["--die-in-eval", "2:4"], False),
                                       (["--die-in-eval", "2:4"], True)],
                         ids=["after-batch-3", "in-the-batch-4-evaluation", "fsdp-in-the-batch-4-evaluation"])
def test_after_a_lost_rank_each_evaluation_counts_every_held_out_sample_once(
        tmp_path: Path, reference, kill: list[str], fsdp: bool) -> None:
    # 37 held-out samples, evaluated every 2 batches; rank 2 is lost after batch 3, or after its
    # first batch of the batch-4 evaluation (the epoch's last batch: the epoch ends after it); the
    # evaluations of batches 4 (again), 6 and 8 run on 3 ranks, whose sampler was made for 4.
    # Under FSDP the three go back to the batch-2 checkpoint, resharded, and train batches 3 and 4 again
    out = tmp_path / "out"
    finish(launch(out, *kill, "--eval", "--train-accuracy", *(("--fsdp", "--save", str(tmp_path / "save")) if fsdp else ())))
    assert_as_uninterrupted(out, reference)
    evals = _evaluations_as_one_process_over_every_sample(out)
    assert [(e["batch"], e["world"]) for e in evals] == [(2, 4), (4, 3), (6, 3), (8, 3)], evals


def _evaluations_as_one_process_over_every_sample(out: Path) -> list[dict]:
    """The job's evaluations (``--eval``), each checked against one process over the whole
    held-out set with the parameters it evaluated."""
    evals = [json.loads(line) for line in (out / "evals").read_text().splitlines()]
    x, y = dataset(EVAL_SAMPLES).tensors
    for e in evals:
        model = MLP()
        model.load_state_dict(torch.load(out / f"eval{e['batch']}.params", weights_only=True))
        with torch.no_grad():
            outputs = model((x, y))
        assert e["accuracy"] == pytest.approx(float((outputs.argmax(dim=1) == y).double().mean()), abs=1e-6), e
        assert e["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(outputs, y)), abs=1e-5), e
    return evals


def test_a_rank_lost_in_the_epoch_end_checkpoint_has_the_others_save_it_and_count_the_epoch_once(
        tmp_path: Path, reference) -> None:
    # under DDP, rank 2 dies in the agreement of the batch-4 checkpoint, which is saved after the
    # epoch's end: the three left save it on their new group, and neither the epoch nor its data repeats
    out, save = tmp_path / "out", tmp_path / "save"
    finish(launch(out, "--save", str(save), "--die-in-save", "2:4:agree"))
    assert_as_uninterrupted(out, reference)
    assert sorted(p.name for p in save.glob("ep*")) == \
        ["ep0-ba2-rank0.pt", "ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]


def test_a_rank_lost_while_the_others_form_the_new_group_costs_seconds_not_the_dist_timeout(
        tmp_path: Path, reference) -> None:
    # rank 0 is killed after batch 2; rank 3 dies as it starts to form generation 1's group, which
    # the other two would otherwise wait for until dist_timeout (300 s); they form generation 2
    out = tmp_path / "out"
    start = time.monotonic()
    err = finish(launch(out, "0:2", "--die-in-reform", "3"))
    assert time.monotonic() - start < 60
    assert "rank 0 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert "rank 3 left (signal SIGKILL): 2 of 4 ranks go on at world size 2 (generation 2" in err, err
    assert_as_uninterrupted(out, reference)
    for rank in (1, 2):  # one change for them: generation 1 never trained
        told = [json.loads(line) for line in (out / f"changes{rank}").read_text().splitlines()]
        assert [(c["generation"], c["world_size"], c["previous_world_size"], c["batch"]) for c in told] \
            == [(2, 2, 4, 2)], told


def test_a_rank_killed_from_outside_at_a_random_moment_costs_no_sample_and_no_exactness(
        tmp_path: Path, reference) -> None:
    chosen = random.Random()
    rank, delay = chosen.randrange(4), chosen.uniform(0.0, 0.6)
    out = tmp_path / "out"
    proc = launch(out, "--sleep", "0.1", "--eval", "--train-accuracy")  # a kill may come during an evaluation too
    deadline = time.monotonic() + 90
    while not (out / "ends0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(delay)
    os.kill(int((out / f"pid{rank}").read_text()), signal.SIGKILL)
    err = finish(proc)
    assert f"rank {rank} left (signal SIGKILL): 3 of 4 ranks go on" in err, (rank, delay, err)
    assert_as_uninterrupted(out, reference)
    evaluated = [e["batch"] for e in _evaluations_as_one_process_over_every_sample(out)]
    expected = [2, 4, 6, 8]
    if rank == 0:  # rank 0 alone writes an evaluation's record, after its last collective: killed in
        # between, it takes the record of an evaluation the others finished (and do not run again)
        change = json.loads((out / "changes1").read_text().splitlines()[0])
        if change["batch"] in expected and change["batch"] not in evaluated:
            expected.remove(change["batch"])
    assert evaluated == expected, (rank, delay, err[-3000:])


IN_THE_EPOCH_END = ("--hold", "4", "--join-after", "4")
"""The rank started again joins once the three ended batch 4, the epoch's last, where they wait:
the change ends the batch-4 checkpoint's save."""


@pytest.mark.parametrize("backend,when", [((), IN_THE_EPOCH_END), (("--fsdp",), IN_THE_EPOCH_END),
                                          (("--zero", "2"), ("--hold-in-step", "3"))],
                         ids=["ddp-in-the-epoch-end", "fsdp-in-the-epoch-end", "zero2-in-the-step"])
def test_with_rank_restarts_a_lost_rank_is_started_again_in_place_and_the_four_end_as_four_would(
        tmp_path: Path, reference, backend: tuple[str, ...], when: tuple[str, ...]) -> None:
    """``--rank_restarts 1``: rank 2, killed after batch 3, is started again by its launcher; the
    three left go on (under FSDP and ZeRO-2 from the batch-2 checkpoint, resharded) until it
    joins, back in its place, and takes the state from its peers (under FSDP and ZeRO-2 their
    shards); the four end within 1e-5 of the uninterrupted run, on the same global batches, with
    no step trained again at the join. It joins at the hardest moments: in the end of the epoch's
    last batch (the rank that joined takes the rest of it up with the others, so the epoch is
    counted once and its checkpoint saved), or under ZeRO-2 in batch 3's optimizer step, each of
    the three with its partition updated, before the gather of the updated weights
    (``--hold-in-step``): the step counts as taken, and is not taken twice."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    err = finish(launch(out, "2:3", *when, *backend, "--save", str(ck),
                        launcher=("-n", "4", "--min_ranks", "2", "--rank_restarts", "1")))
    assert "rank 2 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert "rank 2 (local rank 2) started again in place (1 of --rank_restarts 1)" in err, err
    assert "rank 2 joined: 4 of 4 ranks go on at world size 4 (generation 2" in err, err
    params, batches = reference
    assert_same_params(torch.load(out / "params.pt", weights_only=True), params, atol=1e-5)
    assert global_batches(out) == batches
    if not backend:
        assert_as_uninterrupted(out, reference)  # and no checkpoint in OUT, so none read
    told = [json.loads(line) for line in (out / "changes0").read_text().splitlines()]
    # let in only once the three made the change without it: two changes, never one skipped
    assert [(c["generation"], c["world_size"], c["left"], c["joined"]) for c in told] == \
        [(1, 3, [2], []), (2, 4, [], [2])], (told, err)
    # under ZeRO-2, where one of the three also ended batch 3 (its gather done before it saw the
    # change), they were at different steps: back to the batch-2 checkpoint (launcher.md)
    assert (told[-1]["batch"], told[-1]["trained_again"]) in \
        ([(4, 0)] if when == IN_THE_EPOCH_END else [(3, 0), (2, 1)]), told
    assert sorted(p.name for p in ck.glob("ep*")) == \
        ["ep0-ba2-rank0.pt", "ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"], err


def test_a_change_while_the_ranks_agree_on_the_end_of_the_interrupted_batch_is_taken_as_any_other(
        tmp_path: Path, reference) -> None:
    # rank 2 is killed after batch 3; the three left agree on the end of the batch the loss
    # interrupted only once rank 2, started again, joined (--change-in-end-pending): that change
    # ends their agreement, and they take it as any other (before, each of them left the job)
    out = tmp_path / "out"
    err = finish(launch(out, "2:3", "--change-in-end-pending",
                        launcher=("-n", "4", "--min_ranks", "2", "--rank_restarts", "1")))
    assert "rank 2 joined: 4 of 4 ranks go on at world size 4 (generation 2" in err and "rank 0 left" not in err, err
    told = [json.loads(line) for line in (out / "changes0").read_text().splitlines()]
    assert [(c["generation"], c["left"], c["joined"]) for c in told] == [(1, [2], []), (2, [], [2])], (told, err)
    assert_as_uninterrupted(out, reference)


def test_a_rank_started_again_that_dies_before_it_is_let_in_is_started_again_and_never_waited_for(
        tmp_path: Path, reference) -> None:
    # rank 2 is killed after batch 3; each time it is started again it exits 3 as it starts, before
    # the master's launcher let it in: its request is taken back, its second start is its last, and
    # the three left never wait for it and end as the uninterrupted run
    out = tmp_path / "out"
    err = finish(launch(out, "2:3", "--fail-to-join", "--sleep", "0.6",  # the job outlasts both starts
                        launcher=("-n", "4", "--min_ranks", "2", "--rank_restarts", "2")))
    for nth in (1, 2):
        assert f"rank 2 (local rank 2) started again in place ({nth} of --rank_restarts 2)" in err, err
    assert err.count("rank 2, started again in place, exited before the job let it in (exit code 3)") == 2, err
    assert f"rank 2 wrote nothing to {out / 'run' / 'rank2.stderr.log'} or " in err, err
    assert "rank 2 is not started again (--rank_restarts 2 used" in err and "joined" not in err, err
    assert_as_uninterrupted(out, reference)


def test_below_min_ranks_the_job_stops_as_without_it(tmp_path: Path) -> None:
    proc = launch(tmp_path / "out", "1:2", launcher=("-n", "2", "--min_ranks", "2"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "rank 1 was lost (signal SIGKILL): 1 rank would remain, fewer than --min_ranks 2; the job stops" in err
    assert "rank 1 (local rank 1" in err and "failed first with signal SIGKILL" in err, err


@pytest.mark.parametrize("argv,said", [
    (["-n", "2", "--min_ranks", "3", str(JOB)], "--min_ranks 3 is more than the job's 2 ranks: give at most 2"),
    (["-n", "2", "-c", "--min_ranks", "1", "true"], "drop -c"),
    (["-n", "2", "--rank_restarts", "1", str(JOB)], "add --min_ranks (or --nnodes MIN:MAX), or use --max_restarts"),
])
def test_min_ranks_that_cannot_work_are_one_line_errors(argv: list[str], said: str) -> None:
    from lockstep.launcher.cli import parse_plan
    from lockstep.launcher.plan import LaunchError

    with pytest.raises(LaunchError) as error:
        parse_plan(argv, {})
    assert said in str(error.value) and "\n" not in str(error.value)


def test_nnodes_min_max_makes_a_job_of_max_nodes_that_goes_on_with_min_nodes_ranks(tmp_path: Path) -> None:
    from lockstep.launcher.cli import parse_plan

    script = tmp_path / "x.py"
    script.write_text("")
    node = ["--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "10.77.0.1", "--master-port", "29500",
            "--run_directory", str(tmp_path / "run"), str(script)]
    plan = parse_plan(["--nnodes", "1:3", *node], {})
    assert (plan.world_size, plan.nnodes, plan.min_ranks) == (6, 3, 2)
    env = plan.worker_env(1, 29501, 1, {})
    assert env["LOCKSTEP_ELASTIC_STORE"] == "10.77.0.1:29500"  # the job's store, not the restart's
    assert parse_plan(["--nnodes", "3", *node], {}).min_ranks == 0
    assert parse_plan(["--nnodes", "3", "--min_ranks", "4", *node], {}).min_ranks == 4


def test_an_elastic_rank_is_told_its_attempts_membership_keys_and_the_full_world(tmp_path: Path) -> None:
    from lockstep.launcher.cli import parse_plan

    script = tmp_path / "x.py"
    script.write_text("")
    plan = parse_plan(["-n", "3", "--min_ranks", "2", "--run_directory", str(tmp_path / "run"), str(script)], {})
    env = plan.worker_env(1, 29500, 2, {})
    assert env["LOCKSTEP_ELASTIC"] == "lockstep/elastic/attempt2/" and env["LOCKSTEP_FULL_WORLD_SIZE"] == "3"
    assert "LOCKSTEP_ELASTIC" not in parse_plan(["-n", "3", "--run_directory", str(tmp_path / "r2"), str(script)],
                                                 {}).worker_env(1, 29500, 0, {})


@pytest.mark.parametrize("kill,kind", [(["2:3", "--stateful"], "full"), (["--die-in-save", "2:4:agree"], "full"),
                                       (["--die-in-save", "2:4:gather"], "full"), (["2:3"], "sharded"),
                                       (["--die-in-save", "2:4:write"], "sharded")],
                         ids=["after-batch-3-stateful-loader", "in-the-batch-4-agreement", "in-the-batch-4-gather",
                              "sharded-after-batch-3", "sharded-in-the-batch-4-write"])
def test_under_fsdp_a_lost_rank_goes_on_from_the_last_checkpoint_resharded_and_ends_as_four_ranks_would(
        tmp_path: Path, reference, kill: list[str], kind: str) -> None:
    # rank 2 is killed after batch 3 (or as the others wait for it in the agreement of the batch-4
    # checkpoint, in its gather of the full state, or in DCP's collectives as the ranks write their
    # shards of a sharded one: that checkpoint is never written); its shards are nowhere else, so
    # the three ranks left shard the model anew over themselves and load the batch-2 checkpoint
    # into it (with a StatefulDataLoader, the position its state saved by a rank of 4 gives a rank
    # of 3's share of the global batches)
    out = tmp_path / "out"
    err = finish(launch(out, *kill, "--fsdp", kind, "--save", str(tmp_path / "ck")))
    again = _trained_again(err, kill, 1 if kill[0] == "2:3" else 2)
    assert "rank 2 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert ("rank 2 (at launch) left: the job goes on at world size 3 (was 4; generation 1) from batch 2, "
            in err), err
    assert f"{again} finished step(s) are trained again (from the last checkpoint, resharded)" in err, err
    params, batches = reference
    assert_same_params(torch.load(out / "params.pt", weights_only=True), params, atol=1e-5)
    assert global_batches(out) == batches  # each step's samples as the generation that finished it read them
    for rank in (0, 1, 3):
        told = [json.loads(line) for line in (out / f"changes{rank}").read_text().splitlines()]
        assert [(c["generation"], c["world_size"], c["left"], c["batch"], c["trained_again"]) for c in told] \
            == [(1, 3, [2], 2, again)], told
    assert sorted(p.name for p in (tmp_path / "ck").glob("ep*")) == \
        ["ep0-ba2-rank0.pt", "ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]
    last = tmp_path / "ck" / "ep2-ba8-rank0.pt"
    if kind == "sharded":  # the shards of the three left (and a batch-2 folder of the four's)
        assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
        assert len(list((tmp_path / "ck" / "ep0-ba2-rank0.pt").glob("*.distcp"))) == 4
        return
    # the full state the three gathered for the last save
    assert_same_params(torch.load(last, weights_only=False)["state"]["model"], params, atol=1e-5)


def _trained_again(err: str, kill: list[str], expected: int) -> int:
    """The finished steps the ranks left train again: ``expected``; for a rank killed in its writer
    thread, which writes while the ranks train on, one more where the others ended the next batch
    before the loss stopped them."""
    if not kill[-1].endswith(":write"):
        return expected
    said = re.search(r"(\d+) finished step\(s\) are trained again", err)
    assert said is not None and int(said[1]) in (expected, expected + 1), err
    return int(said[1])


def test_a_rank_that_gives_up_the_agreement_after_a_loss_that_the_others_completed_costs_seconds_not_the_dist_timeout(
        tmp_path: Path, reference) -> None:
    # rank 2 is killed after batch 3; the three left agree that their state comes from the batch-2
    # checkpoint; rank 1 is then killed, and rank 3 gives that agreement up on seeing it, as a rank
    # whose polled wait saw the change before the gather's end. Rank 0 completed it: before, it went
    # on into the model's resharding, whose process groups (DeepSpeed's) wait for rank 3 inside torch
    # until dist_timeout (300 s); the two now decide all or none first, and form generation 2
    out, saves = tmp_path / "out", tmp_path / "ck"
    start = time.monotonic()
    err = finish(launch(out, "2:3", "--zero", "2", "--save", str(saves), "--give-up-in-rejoin", "3:1"))
    assert time.monotonic() - start < 90, err
    assert "rank 2 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert "rank 1 left (signal SIGKILL): 2 of 4 ranks go on at world size 2 (generation 2" in err, err
    params, batches = reference
    assert_same_params(torch.load(out / "params.pt", weights_only=True), params, atol=1e-5)
    assert global_batches(out) == batches


@pytest.mark.parametrize("stage,kill,again", [(2, ["2:3"], 1), (2, ["--die-in-save", "2:4:write"], 2),
                                              (3, ["2:3"], 1)],
                         ids=["zero2-after-batch-3", "zero2-in-the-batch-4-write", "zero3-after-batch-3"])
def test_under_deepspeed_a_lost_rank_goes_on_from_the_last_checkpoint_resharded_and_ends_as_four_ranks_would(
        tmp_path: Path, reference, stage: int, kill: list[str], again: int) -> None:
    # rank 2 is killed after batch 3 (once the batch-2 checkpoint is published), or in its writer
    # thread as it writes its files of the batch-4 checkpoint, which the others then give up (that
    # write met in collectives of the ranks that were). A lost rank's ZeRO partitions are nowhere
    # else, so the three ranks left build a new engine over themselves and load the batch-2
    # checkpoint, saved by four ranks: at stages 1-2 each takes its slice of the optimizer state of
    # the new partitioning (lockstep's reshard)
    out, saves = tmp_path / "out", tmp_path / "ck"
    metrics = ("--train-accuracy",) if kill == ["2:3"] else ()  # the training metric through a change
    err = finish(launch(out, *kill, "--zero", str(stage), "--save", str(saves), *metrics))
    again = _trained_again(err, kill, again)
    assert ("rank 2 (at launch) left: the job goes on at world size 3 (was 4; generation 1) from batch 2, "
            in err), err
    assert f"{again} finished step(s) are trained again (from the last checkpoint, resharded)" in err, err
    params, batches = reference  # the DDP run: ZeRO's math is the same
    assert_same_params(torch.load(out / "params.pt", weights_only=True), params, atol=1e-5)
    assert global_batches(out) == batches
    saved = sorted(p.name for p in saves.iterdir())  # no temporary folder of the write given up
    assert saved == ["ep0-ba2-rank0.pt", "ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt",
                     "latest-rank0.pt"], saved
    assert (saves / "ep1-ba4-rank0.pt" / "deepspeed").is_dir()  # written by the three


def test_under_deepspeed_zero0_a_lost_rank_costs_what_it_costs_under_ddp_and_no_checkpoint_is_needed(
        tmp_path: Path, reference) -> None:
    # ZeRO-0 in fp32 steps the user's optimizer, whose state every rank holds: the three ranks left
    # build a new engine around the same model and optimizer, as they were, with no save folder
    out = tmp_path / "out"
    err = finish(launch(out, "2:3", "--zero", "0", "--train-accuracy"))
    assert "rank 2 left (signal SIGKILL): 3 of 4 ranks go on at world size 3 (generation 1" in err, err
    assert "from batch 3, " in err and "no finished step is trained again" in err, err
    assert_as_uninterrupted(out, reference)
    for rank in (0, 1, 3):
        told = [json.loads(line) for line in (out / f"changes{rank}").read_text().splitlines()]
        assert [(c["world_size"], c["left"], c["batch"], c["trained_again"]) for c in told] == [(3, [2], 3, 0)], told


def test_fsdp_under_min_ranks_without_a_save_folder_is_refused_in_one_line_before_training(tmp_path: Path) -> None:
    proc = launch(tmp_path / "out", "--fsdp", launcher=("-n", "2", "--min_ranks", "1"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert ("under FSDP goes on from the last checkpoint, resharded over the ranks left (a lost rank's shards "
            "are nowhere else): give save_folder and save_interval") in err, err
    assert not (tmp_path / "out" / "ends0").exists()


def test_a_script_whose_ranks_do_not_follow_a_change_stops_at_a_lost_rank(tmp_path: Path) -> None:
    # without lockstep's Trainer, rank 0 would wait in its all-reduce for the group's timeout
    script = tmp_path / "plain.py"
    script.write_text("import os, time, torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n    os._exit(3)\n"
                      "dist.all_reduce(torch.ones(1))\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", "--min_ranks", "1", "--run_directory",
                           str(tmp_path / "run"), str(script)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "rank 1 was lost (exit code 3) and not every rank follows a change of the job's ranks" in done.stderr
    assert time.monotonic() - started < 60


def test_with_max_restarts_such_a_script_is_started_again_at_every_rank_as_under_torchrun(tmp_path: Path) -> None:
    # the restart's ranks rendezvous in a fresh store: the launcher's still holds the first attempt's keys
    script = tmp_path / "plain.py"
    script.write_text("import os, sys, torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
                      "if dist.get_rank() == 1 and attempt == '0':\n    os._exit(3)\n"
                      "total = torch.ones(1)\ndist.all_reduce(total)\n"
                      "print(f'attempt {attempt} rank {dist.get_rank()} of {dist.get_world_size()}: {total.item()}')\n")
    done = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", "--min_ranks", "1", "--max_restarts", "1",
                           "--tee", "1", "--run_directory", str(tmp_path / "run"), str(script)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "restarting this node's ranks (1 of 1)" in done.stderr, done.stderr
    assert sorted(line.split(":", 1)[1] for line in done.stdout.splitlines() if "attempt" in line) == \
        ["attempt 1 rank 0 of 2: 2.0", "attempt 1 rank 1 of 2: 2.0"], done.stdout


@pytest.mark.parametrize("parallel,save_folder,said", [
    ({"deepspeed_config": {"zero_optimization": {"stage": 3}}}, None, "give save_folder and save_interval"),
    ({"deepspeed_config": {"zero_optimization": {"stage": 3}}}, "ck", None),
    ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, None, "give save_folder and save_interval"),
    ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, "ck", None),
    ({"deepspeed_config": {"zero_optimization": {"stage": 0}}}, None, None),  # every rank holds the state
    ({"fsdp_config": {"sharding_strategy": "HYBRID_SHARD"}}, "ck", "drop HYBRID_SHARD, the mesh degrees"),
    ({"fsdp_config": {"state_dict_type": "local"}}, "ck", "not 'local', whose per-rank files load only at"),
    ({"fsdp_config": {"state_dict_type": "sharded"}}, "ck", None),
    ({"fsdp_config": {}}, None, "give save_folder and save_interval"),
    ({"fsdp_config": {}}, "ck", None),
    ({}, None, None),
])
def test_what_an_elastic_job_cannot_go_on_with_is_refused_in_one_line(
        parallel: dict, save_folder: str | None, said: str | None) -> None:
    from lockstep.parallel.config import ParallelConfig, build_strategy
    from lockstep.trainer.setup import check_elastic

    if "deepspeed_config" in parallel:
        pytest.importorskip("deepspeed")
    config = ParallelConfig(**parallel)
    strategy = build_strategy(config, device=torch.device("cpu"), precision="fp32", train_dataloader=None,
                              microbatch_size=None, grad_accum=None, num_optimizers=1)
    if said is None:
        check_elastic(strategy, config, save_folder)
        return
    with pytest.raises(ValueError) as error:
        check_elastic(strategy, config, save_folder)
    assert said in str(error.value) and "\n" not in str(error.value), error.value
