"""Starting one rank: fork from the warm agent, or spawn a fresh interpreter.

Both start the child in its own process group (a terminal Ctrl-C reaches only
the agent, which tears ranks down in order) and ask the kernel to SIGKILL the
child if the agent dies, so no rank outlives its agent.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import select
import signal
import subprocess
import sys
import traceback
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from trainmover_ext.launch.logs import ProcessOutput

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the agent's teardown still kills children
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def preimport_for_fork() -> None:
    """Import the heavy modules once in the agent so forked ranks skip 4-10 s of imports."""
    import torch  # noqa: F401

    import megatron.training  # noqa: F401  (quiets CPU fallback warnings first)
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import trainmover_ext.patches  # noqa: F401


@dataclass
class RankProcess:
    """A started rank: its global rank, pid and, for spawned ones, the Popen handle."""

    rank: int
    pid: int
    popen: Optional[subprocess.Popen] = None
    returncode: Optional[int] = None
    _pidfd: Optional[int] = field(default=None, repr=False)

    def poll(self) -> Optional[int]:
        """Return code (negative signal number when killed) once it exited, else None."""
        if self.returncode is not None:
            return self.returncode
        if self.popen is not None:
            self.returncode = self.popen.poll()
        else:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        if self.returncode is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def exit_fd(self) -> Optional[int]:
        """A descriptor that becomes readable when the process exits (Linux pidfd), or None."""
        if self._pidfd is None and self.returncode is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:  # already reaped, or a kernel without pidfds
                return None
        return self._pidfd

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def wait_any_exit(procs: Iterable[RankProcess], timeout_s: float) -> None:
    """Return as soon as one of ``procs`` exits, or after ``timeout_s``.

    The agent's supervision loop sleeps here: a dead rank wakes it at once (pidfds) instead of at
    its next poll, which takes the poll interval off the failure detection time."""
    poller = select.poll()
    watched = 0
    for proc in procs:
        fd = proc.exit_fd()
        if fd is not None:
            poller.register(fd, select.POLLIN)
            watched += 1
    if watched:
        poller.poll(max(0, int(timeout_s * 1000)))
    else:
        time.sleep(timeout_s)


def fork_rank(rank: int, env: dict[str, str], script: str, script_args: list[str],
              output: Optional[ProcessOutput] = None, *, niceness: int = 0) -> RankProcess:
    """Fork a child that runs ``script`` as ``__main__`` with ``env`` applied, writing to ``output``
    (per-process log files, :mod:`.logs`) or to the agent's console, ``niceness`` lower in priority."""
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        if output is not None:
            output.started()
        return RankProcess(rank=rank, pid=pid)
    # child
    code = 1
    try:
        os.setpgid(0, 0)
        _die_with_parent(parent)
        if niceness > 0:
            os.nice(niceness)
        if output is not None:
            output.in_child()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(env)
        sys.argv = [script] + list(script_args)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a rank must report anything and exit non-zero
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: a rank that abandoned pending gloo ops would abort in atexit handlers.
        os._exit(code)


ENV_PARENT_PID = "TRAINMOVER_PARENT_PID"


def die_with_parent_from_env() -> None:
    """In a spawned rank: die with the agent named by ``TRAINMOVER_PARENT_PID`` (called at start-up)."""
    parent = os.environ.get(ENV_PARENT_PID)
    if parent and parent.isdigit():
        _die_with_parent(int(parent))


def spawn_rank(rank: int, env: dict[str, str], script: str, script_args: list[str],
               output: Optional[ProcessOutput] = None, *, niceness: int = 0) -> RankProcess:
    """Start ``python script args`` as a fresh interpreter, as torchrun does.

    No Python runs between fork and exec (no ``preexec_fn``): the agent may hold
    gRPC threads by then, and running code in a forked copy of them can abort.
    The child sets its parent-death signal itself (:func:`die_with_parent_from_env`).
    """
    full_env = dict(os.environ)
    full_env.update(env)
    full_env[ENV_PARENT_PID] = str(os.getpid())
    fds = output.child_fds if output is not None else {}
    nice = ["nice", "-n", str(niceness)] if niceness > 0 else []  # before the interpreter runs any Python
    popen = subprocess.Popen([*nice, sys.executable, "-u", script, *script_args], env=full_env, start_new_session=True,
                             stdout=fds.get("stdout"), stderr=fds.get("stderr"))
    if output is not None:
        output.started()
    return RankProcess(rank=rank, pid=popen.pid, popen=popen)
