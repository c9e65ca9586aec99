"""Leaving training early as Megatron-LM does (real processes): ``--exit-interval``,
``--exit-duration-in-mins`` and ``--exit-signal-handler`` save a checkpoint at an iteration
boundary that every rank agrees on, and the job exits 0."""

from __future__ import annotations

import os
import signal

from helpers import read_metrics, run_job, start_job, tiny_args, wait_for


def _latest(ckpt) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def test_exit_interval_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(None, iters=10, gbs=4, extra=["--save", str(ckpt)])
    job = run_job(tmp_path, 2, args + ["--exit-interval", "3"], name="exit_interval")
    assert [r["iteration"] for r in read_metrics(job.metrics_path)] == [1, 2, 3]
    assert _latest(ckpt) == 3 and "exiting at iteration 3: --exit-interval 3" in job.stdout()
    resumed = run_job(tmp_path, 2, args + ["--load", str(ckpt)], name="resumed")
    assert read_metrics(resumed.metrics_path, "startup")[0]["resumed_iteration"] == 3
    assert [r["iteration"] for r in read_metrics(resumed.metrics_path)] == list(range(4, 11))


def test_exit_duration_in_mins(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(None, iters=50, gbs=4, extra=["--save", str(ckpt), "--exit-duration-in-mins", "0.0001"])
    job = run_job(tmp_path, 2, args, name="exit_duration")
    done = [r["iteration"] for r in read_metrics(job.metrics_path)]
    assert done and max(done) < 50 and _latest(ckpt) == max(done)
    assert "--exit-duration-in-mins 0.0001" in job.stdout()


def _sigterm_one_rank(tmp_path, handler: bool):
    ckpt = tmp_path / "ckpt"
    extra = ["--save", str(ckpt)] + (["--exit-signal-handler"] if handler else [])
    job = start_job(tmp_path, 2, tiny_args(None, iters=2000, gbs=4, extra=extra), name=f"sigterm_{handler}")
    wait_for(lambda: len(read_metrics(job.metrics_path)) >= 3, 120, what="three iterations")
    os.kill(job.rank_pids()[0][1], signal.SIGTERM)  # the rank that does not log
    return job, ckpt, job.wait(120)


def test_exit_signal_handler_saves_on_sigterm(tmp_path):
    job, ckpt, code = _sigterm_one_rank(tmp_path, handler=True)
    assert code == 0, job.stderr()[-3000:]
    done = [r["iteration"] for r in read_metrics(job.metrics_path)]
    assert max(done) < 2000 and _latest(ckpt) == max(done), (done[-3:], _latest(ckpt))
    assert "SIGTERM (--exit-signal-handler)" in job.stdout()


def test_without_the_handler_sigterm_fails_the_job(tmp_path):
    """The companion: the same SIGTERM without --exit-signal-handler ends the rank and the job."""
    job, ckpt, code = _sigterm_one_rank(tmp_path, handler=False)
    assert code != 0 and not (ckpt / "latest_checkpointed_iteration.txt").exists()
