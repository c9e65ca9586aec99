"""The agent's fast hang path (launch.heartbeat) on real processes: a frozen process (SIGSTOP) is found
hung within the timeout; a process whose heartbeat thread is held up while it still computes is not;
a process that has not beaten yet is not judged; 0 turns the path off.

Each process is a fresh interpreter that starts its heartbeat the way a rank's hooks do
(``heartbeat.start_from_env``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainmover_ext.launch.heartbeat import ORPHAN_AFTER_S, HangWatch, busy_threads, cpu_time_ns

TIMEOUT_S = 0.5

BEATING = textwrap.dedent("""
    import sys, time
    from trainmover_ext.launch import heartbeat
    assert heartbeat.start_from_env()
    print("beating", flush=True)
    if sys.argv[1] == "gil":
        # The heartbeat thread cannot run while this holds the GIL, yet the process computes.
        import re
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            re.match(r"(a|aa)*c", "a" * 36)  # one call holds the GIL for about a second or more
    else:
        time.sleep(60)
""")


@pytest.fixture
def watch():
    w = HangWatch(TIMEOUT_S)
    yield w
    w.close()


def _start(watch: HangWatch, member: str, mode: str) -> subprocess.Popen:
    env = dict(os.environ) | watch.env_for(member)
    proc = subprocess.Popen([sys.executable, "-c", BEATING, mode], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "beating"
    return proc


def _judge(watch: HangWatch, member: str, pid: int, for_s: float) -> tuple[float | None, str]:
    """Ask every 50 ms (as the agent does) for ``for_s``: (seconds until found hung or None, why)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < for_s:
        found = dict(watch.hung({member: pid}))
        if member in found:
            return time.monotonic() - t0, found[member]
        time.sleep(0.05)
    return None, ""


def test_a_stopped_process_is_found_hung_within_the_timeout(watch):
    proc = _start(watch, "w0", "sleep")
    try:
        assert _judge(watch, "w0", proc.pid, 1.0)[0] is None, "a live process was taken for a hung one"
        os.kill(proc.pid, signal.SIGSTOP)
        after, why = _judge(watch, "w0", proc.pid, 5.0)
        assert after is not None, "a stopped process was not found hung"
        # its last beat was at most one interval before the stop; two polls of slack
        assert TIMEOUT_S - watch.interval_s <= after <= TIMEOUT_S + 0.2, after
        assert "no heartbeat for" in why and "no CPU time used" in why, why
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_computes_while_its_heartbeat_waits_is_not_hung(watch):
    """The regex holds the GIL for seconds per call: no beats, but CPU time keeps growing."""
    proc = _start(watch, "w1", "gil")
    try:
        # the beats do stop for longer than the timeout (else this test would prove nothing)...
        t0 = time.monotonic()
        while time.monotonic() - watch.last_beat("w1") <= TIMEOUT_S * 1.5:
            assert time.monotonic() - t0 < 10, "the heartbeat never paused: this test proves nothing"
            time.sleep(0.02)
        # ...yet it is never found hung, since it uses CPU
        assert _judge(watch, "w1", proc.pid, 3.0)[0] is None
        os.kill(proc.pid, signal.SIGSTOP)  # and once it freezes, it is
        assert _judge(watch, "w1", proc.pid, 5.0)[0] is not None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_before_its_first_beat_is_not_judged(watch):
    watch.file_for("w2")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # never beats
    try:
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        assert watch.last_beat("w2") is None
        assert _judge(watch, "w2", proc.pid, 2 * TIMEOUT_S + 0.2)[0] is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_a_process_under_the_idle_policy_is_not_judged(watch):
    """A standby not yet promoted runs under SCHED_IDLE: starved on busy cores it uses no CPU and does not
    beat, so a stop there is left to its lease."""
    proc = _start(watch, "w4", "sleep")
    try:
        os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        os.kill(proc.pid, signal.SIGSTOP)
        assert _judge(watch, "w4", proc.pid, 2 * TIMEOUT_S + 0.3)[0] is None
    finally:
        proc.kill()
        proc.wait()


EXITING = textwrap.dedent("""
    import time
    from trainmover_ext.launch import heartbeat

    class SlowTeardown:  # a C++ destructor that waits, as a process group's may: run after the threads stop
        def __del__(self):
            time.sleep(2)

    keep = SlowTeardown()
    assert heartbeat.start_from_env()
    print("exiting", flush=True)
""")


def test_a_process_in_its_interpreter_teardown_is_not_judged(watch):
    """Teardown stops every Python thread, the heartbeat's too, and may then wait on no CPU: the exit path
    reports the process's exit, the hang watch does not kill it first."""
    env = dict(os.environ) | watch.env_for("w5")
    proc = subprocess.Popen([sys.executable, "-c", EXITING], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "exiting"
        assert _judge(watch, "w5", proc.pid, 1.5)[0] is None
        assert proc.wait(10) == 0
        assert watch.last_beat("w5") == float("inf")
    finally:
        proc.kill()
        proc.wait()


def test_zero_turns_the_path_off():
    off = HangWatch(0)
    assert off.env_for("w3") == {} and off.file_for("w3") == "" and not off.directory
    assert off.hung({"w3": os.getpid()}) == []
    with pytest.raises(ValueError):
        HangWatch(-1)


def test_cpu_time_sums_every_thread_and_stops_when_stopped():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        first = cpu_time_ns(proc.pid)
        time.sleep(0.2)
        assert cpu_time_ns(proc.pid) > first
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.1)
        stopped = cpu_time_ns(proc.pid)
        time.sleep(0.3)
        assert cpu_time_ns(proc.pid) == stopped
    finally:
        proc.kill()
        proc.wait()
    assert cpu_time_ns(proc.pid) is None  # reaped: /proc cannot tell


def _state(pid: int) -> str:
    """The process state letter of ``/proc/<pid>/stat`` (R running, S sleeping, T stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_process_starved_of_cpu_counts_its_wait_for_one():
    """Two spinners on one core: each waits on the run queue about as long as it runs. The wait counts
    (``waited``), so a runnable process that gets no CPU for a while is not taken for a frozen one; a
    stopped one neither runs nor waits (the companion: its sum stands still)."""
    spin = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
    core = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", spin, str(core)]) for _ in range(2)]
    try:
        time.sleep(0.5)
        ran, both = cpu_time_ns(procs[0].pid), cpu_time_ns(procs[0].pid, waited=True)
        time.sleep(0.5)
        ran_more = cpu_time_ns(procs[0].pid) - ran
        waited_more = cpu_time_ns(procs[0].pid, waited=True) - both - ran_more
        assert waited_more > 0.1e9, (ran_more, waited_more)  # it waited for the core it shares
        os.kill(procs[0].pid, signal.SIGSTOP)
        # stopped once the kernel says so (state T): on a crowded core the spinner, runnable, may still wait
        # for it, and its wait still counts, for more than 0.1 s (seen: 111 ms more after a 0.1 s sleep)
        deadline = time.monotonic() + 10
        while _state(procs[0].pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped = cpu_time_ns(procs[0].pid, waited=True)
        time.sleep(0.3)
        assert cpu_time_ns(procs[0].pid, waited=True) == stopped
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_killed_agents_heartbeat_directory_is_removed_by_the_next_watch(tmp_path):
    """An agent killed with SIGKILL never closes its watch; the next agent's watch on the machine removes
    that directory once its files are stale, and leaves a live agent's alone."""
    code = (
        "import os, sys; from trainmover_ext.launch.heartbeat import HangWatch; "
        "w = HangWatch(0.5, sys.argv[1]); w.file_for('w0'); print(w.directory, flush=True); os.kill(os.getpid(), 9)"
    )
    agent = subprocess.run([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert agent.returncode == -signal.SIGKILL
    dead = agent.stdout.strip()
    beat = os.path.join(dead, "w0")
    assert os.path.exists(beat)
    HangWatch(0.5, str(tmp_path)).close()
    assert os.path.exists(dead), "removed while a rank might still beat (another pid namespace)"
    stale = time.time() - ORPHAN_AFTER_S - 1
    os.utime(beat, (stale, stale))
    live = HangWatch(0.5, str(tmp_path))
    try:
        assert not os.path.exists(dead)
        HangWatch(0.5, str(tmp_path)).file_for("w1")  # not closed, but its agent (this process) lives
        assert len(os.listdir(tmp_path)) == 2 and os.path.isdir(live.directory)
    finally:
        live.close()


STARVED = textwrap.dedent("""
    import os, sys
    os.sched_setaffinity(0, {int(sys.argv[1])})  # before the heartbeat thread starts: it inherits the core
    from trainmover_ext.launch import heartbeat
    assert heartbeat.start_from_env()
    print("beating", flush=True)
    while True:
        pass
""")
HOG = textwrap.dedent("""
    import os, sys, time
    os.sched_setaffinity(0, {int(sys.argv[1])})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    print("hogging", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        pass
""")


def _can_run_fifo() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not _can_run_fifo(), reason="two cores and SCHED_FIFO")
def test_a_process_starved_for_a_second_is_not_hung(watch):
    """A real-time spinner on the one core a process may use leaves it Linux's 5 % reserve for ordinary
    tasks: the process gets no CPU for most of each second, so its beats stop and schedstat's sums stand
    still (a wait is added only once it ends). It is runnable throughout (``R``), and is not hung.

    The companion is inside: the sums are seen standing still for longer than the hang rule's window while
    the beat is stale (without the state, it would have been killed); and once stopped, it is hung."""
    core = max(os.sched_getaffinity(0))
    env = dict(os.environ) | watch.env_for("w6")
    proc = subprocess.Popen([sys.executable, "-c", STARVED, str(core)], env=env, stdout=subprocess.PIPE, text=True)
    hog = None
    try:
        assert proc.stdout.readline().strip() == "beating"
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(core), "4"], stdout=subprocess.PIPE, text=True)
        assert hog.stdout.readline().strip() == "hogging"
        still_for, seen, found = 0.0, None, None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0 and found is None:
            found = dict(watch.hung({"w6": proc.pid})).get("w6")
            now, cpu = time.monotonic(), cpu_time_ns(proc.pid, waited=True)
            if seen is None or seen[1] != cpu:
                seen = (now, cpu)
            elif now - watch.last_beat("w6") > TIMEOUT_S:
                still_for = max(still_for, now - seen[0])
                assert busy_threads(proc.pid) >= 1  # it is runnable meanwhile
            time.sleep(0.05)
        assert found is None, f"a starved process was taken for a hung one: {found}"
        assert still_for >= TIMEOUT_S / 2 + 0.1, f"never starved long enough to prove anything ({still_for:.2f}s)"
        hog.wait(10)
        os.kill(proc.pid, signal.SIGSTOP)
        assert busy_threads(proc.pid) == 0
        assert _judge(watch, "w6", proc.pid, 5.0)[0] is not None
    finally:
        for p in (proc, hog):
            if p is not None:
                p.kill()
                p.wait()
