"""A ``torch.distributed.Store`` backed by etcd: rendezvous with no rank-0 TCPStore.

Contract:
- Usable directly as ``init_process_group(store=EtcdStore(...), ...)``, and as
  the store of standalone gloo groups (wrap it in a ``PrefixStore`` per group).
- Every key lives under ``prefix`` (use ``/trainmover/<job>/store/<generation>/``
  so that a job's rendezvous never mixes with another's or with an older
  generation's).
- ``wait`` and ``get`` block at most ``timeout`` (the store timeout, or the one
  passed to ``wait``) and raise ``torch.distributed.DistStoreError``-compatible
  errors (:class:`StoreTimeout`, a ``TimeoutError``) naming the missing keys.
- Fork safety: the etcd client is built lazily, per process. A store built in a
  launcher and inherited by forked workers opens its own connection in each
  child; the parent should not have used it before forking (a gRPC channel must
  not cross ``fork()``).
- ``add`` is a compare-and-swap loop, so concurrent adds from many ranks are
  exact. Values written by ``add`` are ASCII decimals, as with TCPStore.
- ``add`` and ``append`` apply once even when etcd applied an attempt whose answer
  was lost: the client retries it, its guard then fails, and a plain loop would
  add again. Each call's transaction also writes a receipt (``~receipts/<id>``
  under the prefix, deleted once read; ``num_keys`` leaves receipts out), and a
  failed guard whose receipt exists means the call already took effect.
- Losing the etcd server blocks calls for up to the client timeout, then raises
  :class:`EtcdUnavailable`; with a multi-member etcd the calls fail over.

Example::

    store = EtcdStore(EtcdClientConfig(endpoints=["127.0.0.1:2379"]), prefix="/trainmover/j/store/0/",
                      timeout=timedelta(seconds=60))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, StoreTimeout
from trainmover_ext.kv.base import KV, Entry, Guard, Put, wait_prefix
from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV

RECEIPTS = "~receipts/"
"""Where (under a store's prefix) ``add`` and ``append`` leave the receipt of their one write."""


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


class EtcdStore(c10d.Store):  # = torch.distributed.Store, which torch does not export explicitly
    """See the module docstring."""

    timeout: timedelta  # the store timeout: a property of torch's Store that its stub omits

    def __init__(
        self,
        config: EtcdClientConfig | list[str],
        prefix: str,
        timeout: timedelta | float = 300.0,
        *,
        kv: KV | None = None,
    ) -> None:
        super().__init__()
        self.config = config if isinstance(config, EtcdClientConfig) else EtcdClientConfig(endpoints=list(config))
        if not prefix.endswith("/"):
            raise ConfigError(f"EtcdStore prefix {prefix!r} must end with '/' so that stores never overlap")
        self.prefix = prefix
        self.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout)))
        # kv injected only by tests and by callers that manage the client themselves.
        self._given_kv = kv
        self._kv_by_pid: dict[int, KV] = {}
        self._lock = threading.Lock()

    # -- plumbing --
    def _kv(self) -> KV:
        if self._given_kv is not None:
            return self._given_kv
        pid = os.getpid()
        kv = self._kv_by_pid.get(pid)
        if kv is None:
            with self._lock:
                kv = self._kv_by_pid.get(pid)
                if kv is None:
                    # A client inherited through fork() is unusable (gRPC), so each process builds its own.
                    self._kv_by_pid = {pid: EtcdKV(self.config)}
                    kv = self._kv_by_pid[pid]
        return kv

    def _full(self, key: str) -> str:
        return self.prefix + key

    def _timeout_s(self, timeout: timedelta | None = None) -> float:
        return (timeout or self.timeout).total_seconds()

    def connect(self) -> EtcdStore:
        """Open this process's etcd client now (it is otherwise opened by the first call). A process that
        will call the store from several threads at once (a joiner's link threads, each inside a gloo
        constructor) opens it first, so that none of them logs in while the others wait."""
        self._kv()
        return self

    def close(self) -> None:
        """Close this process's etcd client (the keys stay)."""
        kv = self._kv_by_pid.pop(os.getpid(), None)
        if kv is not None:
            kv.close()

    # -- torch.distributed.Store API --
    def set(self, key: str, value: object) -> None:
        self._kv().put(self._full(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        # TCPStore semantics: get blocks until the key exists (or the store timeout passes).
        entry = self._kv().get(self._full(key))
        if entry is None:
            self._wait_one(key, self._timeout_s())
            entry = self._kv().get(self._full(key))
            if entry is None:  # deleted between the wait and the read
                raise StoreTimeout(f"key {key!r} under {self.prefix} vanished while being read")
        return entry.value

    def _update_once(self, key: str, op: str, update: Callable[[Entry | None], bytes]) -> bytes:
        """Compare-and-swap ``key`` to ``update(entry)`` exactly once (module docstring: receipts); returns
        the value written."""
        kv, full = self._kv(), self._full(key)
        receipt = self._full(RECEIPTS + uuid.uuid4().hex)
        deadline = Deadline(self._timeout_s())
        while True:
            entry = kv.get(full)
            new = update(entry)
            guard = Guard.mod_revision(full, entry.mod_revision if entry else 0)
            applied = kv.commit([guard], [Put(full, new), Put(receipt, new)])
            done: bytes | None = new
            if not applied:  # a lost race leaves no receipt; an attempt applied before a retry does
                found = kv.get(receipt)
                done = found.value if found is not None else None
            if done is not None:
                kv.delete(receipt)
                return done
            if deadline.expired:  # only under pathological contention
                raise StoreTimeout(f"{op}({key!r}) lost every compare-and-swap race for {self._timeout_s():.0f}s")

    def add(self, key: str, amount: int) -> int:
        return int(self._update_once(key, "add", lambda e: str((int(e.value) if e else 0) + int(amount)).encode()))

    def compare_set(self, key: str, expected_value: object, desired_value: object) -> bytes:
        kv, full = self._kv(), self._full(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            entry = kv.get(full)
            if entry is None:
                if expected:
                    return expected  # HashStore/TCPStore: a missing key with a non-empty expectation is not set
                if kv.commit([Guard.absent(full)], [Put(full, desired)]):
                    return desired
                continue
            if entry.value != expected:
                return entry.value
            if kv.commit([Guard.mod_revision(full, entry.mod_revision)], [Put(full, desired)]):
                return desired

    def delete_key(self, key: str) -> bool:
        return self._kv().delete(self._full(key))

    def num_keys(self) -> int:
        receipts = self._full(RECEIPTS)
        return sum(not e.key.startswith(receipts) for e in self._kv().get_prefix(self.prefix).entries)

    def check(self, keys: list[str]) -> bool:
        kv = self._kv()
        return all(kv.get(self._full(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        budget = self._timeout_s(timeout)
        deadline = Deadline(budget)
        for key in keys:
            self._wait_one(key, deadline.remaining(), total=budget, all_keys=keys)

    def append(self, key: str, value: object) -> None:
        data = _as_bytes(value)
        self._update_once(key, "append", lambda e: (e.value if e else b"") + data)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[object]) -> None:
        self._kv().commit([], [Put(self._full(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)])

    def has_extended_api(self) -> bool:
        return True

    # -- waiting --
    def _wait_one(
        self, key: str, remaining: float, *, total: float | None = None, all_keys: list[str] | None = None
    ) -> None:
        full = self._full(key)
        # One read, then a watch, plus a read every RECHECK_S in case the watch never fires.
        if wait_prefix(self._kv(), full, lambda values: full in values, remaining) is None:
            raise StoreTimeout(
                f"timed out after {total if total is not None else remaining:.1f}s waiting for store keys "
                f"{all_keys or [key]} under {self.prefix} (missing: {key!r}); a peer did not arrive: check that "
                "every rank started and uses the same --tm-job and store generation"
            )
