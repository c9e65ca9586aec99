"""Unexpected failures replaced by a warm standby: bit-identical trajectories (real processes, real etcd)."""

from __future__ import annotations

import pytest

from helpers import ITERS, read_metrics, run_job, tm_args, trajectory


def _assert_recovered(job, ref, victim: int):
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1)), "an iteration is missing"
    for it in ref:
        assert got[it] == ref[it], f"iteration {it}: {got[it]} != fault-free {ref[it]}"
    # no sample skipped or repeated: consumed samples advance by exactly one global batch
    consumed = [got[i][1] for i in sorted(got)]
    assert all(b - a == consumed[0] for a, b in zip(consumed, consumed[1:]))
    err = job.stderr()
    assert f"rank {victim} " in err and "-> standby" in err, err[-3000:]
    promoted = read_metrics(job.metrics_path, "promoted")
    return promoted


# victim rank -> (stage, tp rank) in TP2 x PP2 x DP2: rank = tp + 2*dp + 4*pp
CASES = [
    pytest.param(0, "forward", id="first-stage-tp0-forward"),
    pytest.param(5, "backward", id="last-stage-tp1-backward"),
    pytest.param(3, "allreduce", id="first-stage-tp1-allreduce"),
    pytest.param(6, "step", id="last-stage-tp0-step"),
]


@pytest.mark.parametrize("victim,phase", CASES)
def test_sigkill_is_replaced_bit_identically(tmp_path, corpus, reference, victim, phase):
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", f"{victim}:6:{phase}"]),
                  name=f"fault_{victim}_{phase}", timeout=300)
    assert "exited with code -9" in job.stderr()
    _assert_recovered(job, ref, victim)


def test_hung_rank_is_detected_by_lease_and_fenced(tmp_path, corpus, reference):
    """SIGSTOP: no link error, no exit; the lease expires, the rank is replaced and the hung process killed."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", "4:6:forward:STOP"]),
                  name="hung", timeout=300)
    _assert_recovered(job, ref, 4)
    pids = job.rank_pids()
    assert pids, job.stderr()[-2000:]
