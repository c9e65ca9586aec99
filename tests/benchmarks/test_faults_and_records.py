"""The fault schedule is the same for every strategy, the launcher's log tells which process serves a rank,
and a run's records give every rank's resume, its state, and the plans no fault explains."""

from __future__ import annotations

import math
import subprocess
import sys

import faults
import run_records as rr
from strategies import unscheduled


def test_a_seed_gives_one_schedule():
    a = faults.make_schedule(3, 300, 25, world=8, stop_share=0.2, cascade_share=0.25)
    assert a == faults.make_schedule(3, 300, 25, world=8, stop_share=0.2, cascade_share=0.25)
    assert a != faults.make_schedule(4, 300, 25, world=8, stop_share=0.2, cascade_share=0.25)
    assert all(e["kind"] in ("kill", "hang") and 0 <= e["rank"] < 8 and e["after_iteration"] <= 290 for e in a)
    gaps = [b["after_iteration"] - a["after_iteration"] for a, b in zip(a, a[1:], strict=False)]
    assert min(gaps) >= 4 and 15 < sum(gaps) / len(gaps) < 35
    assert [e["cascade"] for e in a if e["cascade"]][:2] == ["joiner", "other"]


def test_rarer_failures_make_fewer_events():
    often = sum(len(faults.make_schedule(s, 400, 25, world=8)) for s in range(3))
    rare = sum(len(faults.make_schedule(s, 400, 100, world=8)) for s in range(3))
    assert rare * 2 < often


class _Proc:
    def poll(self):
        return None


def test_the_launcher_log_says_who_serves_a_rank(tmp_path):
    err, metrics = tmp_path / "job.err", tmp_path / "job.jsonl"
    err.write_text("[trainmover launch] started 4 ranks, pids [10, 11, 12, 13], and 1 standby(s)\n")
    target = faults.LauncherTarget(_Proc(), str(err), str(metrics))
    assert target.pid_of(2) == 12 and target.recoveries() == 0 and target.replacement_pid(2, 0) is None
    with open(err, "a") as f:
        f.write("[trainmover launch] epoch 1 (failure): rank 2 -> standby-n0-0-ab (pid 20); state from replica\n")
    assert target.pid_of(2) == 20 and target.recoveries() == 1 and target.replacement_pid(2, 0) == 20
    with open(err, "a") as f:  # a stop-restart: every rank anew
        f.write("[trainmover launch] started 4 ranks (fork), pids [30, 31, 32, 33]\n")
    assert target.pid_of(2) == 32 and target.recoveries() == 2 and target.replacement_pid(1, 1) == 31


def test_the_harness_fences_a_hang_for_a_strategy_without_detection(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {}
        faults._fence_later(child.pid, 0.05, record).join(10)
        assert child.wait(10) == -9 and record["fenced_t"] > 0
    finally:
        child.kill()


def test_every_ranks_resume_is_its_last_before_the_next_fault():
    records = [
        {"event": "recovered", "rank": 0, "t": 10.5},
        {"event": "recovered", "rank": 0, "t": 11.0},  # a cascade: recovered again
        {"event": "promoted", "rank": 3, "state_ready": 10.8},
        {"event": "startup", "rank": 1, "checkpoint_loaded": 12.0},
        {"event": "recovered", "rank": 2, "t": 30.0},  # the next fault's
        {"event": "recovered", "rank": None, "t": 10.2},
    ]
    assert rr.resume_times(records, 10.0, 20.0) == {0: 11.0, 1: 12.0, 3: 10.8}


def test_states_are_identical_only_when_every_rank_matches():
    same = {r: {"params": "p", "optimizer": f"o{r}"} for r in range(4)}
    assert rr.compare_states(same, dict(same), 4)["state_identical"]
    missing = {r: v for r, v in same.items() if r != 2}
    assert rr.compare_states(missing, same, 4) == {
        "state_identical": False,
        "missing_ranks": [2],
        "differing_ranks": [],
    }
    changed = same | {1: {"params": "p", "optimizer": "x"}}
    assert rr.compare_states(changed, same, 4)["differing_ranks"] == [1]


ARCHIVE = [
    {"what": "member_joined", "time": 1.0, "detail": {"kind": "standby", "member": "s0"}},
    {"what": "member_joined", "time": 1.1, "detail": {"kind": "standby", "member": "s1"}},
    {"what": "standby_started", "time": 0.9, "detail": {"member": "s1", "how": "pre-forked"}},
    {
        "what": "migration_planned",
        "time": 5.0,
        "detail": {
            "epoch": 1,
            "reason": "failure",
            "replacements": [{"rank": 3, "joiner": "s0", "why": "lease expired"}],
        },
    },
    {
        "what": "migration_planned",
        "time": 9.2,
        "detail": {"epoch": 2, "reason": "failure", "replacements": [{"rank": 5, "joiner": "s1", "why": "exit -9"}]},
    },
]


def test_epochs_idle_standbys_and_plans_no_fault_explains():
    plans = [{"epoch": 2, "steps": {"detected": 9.1, "decided": 9.2}, "status": "done", "replacements": []}]
    epochs = rr.epochs(ARCHIVE, plans)
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[1]["steps"]["detected"] == 9.1 and not epochs[0]["steps"]
    assert rr.idle_standbys(ARCHIVE, 4.0) == 2 and rr.idle_standbys(ARCHIVE, 6.0) == 1
    assert rr.standby_starts(ARCHIVE) == {"s1": {"t": 0.9, "how": "pre-forked"}}
    injected = [{"rank": 5, "t": 9.0, "cascade": None}]
    assert unscheduled(epochs, injected) == [{"epoch": 1, "rank": 3, "why": "lease expired", "t": 5.0}]


def test_warmth_and_fenced_processes_from_the_launcher_output():
    log = (
        "[trainmover] standby s0 warm in 4.53s (sandbox, roles ['first', 'last']); warming stopped: promoted "
        "before every role was warm [wait 0.41s]\n"
        "[trainmover] standby s1 warm in 2.00s (sandbox, roles ['first', 'last']); waiting to be promoted [x]\n"
        "[trainmover launch] rank 7 (worker-n0-7-ab) hung: no heartbeat for 0.58s; killed it\n"
    )
    assert rr.standby_warmth(log) == {"s0": "promoted before every role was warm", "s1": "warm"}
    assert rr.fenced_and_planned(log, []) == {"fenced": 1, "plans": 0}


def test_refill_warmups_run_from_each_later_start_for_the_logged_warm_up():
    """A standby started after the job began (a refill) is busy from its start for as long as the launcher
    says it warmed (or warmed until it stopped), or to the run's end when it never said (still warming as
    the job ended: left out before, which put a warming refill's cost under other iterations); one
    started before the job is not counted."""
    archive = [
        {"what": "standby_started", "time": 1.0, "detail": {"member": "s0", "how": "fork"}},
        {"what": "standby_started", "time": 20.0, "detail": {"member": "s1", "how": "pre-forked"}},
        {"what": "standby_started", "time": 30.0, "detail": {"member": "s2", "how": "pre-forked"}},
        {"what": "standby_started", "time": 40.0, "detail": {"member": "s3", "how": "pre-forked"}},
    ]
    log = (
        "[trainmover] standby s0 warm in 9.00s (sandbox, roles ['first']); waiting to be promoted [x]\n"
        "[trainmover] standby s1 warm in 17.25s (sandbox, roles ['first', 'last']); waiting to be promoted [x]\n"
        "[trainmover] standby s2 warm in 4.50s (sandbox, roles ['first']); warming stopped: promoted first [x]\n"
    )
    assert rr.refill_warmups(archive, log, after=5.0) == [(20.0, 37.25), (30.0, 34.5), (40.0, math.inf)]
