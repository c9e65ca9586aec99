"""The fast hang path: a frozen rank is fenced and reported by its own agent within ``--tm-hang-timeout``.

A rank that exits is seen by its agent at once (``wait_any_exit``). A rank that *hangs* without
exiting (SIGSTOP, a frozen cgroup) was seen only when its etcd lease lapsed, a whole TTL later. This
module lets the agent see it sooner, on the node itself.

Contract:
- **The rank** (:func:`start_from_env`, called by the process's hooks at start-up): when
  ``TRAINMOVER_HEARTBEAT_FILE`` names a file, a daemon thread writes ``CLOCK_MONOTONIC`` into its
  first 8 bytes every ``TRAINMOVER_HEARTBEAT_INTERVAL`` seconds. Nothing else; a write that fails
  ends the thread quietly (the lease remains).
- **The agent** (:class:`HangWatch`) gives every process it starts its own file, in a node-local
  directory (``/dev/shm`` when there is one), and asks :meth:`HangWatch.hung` about the processes
  that serve ranks. A process is **hung** when both hold:

  1. its last beat is older than ``timeout_s``, and
  2. over the last ``timeout_s / 2`` or more, it neither used CPU time nor waited runnable for a
     CPU, summed over its threads (``/proc/<pid>/task/*/schedstat``: time on a CPU and time on a run
     queue), and whenever the agent looked, none of its threads was runnable or in an
     uninterruptible wait (``/proc/<pid>/task/*/stat``'s state ``R`` or ``D``).

  The second keeps a slow process from being taken for a dead one: a process that computes while
  its heartbeat thread waits for the GIL still uses CPU; one starved of cores on a busy machine (it
  may get none for a second: a virtual CPU taken by the host, a real-time task) is runnable, and
  schedstat adds a wait to its sum only once the wait ends, so the state is what shows it; one
  paging in or writing through a slow disk is in ``D``. A stopped or frozen process is none of these.
  A process stuck in ``D`` for good (a dead network file system) is left to the lease TTL.
- A deadlock that holds the GIL is not seen here either: the threads waiting for the GIL wake every
  5 ms (CPython's switch interval) and use a little CPU each time. The lease's keep-alive needs the
  GIL too, so the TTL finds it.
- A process that is exiting is not judged either: at interpreter exit (``atexit``) the heartbeat
  stops and writes +inf. Interpreter teardown stops every Python thread and may then wait, on no CPU,
  in a C++ destructor; its exit is the exit path's to report.
- A process that has not written its first beat yet (imports, start-up) is not judged, nor one that
  runs under Linux's idle scheduling policy (a standby not yet promoted, ``launch.priority``): on busy
  cores such a process gets no CPU at all, and would look frozen.
- The agent then SIGKILLs the process (it must never touch the job again) and reports a failure
  of its rank, as for an exit. What this cannot see (a process that still uses CPU but makes no
  progress, a whole node frozen with its agent) is left to the lease TTL, as before.
- ``timeout_s`` 0 turns the path off.

Example (the agent)::

    watch = HangWatch(timeout_s=0.5)
    env.update(watch.env_for(member))  # before the process starts
    ...
    for member, why in watch.hung({member: proc.pid}):
        ...  # SIGKILL, then report the rank's failure
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass

DEFAULT_HANG_TIMEOUT_S = 0.5
"""``--tm-hang-timeout``'s default."""
ENV_HEARTBEAT_FILE = "TRAINMOVER_HEARTBEAT_FILE"
ENV_HEARTBEAT_INTERVAL = "TRAINMOVER_HEARTBEAT_INTERVAL"
_BEAT = struct.Struct("<d")

_started: threading.Thread | None = None
_stop = threading.Event()


def _beat_loop(fd: int, interval_s: float) -> None:
    try:
        while not _stop.is_set():
            os.pwrite(fd, _BEAT.pack(time.monotonic()), 0)
            _stop.wait(interval_s)
    except OSError:
        return  # the agent removed the directory (it is stopping): the lease remains
    finally:
        os.close(fd)


def _exiting(path: str) -> None:
    """At interpreter exit: stop beating and say so (+inf), so that the teardown is not judged."""
    _stop.set()
    if _started is not None:
        _started.join(1.0)
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, _BEAT.pack(math.inf), 0)
        finally:
            os.close(fd)
    except OSError:
        pass


def start_from_env(environ: dict[str, str] | None = None) -> bool:
    """In a process the agent started: beat into ``TRAINMOVER_HEARTBEAT_FILE`` until the process ends.
    Returns whether a heartbeat runs (started now or before; not when the variable is unset or the file
    cannot be opened). Safe to call more than once."""
    global _started
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_HEARTBEAT_FILE)
    if not path:
        return False
    if _started is not None and _started.is_alive():
        return True
    try:
        interval_s = float(environ.get(ENV_HEARTBEAT_INTERVAL, "0.1"))
        fd = os.open(path, os.O_WRONLY)
    except (OSError, ValueError):
        return False
    os.pwrite(fd, _BEAT.pack(time.monotonic()), 0)  # the first beat before this returns
    _stop.clear()
    _started = threading.Thread(target=_beat_loop, args=(fd, max(0.01, interval_s)), name="tm_heartbeat", daemon=True)
    _started.start()
    atexit.register(_exiting, path)
    return True


def cpu_time_ns(pid: int, waited: bool = False) -> int | None:
    """CPU time used by every thread of ``pid`` so far, in ns (None when ``/proc`` cannot tell); with
    ``waited``, plus the time its threads spent runnable, waiting for a CPU (``schedstat``'s second
    field), so that a process starved of CPU on a busy machine is told from a frozen one."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
                total += int(fields[0]) + (int(fields[1]) if waited else 0)
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile used what it used
    return total


def busy_threads(pid: int) -> int:
    """How many threads of ``pid`` are runnable (running or waiting for a CPU) or in an uninterruptible
    wait (disk, page-in) now: ``R`` or ``D`` in ``/proc/<pid>/task/*/stat`` (0 when ``/proc`` cannot tell)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    busy = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split(None, 1)[0]  # the name may hold ')' or spaces
        except (OSError, IndexError):
            continue
        busy += state in (b"R", b"D")
    return busy


def _idle_policy(pid: int) -> bool:
    """Whether ``pid`` runs under ``SCHED_IDLE`` (False where Linux cannot tell)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None:
        return False
    try:
        return os.sched_getscheduler(pid) == idle
    except OSError:
        return False


@dataclass
class _Judged:
    cpu_ns: int
    at: float
    """When the process was first seen at ``cpu_ns``."""
    checked_at: float
    """When ``/proc`` was last read for it."""


_DIR_PREFIX = "trainmover-heartbeats-"
ORPHAN_AFTER_S = 60.0
"""A heartbeat directory is an orphan only once nothing in it was written for this long: an agent in
another pid namespace that shares ``/dev/shm`` is not visible in ``/proc``, but its ranks beat."""


def _remove_orphans(base: str) -> None:
    """Remove the heartbeat directories of agents that died without :meth:`HangWatch.close` (SIGKILL):
    each is named after its agent's pid, and is removed when that pid is gone and its files are stale
    (:data:`ORPHAN_AFTER_S`)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid = name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if not (name.startswith(_DIR_PREFIX) and pid.isdigit()) or os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(base, name)
        try:
            newest = max((e.stat().st_mtime for e in os.scandir(path)), default=0.0)
        except OSError:
            continue
        if time.time() - newest >= ORPHAN_AFTER_S:
            shutil.rmtree(path, ignore_errors=True)


class HangWatch:
    """See the module docstring. Not thread-safe: the agent's supervision loop owns it."""

    def __init__(self, timeout_s: float, directory: str | None = None) -> None:
        if timeout_s < 0:
            raise ValueError("the hang timeout must be >= 0 (0 turns the fast hang path off)")
        self.timeout_s = timeout_s
        self.interval_s = round(min(1.0, max(0.02, timeout_s / 5)), 3)
        """How often a rank beats: five beats per timeout."""
        self.enabled = timeout_s > 0
        base = directory or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
        self.directory = ""
        if self.enabled:
            _remove_orphans(base)
            self.directory = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base)
        self._files: dict[str, str] = {}
        self._samples: dict[str, _Judged] = {}

    def file_for(self, member: str) -> str:
        """Create (or reuse) ``member``'s heartbeat file; '' when the path is off."""
        if not self.enabled:
            return ""
        path = self._files.get(member)
        if path is None:
            path = os.path.join(self.directory, member)
            with open(path, "wb") as f:
                f.write(_BEAT.pack(0.0))
            self._files[member] = path
        return path

    def env_for(self, member: str) -> dict[str, str]:
        """The variables a process serving as ``member`` needs to beat (none when the path is off)."""
        if not self.enabled:
            return {}
        return {ENV_HEARTBEAT_FILE: self.file_for(member), ENV_HEARTBEAT_INTERVAL: str(self.interval_s)}

    def last_beat(self, member: str) -> float | None:
        """``member``'s last beat (``time.monotonic()``), None before its first, +inf once it is exiting."""
        path = self._files.get(member)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                (beat,) = _BEAT.unpack(f.read(_BEAT.size))
        except (OSError, struct.error):
            return None
        return beat or None

    def hung(self, processes: dict[str, int]) -> list[tuple[str, str]]:
        """``(member, why)`` for each of ``processes`` (member -> pid) that is hung (module docstring)."""
        if not self.enabled:
            return []
        found = []
        now = time.monotonic()
        for member, pid in processes.items():
            beat = self.last_beat(member)
            if beat is None or math.isinf(beat) or now - beat < self.timeout_s / 2 or _idle_policy(pid):
                self._samples.pop(member, None)
                continue
            sample = self._samples.get(member)
            if sample is not None and now - sample.checked_at < self.timeout_s / 4:
                continue  # read /proc at most 4 times a timeout: a starved machine has many stale beats
            cpu = cpu_time_ns(pid, waited=True)  # a starved process waits for a CPU: it is not frozen
            if cpu is None:
                continue
            if sample is None or sample.cpu_ns != cpu or busy_threads(pid):
                self._samples[member] = _Judged(cpu, now, now)  # it ran since: judge again from here
                continue
            sample.checked_at = now
            if now - beat >= self.timeout_s and now - sample.at >= self.timeout_s / 2:
                found.append(
                    (
                        member,
                        f"no heartbeat for {now - beat:.2f}s and no CPU time used (or waited for), no thread "
                        f"runnable or in I/O, for {now - sample.at:.2f}s",
                    )
                )
        return found

    def forget(self, member: str) -> None:
        """Stop judging ``member`` (it exited or left); its file goes."""
        self._samples.pop(member, None)
        path = self._files.pop(member, None)
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        """Remove every file (the processes' heartbeats then stop quietly)."""
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._files.clear()
        self._samples.clear()
