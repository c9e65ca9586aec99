"""A standby's CPU priority: low while it warms and waits, normal again once it is promoted.

Why: a standby shares the node's cores with the ranks. Its interpreter start (importing torch
and megatron-core, seconds of CPU) and its warm-up would otherwise take cores from the ranks
right when the job recovers from a failure: the pool is refilled after every promotion.

Niceness alone leaves a standby in the ranks' way: the ranks block in collectives many times an
iteration, a standby fills every gap, and a rank that wakes may wait for the standby's slice to
end. A lowered standby therefore also runs under Linux's idle policy (``SCHED_IDLE``), which any
normal thread that wakes preempts at once.

Contract:
- :func:`can_restore` says whether a process may raise its priority back to normal (root,
  ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` soft limit of at least 20). The launcher lowers a
  standby's priority only then: a promoted standby stuck at a low priority would be a
  straggler that slows every rank.
- The launcher applies the niceness and the idle policy before the standby's interpreter runs
  any Python (``chrt --idle 0 nice -n N`` for a spawned standby, :func:`lower` in a forked one,
  whose threads all start later and inherit both). Where the idle policy is unavailable the
  niceness still applies. The one thread that leaves the idle policy (keeping the niceness) is a
  lease keepalive (``control.membership``): starved, it would let the standby's lease lapse.
- :func:`restore` (at promotion) sets every thread of the process back to niceness 0 and the
  normal policy (Linux keeps both per thread).
"""

from __future__ import annotations

import os
import resource
import shutil


def can_restore() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except (AttributeError, ValueError, OSError):
        return False


def lower(niceness: int) -> None:
    """Lower the calling thread's priority by ``niceness`` and, if lowered, put it under the idle policy
    (0: nothing). Threads it starts later inherit both."""
    if niceness > 0:
        os.nice(niceness)
        _set_policy(0, idle=True)


def spawn_prefix(niceness: int) -> list[str]:
    """The command words that start a new process at :func:`lower`'s priority (empty for 0)."""
    if niceness <= 0:
        return []
    chrt = shutil.which("chrt") if hasattr(os, "SCHED_IDLE") else None
    return ([chrt, "--idle", "0"] if chrt else []) + ["nice", "-n", str(niceness)]


def is_idle(tid: int = 0) -> bool:
    """Whether thread ``tid`` (0: the calling one) runs under the idle policy."""
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE


def restore() -> int:
    """Set every thread of this process back to niceness 0 and the normal policy; returns how many
    threads could not be."""
    failed = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if is_idle(tid):
                _set_policy(tid, idle=False)
            if os.getpriority(os.PRIO_PROCESS, tid) != 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except OSError:
            failed += 1
    return failed


def _set_policy(tid: int, *, idle: bool) -> None:
    if not hasattr(os, "SCHED_IDLE"):
        return
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        if not idle:
            raise  # a promoted rank left under the idle policy is a straggler: restore() counts it
