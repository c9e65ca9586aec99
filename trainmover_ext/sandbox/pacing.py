"""Pacing of a warming standby: it may use at most a set share of one core, so the job beside it keeps its speed.

A standby warms up on the same node as the job's ranks (``trainmover launch
--tm-standbys N`` starts it there). Its shadow iterations are real training
iterations; on a node whose cores the ranks keep busy, every CPU-second the
standby takes is one the ranks wait for, and scheduling priority alone
cannot hand it back: an unprivileged process cannot leave ``SCHED_IDLE`` or
lower its niceness again once it is promoted (``RLIMIT_NICE``), so that is
not used in production. Instead the standby paces itself:

Contract
- :meth:`Pacer.pace` is called at points where the warm-up may pause (after
  each shadow iteration, after each role). It sleeps until the process's CPU
  time since the pacer started is at most ``duty`` of the wall time since
  then, so over any stretch between two calls the standby's share of one
  core is bounded by ``duty`` (a long build between two calls is paid for
  by a longer pause after it).
- ``duty >= 1`` never sleeps. A pacer whose :meth:`stop` was called (the
  standby was promoted) never sleeps again.
- The CPU time of every thread of the process counts (``time.process_time``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Pacer:
    """Keeps this process's CPU use at most ``duty`` of the wall time (see the module docstring)."""

    def __init__(
        self,
        duty: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        max_pause_s: float = 60.0,
    ):
        if duty <= 0:
            raise ValueError(f"duty={duty} must be > 0 (1 = unpaced)")
        self.duty = duty
        self.max_pause_s = max_pause_s
        self._clock, self._cpu = clock, cpu_clock
        self._t0, self._c0 = clock(), cpu_clock()
        self._stopped = threading.Event()
        self.paused_s = 0.0
        """Total time :meth:`pace` slept."""

    def pace(self) -> float:
        """Sleep as long as the budget needs (at most ``max_pause_s`` at a time); returns the seconds slept."""
        if self.duty >= 1 or self._stopped.is_set():
            return 0.0
        used = self._cpu() - self._c0
        elapsed = self._clock() - self._t0
        owed = min(used / self.duty - elapsed, self.max_pause_s)
        if owed <= 0:
            return 0.0
        t = self._clock()
        self._stopped.wait(owed)  # stop() wakes it: a promotion never waits for the pacer
        slept = self._clock() - t
        self.paused_s += slept
        return slept

    def stop(self) -> None:
        """Never pause again (e.g. the standby was promoted); wakes a pause in progress."""
        self._stopped.set()
