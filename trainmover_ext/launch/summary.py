"""The failure summary ``trainmover launch`` prints when it exits non-zero, in the shape of torchrun's.

Contract (the agent, main thread): every process failure the agent sees is added with
:meth:`FailureLog.add` (a rank that exited non-zero, was killed, or hung and was fenced). When the
agent's exit code is not 0 and it was not asked to stop, :meth:`FailureLog.render` gives the block
it prints: every failure, then the first one as the root cause, each with its time, host, rank,
exit code, pid and log file. Under ``--trainmover`` a failure a standby took over is listed too,
marked so: the root cause of a job that stopped is often a failure that could not be replaced.
"""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One process failure the agent saw."""

    rank: int
    """The global rank the process served."""
    local_rank: int | None
    """Its local rank on this node (None when unknown, e.g. a promoted standby)."""
    pid: int | None
    code: int
    """Exit code; negative: killed by that signal."""
    time: float
    host: str
    member: str = ""
    """The member id (under ``--trainmover``)."""
    log_file: str | None = None
    """Its stderr log under ``--log-dir``, if any."""
    note: str = ""
    """E.g. ``hung (...)``, or that a standby took over."""


def describe_code(code: int) -> str:
    """``1`` -> ``exit code 1``; ``-9`` -> ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class FailureLog:
    """The failures of one ``trainmover launch`` run (see the module docstring)."""

    script: str
    failures: list[Failure] = field(default_factory=list)

    def add(self, failure: Failure) -> None:
        self.failures.append(failure)

    def render(self) -> list[str]:
        """The summary's lines; empty when no failure was seen."""
        if not self.failures:
            return []
        rule = "=" * 64
        lines = [rule, f"{os.path.basename(self.script)} FAILED", "-" * 64, "Failures:"]
        ordered = sorted(self.failures, key=lambda f: f.time)
        for i, failure in enumerate(ordered[1:], start=1):
            lines += [f"[{i}]:", *self._block(failure)]
        if len(ordered) == 1:
            lines.append("  <NO_OTHER_FAILURES>")
        lines += ["-" * 64, "Root Cause (first observed failure):", "[0]:", *self._block(ordered[0]), rule]
        return lines

    @staticmethod
    def _block(f: Failure) -> list[str]:
        when = datetime.datetime.fromtimestamp(f.time).strftime("%Y-%m-%d_%H:%M:%S")
        local = "?" if f.local_rank is None else f.local_rank
        lines = [
            f"  time      : {when}",
            f"  host      : {f.host}",
            f"  rank      : {f.rank} (local_rank: {local})" + (f", member {f.member}" if f.member else ""),
            f"  exitcode  : {f.code} ({describe_code(f.code)}; pid: {f.pid if f.pid is not None else '?'})",
            f"  log       : {f.log_file or '<console; --log-dir DIR keeps one file per rank>'}",
        ]
        if f.note:
            lines.append(f"  note      : {f.note}")
        return lines
