"""Helpers shared by the benchmarks: run the launcher, read metrics, print tables."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from harness.jobs import PRETRAIN, launch_cmd  # noqa: E402


def read_events(path: str) -> list[dict]:
    """All complete JSON-line records of a ``--tm-metrics-file`` (a running job may be writing its last
    line: a line without its newline is left for the next read)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


class Tail:
    """Reads a growing file a complete line at a time, from where the last call stopped.

    A harness that polls a running job re-reading and re-parsing its whole metrics file costs that
    job CPU in proportion to the file's length (on 2 cores, 100 reads a second of a 350-line file is
    a few percent of the machine, charged to the run under test). A tail costs the new lines only."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._partial = ""

    def lines(self) -> list[str]:
        """The complete lines written since the last call (a line without its newline waits)."""
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        *complete, self._partial = text.split("\n")
        return [line for line in complete if line.strip()]


class LastIteration:
    """The last ``iteration`` event of a ``--tm-metrics-file``, read incrementally (see :class:`Tail`)."""

    def __init__(self, metrics: str):
        self._tail = Tail(metrics)
        self.value = 0

    def __call__(self) -> int:
        for line in self._tail.lines():
            if '"iteration"' in line:  # most lines are iterations; parse only the candidates
                rec = json.loads(line)
                if rec.get("event") == "iteration":
                    self.value = rec["iteration"]
        return self.value


def start_launcher(
    nproc: int,
    script_args: list[str],
    launch_flags: list[str],
    log_prefix: str,
    *,
    script: str = PRETRAIN,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``trainmover launch`` of ``script`` in the background, its output in ``log_prefix.{out,err}``;
    ``env``: more environment for it (and every process it starts)."""
    cmd = launch_cmd(nproc, script_args, *launch_flags, script=script)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(
        cmd, stdout=open(log_prefix + ".out", "w"), stderr=open(log_prefix + ".err", "w"), cwd=ROOT, env=env
    )


def rank_pids(err_path: str) -> list[list[int]]:
    return [json.loads(m) for m in re.findall(r"pids (\[[\d, ]+\])", open(err_path).read())]


def wait_until(predicate, timeout: float, interval: float = 0.005):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def print_table(title: str, rows: list[tuple], headers: tuple) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print(title)
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)))


def measured_at() -> dict:
    """When and on what code a figure was measured: UTC date, the commit, and whether tracked files
    differed from it (another engineer's uncommitted work in the same tree counts)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git("rev-parse", "--short=12", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


ONE_LINE_KEYS = ("iterations", "events")
"""Top-level lists written one element a line: thousands of rows stay readable and diffable."""


def dumps(payload: dict) -> str:
    """``payload`` as indented JSON, the lists of :data:`ONE_LINE_KEYS` one element a line."""
    rest = {k: v for k, v in payload.items() if k not in ONE_LINE_KEYS}
    lists = [k for k in ONE_LINE_KEYS if isinstance(payload.get(k), list)]
    text = json.dumps(rest, indent=2)
    if not lists:
        return text
    parts = [
        f"  {json.dumps(k)}: ["
        + ",".join("\n    " + json.dumps(x) for x in payload[k])
        + ("\n  ]" if payload[k] else "]")
        for k in lists
    ]
    head = text[: text.rfind("}")].rstrip()
    return head + ("," if rest else "") + "\n" + ",\n".join(parts) + "\n}"


def write_json(path: str | None, payload: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(dumps(payload) + "\n")
        print(f"wrote {path}")
