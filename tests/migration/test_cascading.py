"""Failures during a migration: every participant can fail at every step, and recovery restarts at the
newest epoch with no restart and a trajectory bit-identical to a fault-free run (real processes, real
etcd, dropout 0.1). Drills: ``--tm-inject-fault`` (``trainmover_ext.runtime.faults``), several at once."""

from __future__ import annotations

import re
import signal

import pytest

from helpers import (
    ITERS,
    control_flags,
    fell_back,
    kill_quietly,
    read_metrics,
    replaced,
    run_job,
    start_job,
    tm_args,
    trainmover_cli,
    trajectory,
    transfer_pairs,
    wait_for,
    wait_iteration,
)
from nccl_delta.config import DeltaConfig


def _plans(job) -> list[tuple[int, str, int]]:
    """(epoch, reason, rank) of every replacement the controller planned, from the job's timeline."""
    return [(r["epoch"], r["reason"], r["rank"]) for r in replaced(job)]


def _cascade_args(corpus, drills: str, standbys: int = 2, extra=None, iters: int = ITERS) -> list[str]:
    args = tm_args(corpus, iters=iters, extra=["--tm-inject-fault", drills] + (extra or []))
    i = args.index("--tm-standbys")
    args[i + 1] = str(standbys)
    return args


def assert_bit_identical_without_restart(job, ref) -> None:
    """Every iteration once or re-run identically, equal to the fault-free run; no sample skipped or
    repeated; no rank restarted and the launcher never fell back to stop-restart."""
    got = trajectory(job.metrics_path)
    assert sorted(got) == sorted(ref), f"iterations missing: {sorted(got)}"
    diffs = {it: (got[it], ref[it]) for it in ref if got[it] != ref[it]}
    assert not diffs, f"not bit-identical to the fault-free run: {diffs}"
    consumed = [got[i][1] for i in sorted(got)]
    assert all(b - a == consumed[0] for a, b in zip(consumed, consumed[1:], strict=False))
    assert not fell_back(job), job.stderr()[-4000:]
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "a rank restarted"


def run_while(job, act) -> None:
    """Call ``act()`` while ``job`` runs, then wait for it to end well (it is killed if anything fails)."""
    try:
        act()
        code = job.wait(400)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, job.stderr()[-4000:]


def test_the_joiner_dies_during_its_promotion(tmp_path, corpus, reference):
    """Rank 6 dies; the standby promoted into it (epoch 1) dies while the stayers build links to it. The
    stayers give up epoch 1's links at once and recover again at epoch 2 with the second standby."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, _cascade_args(corpus, "6:6:backward,6:1:join"), name="joiner_dies", timeout=400)
    assert_bit_identical_without_restart(job, ref)
    assert _plans(job)[:2] == [(1, "failure", 6), (2, "failure", 6)], job.stderr()[-3000:]
    # the stayers gave up epoch 1's links to the dead joiner at once: epoch 2 ran its first iteration
    # well within the link deadline they would otherwise have waited out
    epoch2 = next(p for p in job.migrations() if p["epoch"] == 2)
    took = epoch2["steps"]["first_iteration"] - epoch2["steps"]["decided"]
    assert took < DeltaConfig().connect_timeout_s / 2, f"epoch 2 took {took:.1f}s: a rank waited for dead links"


def test_the_only_standby_dies_during_its_promotion_and_the_pool_s_refill_takes_the_rank(tmp_path, corpus, reference):
    """As above with one standby: once its joiner died, none is left. The agent wakes the pool's refill at
    once (not after the epoch settled, which it never will) and waits for it to warm up instead of falling
    back to stop-restart after ``replacement_s``; epoch 2 gives rank 6 to the refill."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path, 8, _cascade_args(corpus, "6:6:backward,6:1:join", standbys=1), name="only_joiner_dies", timeout=400
    )
    assert_bit_identical_without_restart(job, ref)
    assert _plans(job)[:2] == [(1, "failure", 6), (2, "failure", 6)], job.stderr()[-3000:]
    refills = [e["detail"]["member"] for e in job.events("standby_started") if e["detail"]["how"] != "fork"]
    epoch2 = next(p for p in job.migrations() if p["epoch"] == 2)
    assert [r["joiner"] for r in epoch2["replacements"]] == refills[:1], (epoch2, refills)
    assert "no standby of this node is idle: refilling the pool now" in job.stderr(), job.stderr()[-3000:]


def test_another_rank_dies_during_a_recovery(tmp_path, corpus, reference):
    """Rank 5 dies; during epoch 1's recovery, before it reports what it holds, rank 2 dies too, so
    epoch 1 cannot converge. Every rank, the joiner of epoch 1 included, restarts recovery at epoch 2."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, _cascade_args(corpus, "5:6:backward,2:1:recover"), name="second_failure", timeout=400)
    assert_bit_identical_without_restart(job, ref)
    assert _plans(job)[:2] == [(1, "failure", 5), (2, "failure", 2)], job.stderr()[-3000:]
    # the logging rank (4) restarted its recovery at epoch 2: it never completed epoch 1's
    recovered = [r["epoch"] for r in read_metrics(job.metrics_path, "recovered")]
    assert recovered == [2], f"no recovery was restarted: {recovered}"


def test_the_state_source_dies_mid_transfer(tmp_path, corpus, reference):
    """Rank 6 dies; its replica rank 4 dies while sending rank 6's state to the joiner. No live replica
    of that shard is left, so epoch 2 brings every rank back to the checkpoint (iteration 4) through
    the warm path, with no restart, and the re-run iterations reproduce the fault-free values."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    ckpt = str(tmp_path / "ckpt")
    job = run_job(
        tmp_path,
        8,
        _cascade_args(corpus, "6:6:backward,4:1:send", extra=["--save", ckpt, "--save-interval", "4"]),
        name="source_dies",
        timeout=400,
    )
    assert_bit_identical_without_restart(job, ref)
    assert _plans(job)[:2] == [(1, "failure", 6), (2, "failure", 4)], job.stderr()[-3000:]
    # the logging rank (4) is the one that died: its joiner logs where it resumed
    promoted = read_metrics(job.metrics_path, "promoted")
    assert [(p["epoch"], p["resumed_iteration"]) for p in promoted] == [(2, 4)], promoted


def test_two_ranks_die_at_once(tmp_path, corpus, reference):
    """Ranks 1 and 6 (different shards) die in the same backward pass; both are replaced (in one plan or
    two) and their states come from their replicas."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, _cascade_args(corpus, "1:6:backward,6:6:backward"), name="two_at_once", timeout=400)
    assert_bit_identical_without_restart(job, ref)
    assert {r for _, why, r in _plans(job) if why == "failure"} == {1, 6}, job.stderr()[-3000:]
    assert {(3, 1), (4, 6)} <= transfer_pairs(job), transfer_pairs(job)


def _move_rank_6_while(tmp_path, corpus, reference, drill: str, standbys: int, name: str):
    """``trainmover migrate --rank 6`` at iteration 3 of a bf16 job running ``drill``; the job must end
    bit-identical to the fault-free run, without a restart, after a planned epoch 1 and a failure epoch 2 of
    rank 6."""
    ref = reference("tp2pp2dp2-bf16", 8, tm_args(corpus, extra=["--bf16"]))
    job = start_job(tmp_path, 8, _cascade_args(corpus, drill, standbys=standbys, extra=["--bf16"]), name=name)

    def migrate() -> None:
        wait_iteration(job, 3)
        # --wait 0: the 12-iteration job may be over (its etcd gone) before the CLI reads the decision
        done = trainmover_cli("migrate", "--rank", "6", "--wait", "0", *control_flags(job))
        assert done.returncode == 0, done.stderr[-2000:]

    run_while(job, migrate)
    assert_bit_identical_without_restart(job, ref)
    assert _plans(job)[:2] == [(1, "planned", 6), (2, "failure", 6)], job.stderr()[-3000:]
    return job


@pytest.mark.parametrize("phase", ["prepare", "handover"], ids=["phase-1", "phase-2"])
def test_the_planned_leaver_dies_during_the_move(tmp_path, corpus, reference, phase):
    """``trainmover migrate --rank 6``: the leaver dies in phase 1 (after the plan, before the hand-over)
    or in phase 2 (while handing its state over). Its death is a failure of rank 6; the planned joiner
    keeps the rank and takes the state from rank 6's replica."""
    job = _move_rank_6_while(tmp_path, corpus, reference, f"6:1:{phase}", 1, f"leaver_dies_{phase}")
    # the leaver was lost before its hand-over: the planned joiner keeps the rank in the failure epoch
    moves = replaced(job)
    assert moves[1]["joiner"] == moves[0]["joiner"] and moves[1]["leaver"] == moves[0]["leaver"], moves
    assert (4, 6) in transfer_pairs(job), transfer_pairs(job)


def test_the_planned_leaver_hangs_during_its_hand_over(tmp_path, corpus, reference):
    """``trainmover migrate --rank 6``: the leaver freezes (SIGSTOP) while it sends its state. Its agent
    sees the heartbeat stop while the process uses no CPU, as for a serving rank: it kills the leaver and
    reports the hang, without waiting for the lease. The planned joiner keeps rank 6, state from its
    replica."""
    job = _move_rank_6_while(tmp_path, corpus, reference, "6:1:handover:STOP", 1, "leaver_hangs")
    moves = replaced(job)
    assert moves[1]["joiner"] == moves[0]["joiner"] and moves[1]["leaver"] == moves[0]["leaver"], moves
    assert moves[1]["why"] == "the leaver of a planned move was lost before its hand-over", moves[1]
    assert re.search(r"rank 6 \(worker-n0-6-\w+\) hung: no heartbeat for", job.stderr()), job.stderr()[-3000:]
    assert (4, 6) in transfer_pairs(job), transfer_pairs(job)


def test_the_planned_joiner_dies_before_the_hand_over(tmp_path, corpus, reference):
    """``trainmover migrate --rank 6``: the standby the move promotes dies while it joins (phase 1), while
    the leaver still trains rank 6. The failure plan names the leaver as leaving too: it is fenced
    (not left to serve rank 6 beside the new joiner), and the second standby takes rank 6 from its replica."""
    job = _move_rank_6_while(tmp_path, corpus, reference, "6:1:join", 2, "planned_joiner_dies")
    planned, failure = replaced(job)[:2]
    assert failure["leaver"] == planned["leaver"], (planned, failure)
    assert failure["joiner"] not in (planned["joiner"], planned["leaver"]), (planned, failure)
    assert (4, 6) in transfer_pairs(job), transfer_pairs(job)


def test_a_standby_dies_while_warming(tmp_path, corpus, reference):
    """The only standby is killed while it warms; the agent starts another, which later replaces rank 3.
    40 iterations, rank 3 dying in the 36th: the kill lands long before, even on a loaded machine."""
    ref = reference("tp2pp2dp2_40", 8, tm_args(corpus, iters=40))
    job = start_job(tmp_path, 8, _cascade_args(corpus, "3:36:forward", standbys=1, iters=40), name="standby_dies")
    started: list[dict] = []

    def kill_the_standby() -> None:
        (first,) = wait_for(lambda: job.events("standby_started"), 120, what="the standby's start")
        started.append(first["detail"])
        kill_quietly(first["detail"]["pid"], signal.SIGKILL)

    run_while(job, kill_the_standby)
    assert_bit_identical_without_restart(job, ref)
    exits = [e["detail"] for e in job.events("standby_exited")]
    assert exits == [{"member": started[0]["member"], "code": -9, "replaced": True}], exits
    second = [e["detail"]["member"] for e in job.events("standby_started")][1:]
    assert [(r["epoch"], r["rank"], r["joiner"]) for r in replaced(job, "failure")] == [(1, 3, second[0])]
