"""Exact recovery under the settings people train with: dropout 0.1 and bf16 (fp16 too), every fault point.

Real processes, a real etcd, SIGKILL; each faulted run's loss trajectory is compared bit for bit with
a fault-free run of the same flags.

- The matrix: first, middle and last pipeline stage x TP rank 0 and 1 x forward, backward, the
  gradient all-reduce and the optimizer step (24 cells), in bf16 on TP2 x PP3 x DP2 (12 ranks,
  one layer per stage). One job per phase and TP rank kills its three stages in turn, each at its own
  iteration with a warm standby of its own (8 jobs, 24 kills): every cell is still a kill of its own,
  recovered bit for bit, and the later ones land in a job that has recovered before. Under the slow
  mark; CI runs it.
- A kill during a checkpoint save: the save is recovered and done again.
- A kill that leaves the data-parallel replicas one step apart: stayers receive copies.
- The distributed optimizer with DP=2 and its mirror off (``--tm-optimizer-mirror off``: its shards have
  no copy): the checkpoint fallback. With the mirror: tests/migration/test_optimizer_mirror.py.
- fp16 with a dynamic loss scale that grows during the run: the scale resumes too.
- Kills inside a collective (the victim issued it and its peers are in it): the gradient
  reduction, the gradient-norm all-reduce, and the distributed optimizer's parameter all-gather.
"""

from __future__ import annotations

import os

import pytest

from helpers import (
    assert_killed,
    assert_recovered,
    fell_back,
    read_metrics,
    replaced,
    run_job,
    state_sources,
    tm_args,
    trajectory,
    transfer_pairs,
)

BF16 = ["--bf16"]
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "3"]
"""fp16 with a scale that doubles every 3 iterations: the scaler's state changes across the fault."""

STAGES = {"first": 0, "middle": 1, "last": 2}
PHASES = ("forward", "backward", "allreduce", "step")


KILL_AT = (6, 8, 10)
"""The iterations of a matrix job's three kills: the first, middle and last stage, in that order."""


def _matrix():
    """One job per phase and TP rank: its three cells, ``(victim, iteration)`` per pipeline stage."""
    jobs = []
    for tp in (0, 1):
        for i, phase in enumerate(PHASES):
            dp = (i + tp) % 2  # both data-parallel replicas of each shard get hit somewhere
            # TP2 x PP3 x DP2: rank = tp + 2*dp + 4*pp
            cells = [(tp + 2 * dp + 4 * pp, at) for pp, at in zip(STAGES.values(), KILL_AT, strict=True)]
            jobs.append(pytest.param(phase, cells, id=f"{phase}-tp{tp}"))
    return jobs


def _pp3_args(corpus, extra=()):
    return tm_args(corpus, tp=2, pp=3, extra=["--num-layers", "3", *BF16, *extra])


@pytest.mark.slow
@pytest.mark.parametrize("phase,cells", _matrix())
def test_bf16_fault_matrix(tmp_path, corpus, reference, phase, cells):
    """The first, middle and last stage's rank of one column is killed in ``phase``, at iterations 6, 8 and
    10, with three warm standbys: each kill is replaced by a standby in a failure epoch of its own, from its
    data-parallel replica, and the whole run is bit-identical to the fault-free one."""
    ref = reference("tp2pp3dp2-bf16", 12, _pp3_args(corpus))
    drills = ",".join(f"{victim}:{at}:{phase}" for victim, at in cells)
    args = _pp3_args(corpus, ["--tm-inject-fault", drills])
    args[args.index("--tm-standbys") + 1] = str(len(cells))
    job = run_job(tmp_path, 12, args, name=f"cells_{phase}", timeout=400)
    victims = [victim for victim, _ in cells]
    assert [r["rank"] for r in replaced(job, "failure")] == victims, job.stderr()[-3000:]
    for victim in victims:
        assert_recovered(job, ref, victim)
        assert_killed(job, victim)


def test_kill_during_a_checkpoint_save_is_recovered_and_the_save_redone(tmp_path, corpus, reference):
    """Rank 3 dies after writing its file of checkpoint 4, before the ranks agree it is complete: the
    others' barrier fails, a standby takes rank 3 from its replica, and checkpoint 4 is saved again."""
    ref = reference("tp2pp2dp2-bf16", 8, tm_args(corpus, extra=BF16))
    ckpt = tmp_path / "ckpt"
    job = run_job(
        tmp_path,
        8,
        tm_args(corpus, extra=[*BF16, "--save", str(ckpt), "--save-interval", "4", "--tm-inject-fault", "3:4:save"]),
        name="save_kill",
    )
    assert_recovered(job, ref, 3)
    assert_killed(job, 3)
    assert [r["iteration"] for r in read_metrics(job.metrics_path, "checkpoint")] == [4, 8, 12]
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [4]
    assert len(os.listdir(ckpt / "iter_0000004")) == 8
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "12"


def test_replicas_one_step_apart_are_brought_level_by_copies(tmp_path, corpus, reference):
    """Rank 6 dies before its model-parallel group's gradient-norm all-reduce: that group (2, 3, 6, 7)
    cannot step while the other replica (0, 1, 4, 5) does. The job resumes at the newer iteration:
    the stayers 2, 3 and 7 receive copies from their replicas, and the result is still bit-identical."""
    ref = reference("tp2pp2dp2-bf16", 8, tm_args(corpus, extra=BF16))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=[*BF16, "--tm-inject-fault", "6:6:clip"]), name="clip")
    assert_recovered(job, ref, 6)
    assert transfer_pairs(job) == {(0, 2), (1, 3), (5, 7), (4, 6)}
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [6]


def test_distributed_optimizer_recovers_through_the_checkpoint(tmp_path, corpus, reference):
    """DP=2 with the distributed optimizer and its mirror off: rank 5's optimizer shard exists nowhere
    else, so every rank reloads checkpoint 4 through the warm path (no restart) and re-runs 5 and 6
    identically."""
    base = tm_args(corpus, extra=[*BF16, "--use-distributed-optimizer"])
    ref = reference("tp2pp2dp2-bf16-distopt", 8, base)
    base = base + ["--tm-optimizer-mirror", "off"]
    ckpt = str(tmp_path / "ckpt")
    job = run_job(
        tmp_path,
        8,
        base + ["--save", ckpt, "--save-interval", "4", "--tm-inject-fault", "5:7:backward"],
        name="distopt",
    )
    assert trajectory(job.metrics_path) == ref
    assert [(r["rank"], r["joiner"][:7]) for r in replaced(job, "failure")] == [(5, "standby")]
    assert state_sources(job, 5) == ["checkpoint"]
    assert not fell_back(job) and len(read_metrics(job.metrics_path, "startup")) == 1, job.stderr()[-3000:]
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [4]


def test_fp16_recovery_resumes_the_loss_scale(tmp_path, corpus, reference):
    """fp16, the dynamic scale doubling every 3 iterations: a standby that started from a fresh scaler
    would scale its gradients differently from its peers and diverge from iteration 8 on. The
    trajectory compared includes the logged loss scale."""
    args = tm_args(corpus, extra=FP16)
    ref = reference("tp2pp2dp2-fp16", 8, args)
    assert len({scale for _, _, scale in ref.values()}) >= 3, f"the loss scale did not move: {ref}"
    job = run_job(tmp_path, 8, args + ["--tm-inject-fault", "2:6:step"], name="fp16")
    assert_recovered(job, ref, 2)


@pytest.mark.slow
@pytest.mark.parametrize("victim,phase", [(2, "in-reduce"), (5, "in-norm")])
def test_kill_inside_a_collective_is_recovered_bit_identically(tmp_path, corpus, reference, victim, phase):
    """The victim dies right after it issued the data-parallel gradient reduction (in-reduce) or the
    gradient-norm all-reduce (in-norm), with its peers inside the same collective: the groups with it
    are aborted on every live member, the iteration is abandoned alike, and a standby takes the rank
    from its replica."""
    ref = reference("tp2pp2dp2-bf16", 8, tm_args(corpus, extra=BF16))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=[*BF16, "--tm-inject-fault", f"{victim}:6:{phase}"]), name=phase)
    assert "inside" in job.stdout(), job.stdout()[-3000:]
    assert_recovered(job, ref, victim)
    assert_killed(job, victim)


@pytest.mark.slow
def test_kill_inside_the_parameter_all_gather_recovers_through_the_checkpoint(tmp_path, corpus, reference):
    """Distributed optimizer, its mirror off: rank 5 dies inside the all-gather of the updated
    parameters, after its data-parallel peers stepped their shards. Its shard exists nowhere else, so
    every rank reloads checkpoint 4 without a restart and re-runs 5 and 6 identically."""
    base = tm_args(corpus, extra=[*BF16, "--use-distributed-optimizer"])
    ref = reference("tp2pp2dp2-bf16-distopt", 8, base)
    base = base + ["--tm-optimizer-mirror", "off"]
    ckpt = str(tmp_path / "ckpt")
    job = run_job(
        tmp_path,
        8,
        base + ["--save", ckpt, "--save-interval", "4", "--tm-inject-fault", "5:6:in-gather"],
        name="gather",
    )
    assert "inside all_gather" in job.stdout(), job.stdout()[-3000:]
    assert trajectory(job.metrics_path) == ref
    assert state_sources(job, 5) == ["checkpoint"]
    assert not fell_back(job) and len(read_metrics(job.metrics_path, "startup")) == 1, job.stderr()[-3000:]
