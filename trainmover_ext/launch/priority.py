"""A standby's CPU priority: low while it warms and waits, normal again once it is promoted.

Why: a standby shares the node's cores with the ranks. Its interpreter start (importing torch
and megatron-core, seconds of CPU) and its warm-up would otherwise take cores from the ranks
right when the job recovers from a failure: the pool is refilled after every promotion.

Contract:
- :func:`can_restore` says whether a process may raise its priority back to normal (root,
  ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` soft limit of at least 20). The launcher lowers a
  standby's priority only then: a promoted standby stuck at a low priority would be a
  straggler that slows every rank.
- The launcher applies the niceness before the standby's interpreter runs any Python
  (``nice -n N`` for a spawned standby, :func:`lower` in a forked one).
- :func:`restore` (at promotion) sets every thread of the process back to niceness 0 (Linux
  keeps one niceness per thread).
"""

from __future__ import annotations

import os
import resource


def can_restore() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except (AttributeError, ValueError, OSError):
        return False


def lower(niceness: int) -> None:
    """Lower this process's priority by ``niceness`` (0: nothing)."""
    if niceness > 0:
        os.nice(niceness)


def restore() -> int:
    """Set every thread of this process back to niceness 0; returns how many threads could not be."""
    failed = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except OSError:
            failed += 1
    return failed
