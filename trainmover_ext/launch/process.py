"""Starting one rank: fork from the warm agent, wake a pre-forked reserve, or spawn a fresh interpreter.

All three start the child in its own process group (a terminal Ctrl-C reaches only
the agent, which tears ranks down in order) and ask the kernel to SIGKILL the
child if the agent dies, so no rank outlives its agent.

A fork is possible only while the agent holds no gRPC channel (before it opens
etcd). Processes the agent starts later (standbys that refill the pool) would
have to pay a fresh interpreter's imports, seconds of CPU taken from the ranks
while they train. A **reserve** avoids that: :func:`fork_reserve` forks a
child while forking is still safe, and the child sleeps on a socket; at a
refill :func:`activate` sends it the process's environment, arguments and
output descriptors, and it runs the script exactly as a forked rank would.
:func:`discard` ends an unused one.

A child forked from a process that has asked the CUDA runtime anything (``torch.cuda.is_available()``
counts devices through it by default) cannot use CUDA: torch refuses with "Cannot re-initialize CUDA in
forked subprocess". :func:`fork_safe_cuda_checks` makes torch answer such questions through NVML
instead; the launcher calls it before it imports torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainmover_ext.deadline import Deadline
from trainmover_ext.launch import priority
from trainmover_ext.launch.logs import ProcessOutput

_PR_SET_PDEATHSIG = 1

# torch's documented switch: its CUDA checks ask NVML, which leaves the CUDA runtime untouched.
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def fork_safe_cuda_checks() -> None:
    """Make ``torch.cuda.is_available()`` in this process (and the ranks it starts) leave forking safe.

    Without it, the first such call in the agent (megatron-core's patches ask it at import) initialises
    the CUDA driver, and every rank forked afterwards fails at ``torch.cuda.set_device``. torch reads the
    variable at each call, so this works whenever it runs before the first check. A value the user set
    is kept."""
    os.environ.setdefault(NVML_CUDA_CHECK, "1")


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the agent's teardown still kills children
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def preimport_for_fork(*, install_patches: bool = False) -> None:
    """Import the heavy modules once in the agent so forked ranks skip 4-10 s of imports; with
    ``install_patches`` (the ranks are TrainMover's, which install them anyway) also install the
    megatron-core patches, so that every process forked afterwards inherits them installed."""
    fork_safe_cuda_checks()
    import trainmover_training  # noqa: F401  (first: it quiets megatron-core's CPU fallback warnings)

    # isort: split
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch  # noqa: F401

    import trainmover_ext.patches

    if install_patches:
        trainmover_ext.patches.install()


@dataclass
class RankProcess:
    """A started rank: its global rank, pid and, for spawned ones, the Popen handle."""

    rank: int
    pid: int
    popen: subprocess.Popen | None = None
    returncode: int | None = None
    heartbeat: str = ""
    """The key of its heartbeat file in the agent's :class:`~trainmover_ext.launch.heartbeat.HangWatch`
    (the member id it was started as), '' when it has none."""
    _pidfd: int | None = field(default=None, repr=False)

    def poll(self) -> int | None:
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

    def exit_fd(self) -> int | None:
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


def fork_rank(
    rank: int,
    env: dict[str, str],
    script: str,
    script_args: list[str],
    output: ProcessOutput | None = None,
    *,
    niceness: int = 0,
) -> RankProcess:
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
    _run_child(parent, niceness, lambda: (env, script, list(script_args), output.in_child if output else None))


def _run_child(parent: int, niceness: int, task) -> None:
    """The body of a forked child; never returns. ``task()`` gives ``(env, script, args, redirect)``
    (a reserve blocks in it until it is activated; None: exit 0 without running anything)."""
    code = 1
    try:
        os.setpgid(0, 0)
        _die_with_parent(parent)
        for reserve_sock in _reserve_socks:  # another reserve's wake-up line is not ours to hold open
            reserve_sock.close()
        priority.lower(niceness)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        what = task()
        if what is None:
            code = 0
            return
        env, script, script_args, redirect = what
        if redirect is not None:
            redirect()
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


_reserve_socks: list[socket.socket] = []
"""The agent's ends of its reserves' sockets (closed in every child it forks)."""
_WAKE_MAX_BYTES = 1 << 20


@dataclass
class Reserve:
    """A child forked while forking was safe, asleep until :func:`activate` or :func:`discard`."""

    pid: int
    sock: socket.socket = field(repr=False)


def fork_reserve(*, niceness: int = 0) -> Reserve:
    """Fork a reserve (see the module docstring), ``niceness`` lower in priority from now on. Call it only
    while the agent holds no gRPC channel, like :func:`fork_rank`."""
    parent = os.getpid()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        _reserve_socks.append(mine)
        return Reserve(pid=pid, sock=mine)
    mine.close()

    def wait_for_work():
        try:
            data, fds, _, _ = socket.recv_fds(theirs, _WAKE_MAX_BYTES, 2)
        except OSError:
            return None
        finally:
            theirs.close()
        if not data:  # the agent closed the line: discarded, or gone
            return None
        req = json.loads(data)

        def redirect() -> None:
            for stream, fd in zip(req["streams"], fds, strict=False):
                os.dup2(fd, 1 if stream == "stdout" else 2)
                os.close(fd)

        return req["env"], req["script"], req["args"], redirect

    _run_child(parent, niceness, wait_for_work)


def activate(
    reserve: Reserve,
    rank: int,
    env: dict[str, str],
    script: str,
    script_args: list[str],
    output: ProcessOutput | None = None,
) -> RankProcess | None:
    """Wake ``reserve`` to run ``script`` as :func:`fork_rank` would (with ``env`` applied, writing to
    ``output``); the started process, or None when the reserve is gone (``output`` is then unused and
    the caller may start the process another way)."""
    fds = output.child_fds if output is not None else {}
    streams = sorted(fds)
    message = json.dumps({"env": env, "script": script, "args": list(script_args), "streams": streams}).encode()
    if len(message) > _WAKE_MAX_BYTES:
        discard(reserve)
        return None
    try:
        socket.send_fds(reserve.sock, [message], [fds[s] for s in streams])
    except OSError:
        discard(reserve)
        return None
    _forget(reserve)
    if output is not None:
        output.started()
    return RankProcess(rank=rank, pid=reserve.pid)


def discard(reserve: Reserve, timeout_s: float = 2.0) -> None:
    """End an unused reserve: close its line (it exits 0), SIGKILL it after ``timeout_s``, reap it."""
    _forget(reserve)
    deadline = Deadline(timeout_s)
    while True:
        try:
            pid, _ = os.waitpid(reserve.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            return
        if deadline.expired:
            try:
                os.kill(reserve.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = Deadline(float("inf"))
        time.sleep(0.01)


def _forget(reserve: Reserve) -> None:
    if reserve.sock in _reserve_socks:
        _reserve_socks.remove(reserve.sock)
    reserve.sock.close()


ENV_PARENT_PID = "TRAINMOVER_PARENT_PID"


def die_with_parent_from_env() -> None:
    """In a spawned rank: die with the agent named by ``TRAINMOVER_PARENT_PID`` (called at start-up)."""
    parent = os.environ.get(ENV_PARENT_PID)
    if parent and parent.isdigit():
        _die_with_parent(int(parent))


def spawn_rank(
    rank: int,
    env: dict[str, str],
    script: str,
    script_args: list[str],
    output: ProcessOutput | None = None,
    *,
    niceness: int = 0,
) -> RankProcess:
    """Start ``python script args`` as a fresh interpreter, as torchrun does.

    No Python runs between fork and exec (no ``preexec_fn``): the agent may hold
    gRPC threads by then, and running code in a forked copy of them can abort.
    The child sets its parent-death signal itself (:func:`die_with_parent_from_env`).
    """
    full_env = dict(os.environ)
    full_env.update(env)
    full_env[ENV_PARENT_PID] = str(os.getpid())
    fds = output.child_fds if output is not None else {}
    lowered = priority.spawn_prefix(niceness)  # before the interpreter runs any Python
    popen = subprocess.Popen(
        [*lowered, sys.executable, "-u", script, *script_args],
        env=full_env,
        start_new_session=True,
        stdout=fds.get("stdout"),
        stderr=fds.get("stderr"),
    )
    if output is not None:
        output.started()
    return RankProcess(rank=rank, pid=popen.pid, popen=popen)
