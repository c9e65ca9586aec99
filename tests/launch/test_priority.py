"""A standby's CPU priority (launch.priority): lowered, it runs at the given niceness under the idle
policy, and so do the threads it starts later, except its lease keepalive and the thread that hears its
promotion, which leave the idle policy; restored at promotion, every thread is back at niceness 0 under
the normal policy. Also the command prefix a spawned standby starts with.

Each case runs in a fresh interpreter (the test process may hold gRPC channels, and a lowered
priority cannot be undone without privilege)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from trainmover_ext.launch import priority

pytestmark = pytest.mark.skipif(
    not priority.can_restore() or not hasattr(os, "SCHED_IDLE"),
    reason="lowering a priority for good needs root, CAP_SYS_NICE or RLIMIT_NICE >= 20, and Linux's SCHED_IDLE",
)

DRIVER = textwrap.dedent("""
    import os, threading
    from trainmover_ext.control.membership import _leave_idle_policy
    from trainmover_ext.launch import priority

    def state(tid=0):
        return (priority.is_idle(tid), os.getpriority(os.PRIO_PROCESS, tid))

    print("start", state())
    priority.lower(int(os.environ["NICENESS"]))
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(later=state()))
    thread.start(); thread.join()
    print("lowered", state(), "later thread", seen["later"])
    keeper = threading.Thread(target=lambda: (_leave_idle_policy(), seen.update(keeper=state())))
    keeper.start(); keeper.join()
    print("lease keepalive", seen["keeper"])
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait); waiting.start()
    print("restore failed", priority.restore())
    print("restored", sorted({state(int(t)) for t in os.listdir("/proc/self/task")}))
    stop.set(); waiting.join()
""")


def _run(niceness: int) -> list[str]:
    env = dict(os.environ, NICENESS=str(niceness))
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_a_lowered_standby_runs_idle_and_its_promotion_restores_every_thread():
    lines = _run(19)
    assert lines[0] == "start (False, 0)", lines
    assert lines[1] == "lowered (True, 19) later thread (True, 19)", lines
    # A lease keepalive leaves the idle policy (it must not starve) but keeps the standby's niceness.
    assert lines[2] == "lease keepalive (False, 19)", lines
    assert lines[3:] == ["restore failed 0", "restored [(False, 0)]"], lines


def test_niceness_zero_leaves_the_priority_alone():
    assert _run(0)[1] == "lowered (False, 0) later thread (False, 0)"


def test_a_spawned_standby_starts_idle_and_lowered():
    prefix = priority.spawn_prefix(19)
    assert prefix[-3:] == ["nice", "-n", "19"] and priority.spawn_prefix(0) == []
    probe = "import os; print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0))"
    out = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "19"], out.stdout + out.stderr


PLAN_WATCH = textwrap.dedent("""
    import os, sys
    from trainmover_ext.control.membership import PlanInbox
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import JobSpace
    from trainmover_ext.launch import priority

    priority.lower(19)
    config = EtcdClientConfig(endpoints=sys.argv[1].split(","), timeout_s=3.0)
    plain, inboxed = EtcdKV(config), EtcdKV(config)  # a client each: a client's watches share one thread
    watch = plain.watch_prefix("/other/", lambda events: None)
    inbox = PlanInbox(JobSpace.create(inboxed, "j", "tok"))
    for name, handle in (("plain watch", watch), ("plan watch", inbox._watch)):
        tid = handle.delivery_thread_id()
        print(name, priority.is_idle(tid), os.getpriority(os.PRIO_PROCESS, tid))
    inbox.close(); watch.cancel(); plain.close(); inboxed.close()
""")


def test_a_lowered_standby_hears_its_promotion_outside_the_idle_policy(etcd):
    """The thread that delivers plans to a lowered standby leaves the idle policy (keeping its niceness):
    under it, the promotion waited for a free core while every rank waited for the standby. A watch
    opened otherwise (the companion) keeps the inherited policy."""
    out = subprocess.run(
        [sys.executable, "-c", PLAN_WATCH, ",".join(etcd.endpoints)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["plain watch True 19", "plan watch False 19"], out.stdout + out.stderr
