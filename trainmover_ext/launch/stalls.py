"""The progress watchdog: the agent finds a rank whose main thread stalled, and names it, not its waiting peers.

A frozen process is :mod:`launch.heartbeat`'s. A process whose *main thread* hangs while its
background threads live (a deadlock, a stuck data loader or kernel) keeps its lease and its
heartbeat; only its progress (:mod:`trainmover_ext.launch.progress`, written by the main thread)
stops. So does the progress of every rank that waits for it in a collective.

Contract (:meth:`StallWatch.stalled`, on the agent's supervision loop, for the ranks it serves):
- A rank is judged only in the phases of :data:`~trainmover_ext.launch.progress.JUDGED` (an
  iteration's forward, backward and optimizer step), never while it waits in a collective: that
  rank waits for another, which is the culprit.
- The **bound** is ``--tm-progress-timeout`` when given; by default it is :data:`FACTOR` times the
  median of the rank's last iteration times as this watch saw them, at least :data:`FLOOR_S`. A rank
  with fewer than :data:`MIN_INTERVALS` iterations seen since it started or since it last left a
  judged phase (a save, an evaluation, a recovery) is not judged: its pace is not known yet.
- A rank is **stalled** when its last progress mark is older than the bound and its main thread
  used (almost) no CPU over the last half of it (:data:`BLOCKED_SHARE`): it waits on something.
  A main thread that keeps computing without a mark (a spin) is stalled at :data:`BUSY_FACTOR` times
  the bound. A busy machine slows a rank's marks but not to zero CPU.
- ``why`` names the evidence: the phase, the iteration, how long, and which of this agent's other
  ranks wait in which collective meanwhile. The caller fences the rank and reports it, as a hang.
- ``timeout_s`` 0 turns the watchdog off.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from trainmover_ext.launch import progress

FLOOR_S = 2.5
"""The smallest default bound: below this, scheduling noise on a busy host looks like a stall."""
FACTOR = 4.0
"""The default bound in iterations."""
MIN_INTERVALS = 2
"""Iterations to see before a default bound is known."""
BLOCKED_SHARE = 0.05
"""A main thread that used less than this share of one core over the last half bound is blocked."""
BUSY_FACTOR = 3.0
"""A main thread stalled while computing is judged at this many bounds."""


def thread_cpu_ns(pid: int, tid: int) -> int | None:
    """CPU time thread ``tid`` of ``pid`` used so far, in ns (None when ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class _Rank:
    iteration: int = -1
    seen_at: float = 0.0
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    cpu: tuple[float, int] | None = None
    """(when, main-thread CPU ns) sampled once the current mark was half a bound old."""
    mark_at: float = -1.0


class StallWatch:
    """See the module docstring. Not thread-safe: the agent's supervision loop owns it."""

    def __init__(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError("the progress timeout must be >= 0 (0 turns the watchdog off)")
        self.timeout_s = timeout_s
        self.enabled = timeout_s != 0
        self._ranks: dict[str, _Rank] = {}

    def bound(self, key: str) -> float | None:
        """The stall bound of ``key`` now (None: not judged yet)."""
        if self.timeout_s:
            return self.timeout_s
        seen = self._ranks.get(key)
        if seen is None or len(seen.intervals) < MIN_INTERVALS:
            return None
        return max(FLOOR_S, FACTOR * statistics.median(seen.intervals))

    def stalled(self, processes: dict[str, tuple[int, int, str]]) -> list[tuple[str, str]]:
        """``(key, why)`` for each stalled process of ``processes``: key -> (pid, rank, progress file)."""
        if not self.enabled:
            return []
        now = time.monotonic()
        records = {key: progress.read(path) for key, (_, _, path) in processes.items()}
        for key in list(self._ranks):
            if key not in processes:
                del self._ranks[key]
        found = []
        for key, (pid, _, _) in processes.items():
            record = records[key]
            seen = self._ranks.setdefault(key, _Rank())
            if record is None or record.phase not in progress.JUDGED:
                if record is None or record.phase in progress.RESETS:
                    seen.iteration, seen.cpu = -1, None
                    seen.intervals.clear()  # its pace after a save, a recovery or a start is measured anew
                continue
            if record.iteration != seen.iteration:
                if seen.iteration >= 0 and record.iteration == seen.iteration + 1:
                    seen.intervals.append(now - seen.seen_at)
                seen.iteration, seen.seen_at = record.iteration, now
            if record.at != seen.mark_at:
                seen.mark_at, seen.cpu = record.at, None
            bound = self.bound(key)
            idle = now - record.at
            if record.group is not None or bound is None or idle < bound / 2:
                continue
            cpu = thread_cpu_ns(pid, pid)
            if cpu is None:
                continue
            if seen.cpu is None:
                seen.cpu = (now, cpu)
                continue
            since, cpu_then = seen.cpu
            blocked = now - since >= bound / 2 and (cpu - cpu_then) < BLOCKED_SHARE * (now - since) * 1e9
            if (idle >= bound and blocked) or idle >= BUSY_FACTOR * bound:
                state = "blocked" if blocked else "computing"
                why = (
                    f"main thread stalled in {record.phase} of iteration {record.iteration + 1} for {idle:.1f}s "
                    f"({state}; bound {bound:.1f}s)"
                )
                waits = [
                    f"rank {other_rank} waits in group {other.group!r} op #{other.op} for {now - other.at:.1f}s"
                    for other_key, (_, other_rank, _) in sorted(processes.items(), key=lambda kv: kv[1][1])
                    if other_key != key and (other := records[other_key]) is not None and other.group is not None
                ]
                found.append((key, "; ".join([why] + waits[:3])))
        return found

    def forget(self, key: str) -> None:
        """Stop judging ``key`` (it exited, left or was fenced)."""
        self._ranks.pop(key, None)
