"""Copies of the job's events and migration timelines in the run directory, so they outlive etcd.

Contract:
- :meth:`RunArchive.start` runs :meth:`RunArchive.poll` on a daemon thread of
  the agent every ``interval_s`` while ``is_leader()`` (its controller leads),
  and once more at :meth:`RunArchive.close`. A poll appends each timeline record (``~events/``) not yet copied
  to ``RUN_DIR/events.jsonl``,
  and each migration plan once it finished (status ``done`` or ``aborted``)
  to ``RUN_DIR/migrations.jsonl``, with its per-step timestamps.
- Lines are the records' own JSON (:class:`~trainmover_ext.control.records.Event`,
  :class:`~trainmover_ext.control.records.MigrationPlan` as dicts), one per line;
  a reader skips a line it cannot parse (a torn last line after a crash).
- What is already in the files is never written twice, whoever wrote it: an earlier agent of the
  same run directory, or another leader meanwhile (two agents of one run directory, leading in
  turn, each alive). Every append holds an exclusive ``flock`` on the file and first reads the lines
  other writers appended since this archive's last look; a torn last line (a writer that died
  mid-write) is ended before the next record.
- A poll reads only the events and plans written since the previous one (a plan that finished was
  written again), so its cost does not grow with the job's history.
- A malformed record is skipped; on the thread, a failed round (etcd away, disk
  full) is logged and retried at the next one, which reads again what that one did not copy.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from trainmover_ext.control.records import Event, MigrationPlan
from trainmover_ext.errors import MalformedValue

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
MIGRATIONS_FILE = "migrations.jsonl"
FINISHED = ("done", "aborted")


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, skipping lines that do not parse; nothing if it is missing."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


class RunArchive:
    """See the module docstring."""

    _thread: threading.Thread | None
    """The polling thread, from :meth:`start` until :meth:`close` (unset before :meth:`start`)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.events_path = os.path.join(run_dir, EVENTS_FILE)
        self.migrations_path = os.path.join(run_dir, MIGRATIONS_FILE)
        self._events: set[Any] = set()
        self._epochs: set[Any] = set()
        self._read_to = {self.events_path: 0, self.migrations_path: 0}
        """How far each file has been read (bytes): lines past it were written by another archive."""
        for path, seen, key in ((self.events_path, self._events, "key"), (self.migrations_path, self._epochs, "epoch")):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    self._catch_up(f, seen, key)
        self._events_since = self._plans_since = 0
        """The next poll reads only the events and plans written from these revisions on."""

    def start(self, space: JobSpace, is_leader: Callable[[], bool], interval_s: float = 1.0) -> RunArchive:
        """Poll ``space`` on a daemon thread while ``is_leader()``; see the module docstring."""
        self._space, self._is_leader = space, is_leader
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="tm-run-archive", daemon=True)
        self._thread.start()
        return self

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._round()

    def _round(self) -> None:
        from trainmover_ext.errors import TrainMoverError

        if not self._is_leader():
            return
        try:
            self.poll(self._space)
        except (OSError, TrainMoverError) as exc:
            logger.warning("run archive: could not copy events to %s (retrying): %s", self.run_dir, exc)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and copy what is new one last time; safe to call twice or unstarted."""
        thread = getattr(self, "_thread", None)
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        self._thread = None
        self._round()

    def poll(self, space: JobSpace) -> int:
        """Copy what is new in ``space`` (a JobSpace); returns how many records were written."""
        written = 0
        new_events: list[dict[str, Any]] = []
        events = space.kv.get_prefix(space.events_prefix, since=self._events_since)
        for entry in events.entries:
            if entry.key in self._events:
                continue
            try:
                event = Event.from_bytes(entry.value, key=entry.key)
            except MalformedValue:
                continue
            new_events.append({"key": entry.key, **dataclasses.asdict(event)})
        written += self._append(self.events_path, new_events, self._events, "key")
        self._events_since = events.revision + 1
        finished: list[dict[str, Any]] = []
        plans = space.kv.get_prefix(space.key("migrations/"), since=self._plans_since)
        for entry in plans.entries:
            try:
                plan = MigrationPlan.from_bytes(entry.value, key=entry.key)
            except MalformedValue:
                continue
            if plan.status in FINISHED and plan.epoch not in self._epochs:
                finished.append(dataclasses.asdict(plan))
        written += self._append(self.migrations_path, finished, self._epochs, "epoch")
        self._plans_since = plans.revision + 1
        return written

    def _catch_up(self, f: BinaryIO, seen: set[Any], key: str) -> None:
        """Add the ``key`` of every whole line of ``f`` past where this archive last read to ``seen``."""
        path = f.name
        f.seek(self._read_to[path])
        data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line is not read (its writer died, or writes it now)
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                seen.add(record.get(key))
        self._read_to[path] += end

    def _append(self, path: str, records: list[dict[str, Any]], seen: set[Any], key: str) -> int:
        """Append the records whose ``key`` no writer of ``path`` wrote yet; how many were written."""
        if not records:
            return 0
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            self._catch_up(f, seen, key)
            fresh = [r for r in records if r[key] not in seen]
            if not fresh:
                return 0
            f.seek(0, os.SEEK_END)
            out = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in fresh)
            if f.tell() > self._read_to[path]:  # a torn line: end it, so that ours parse
                out = b"\n" + out
            f.write(out)
            f.flush()
            os.fsync(f.fileno())
            self._read_to[path] = f.tell()
            seen.update(r[key] for r in fresh)
        return len(fresh)
