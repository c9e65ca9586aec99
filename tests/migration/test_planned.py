"""Planned migration (`trainmover migrate --rank R`): the leaver hands its state to a warm standby at an
iteration boundary while the job trains on; the trajectory stays bit-identical to a run without it."""

from __future__ import annotations

import re

import pytest

from helpers import (
    ITERS,
    assert_transfer_memory,
    control_flags,
    fell_back,
    finish_job,
    read_metrics,
    replaced,
    start_job,
    tm_args,
    trainmover_cli,
    trajectory,
    transfer_reports,
    wait_for,
    wait_iteration,
    wait_warm,
)

# TP2 x PP2 x DP2: rank = tp + 2*dp + 4*pp
CASES = [
    pytest.param(1, id="first-stage-tp1"),
    pytest.param(6, id="last-stage-tp0"),
]


def _migrate(job, *argv: str) -> None:
    done = trainmover_cli("migrate", *argv, *control_flags(job))
    assert done.returncode == 0, done.stderr[-2000:]


def _migrate_and_check(tmp_path, corpus, reference, nproc, args, ref_key, rank, iters=ITERS):
    ref = reference(ref_key, nproc, args)
    job = start_job(tmp_path, nproc, args, name=f"planned_{rank}")
    try:
        wait_iteration(job, 3)
        wait_warm(job)
        _migrate(job, "--rank", str(rank))
    except BaseException:
        job.popen.kill()
        raise
    err = finish_job(job)
    assert [(r["rank"], r["joiner"][:7]) for r in replaced(job)] == [(rank, "standby")], err[-3000:]
    assert replaced(job)[0]["reason"] == "planned" and not fell_back(job), err[-3000:]
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, iters + 1))
    assert got == ref, "the trajectory differs from the run without a migration"
    # the logging rank switched links at one iteration boundary after the request (no restart)
    switched = read_metrics(job.metrics_path, "recovered")
    assert [(s["reason"], s["epoch"]) for s in switched] == [("planned", 1)], switched
    assert 3 <= switched[0]["resumed_iteration"] < iters
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "a rank restarted"
    assert [r[0] for r in transfer_reports(job)] == [rank], "the leaver was not the source"
    assert_transfer_memory(job)


@pytest.mark.parametrize("rank", CASES)
def test_planned_migration_is_bit_identical(tmp_path, corpus, reference, rank):
    """40 iterations: on the Python 3.12 stack (`make test-compat`) the job ended its 12 before the standby
    was warm and the request came (the controller refused the move: the job was finishing)."""
    args = tm_args(corpus, iters=40)
    _migrate_and_check(tmp_path, corpus, reference, 8, args, "tp2pp2dp2-i40", rank, iters=40)


def test_planned_migration_with_the_distributed_optimizer(tmp_path, corpus, reference):
    """bf16 with the distributed optimizer and its mirror: the leaver hands over its shard; from the
    switch on, the joiner holds its ward's copies and its holder its own (the first copies of the new
    epoch carry the layout a new process lacks), and the run stays bit-identical."""
    args = tm_args(corpus, extra=["--bf16", "--use-distributed-optimizer"])
    _migrate_and_check(tmp_path, corpus, reference, 8, args, "tp2pp2dp2-bf16-distopt", 5)


def test_planned_migration_in_fp16(tmp_path, corpus, reference):
    """fp16 with a dynamic loss scale that doubles every 3 iterations: the leaver hands its scaler over
    with the rest of its state (the trajectory compared includes the logged scale)."""
    args = tm_args(corpus, extra=["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "3"])
    _migrate_and_check(tmp_path, corpus, reference, 8, args, "tp2pp2dp2-fp16", 5)


@pytest.mark.slow
def test_planned_migration_of_a_middle_stage(tmp_path, corpus, reference):
    """PP3: the middle stage receives and sends activations; rank 2 = (tp0, dp0, pp1) in TP1 x PP3 x DP2.
    40 iterations: this layout trains fast enough that 12 can end before the request arrives."""
    args = tm_args(corpus, tp=1, pp=3, iters=40, extra=["--num-layers", "6"])
    _migrate_and_check(tmp_path, corpus, reference, 6, args, "tp1pp3dp2_40", 2, iters=40)


def test_leaver_rejoins_the_pool_and_is_promoted_again(tmp_path, corpus, reference):
    """--tm-leaver-becomes-standby: rank 1's process hands its state over, stays alive as a standby
    (no new interpreter is started for the consumed one), warms up, and is then moved into rank 6
    by a second planned migration. Both moves are bit-identical to a run without them.

    Its standbys run at the launcher's default CPU priority (niceness 19, where a promoted standby
    may raise it back): each is promoted at niceness 0, and the leaver waits in the pool at 19 again."""
    from trainmover_ext.launch import priority

    iters = 40
    args = tm_args(corpus, iters=iters)
    ref = reference("tp2pp2dp2-i40", 8, args)
    job = start_job(
        tmp_path, 8, tm_args(corpus, iters=iters, standby_nice=None) + ["--tm-leaver-becomes-standby"], name="rejoin"
    )
    try:
        wait_iteration(job, 3)
        rank1_pid = job.rank_pids()[0][1]
        wait_warm(job, "first")
        _migrate(job, "--rank", "1")
        (back,) = wait_for(
            lambda: job.events("standby_rejoined"), 120, interval=0.1, what="the leaver to rejoin the pool"
        )
        assert (back["detail"]["pid"], back["detail"]["rank"]) == (rank1_pid, 1)
        rejoined = back["detail"]["member"]
        # rank 6 is on the last stage: `migrate --to` accepts only a standby warm for its role
        wait_warm(job, "last", rejoined)
        _migrate(job, "--rank", "6", "--to", rejoined)
    except BaseException:
        job.popen.kill()
        raise
    err = finish_job(job)
    moves = [(r["rank"], r["joiner"], r["reason"]) for r in replaced(job)]
    assert moves[1] == (6, rejoined, "planned") and len(moves) == 2, moves
    assert [e["detail"]["rank"] for e in job.events("standby_rejoined")] == [1, 6], err[-3000:]
    refills = [e for e in job.events("standby_started") if e["detail"]["how"] != "fork"]
    assert refills == [], f"a new standby was started although the leaver refilled the pool: {refills}"
    if priority.can_restore():  # as root, or with CAP_SYS_NICE: the launcher lowers its standbys' priority
        out = job.stdout()
        promotions = re.findall(
            r"promoted to rank (\d) \(local rank \d, epoch \d, planned\); CPU niceness (\d+) -> (\d+)", out
        )
        assert promotions == [("1", "19", "0"), ("6", "19", "0")], out[-3000:]
        assert f"rejoining the pool as standby {rejoined} (pid {rank1_pid}, CPU niceness 19)" in out, out[-3000:]
    assert not fell_back(job) and replaced(job, "failure") == [], err[-3000:]
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, iters + 1))
    assert got == ref, "the trajectory differs from the run without the migrations"
    switched = read_metrics(job.metrics_path, "recovered")
    assert [(s["reason"], s["epoch"]) for s in switched] == [("planned", 1), ("planned", 2)], switched
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "a rank restarted"
    assert [r[0] for r in transfer_reports(job)] == [1, 6]
