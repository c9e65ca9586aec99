"""The defaults hold under load: the job beside two CPU spinners at normal priority (the two cores of the
test machine each shared with a busy loop, on top of four ranks and a standby) replaces nobody and
trains the fault-free trajectory bit for bit. Every default: lease TTL, hang timeout, progress bound.
(Eight ranks, a standby and two spinners on two cores starve the job's own etcd for seconds: that
measures the machine, not the defaults.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import run_job, tm_args, trajectory

ITERS = 60


@pytest.mark.slow
def test_the_job_beside_two_cpu_spinners_replaces_nobody(tmp_path, corpus, reference):
    args = tm_args(corpus, tp=1, pp=2, gbs=8, iters=ITERS)
    ref = reference(f"tp1pp2dp2-{ITERS}", 4, args)
    spin = "while True:\n    pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        job = run_job(tmp_path, 4, args, name="loaded", timeout=600)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait(10)
    assert not job.events("migration_planned"), [e["detail"] for e in job.events("migration_planned")]
    assert not job.events("stop_restart")
    assert trajectory(job.metrics_path) == ref
