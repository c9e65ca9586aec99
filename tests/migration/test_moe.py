"""Mixture-of-experts under TrainMover: megatron-core's MoE layer (4 experts, top-2, the all-to-all token
dispatcher) with expert parallelism 2 on 8 ranks (TP1 x PP2 x DP4), bf16, dropout 0.1, the default
settings. An expert's parameters exist only on the data-parallel ranks with its EP rank (megatron's
expert-data-parallel group), so a lost or moving rank's state must come from there. Real processes, real
etcd, SIGKILL."""

from __future__ import annotations

import re
import signal

from harness.jobs import MOE_ARGS
from helpers import (
    ITERS,
    assert_recovered,
    assert_transfer_memory,
    control_flags,
    fell_back,
    finish_job,
    kill_quietly,
    read_metrics,
    replaced,
    run_job,
    start_job,
    state_sources,
    tm_args,
    trainmover_cli,
    trajectory,
    transfer_pairs,
    transfer_reports,
    wait_for,
    wait_iteration,
    wait_warm,
)

MOE = [*MOE_ARGS, "--bf16"]
REF = "tp1pp2dp4-moe-ep2-bf16"
# TP1 x PP2 x DP4: rank = dp + 4 * pp, EP rank = dp % 2; rank 5's experts live on rank 7 alone


def test_a_killed_expert_rank_takes_its_experts_from_its_expert_data_parallel_replica(tmp_path, corpus, reference):
    """Rank 5 (last stage, EP rank 1) is killed in the backward pass, mid all-to-all. Its dense
    replicas are ranks 4, 6 and 7, but only rank 7 holds its experts: the joiner's state comes from
    rank 7, and the run equals the fault-free one bit for bit."""
    ref = reference(REF, 8, tm_args(corpus, tp=1, extra=MOE))
    job = run_job(
        tmp_path, 8, tm_args(corpus, tp=1, extra=[*MOE, "--tm-inject-fault", "5:6:backward"]), name="moe_kill"
    )
    assert_recovered(job, ref, victim=5)
    assert transfer_pairs(job) == {(7, 5)}, transfer_pairs(job)


def test_with_the_distributed_optimizer_a_killed_expert_rank_takes_its_shards_from_the_mirror(
    tmp_path, corpus, reference
):
    """With --use-distributed-optimizer a rank's optimizer state is a shard of the dense parameters'
    (over DP) and one of its experts' (over the expert-DP group), both mirrored into its holder's host
    memory (rank 6, its data-parallel ring neighbour); the joiner takes both from there and every rank
    rebuilds its parameters from the main ones: bit-identical, no checkpoint."""
    extra = [*MOE, "--use-distributed-optimizer"]
    ref = reference(f"{REF}-distopt", 8, tm_args(corpus, tp=1, extra=extra))
    job = run_job(
        tmp_path, 8, tm_args(corpus, tp=1, extra=[*extra, "--tm-inject-fault", "5:6:backward"]), name="moe_distopt"
    )
    assert_recovered(job, ref, victim=5)
    assert state_sources(job, 5) == ["mirror"] and transfer_pairs(job) == {(6, 5)}, transfer_pairs(job)


def test_a_planned_move_of_an_expert_rank_is_bit_identical(tmp_path, corpus, reference):
    """`trainmover migrate --rank 2` (first stage, EP rank 0): the leaver hands its experts and dense
    state to a standby at an iteration boundary, and the run stays bit-identical."""
    args = tm_args(corpus, tp=1, extra=MOE, standby_nice=None)
    ref = reference(REF, 8, tm_args(corpus, tp=1, extra=MOE))
    job = start_job(tmp_path, 8, args, name="moe_planned")
    try:
        wait_iteration(job, 3)
        wait_warm(job)
        done = trainmover_cli("migrate", "--rank", "2", *control_flags(job))
        assert done.returncode == 0, done.stderr[-2000:]
    except BaseException:
        job.popen.kill()
        raise
    err = finish_job(job)
    assert [(r["rank"], r["joiner"][:7]) for r in replaced(job)] == [(2, "standby")], err[-3000:]
    assert replaced(job)[0]["reason"] == "planned" and not fell_back(job), err[-3000:]
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == ref, "the trajectory differs from the run without a migration"
    assert [r[0] for r in transfer_reports(job)] == [2], "the leaver was not the source"
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "a rank restarted"
    assert_transfer_memory(job)


def test_a_sandbox_standby_replays_the_all_to_alls_and_replaces_a_killed_expert_rank(tmp_path, corpus, reference):
    """The standby warms both pipeline roles in its sandbox, replaying the job's recorded all-to-alls
    (token counts differ per call, so each call's split sizes come from its recording), then takes the
    place of SIGKILLed rank 4 (first stage, EP rank 0; its experts live on rank 6)."""
    iters = 40  # the standby must be warm (two roles) well before the end
    ref = reference(f"{REF}-i40", 8, tm_args(corpus, tp=1, iters=iters, extra=MOE))
    job = start_job(tmp_path, 8, tm_args(corpus, tp=1, iters=iters, sandbox=True, extra=MOE), name="moe_sandbox")
    log = lambda: job.stdout() + job.stderr()  # noqa: E731
    try:
        warm = wait_for(
            lambda: re.search(r"standby (\S+) warm in [\d.]+s \(sandbox, roles \[([^\]]*)\]\)", log()),
            180,
            0.2,
            "the standby's sandbox warm-up",
            detail=lambda: log()[-4000:],
            give_up=lambda: job.popen.poll() is not None,
        )
        killed_at = max((r["iteration"] for r in read_metrics(job.metrics_path)), default=0)
        assert killed_at < iters - 5, f"the standby was warm only at iteration {killed_at}: too late to test"
        kill_quietly(job.rank_pids()[0][4], signal.SIGKILL)
        code = job.wait(300)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, log()[-4000:]
    assert sorted(warm.group(2).split(", ")) == ["'first'", "'last'"], warm.group(0)
    assert f"rank 4 -> {warm.group(1)}" in log(), log()[-3000:]
    assert "falling back" not in log() and "basic warm-up only" not in log(), log()[-3000:]
    assert transfer_pairs(job) == {(6, 4)}, transfer_pairs(job)
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, iters + 1)), "an iteration is missing"
    assert got == ref, "the trajectory differs from the fault-free run"
