"""Planned migration (`trainmover migrate --rank R`): the leaver hands its state to a warm standby at an
iteration boundary while the job trains on; the trajectory stays bit-identical to a run without it."""

from __future__ import annotations

import pytest

from helpers import (ITERS, assert_transfer_memory, control_flags, read_metrics, start_job, tm_args,
                     trainmover_cli, trajectory, transfer_reports, wait_iteration)

# TP2 x PP2 x DP2: rank = tp + 2*dp + 4*pp
CASES = [
    pytest.param(1, id="first-stage-tp1"),
    pytest.param(6, id="last-stage-tp0"),
]


def _migrate_and_check(tmp_path, corpus, reference, nproc, args, ref_key, rank):
    ref = reference(ref_key, nproc, args)
    job = start_job(tmp_path, nproc, args, name=f"planned_{rank}")
    try:
        wait_iteration(job, 3)
        done = trainmover_cli("migrate", "--rank", str(rank), *control_flags(job))
        assert done.returncode == 0, done.stderr[-2000:]
        code = job.wait(300)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, job.stderr()[-4000:]
    err = job.stderr()
    assert f"(planned): rank {rank} -> standby" in err, err[-3000:]
    assert "falling back" not in err and "exited with code" not in err, err[-3000:]
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == ref, "the trajectory differs from the run without a migration"
    # the logging rank switched links at one iteration boundary after the request (no restart)
    switched = read_metrics(job.metrics_path, "recovered")
    assert [(s["reason"], s["epoch"]) for s in switched] == [("planned", 1)], switched
    assert 3 <= switched[0]["resumed_iteration"] < ITERS
    assert len(read_metrics(job.metrics_path, "startup")) == 1, "a rank restarted"
    assert [r[0] for r in transfer_reports(job)] == [rank], "the leaver was not the source"
    assert_transfer_memory(job)


@pytest.mark.parametrize("rank", CASES)
def test_planned_migration_is_bit_identical(tmp_path, corpus, reference, rank):
    _migrate_and_check(tmp_path, corpus, reference, 8, tm_args(corpus), "tp2pp2dp2", rank)


@pytest.mark.slow
def test_planned_migration_of_a_middle_stage(tmp_path, corpus, reference):
    """PP3: the middle stage receives and sends activations; rank 2 = (tp0, dp0, pp1) in TP1 x PP3 x DP2."""
    args = tm_args(corpus, tp=1, pp=3, extra=["--num-layers", "6"])
    _migrate_and_check(tmp_path, corpus, reference, 6, args, "tp1pp3dp2", 2)
