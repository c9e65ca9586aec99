"""An in-memory :class:`~trainmover_ext.kv.base.KV` for unit tests of pure logic.

It keeps etcd's semantics that the control plane relies on: one global
revision counter, ``mod_revision``/``create_revision`` per key, atomic guarded
commits, leases whose keys vanish on expiry, and prefix watches delivered in
revision order. Time is injected (``clock``) and leases expire only when
:meth:`MemoryKV.expire_leases` is called, so tests are deterministic. Watch
callbacks run synchronously inside the write that caused them.

Never use it outside tests: it is one process's memory, exactly the single point
of failure TrainMover exists to avoid.

Example::

    now = [0.0]
    kv = MemoryKV(clock=lambda: now[0])
    lease = kv.grant_lease(2)
    kv.put("/m/a", b"x", lease=lease)
    now[0] = 3.0
    kv.expire_leases()          # "/m/a" is gone
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from trainmover_ext.errors import LeaseNotFound, StoreError
from trainmover_ext.kv.base import KV, Delete, Entry, Guard, Put, Snapshot, WatchCallback, WatchEvent, WatchHandle


class _MemoryWatch(WatchHandle):
    def __init__(self, owner: MemoryKV, prefix: str, callback: WatchCallback, end: str | None = None) -> None:
        self.owner, self.prefix, self.callback, self.end = owner, prefix, callback, end

    def covers(self, key: str) -> bool:
        return key.startswith(self.prefix) and (self.end is None or key < self.end)

    def cancel(self) -> None:
        with self.owner._lock:
            if self in self.owner._watches:
                self.owner._watches.remove(self)


class MemoryKV(KV):
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._data: dict[str, Entry] = {}
        self._revision = 1
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._next_lease = 1000
        self._watches: list[_MemoryWatch] = []
        self._history: list[WatchEvent] = []

    # -- reads --
    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self._data.get(key)

    def get_prefix(self, prefix: str, *, end: str | None = None, since: int = 0) -> Snapshot:
        with self._lock:
            entries = [
                e
                for k, e in sorted(self._data.items())
                if k.startswith(prefix) and (end is None or k < end) and e.mod_revision >= since
            ]
            return Snapshot(revision=self._revision, entries=entries)

    # -- writes --
    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        self.commit([], [Put(key, value, lease)])
        return self._revision

    def delete(self, key: str) -> bool:
        with self._lock:
            existed = key in self._data
            self.commit([], [Delete(key)])
            return existed

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            count = sum(1 for k in self._data if k.startswith(prefix))
            self.commit([], [Delete(prefix, prefix=True)])
            return count

    def _holds(self, guard: Guard) -> bool:
        entry = self._data.get(guard.key)
        if guard.target == "mod":
            return (entry.mod_revision if entry else 0) == guard.expected
        return entry is not None and entry.value == guard.expected

    @staticmethod
    def _check_disjoint(ops: Sequence[Put | Delete]) -> None:
        # etcd rejects a transaction that writes one key twice (or puts inside a deleted range).
        for i, a in enumerate(ops):
            for b in ops[i + 1 :]:

                def covers(d: Put | Delete, k: str) -> bool:
                    return k.startswith(d.key) if isinstance(d, Delete) and d.prefix else k == d.key

                if covers(a, b.key) or covers(b, a.key):
                    raise StoreError(f"duplicate key given in txn request: {a.key} / {b.key}")

    def commit(self, guards: Sequence[Guard], ops: Sequence[Put | Delete]) -> bool:
        self._check_disjoint(ops)
        with self._lock:
            if not all(self._holds(g) for g in guards):
                return False
            if not ops:
                return True
            # etcd applies a whole transaction at one new revision.
            self._revision += 1
            rev = self._revision
            events: list[WatchEvent] = []
            for op in ops:
                if isinstance(op, Put):
                    if op.lease and op.lease not in self._leases:
                        raise LeaseNotFound(f"lease {op.lease:x} not found while writing {op.key}: re-register")
                    old = self._data.get(op.key)
                    self._data[op.key] = Entry(
                        key=op.key,
                        value=bytes(op.value),
                        mod_revision=rev,
                        create_revision=old.create_revision if old else rev,
                        lease=op.lease,
                    )
                    events.append(WatchEvent(kind="put", key=op.key, value=bytes(op.value), mod_revision=rev))
                else:
                    keys = [k for k in self._data if (k.startswith(op.key) if op.prefix else k == op.key)]
                    for k in sorted(keys):
                        del self._data[k]
                        events.append(WatchEvent(kind="delete", key=k, value=b"", mod_revision=rev))
            self._history.extend(events)
            self._deliver(events)
            return True

    def _deliver(self, events: list[WatchEvent]) -> None:
        for watch in list(self._watches):
            mine = [e for e in events if watch.covers(e.key)]
            if mine:
                watch.callback(mine)

    # -- leases --
    def grant_lease(self, ttl_s: int) -> int:
        with self._lock:
            self._next_lease += 1
            self._leases[self._next_lease] = (ttl_s, self._clock() + ttl_s)
            return self._next_lease

    def refresh_lease(self, lease_id: int) -> int:
        with self._lock:
            if lease_id not in self._leases:
                return 0
            ttl, _ = self._leases[lease_id]
            self._leases[lease_id] = (ttl, self._clock() + ttl)
            return ttl

    def revoke_lease(self, lease_id: int) -> None:
        with self._lock:
            if self._leases.pop(lease_id, None) is None:
                return
            doomed = [k for k, e in self._data.items() if e.lease == lease_id]
            if doomed:
                self.commit([], [Delete(k) for k in doomed])

    def expire_leases(self) -> list[int]:
        """Revoke every lease past its deadline on the injected clock; returns their ids."""
        with self._lock:
            now = self._clock()
            expired = [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]
            for lid in expired:
                self.revoke_lease(lid)
            return expired

    # -- watches --
    def watch_prefix(
        self, prefix: str, callback: WatchCallback, *, start_revision: int = 0, end: str | None = None
    ) -> WatchHandle:
        with self._lock:
            watch = _MemoryWatch(self, prefix, callback, end)
            if start_revision:
                backlog = [e for e in self._history if e.mod_revision >= start_revision and watch.covers(e.key)]
                if backlog:
                    callback(backlog)
            self._watches.append(watch)
            return watch
