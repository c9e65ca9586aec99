"""The small key-value interface the control plane is written against.

Contract: every TrainMover component that talks to etcd goes through
:class:`KV`, never through the client library. Two implementations exist:
:class:`trainmover_ext.kv.etcd.EtcdKV` (the real server, used by every
integration test and in production) and :class:`trainmover_ext.kv.memory.MemoryKV`
(an in-memory fake with an injected clock, used only by unit tests of pure
logic). Keys are ``str``, values are ``bytes``.

Atomicity is expressed with :meth:`KV.commit`: a list of guards (comparisons on
a key's ``mod_revision`` or value) and a list of writes that apply only when all
guards hold. This is enough for compare-and-swap on ``epoch``, for
``put-if-absent`` and for multi-key decisions, and it maps 1:1 onto an etcd
transaction.

Failure: methods raise :class:`~trainmover_ext.errors.EtcdUnavailable` when the
server cannot be reached within the client timeout, and
:class:`~trainmover_ext.errors.StoreError` for any other refusal.

Example::

    kv = MemoryKV()                         # or EtcdKV(EtcdClientConfig(endpoints=[...]))
    kv.put("/a", b"1")
    ok = kv.commit([Guard.mod_revision("/a", kv.get("/a").mod_revision)], [Put("/a", b"2")])
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import EtcdUnavailable


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One stored key at one revision."""

    key: str
    """The full key."""
    value: bytes
    """The raw value."""
    mod_revision: int
    """Revision of the last write to the key; guards compare against it."""
    create_revision: int
    """Revision at which the key was created (changes when it is deleted and re-created)."""
    lease: int = 0
    """The lease the key is attached to; 0 when none."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The result of a prefix read: entries sorted by key, all at one revision."""

    revision: int
    """The store revision the read saw; a watch from ``revision + 1`` misses nothing."""
    entries: list[Entry] = field(default_factory=list)
    """The entries, sorted by key."""


@dataclass(frozen=True, kw_only=True)
class WatchEvent:
    """One change seen by a watch."""

    kind: str
    """``"put"`` or ``"delete"``."""
    key: str
    """The full key that changed."""
    value: bytes
    """The new value (empty for a delete)."""
    mod_revision: int
    """The revision of the change."""


@dataclass(frozen=True)
class Guard:
    """A condition in :meth:`KV.commit`.

    ``target`` is ``"mod"`` (compare the key's mod_revision; 0 means "absent"),
    or ``"value"`` (compare the raw value; the key must exist).
    """

    key: str
    target: str
    expected: int | bytes

    @staticmethod
    def mod_revision(key: str, revision: int) -> Guard:
        """Holds when ``key`` was last written at ``revision`` (0: the key is absent)."""
        return Guard(key, "mod", int(revision))

    @staticmethod
    def absent(key: str) -> Guard:
        """Holds when ``key`` does not exist."""
        return Guard(key, "mod", 0)

    @staticmethod
    def value(key: str, value: bytes) -> Guard:
        """Holds when ``key`` exists and holds exactly ``value``."""
        return Guard(key, "value", bytes(value))


@dataclass(frozen=True)
class Put:
    """A write in :meth:`KV.commit`."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """A delete in :meth:`KV.commit`; ``prefix=True`` deletes every key under ``key``."""

    key: str
    prefix: bool = False


WatchCallback = Callable[[list[WatchEvent]], None]
"""Receives each batch of events, in revision order, on a background thread."""


class WatchHandle(abc.ABC):
    """A running watch; :meth:`cancel` is idempotent and never blocks for long."""

    @abc.abstractmethod
    def cancel(self) -> None: ...

    def delivery_thread_id(self) -> int | None:
        """The native id of the thread that runs the callback, when one thread does (None: unknown, or
        the writer's own thread). A process at a low CPU priority raises this thread's priority alone."""
        return None


class KV(abc.ABC):
    """The storage interface (see the module docstring for the contract)."""

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The entry at ``key``, or None when absent."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str, *, end: str | None = None, since: int = 0) -> Snapshot:
        """Every key that starts with ``prefix``, read at one revision; with ``end``, only the keys
        below ``end`` (a job's control plane reads its namespace without the rendezvous store,
        which sorts last: see :attr:`~trainmover_ext.kv.job.JobSpace.control_end`); with ``since``,
        only the keys last written at revision ``since`` or later (a reader that keeps what it read
        asks for what changed: the snapshot's revision is the store's, the next ``since`` is one more)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write unconditionally; returns the new revision."""

    @abc.abstractmethod
    def commit(self, guards: Sequence[Guard], ops: Sequence[Put | Delete]) -> bool:
        """Apply ``ops`` atomically iff every guard holds; returns whether they were applied."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""

    @abc.abstractmethod
    def grant_lease(self, ttl_s: int) -> int:
        """Create a lease of ``ttl_s`` seconds; returns its id."""

    @abc.abstractmethod
    def refresh_lease(self, lease_id: int) -> int:
        """Keep a lease alive; returns the remaining TTL, 0 when the store says the lease is gone.

        Raises :class:`~trainmover_ext.errors.StoreError` (e.g. ``EtcdUnavailable``) when the store
        gave no answer: that says nothing about the lease, so callers keep trying."""

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """End a lease now; its keys are deleted. Unknown ids are ignored."""

    @abc.abstractmethod
    def watch_prefix(
        self, prefix: str, callback: WatchCallback, *, start_revision: int = 0, end: str | None = None
    ) -> WatchHandle:
        """Call ``callback`` with every change under ``prefix`` (and below ``end``, if given) from
        ``start_revision`` (0: from now).

        Implementations re-establish the watch after a transient server loss,
        resuming after the last revision delivered, so no change is skipped.
        """

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: bytes, *, lease: int = 0) -> bool:
        """Write ``value`` iff ``key`` was last written at ``expected_mod_revision`` (0: absent)."""
        return self.commit([Guard.mod_revision(key, expected_mod_revision)], [Put(key, value, lease)])

    def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Create ``key`` only if it does not exist; returns whether it was created."""
        return self.commit([Guard.absent(key)], [Put(key, value, lease)])

    def close(self) -> None:  # noqa: B027 - optional to override: a store without client resources
        """Release client resources; the default does nothing."""

    def __enter__(self) -> KV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefix_end(prefix: str) -> str:
    """The smallest key greater than every key starting with ``prefix`` (etcd range end)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return "\0"
    raw[-1] += 1
    return raw.decode(errors="surrogateescape")


RECHECK_S = 1.0
"""How often a wait on etcd also reads the keys itself instead of relying on its watch alone: a safety net
for a watch that never delivers. pyetcd gave a watch created after a timed-out create the other
watch's stream (seen once: a 16-rank start, two ranks waiting out a 120 s timeout for a key their peer
had written); :mod:`~trainmover_ext.kv.etcd_watch` prevents that one, and a wait stays bounded by this
net should another defect of the kind remain."""


def wait_prefix(
    kv: KV, prefix: str, ready: Callable[[dict[str, bytes]], bool], timeout_s: float, recheck_s: float | None = None
) -> dict[str, bytes] | None:
    """Block until ``ready(values)`` holds for the keys under ``prefix``; returns ``{key: value}``.

    One read, then a watch from the revision after it (no change is missed), plus one read every
    :data:`RECHECK_S` (or ``recheck_s``) in case the watch never fires. Returns None when
    ``timeout_s`` passes first; the caller says what was missing. Once the wait has begun, an etcd
    out of reach (:class:`~trainmover_ext.errors.EtcdUnavailable` from a re-read) is no answer yet:
    the wait goes on to its deadline, and the watch resumes when etcd serves again."""
    import threading

    snap = kv.get_prefix(prefix)
    values = {e.key: e.value for e in snap.entries}
    if ready(values):
        return values
    cond = threading.Condition()
    state = {"values": values}

    def on_events(events: list[WatchEvent]) -> None:
        with cond:
            current = dict(state["values"])
            for ev in events:
                if ev.kind == "put":
                    current[ev.key] = ev.value
                else:
                    current.pop(ev.key, None)
            state["values"] = current
            cond.notify_all()

    watch = kv.watch_prefix(prefix, on_events, start_revision=snap.revision + 1)
    deadline = Deadline(timeout_s)
    try:
        while True:
            with cond:
                interval = RECHECK_S if recheck_s is None else recheck_s
                if cond.wait_for(lambda: ready(state["values"]), max(0.0, min(interval, deadline.remaining()))):
                    return state["values"]
            # The safety net under the watch (see RECHECK_S): read the prefix itself.
            try:
                values = {e.key: e.value for e in kv.get_prefix(prefix).entries}
            except EtcdUnavailable:
                pass  # no answer yet; the watch resumes once etcd serves again
            else:
                if ready(values):
                    return values
            if deadline.expired:
                return None
    finally:
        watch.cancel()
