"""Per-rank log files, as torchrun's ``--log-dir``, ``--redirects`` and ``--tee`` make them.

Contract (the agent, main thread):
- Without ``--log-dir`` every rank writes to the agent's own stdout and stderr.
- With it, each process the agent starts gets ``LOG_DIR/attempt_<n>/<name>/stdout.log`` and
  ``stderr.log``, ``<name>`` being the global rank (a worker) or the member id (a standby), and
  ``<n>`` the restart count. ``--redirects`` says which streams go to the files only (0 none,
  1 stdout, 2 stderr, 3 both; ``0:3,1:2`` per local rank, the others 0); ``--tee`` which go to the
  files and to the console. A stream named in both is teed. ``--local-ranks-filter`` keeps the other
  local ranks off the console: their streams go to their files only, or nowhere without ``--log-dir``.
- A teed stream goes through a pipe that a daemon thread of the agent copies to the file and to
  the console until the process closes it; a redirected one is the file itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field

from trainmover_ext.errors import ConfigError

NONE, OUT, ERR, BOTH = 0, 1, 2, 3


def parse_std_spec(text: str | None, flag: str) -> dict[int, int]:
    """``"3"`` -> ``{-1: 3}`` (every local rank); ``"0:3,1:2"`` -> ``{0: 3, 1: 2}``."""
    if text is None or str(text).strip() == "":
        return {}
    text = str(text).strip()
    try:
        if ":" not in text:
            value = int(text)
            spec = {-1: value}
        else:
            spec = {}
            for part in text.split(","):
                local, value = part.split(":")
                spec[int(local)] = int(value)
    except ValueError as exc:
        raise ConfigError(
            f"{flag} {text!r}: give 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL:VALUE pairs such as 0:3,1:2"
        ) from exc
    if any(v not in (NONE, OUT, ERR, BOTH) for v in spec.values()) or any(k < -1 for k in spec):
        raise ConfigError(f"{flag} {text!r}: values are 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")
    return spec


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where the started processes write (see the module docstring)."""

    log_dir: str | None = None
    """``--log-dir``: the root of the per-process log files; None keeps the console."""
    redirects: dict[int, int] = field(default_factory=dict)
    """``--redirects`` by local rank (-1: every rank)."""
    tee: dict[int, int] = field(default_factory=dict)
    """``--tee`` by local rank (-1: every rank)."""
    console_ranks: frozenset[int] | None = None
    """``--local-ranks-filter``: the local ranks whose output reaches the console (None: all). The others
    write to their files only (with ``--log-dir``) or nowhere."""

    def __post_init__(self):
        if (self.redirects or self.tee) and not self.log_dir:
            raise ConfigError("--redirects and --tee need --log-dir DIR (where the files go)")

    def modes(self, local_rank: int) -> tuple[int, int]:
        """(redirect, tee) bit masks for ``local_rank``; with --log-dir and neither flag, both streams
        are teed (the files exist and the console still shows everything)."""
        redirect = self.redirects.get(local_rank, self.redirects.get(-1, NONE))
        tee = self.tee.get(local_rank, self.tee.get(-1, NONE))
        if self.log_dir and not self.redirects and not self.tee:
            tee = BOTH
        return redirect & ~tee, tee

    def shown(self, local_rank: int) -> bool:
        """Whether ``local_rank``'s output reaches the console (``--local-ranks-filter``)."""
        return self.console_ranks is None or local_rank in self.console_ranks

    def open(self, name: str, local_rank: int, attempt: int) -> ProcessOutput:
        """The output of one process about to start (files created now)."""
        if not self.log_dir:
            if self.shown(local_rank):
                return ProcessOutput()
            null = {s: os.open(os.devnull, os.O_WRONLY) for s in ("stdout", "stderr")}
            return ProcessOutput(child_fds=null)
        directory = os.path.join(self.log_dir, f"attempt_{attempt}", name)
        os.makedirs(directory, exist_ok=True)
        redirect, tee = self.modes(local_rank)
        if not self.shown(local_rank):  # to the files only
            redirect, tee = BOTH, NONE
        out = ProcessOutput(directory=directory)
        for bit, stream, console in ((OUT, "stdout", sys.stdout), (ERR, "stderr", sys.stderr)):
            path = os.path.join(directory, f"{stream}.log")
            if redirect & bit:
                out.child_fds[stream] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            elif tee & bit:
                read_fd, write_fd = os.pipe()
                out.child_fds[stream] = write_fd
                out.copiers.append((read_fd, path, console))
        return out


@dataclass
class ProcessOutput:
    """The descriptors a started process writes to, and the agent's side of any tee."""

    directory: str | None = None
    child_fds: dict[str, int] = field(default_factory=dict)
    """``stdout``/``stderr`` -> the descriptor the process writes that stream to (absent: inherit)."""
    copiers: list = field(default_factory=list)
    """(pipe read end, file path, console stream) per teed stream."""

    def in_child(self) -> None:
        """In a forked child: point fds 1 and 2 at the files or pipes, close the agent's ends."""
        for read_fd, _, _ in self.copiers:
            os.close(read_fd)
        for stream, target in (("stdout", 1), ("stderr", 2)):
            fd = self.child_fds.get(stream)
            if fd is not None:
                os.dup2(fd, target)
                os.close(fd)

    def started(self) -> None:
        """In the agent, once the process started: close its ends, start copying what it tees."""
        for fd in self.child_fds.values():
            os.close(fd)
        self.child_fds = {}
        for read_fd, path, console in self.copiers:
            copier = threading.Thread(target=_copy, args=(read_fd, path, console), name="trainmover_tee", daemon=True)
            copier.start()
            _COPIERS.append(copier)
        self.copiers = []


_COPIERS: list[threading.Thread] = []
"""Every tee copier this process started (each ends when its writer closes the pipe)."""


def wait_for_tees(timeout_s: float = 5.0) -> None:
    """Let the tee copiers finish what the processes wrote (all of them at most ``timeout_s``): a launcher
    that leaves with ``os._exit`` would otherwise cut the tail of a stream still in its pipe."""
    deadline = time.monotonic() + timeout_s
    for copier in _COPIERS:
        copier.join(max(0.0, deadline - time.monotonic()))


def _copy(read_fd: int, path: str, console) -> None:
    """Copy a teed stream to its file and to the agent's console until the writer closes it."""
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                chunk = os.read(read_fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            f.write(chunk)
            try:
                console.buffer.write(chunk)
                console.flush()
            except (OSError, ValueError, AttributeError):
                pass  # the console is gone; the file still gets everything
    os.close(read_fd)
