"""The faults every strategy gets: one seeded schedule, carried out the same way on any running job.

Contract: a benchmark makes a schedule (:func:`make_schedule`, or :func:`single_kill`) from its seed and
calls :func:`inject` on a running job through a :class:`Target` (the launcher's log for TrainMover and
stop-restart, nvrx's event file for nvrx). For each fault it waits until the iteration before it is
logged, sleeps ``inside`` of the fault-free twin's steady iteration, and signals the process serving
the rank:

- ``kill``: SIGKILL. ``hang``: SIGSTOP, for every strategy. ``migrate`` (TrainMover only): ``trainmover
  migrate --rank R``, a planned move, timed from the command's start. A strategy without hang detection of its
  own (stop-restart, nvrx in-process here) is given TrainMover's: the harness SIGKILLs the stopped
  process after ``hang_timeout_s`` (0.5 s, TrainMover's ``--tm-hang-timeout``) and that kill is its
  detection (``fenced_t``), which favours the baseline.
- A cascade kills again during the recovery the fault caused: the process that replaces the rank as
  soon as it is named (``joiner``: TrainMover's plan, a restart's new process, nvrx's reassigned
  process), or another rank ``cascade_delay_s`` after the recovery began (``other``).

It returns what was done, with wall times; a signal to a process already gone is left out (it is
not a fault the job saw). Waits are bounded: a job that stops making progress ends the injection.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from common import LastIteration, Tail

HANG_TIMEOUT_S = 0.5
"""What the harness gives a baseline without hang detection: TrainMover's default ``--tm-hang-timeout``."""


def make_schedule(
    seed: int,
    iters: int,
    mean_gap: float,
    *,
    world: int,
    first: int = 10,
    stop_share: float = 0.2,
    cascade_share: float = 0.25,
) -> list[dict]:
    """The failures of a run, in order: after which iteration, where inside the next, which rank, how.
    Gaps are exponential with mean ``mean_gap`` iterations (at least 4); none in the last 10 iterations."""
    rng = random.Random(seed)
    every = max(1, round(1 / cascade_share)) if cascade_share > 0 else 0
    events: list[dict] = []
    it = first
    while True:
        it += max(4, round(rng.expovariate(1.0 / max(1.0, mean_gap - 2))) + 2)
        if it > iters - 10:
            return events
        ev = {
            "after_iteration": it,
            "inside": round(rng.random(), 3),
            "rank": rng.randrange(world),
            "kind": "hang" if rng.random() < stop_share else "kill",
            "cascade": None,
        }
        if every and len(events) % every == every - 1:  # spread evenly, alternating the two kinds
            ev["cascade"] = ("joiner", "other")[(len(events) // every) % 2]
            ev["cascade_rank"] = rng.choice([r for r in range(world) if r != ev["rank"]])
            ev["cascade_delay_s"] = round(rng.uniform(0.0, 0.2), 3)
        events.append(ev)


def single_kill(rank: int, after_iteration: int, inside: float) -> list[dict]:
    """A schedule of one SIGKILL of ``rank`` at ``inside`` of iteration ``after_iteration + 1``."""
    return [{"after_iteration": after_iteration, "inside": inside, "rank": rank, "kind": "kill", "cascade": None}]


class Target(Protocol):
    """A running job as the injection sees it."""

    def last_iteration(self) -> int:
        """The last iteration logged."""

    def running(self) -> bool:
        """Whether the job is still running."""

    def pid_of(self, rank: int) -> int | None:
        """The process serving ``rank`` now."""

    def recoveries(self) -> int:
        """How many recoveries have begun (plans, restarts)."""

    def replacement_pid(self, rank: int, after: int) -> int | None:
        """The process named to serve ``rank`` by a recovery begun after the first ``after`` (None: not yet)."""


STATUS_RE = re.compile(r"status: trainmover status --tm-etcd-endpoints (\S+) --tm-job (\S+)")
PIDS_RE = re.compile(r"started \d+ ranks(?: \(\w+\))?, pids (\[[\d, ]+\])")
PLAN_RE = re.compile(r"epoch (\d+) \((failure|planned)\): rank (\d+) -> (\S+) \(pid (\d+)\)")


class LauncherTarget:
    """A ``trainmover launch`` job, from its log (first start, stop-restarts, TrainMover's plans) and its
    metrics file, both read incrementally (``common.Tail``): the harness polls while the job trains."""

    def __init__(self, proc, err_path: str, metrics_path: str, run_dir: str | None = None):
        self.proc = proc
        self.run_dir = run_dir
        self.status_flags: list[str] = []
        """``--tm-etcd-endpoints E --tm-job J`` of a TrainMover job, from its ``status:`` line."""
        self._tail = Tail(err_path)
        self._last = LastIteration(metrics_path)
        self._pids: list[int] = []
        self.recovery_log: list[dict] = []
        """In order: ``{"epoch", "moves": {rank: pid}}`` per plan, ``{"restart": pids}`` per stop-restart."""

    def _read(self) -> None:
        for line in self._tail.lines():
            m = STATUS_RE.search(line)
            if m:
                self.status_flags = ["--tm-etcd-endpoints", m[1], "--tm-job", m[2]]
            m = PIDS_RE.search(line)
            if m:
                pids = json.loads(m[1])
                if self._pids:
                    self.recovery_log.append({"restart": pids})
                self._pids = list(pids)
                continue
            m = PLAN_RE.search(line)
            if m:
                epoch, rank, pid = int(m[1]), int(m[3]), int(m[5])
                if not self.recovery_log or self.recovery_log[-1].get("epoch") != epoch:
                    self.recovery_log.append({"epoch": epoch, "moves": {}})
                self.recovery_log[-1]["moves"][rank] = pid
                self._pids[rank] = pid

    def last_iteration(self) -> int:
        return self._last()

    def running(self) -> bool:
        return self.proc.poll() is None

    def pid_of(self, rank: int) -> int | None:
        self._read()
        return self._pids[rank] if rank < len(self._pids) else None

    def recoveries(self) -> int:
        self._read()
        return len(self.recovery_log)

    def migrate(self, rank: int, timeout_s: float = 120.0) -> float:
        """``trainmover migrate --rank RANK`` to the controller's decision; returns when it was requested."""
        self._read()
        if not self.status_flags or self.run_dir is None:
            raise RuntimeError("a planned move needs the job's etcd (its launcher's status line) and run directory")
        with open(os.path.join(self.run_dir, "job-token")) as f:
            token = f.read().strip()
        cmd = [sys.executable, "-m", "trainmover_ext.cli", "migrate", "--rank", str(rank), *self.status_flags]
        t0 = time.time()
        out = subprocess.run(cmd + ["--tm-job-token", token], capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"trainmover migrate --rank {rank} exited {out.returncode}: {out.stdout}{out.stderr}")
        return t0

    def replacement_pid(self, rank: int, after: int) -> int | None:
        self._read()
        for rec in self.recovery_log[after:]:
            if "restart" in rec:
                return rec["restart"][rank]
            if rank in rec["moves"]:
                return rec["moves"][rank]
        return None


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _wait(predicate, timeout_s: float, interval_s: float = 0.005):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return None


def inject(
    schedule: list[dict],
    target: Target,
    steady_s: float,
    *,
    fence_hangs_after_s: float | None = None,
    ready: Callable[[], bool] | None = None,
    ready_until_iteration: int = 0,
    timeout_s: float = 1800.0,
    label: str = "",
) -> list[dict]:
    """Carry out ``schedule`` on ``target`` (see the module doc). ``fence_hangs_after_s``: the harness's
    hang detection for a strategy without its own (None: the strategy finds hangs itself). ``ready``:
    the first fault also waits for it (TrainMover's standbys warm), but not past iteration
    ``ready_until_iteration``; a fault that lands later than scheduled says so in its ``iteration``,
    which is always the one it landed in."""
    done: list[dict] = []
    timers: list[threading.Timer] = []
    if schedule and ready is not None:
        _wait(
            lambda: ready() or target.last_iteration() >= ready_until_iteration or not target.running(),
            timeout_s,
            0.05,
        )
    try:
        for n, ev in enumerate(schedule):
            # Sleep from right after an iteration ended: when the harness is late (a warm-up gate, a
            # cascade's wait), the fault moves to the next boundary, and its record says where it landed.
            floor = max(ev["after_iteration"], target.last_iteration() + 1)
            reached = _wait(lambda f=floor: target.last_iteration() >= f or not target.running(), timeout_s, 0.01)
            if not reached or not target.running():
                break
            time.sleep(ev["inside"] * steady_s)
            before = target.recoveries()
            pid = target.pid_of(ev["rank"])
            sig = signal.SIGSTOP if ev["kind"] == "hang" else signal.SIGKILL
            landed_in = target.last_iteration() + 1
            if ev["kind"] == "migrate":
                t = target.migrate(ev["rank"])  # type: ignore[attr-defined]
            else:
                t = time.time()
                if not _signal(pid, sig):
                    continue
            record = {
                "event": n,
                "kind": ev["kind"],
                "rank": ev["rank"],
                "t": t,
                "iteration": landed_in,
                "scheduled_iteration": ev["after_iteration"] + 1,
                "pid": pid,
                "intended_inside": ev["inside"],
                "fenced_t": None,
                "cascade": None,
            }
            done.append(record)
            what = "trainmover migrate" if ev["kind"] == "migrate" else sig.name
            print(f"  [{label}] {what} rank {ev['rank']} inside iteration {record['iteration']}", flush=True)
            if ev["kind"] == "hang" and fence_hangs_after_s is not None:
                timers.append(_fence_later(pid, fence_hangs_after_s, record))
            if ev.get("cascade"):
                record["cascade"] = _cascade(ev, target, before, timeout_s=60.0, label=label)
    finally:
        for timer in timers:
            timer.join(5.0)
    return done


def _fence_later(pid: int, after_s: float, record: dict) -> threading.Timer:
    def fence() -> None:
        t = time.time()
        if _signal(pid, signal.SIGKILL):
            record["fenced_t"] = t

    timer = threading.Timer(after_s, fence)
    timer.daemon = True
    timer.start()
    return timer


def _cascade(ev: dict, target: Target, before: int, *, timeout_s: float, label: str) -> dict | None:
    """The second kill of a cascading fault, once a recovery began after ``before``."""
    if ev["cascade"] == "joiner":
        pid = _wait(lambda: target.replacement_pid(ev["rank"], before), timeout_s, 0.002)
        victim = ev["rank"]
    else:
        if not _wait(lambda: target.recoveries() > before, timeout_s, 0.002):
            return None
        time.sleep(ev["cascade_delay_s"])
        victim = ev["cascade_rank"]
        pid = target.pid_of(victim)
    t = time.time()
    if not _signal(pid, signal.SIGKILL):
        return None
    print(f"  [{label}] cascade: SIGKILL {ev['cascade']} (rank {victim}) during the recovery", flush=True)
    return {"kind": ev["cascade"], "rank": victim, "t": t, "pid": pid}
