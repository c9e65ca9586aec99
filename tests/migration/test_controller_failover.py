"""The controller leader SIGKILLed around a migration, end to end: a stand-alone `trainmover controller`
leads the job; it is killed at the failure (the next leader must decide) or right after it wrote the plan
(the ranks must finish the migration without it). Real etcd, real processes, bit-identical trajectories."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

import pytest

from harness.jobs import REPO_ROOT
from helpers import ITERS, JobProbe, read_metrics, start_job, tm_args, trajectory, wait_for, wait_iteration


def _start_controller(etcd, job: str, token: str, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "controller",
        "--tm-etcd-endpoints",
        ",".join(etcd.endpoints),
        "--tm-job",
        job,
        "--tm-job-token",
        token,
        "--id",
        "ext-controller",
        "--tm-lease-ttl",
        "1",
    ]
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


@pytest.mark.parametrize("when", ["at-the-failure", "after-the-plan"])
def test_leader_killed_around_a_migration(tmp_path, etcd, corpus, reference, when):
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job_name, token = f"ctlkill-{when}", secrets.token_hex(16)
    probe = JobProbe(etcd.endpoints, job_name, token)
    ctl_log = tmp_path / "controller.log"
    ctl = _start_controller(etcd, job_name, token, open(ctl_log, "w"))
    job = None
    try:
        # The stand-alone candidate registers the job and leads before any agent exists.
        wait_for(lambda: "ext-controller leads" in ctl_log.read_text(), 60, what="the controller to lead")
        job = start_job(
            tmp_path,
            8,
            tm_args(corpus),
            "--tm-job",
            job_name,
            "--tm-etcd-endpoints",
            ",".join(etcd.endpoints),
            "--tm-job-token",
            token,
            name=when,
        )
        wait_iteration(job, 4, timeout=180)
        assert probe.leader() == "ext-controller"
        victim = job.rank_pids()[0][2]
        if when == "at-the-failure":
            ctl.kill()
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: probe.plans(), 60, interval=0.002, what="the plan")
            ctl.kill()
            assert "first_iteration" not in probe.plans()[0].steps, "killed too late: the migration was over"
        ctl.wait(10)
        # An agent's controller is elected about one lease TTL (1 s) later, long before the job ends.
        wait_for(
            lambda: (probe.leader() or "").startswith("agent-"),
            30,
            interval=0.05,
            what="an agent's controller to take over",
        )
        code = job.wait(300)
    finally:
        if ctl.poll() is None:
            ctl.kill()
        if job is not None and job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, job.stderr()[-4000:]
    plans = probe.plans()
    assert len(plans) == 1, f"the migration was decided {len(plans)} times"
    if when == "at-the-failure":
        assert plans[0].decided_by.startswith("agent-"), plans[0].decided_by
    else:
        assert plans[0].decided_by == "ext-controller", plans[0].decided_by
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == ref, "the trajectory differs from the run without a failure"
    (rep,) = plans[0].replacement_list()
    assert rep.rank == 2 and rep.joiner.startswith("standby"), rep
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "the job fell back to stop-restart"
