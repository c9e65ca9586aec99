"""GPU: a planned move and a failover on NCCL (run by scripts/gpu_check_multi.sh: 2+ GPUs). One active node of 2 ranks
(TP1·PP1·DP2, GPUs 0-1) and a standby machine of 2 slots, agents on loopback. Rank 0 moves to the
machine's slot 0; then rank 1 is killed and the machine's slot 1 takes it, its state from rank 0's new
process over the job's NCCL links.

With 4 GPUs the machine has GPUs 2-3 of its own, and the hand-over runs on an NCCL pair (two distinct
GPUs). With 2 or 3 the machine shares GPUs 0-1 with the active node, as a spare process per GPU: slot 0
is on the leaver's GPU, so the hand-over is staged through host memory over gloo (NCCL refuses two ends
on one device), and slot 1 takes the killed rank's GPU. Either way the job's links are NCCL."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from harness.nodes import Node, NodesJob
from helpers import (
    JobProbe,
    control_flags,
    fell_back,
    finish_job,
    replaced,
    run_job,
    start_job,
    tm_args,
    trainmover_cli,
    trajectory,
    wait_iteration,
    wait_until,
    wait_warm,
)

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: 2 ranks, and a standby machine of 2 slots on the same or 2 more devices",
)
def test_a_planned_move_and_a_failover_on_nccl(tmp_path, corpus):
    args = tm_args(corpus, tp=1, pp=1, iters=60)
    own_gpus = torch.cuda.device_count() >= 4
    handover = "nccl" if own_gpus else "gloo"
    nodes = [
        Node(env=(("CUDA_VISIBLE_DEVICES", "0,1"),)),
        Node(machine=True, env=(("CUDA_VISIBLE_DEVICES", "2,3" if own_gpus else "0,1"),)),
    ]
    job = NodesJob(tmp_path, args, nodes, "gpumoves", per_node=2)
    try:
        probe = JobProbe(job.etcd.endpoints, job.name, job.token)
        job.wait_warm_machine("n1", probe.view)
        job.wait_iteration(3)
        flags = ["--tm-etcd-endpoints", ",".join(job.etcd.endpoints), "--tm-job", job.name, "--tm-job-token", job.token]
        out = trainmover_cli("migrate", "--rank", "0", *flags, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr + job.errs()
        moved = wait_until(lambda: any("transferred" in p.steps for p in probe.plans()), 240, 0.5)
        assert moved, job.errs()
        os.kill(job.rank_pid(1), signal.SIGKILL)
        assert job.finish() == [0, 0], job.errs()
        plans = sorted(probe.plans(), key=lambda p: p.epoch)
        assert [(p.reason, [r.rank for r in p.replacement_list()]) for p in plans] == [
            ("planned", [0]),
            ("failure", [1]),
        ], plans
        logs = "".join(open(job.dir / f"n{i}.{kind}").read() for i in range(2) for kind in ("out", "err"))
        assert f"planned hand-over of epoch 1 on {handover}" in logs, logs[-4000:]
        assert "falling back" not in logs
    finally:
        job.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_planned_move_on_one_gpu_is_bit_identical(tmp_path, corpus):
    """One GPU (scripts/gpu_check.sh): a one-rank bf16 job with a standby on the same device, warmed in its
    sandbox (the launcher's default). `trainmover migrate --rank 0` hands the rank's CUDA state to the
    standby through host memory (NCCL refuses two ends on one device), and the job trains on with the
    losses of a run without the move, bit for bit."""
    args = tm_args(corpus, tp=1, pp=1, gbs=4, iters=40, extra=["--bf16"], standby_nice=None, sandbox=True)
    ref = trajectory(run_job(tmp_path, 1, args, name="ref").metrics_path)
    job = start_job(tmp_path, 1, args, name="onegpu")
    try:
        wait_iteration(job, 3)
        wait_warm(job, "first")  # a one-stage job's rank has the first stage's role
        out = trainmover_cli("migrate", "--rank", "0", *control_flags(job), timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert job.wait(300) == 0, job.stderr()[-4000:]
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert [(r["rank"], r["reason"]) for r in replaced(job)] == [(0, "planned")], job.stderr()[-3000:]
    assert not fell_back(job), job.stderr()[-3000:]
    assert "planned hand-over of epoch 1 on gloo" in job.stdout() + job.stderr()
    assert trajectory(job.metrics_path) == ref, "the trajectory differs from the run without the move"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA devices (one per rank)"
)
def test_a_slowed_rank_is_named_from_the_devices_timelines(tmp_path, corpus):
    """4 GPUs, PP2 x DP2 on NCCL: rank 1 is 1.5x slower from iteration 10 of 150. Every rank's wall time per
    iteration is then rank 1's (the others' streams stall in the collectives), so only the devices'
    timelines (trainmover_ext.launch.device_time) can name it: the watch names rank 1 alone."""
    extra = ["--bf16", "--tm-straggler-action", "report", "--tm-inject-slowdown", "1:1.5:10"]
    job = start_job(tmp_path, 4, tm_args(corpus, tp=1, pp=2, gbs=8, iters=150, extra=extra), name="gpu_straggler")
    err = finish_job(job, 600)
    assert [f["detail"]["rank"] for f in job.events("straggler")] == [1], err[-3000:]
