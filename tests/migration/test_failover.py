"""Unexpected failures replaced by a warm standby: bit-identical trajectories (real processes, real etcd)."""

from __future__ import annotations

import re

import pytest

from helpers import (
    LLAMA,
    assert_recovered,
    fell_back,
    read_metrics,
    replaced,
    run_job,
    state_sources,
    tm_args,
    trajectory,
)

# victim rank -> (stage, tp rank) in TP2 x PP2 x DP2: rank = tp + 2*dp + 4*pp
CASES = [
    pytest.param(0, "forward", id="first-stage-tp0-forward"),
    pytest.param(5, "backward", id="last-stage-tp1-backward"),
    pytest.param(3, "allreduce", id="first-stage-tp1-allreduce"),
    pytest.param(6, "step", id="last-stage-tp0-step"),
    # The logging rank, after its step and before its metrics record: the job resumes after that
    # iteration, and the replacement writes the record it gets from its data-parallel replica.
    pytest.param(4, "log", id="logging-rank-after-step"),
]


@pytest.mark.parametrize("victim,phase", CASES)
def test_sigkill_is_replaced_bit_identically(tmp_path, corpus, reference, victim, phase):
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path,
        8,
        tm_args(corpus, extra=["--tm-inject-fault", f"{victim}:6:{phase}"]),
        name=f"fault_{victim}_{phase}",
        timeout=300,
    )
    assert_recovered(job, ref, victim)
    assert [r["why"] for r in replaced(job, "failure")] == ["link broken: process exited with code -9"]
    restored = [r for r in read_metrics(job.metrics_path, "iteration") if "restored_from_rank" in r]
    assert [(r["iteration"], r["restored_from_rank"]) for r in restored] == ([(6, 6)] if phase == "log" else [])


def test_llama_architecture_in_bf16_is_replaced_bit_identically(tmp_path, corpus, reference):
    """Megatron-LM's Llama flags (RMSNorm, SwiGLU, rope, grouped-query attention, no linear biases,
    untied output) in bf16 with dropout 0.1: a SIGKILLed last-stage rank is replaced bit-identically."""
    args = tm_args(corpus, extra=[*LLAMA, "--bf16"])
    ref = reference("tp2pp2dp2-llama-bf16", 8, args)
    job = run_job(tmp_path, 8, args + ["--tm-inject-fault", "5:6:backward"], name="llama_fault", timeout=300)
    assert_recovered(job, ref, 5)


def test_hung_rank_is_fenced_by_its_agent(tmp_path, corpus, reference):
    """SIGSTOP: no link error, no exit. Its agent sees the heartbeat stop while the process uses no CPU,
    kills it and reports the hang (launch.heartbeat), well before its lease would expire."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", "4:6:forward:STOP"]), name="hung", timeout=300
    )
    assert_recovered(job, ref, 4)
    whys = [r["why"] for r in replaced(job, "failure")]
    assert len(whys) == 1 and whys[0].startswith("link broken: hung: no heartbeat for"), whys
    log = job.stderr()
    assert re.search(r"rank 4 \(worker-n0-4-\w+\) hung: no heartbeat for [\d.]+s and no CPU time used", log), log[
        -3000:
    ]


@pytest.mark.slow
def test_hung_rank_is_detected_by_lease_without_the_hang_path(tmp_path, corpus, reference):
    """``--tm-hang-timeout 0``: the lease expiry finds the frozen rank, and the plan fences it."""
    args = tm_args(corpus, extra=["--tm-hang-timeout", "0"])
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, args + ["--tm-inject-fault", "4:6:forward:STOP"], name="hung_lease", timeout=300)
    assert_recovered(job, ref, 4)
    assert [r["why"] for r in replaced(job, "failure")] == ["lease expired"]


MIDDLE = [
    # TP1 x PP3 x DP2 (6 ranks): rank = dp + 2*pp; rank 2 is the middle stage, TP rank 0
    pytest.param(6, 1, 2, "backward", id="middle-stage-tp0-backward"),
    # TP2 x PP3 x DP2 (12 ranks): rank = tp + 2*dp + 4*pp; rank 5 is the middle stage, TP rank 1
    pytest.param(12, 2, 5, "step", id="middle-stage-tp1-step"),
]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tp,victim,phase", MIDDLE)
def test_middle_stage_sigkill_is_replaced_bit_identically(tmp_path, corpus, reference, nproc, tp, victim, phase):
    args = tm_args(corpus, tp=tp, pp=3, extra=["--num-layers", "6"])
    ref = reference(f"tp{tp}pp3dp2", nproc, args)
    job = run_job(
        tmp_path,
        nproc,
        args + ["--tm-inject-fault", f"{victim}:6:{phase}"],
        name=f"middle_{victim}_{phase}",
        timeout=600,
    )
    assert_recovered(job, ref, victim)


def test_no_replica_falls_back_to_the_checkpoint_without_restarts(tmp_path, corpus, reference):
    """DP=1: the lost shard exists nowhere else, so every rank reloads the latest checkpoint (iteration 4)
    through the warm path; only the dead rank is replaced, nothing restarts, and the re-run iterations
    5..6 reproduce the fault-free values."""
    ckpt = str(tmp_path / "ckpt")
    args = tm_args(corpus, gbs=4)
    ref = reference("tp2pp2dp1", 4, args)
    job = run_job(
        tmp_path,
        4,
        args + ["--save", ckpt, "--save-interval", "4", "--tm-inject-fault", "1:7:forward"],
        name="no_replica",
        timeout=300,
    )
    got = trajectory(job.metrics_path)
    assert got == ref
    assert [(r["rank"], r["joiner"][:7]) for r in replaced(job, "failure")] == [(1, "standby")]
    assert state_sources(job, 1) == ["checkpoint"]
    assert not fell_back(job) and len(read_metrics(job.metrics_path, "startup")) == 1, job.stderr()[-3000:]
    recovered = read_metrics(job.metrics_path, "recovered")
    assert [r["resumed_iteration"] for r in recovered] == [4], recovered
