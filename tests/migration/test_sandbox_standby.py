"""A sandbox-warmed standby replaces a SIGKILLed rank (real launcher, etcd, processes).

The job records its first iterations into ``--tm-record-dir``; the launcher's standby warms the
last and first roles from the recordings and keeps the first role's model (``--tm-keep-role
first``). Killed is either the rank that role was recorded at (rank 0: TP0, DP0 of the first
stage), whose model the standby adopts instead of building one, or another rank, for which it
drops the kept model and builds the rank's own. (The last role's recorded rank, 4, is the rank
that logs the trajectory: killed between finishing an iteration and logging it, it takes that
line with it, while the job resumes after that iteration.) Both runs must be bit-identical to the fault-free run:
neither the recording, nor the shadow iterations, nor the adopted model may leave a trace in the training.
"""

from __future__ import annotations

import re
import signal

import pytest

from helpers import control_flags, kill_quietly, run_job, start_job, tm_args, trainmover_cli, trajectory, wait_for

ITERS = 40  # the standby must be warm (two roles) well before the end
# TP2 x PP2 x DP2: rank = tp + 2*dp + 4*pp
CASES = [
    pytest.param(0, True, id="first-role-recorder-adopts-the-kept-model"),
    pytest.param(2, False, id="first-stage-dp1-builds-its-model"),
]


def _log(job) -> str:
    return job.stdout() + job.stderr()


def _last_iteration(job) -> int:
    its = [int(m) for m in re.findall(r'"iteration": (\d+)', open(job.metrics_path).read())]
    return max(its, default=0)


@pytest.mark.parametrize("victim,adopts", CASES)
def test_sandbox_standby_replaces_a_killed_rank_bit_identically(tmp_path, corpus, reference, victim, adopts):
    args = tm_args(corpus, iters=ITERS, sandbox=True)
    # The reference records nothing: recording must leave no trace in the training either.
    ref = reference("tp2pp2dp2-i40", 8, tm_args(corpus, iters=ITERS))
    # The standby keeps its CPU priority (--tm-standby-nice 0): on two cores, at the lowest priority
    # it would be warm only after the 40 iterations the job runs. One case names the directory; the
    # other runs the launcher's default (<run dir>/recordings).
    record = ["--tm-record-dir", str(tmp_path / "recordings")] if adopts else []
    job = start_job(tmp_path, 8, args + [*record, "--tm-keep-role", "first"], name=f"sandbox_{victim}")
    try:
        warm = wait_for(
            lambda: re.search(r"standby (\S+) warm in [\d.]+s \(sandbox, roles \[([^\]]*)\]\)", _log(job)),
            180,
            0.2,
            "the standby's sandbox warm-up",
            detail=lambda: _log(job)[-4000:],
            give_up=lambda: job.popen.poll() is not None,
        )
        status = trainmover_cli("status", *control_flags(job))
        row = next(line for line in status.stdout.splitlines() if line.strip().startswith(warm.group(1)))
        assert row.rstrip().endswith("rank 0"), status.stdout  # the kept model, shown to the operator
        killed_at = _last_iteration(job)
        assert killed_at < ITERS - 5, f"the standby was warm only at iteration {killed_at}: too late to test"
        kill_quietly(job.rank_pids()[0][victim], signal.SIGKILL)
        code = job.wait(300)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    log = _log(job)
    assert code == 0, log[-4000:]
    # both roles warm; the kept one (first) was warmed last
    assert warm.group(2) == "'last', 'first'", warm.group(0)
    assert f"rank {victim} -> {warm.group(1)}" in log, log[-3000:]
    if adopts:
        m = re.search(
            rf"standby {re.escape(warm.group(1))} adopted its kept first model for rank {victim} "
            r"\((\d+) group references re-pointed\)",
            log,
        )
        assert m and int(m.group(1)) > 0, log[-3000:]
    else:
        assert (
            f"standby {warm.group(1)} builds rank {victim}'s model (the kept first model was built as rank 0)" in log
        ), log[-3000:]
    assert "falling back" not in log and "basic warm-up only" not in log, log[-3000:]
    if not adopts:
        assert re.search(r"sandbox: the job records its first iterations into \S+/recordings", log), log[-3000:]
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1)), "an iteration is missing"
    assert got == ref, "the trajectory differs from the fault-free run"


def test_a_standby_promoted_while_it_warms_stops_warming_and_serves(tmp_path, corpus, reference):
    """The launcher's default sandbox with a standby paced to 2% of a core (``--tm-standby-duty 0.02``):
    rank 5 dies at iteration 4, long before the standby's roles are warm. It serves anyway (it advertised
    every role once its fingerprint matched), its warm-up stops at once, and the run is bit-identical."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    args = tm_args(corpus, sandbox=True, extra=["--tm-standby-duty", "0.02", "--tm-inject-fault", "5:4:backward"])
    job = run_job(tmp_path, 8, args, name="promoted_warming", timeout=300)
    log = _log(job)
    m = re.search(r"standby (\S+) warm in [\d.]+s \(sandbox, roles \[[^\]]*\]\); warming stopped: promoted", log)
    assert m, log[-4000:]
    assert f"rank 5 -> {m.group(1)}" in log, log[-3000:]
    assert "falling back" not in log and "basic warm-up" not in log, log[-3000:]
    assert trajectory(job.metrics_path) == ref, "the trajectory differs from the fault-free run"
