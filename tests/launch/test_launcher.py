"""The launcher with real processes: stop-restart, teardown without orphans, signals."""

from __future__ import annotations

import signal

from helpers import (
    kill_quietly,
    losses_by_iteration,
    pid_alive,
    read_metrics,
    run_job,
    start_job,
    tiny_args,
    wait_for,
)


def test_max_restarts_survives_sigkill_of_one_rank(tmp_path, corpus):
    """--max-restarts 1: a SIGKILLed rank makes every rank restart from the latest checkpoint."""
    iters = 12
    args = tiny_args(corpus, pp=2, iters=iters, gbs=4, extra=["--save-interval", "3"])
    ref = run_job(tmp_path, 4, args + ["--save", str(tmp_path / "ref")], name="ref")
    ckpt = tmp_path / "ckpt"
    job = start_job(
        tmp_path, 4, args + ["--save", str(ckpt), "--load", str(ckpt)], "--max-restarts", "1", name="restarted"
    )
    latest = ckpt / "latest_checkpointed_iteration.txt"
    wait_for(lambda: latest.exists() and int(latest.read_text()) >= 3, 240, what="first checkpoint")
    first_pids = job.rank_pids()[0]
    kill_quietly(first_pids[2], signal.SIGKILL)
    assert job.wait(300) == 0, job.stderr()[-3000:]
    starts = job.rank_pids()
    assert len(starts) == 2, "expected exactly one restart"
    assert not set(starts[0]) & set(starts[1]), "restarted ranks must be fresh processes"
    assert all(not pid_alive(p) for p in starts[0] + starts[1])
    assert "restart 1/1" in job.stderr()
    # after the restart the trajectory continues exactly as an uninterrupted run
    ref_losses = losses_by_iteration(ref.metrics_path)
    recs = read_metrics(job.metrics_path)
    assert recs[-1]["iteration"] == iters
    for rec in recs:
        assert rec["loss"] == ref_losses[rec["iteration"]], rec


def test_crash_of_one_rank_leaves_no_process_behind(tmp_path):
    """Without restarts, one crashed rank stops the job and every rank pid is gone."""
    job = start_job(tmp_path, 4, tiny_args(None, pp=2, iters=100000, gbs=4), name="crash")
    wait_for(lambda: len(read_metrics(job.metrics_path)) >= 2, 120, what="two iterations")
    pids = job.rank_pids()[0]
    kill_quietly(pids[1], signal.SIGKILL)
    code = job.wait(60)
    assert code == 128 + signal.SIGKILL, (code, job.stderr()[-2000:])
    assert "rank 1" in job.stderr() and "SIGKILL" in job.stderr()
    wait_for(lambda: all(not pid_alive(p) for p in pids), 10, what="all ranks gone")


def test_ctrl_c_tears_down_all_ranks(tmp_path):
    job = start_job(tmp_path, 2, tiny_args(None, pp=2, iters=100000, gbs=2), name="sigint")
    wait_for(lambda: len(read_metrics(job.metrics_path)) >= 1, 120, what="one iteration")
    pids = job.rank_pids()[0]
    job.popen.send_signal(signal.SIGINT)
    assert job.wait(60) == 128 + signal.SIGINT
    wait_for(lambda: all(not pid_alive(p) for p in pids), 10, what="all ranks gone")


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of the agent itself: the kernel kills its ranks (PR_SET_PDEATHSIG)."""
    job = start_job(tmp_path, 2, tiny_args(None, pp=2, iters=100000, gbs=2), name="agentkill")
    wait_for(lambda: len(read_metrics(job.metrics_path)) >= 1, 120, what="one iteration")
    pids = job.rank_pids()[0]
    job.popen.kill()
    job.popen.wait(10)
    wait_for(lambda: all(not pid_alive(p) for p in pids), 10, what="orphaned ranks to die")
