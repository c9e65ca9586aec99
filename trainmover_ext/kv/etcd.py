"""The real :class:`~trainmover_ext.kv.base.KV`, on an etcd v3 server through ``pyetcd``.

Contract:
- Every call carries the client timeout (``EtcdClientConfig.timeout_s``).
  Calls that fail because an endpoint is down are retried on the other
  endpoints until that deadline, then raise :class:`EtcdUnavailable` naming the
  endpoints. A guarded :meth:`commit` whose reply was lost may have applied; a
  retry then finds its guard false and returns False, so callers re-read.
- Construction checks that some endpoint answers (``connect_timeout_s``), so a
  wrong ``--tm-etcd-endpoints`` fails at start with a clear message. Like every
  call, that check and the login fail over: a client built while a member is
  down (a promoted standby's first store client) works through the others.
- Fork safety: a gRPC channel must not cross ``fork()``. An ``EtcdKV`` refuses
  use in a child process (:class:`StoreError`); build a new one there (the
  torch store does this for you).
- Watches survive a server restart, however long it is down, and each hears its
  own range only, even after etcd answered a create late
  (:mod:`trainmover_ext.kv.etcd_watch`).
- A lease's keep-alives share one long-lived stream (:mod:`trainmover_ext.kv.keepalive`), reopened
  after a failure.
- Only etcd's own answer says a lease is gone (:class:`LeaseNotFound`, or
  :meth:`EtcdKV.refresh_lease` returning 0); an unreachable server raises
  :class:`EtcdUnavailable`, which says nothing about any lease.
- Password auth (``user``/``password``): the client logs in at construction and
  again whenever etcd calls its token invalid (an etcd restart forgets tokens), so
  a long-lived process never loses access. The token travels as gRPC metadata,
  over TLS or, on a plain channel, in the clear (use TLS off loopback). With
  ``login_if_enabled`` (a job's derived credentials) a server without auth is used
  without logging in. A reply of "permission denied" still proves the server answers.

Example::

    cfg = EtcdClientConfig(endpoints=["127.0.0.1:2379"])
    with EtcdKV(cfg) as kv:
        kv.put("/trainmover/demo/x", b"1")
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import AuthError, ConfigError, EtcdUnavailable, LeaseNotFound, StoreError
from trainmover_ext.kv.base import (
    KV,
    Delete,
    Entry,
    Guard,
    Put,
    Snapshot,
    WatchCallback,
    WatchHandle,
    prefix_end,
)
from trainmover_ext.kv.etcd_watch import EtcdWatch
from trainmover_ext.kv.keepalive import KeepAliveStream

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(kw_only=True)
class EtcdClientConfig:
    """How to reach etcd. Mirrors the ``--tm-etcd-*`` flags."""

    endpoints: list[str] = field(default_factory=list)
    """``host:port`` (optionally ``http://`` or ``https://``) of each etcd member (``--tm-etcd-endpoints``)."""
    ca_cert: str | None = None
    """CA certificate file; enables TLS (``--tm-etcd-ca``)."""
    client_cert: str | None = None
    """Client certificate file for ``--client-cert-auth`` servers (``--tm-etcd-cert``)."""
    client_key: str | None = None
    """Private key of ``client_cert`` (``--tm-etcd-key``)."""
    user: str | None = None
    """etcd user for password auth (``--tm-etcd-user``)."""
    password: str | None = None
    """Password of ``user`` (``--tm-etcd-password``)."""
    login_if_enabled: bool = False
    """``user``/``password`` are a job's derived credentials (:func:`~trainmover_ext.kv.job.job_password`):
    log in only when the server has auth enabled, else connect without."""
    timeout_s: float = 5.0
    """Deadline of each call, retries included (``--tm-etcd-timeout``)."""
    connect_timeout_s: float = 5.0
    """How long construction waits for some endpoint to answer."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [e for e in self.endpoints.split(",") if e.strip()]
        if not self.endpoints:
            raise ConfigError("no etcd endpoint given: pass --tm-etcd-endpoints host:port[,host:port]")
        for ep in self.endpoints:
            host, _, port = ep.split("://")[-1].rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--tm-etcd-endpoints entry {ep!r} is not host:port")
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigError("--tm-etcd-cert and --tm-etcd-key must be given together")
        if self.client_cert and not self.ca_cert:
            raise ConfigError("--tm-etcd-cert needs --tm-etcd-ca (the CA that signed the server certificate)")
        if (self.user is None) != (self.password is None):
            raise ConfigError("--tm-etcd-user and --tm-etcd-password must be given together")
        for flag, path in (
            ("--tm-etcd-ca", self.ca_cert),
            ("--tm-etcd-cert", self.client_cert),
            ("--tm-etcd-key", self.client_key),
        ):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("--tm-etcd-timeout must be positive")

    def host_ports(self) -> list[tuple[str, int]]:
        out = []
        for ep in self.endpoints:
            host, _, port = ep.split("://")[-1].rpartition(":")
            out.append((host, int(port)))
        return out


def _is_unavailable(exc: BaseException) -> bool:
    import pyetcd.exceptions as pe

    # WatchTimedOut: the server did not confirm a new watch in time (seen on an overloaded host).
    if isinstance(
        exc,
        (
            pe.ConnectionFailedError,
            pe.ConnectionTimeoutError,
            pe.NoServerAvailableError,
            pe.InternalServerError,
            pe.WatchTimedOut,
        ),
    ):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


def _rotate(client: Any) -> None:
    """Move ``client`` to its next endpoint after a failure (round-robin).

    pyetcd's own failover returns to a failed endpoint as soon as its retry
    window passes, and calls outside it (the login) never leave the endpoint the
    client started on, which can pin a client to a dead member; rotating
    explicitly makes every retry try a different member.
    """
    labels = list(client.endpoints)
    if len(labels) < 2:
        return
    try:
        # Setting the label drops the cached stubs, so the next call opens the new member's channel.
        client._current_endpoint_label = labels[(labels.index(client._current_endpoint_label) + 1) % len(labels)]
    except (ValueError, AttributeError):  # library internals changed: fall back to its own failover
        pass


class EtcdKV(KV):
    """See the module docstring."""

    def __init__(self, config: EtcdClientConfig) -> None:
        self.config = config
        self._pid = os.getpid()
        self._closed = False
        self._login_lock = threading.Lock()
        self._last_login = 0.0
        self.logged_in = False
        """Whether this client logged in (the server has auth enabled and ``user`` is set)."""
        self._keepalives: dict[int, KeepAliveStream] = {}
        self._watch_create_lock = threading.Lock()
        """Held while a watch is created (see :mod:`~trainmover_ext.kv.etcd_watch`)."""
        self._etcd = self._make_client()
        self._wait_ready()

    def _make_client(self) -> Any:
        try:
            import pyetcd
        except ImportError as exc:  # pragma: no cover - environment problem
            raise StoreError("the etcd client is missing: pip install etcd-sdk-python==0.0.7 protobuf") from exc
        cfg = self.config
        creds = None
        if cfg.ca_cert:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(cfg.ca_cert, cfg.client_key, cfg.client_cert)
        # time_retry: how long a failed endpoint is skipped. pyetcd's default (300 s) would lock
        # a restarted single etcd out for five minutes, so retry it almost at once.
        # gRPC backs off reconnects up to 120 s by default: a restarted etcd would stay unreachable
        # for minutes. Reconnect quickly instead; loopback and LAN attempts are cheap.
        opts = [
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        eps = [
            pyetcd.Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=0.2, opts=opts)
            for h, p in cfg.host_ports()
        ]
        # Each RPC attempt gets a slice of the call deadline, so an attempt stuck on a dead or
        # leaderless member leaves time to retry on another member before timeout_s runs out.
        attempt_s = max(0.25, min(2.0, cfg.timeout_s / 3))
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=attempt_s, failover=True)
        if cfg.user is not None:
            self._login(client)
        return client

    def _login(self, client: Any) -> None:
        """Log ``client`` in as ``config.user``; its token goes with every call as metadata.

        (pyetcd would send it as call credentials, which gRPC refuses on a plain channel.)"""
        from pyetcd import etcdrpc

        cfg = self.config
        deadline = Deadline(cfg.connect_timeout_s)
        while True:
            try:
                resp = client.authstub.Authenticate(
                    etcdrpc.AuthenticateRequest(name=cfg.user, password=cfg.password), client.timeout
                )
                break
            except Exception as exc:
                details = (exc.details() if isinstance(exc, grpc.RpcError) else None) or ""
                if cfg.login_if_enabled and "not enabled" in details:
                    return  # the server has no auth: nothing to log in to
                if isinstance(exc, grpc.RpcError) and exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    hint = (
                        "the job token is wrong (its etcd password is derived from the token: pass the token "
                        "`trainmover launch` printed)"
                        if cfg.login_if_enabled
                        else "check --tm-etcd-user/--tm-etcd-password"
                    )
                    raise AuthError(f"etcd refused the login of user {cfg.user!r}: {details}; {hint}") from exc
                if not _is_unavailable(exc):
                    raise self._translate(exc, "login") from exc
                if deadline.expired:
                    raise self._unreachable() from exc
                # The auth stub is not under pyetcd's failover: without a rotation every retry goes to the
                # member the client started on (a random one), and a dead member fails the whole login.
                _rotate(client)
                time.sleep(0.05)
        client.metadata = (("token", resp.token),)
        client.call_credentials = None
        client._stubs.pop("watcher", None)  # watch streams opened from now on carry the new token
        self.logged_in = True
        self._last_login = time.monotonic()

    @staticmethod
    def _stale_login(exc: BaseException) -> bool:
        """etcd no longer knows this client's token (it restarted, or the token's TTL passed)."""
        return isinstance(exc, grpc.RpcError) and "invalid auth token" in (exc.details() or "")

    def _auth_turned_on(self, exc: BaseException) -> bool:
        """The server's auth came on after this client found it off (``login_if_enabled``)."""
        return (
            self.config.login_if_enabled
            and not self.logged_in
            and isinstance(exc, grpc.RpcError)
            and "user name is empty" in (exc.details() or "")
        )

    def _relogin(self) -> None:
        """Log in again after :meth:`_stale_login` (at most twice a second across threads)."""
        if not self.logged_in:
            return
        with self._login_lock:
            if time.monotonic() - self._last_login > 0.5:
                logger.info("etcd forgot this client's login (restart?); logging in again as %s", self.config.user)
                self._login(self._etcd)

    def _wait_ready(self) -> None:
        deadline = Deadline(self.config.connect_timeout_s)
        last: BaseException | None = None
        while True:
            try:
                self._etcd.get_response("/trainmover/.ping")
                return
            except Exception as exc:
                last = exc
                if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    return  # a user limited to its job's prefix: the server answered
                if not _is_unavailable(exc):
                    raise self._translate(exc, "connect") from exc
            if deadline.expired:
                break
            self._rotate()
            time.sleep(0.05)
        self._etcd.close()
        raise self._unreachable() from last

    def _unreachable(self) -> EtcdUnavailable:
        tls_hint = (
            " (TLS: check --tm-etcd-ca/--tm-etcd-cert/--tm-etcd-key match the server)" if self.config.ca_cert else ""
        )
        return EtcdUnavailable(
            f"no etcd answered at {','.join(self.config.endpoints)} within "
            f"{self.config.connect_timeout_s:.1f}s{tls_hint}: "
            "is the job still running? Start etcd or fix --tm-etcd-endpoints (`trainmover launch` prints the job's "
            "endpoints when it starts)"
        )

    def _client(self) -> Any:
        if self._closed:
            raise StoreError("this etcd client is closed; build a new EtcdKV")
        if os.getpid() != self._pid:
            raise StoreError("an EtcdKV cannot be used across fork(): build a new EtcdKV in the child process")
        return self._etcd

    def _rotate(self) -> None:
        """Move to the next endpoint after a failure (see :func:`_rotate`)."""
        _rotate(self._etcd)

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, grpc.RpcError):
            code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in (details or ""):
                return AuthError(
                    f"etcd refused {what}: its auth is on and this client did not log in; pass the "
                    "job's --tm-job and --tm-job-token (its etcd login is derived from the token), "
                    "or --tm-etcd-user with TRAINMOVER_ETCD_PASSWORD"
                )
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return AuthError(
                    f"etcd refused {what}: {details}; check --tm-etcd-user/--tm-etcd-password and certificates"
                )
            if code == grpc.StatusCode.NOT_FOUND and "lease" in (details or ""):
                return LeaseNotFound(f"etcd {what}: lease not found (expired); the member must re-register")
            return StoreError(f"etcd {what} failed: {code.name} {details}")
        if _is_unavailable(exc):
            return EtcdUnavailable(
                f"etcd at {','.join(self.config.endpoints)} unreachable during {what} for "
                f"{self.config.timeout_s:.1f}s: "
                "check the etcd servers are running (`trainmover status` shows the endpoints in use)"
            )
        return StoreError(f"etcd {what} failed: {exc!r}")

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        deadline = Deadline(self.config.timeout_s)
        delay = 0.02
        while True:
            try:
                return fn(self._client())
            except StoreError:
                raise
            except Exception as exc:
                if self._stale_login(exc) and delay < deadline.remaining():
                    self._relogin()
                    continue
                if self._auth_turned_on(exc) and delay < deadline.remaining():
                    self._login(self._etcd)  # a job's etcd whose auth came on after this client connected
                    continue
                if not _is_unavailable(exc) or delay >= deadline.remaining():
                    raise self._translate(exc, what) from exc
                self._rotate()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # -- KV --
    def get(self, key: str) -> Entry | None:
        resp = self._call(f"get {key}", lambda c: c.get_response(key))
        if not resp.kvs:
            return None
        return self._entry(resp.kvs[0])

    @staticmethod
    def _entry(kv: Any) -> Entry:
        return Entry(
            key=kv.key.decode(),
            value=bytes(kv.value),
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
            lease=kv.lease,
        )

    def get_prefix(self, prefix: str, *, end: str | None = None, since: int = 0) -> Snapshot:
        kwargs: dict[str, Any] = {"sort_order": "ascend", "sort_target": "key"}
        if since > 0:
            kwargs["min_mod_revision"] = since  # etcd filters: the reply carries only what changed
        if end is None:
            resp = self._call(f"get prefix {prefix}", lambda c: c.get_prefix_response(prefix, **kwargs))
        else:
            resp = self._call(f"get range {prefix}..{end}", lambda c: c.get_range_response(prefix, end, **kwargs))
        return Snapshot(revision=resp.header.revision, entries=[self._entry(kv) for kv in resp.kvs])

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        resp = self._call(f"put {key}", lambda c: c.put(key, value, lease=lease or None))
        revision: int = resp.header.revision
        return revision

    def commit(self, guards: Sequence[Guard], ops: Sequence[Put | Delete]) -> bool:
        def run(c: Any) -> bool:
            t = c.transactions
            compare = []
            for g in guards:
                if g.target == "mod":
                    compare.append(t.mod(g.key) == g.expected)
                else:
                    compare.append(t.value(g.key) == g.expected)
            success = []
            for op in ops:
                if isinstance(op, Put):
                    success.append(t.put(op.key, op.value, lease=op.lease or None))
                else:
                    success.append(
                        t.delete(
                            op.key,
                            range_end=prefix_end(op.key).encode("utf-8", "surrogateescape") if op.prefix else None,
                        )
                    )
            ok, _ = c.transaction(compare=compare, success=success, failure=[])
            return bool(ok)

        return self._call(f"commit {[g.key for g in guards]}", run)

    def delete(self, key: str) -> bool:
        return bool(self._call(f"delete {key}", lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call(f"delete prefix {prefix}", lambda c: c.delete_prefix(prefix)).deleted)

    def grant_lease(self, ttl_s: int) -> int:
        return int(self._call("grant lease", lambda c: c.lease(int(ttl_s))).id)

    def refresh_lease(self, lease_id: int) -> int:
        # One long-lived stream per lease (trainmover_ext.kv.keepalive), not one per renewal.
        stream = self._keepalives.get(lease_id)
        if stream is None:
            stream = self._keepalives[lease_id] = KeepAliveStream(lease_id)
        remaining = self._call("refresh lease", stream.refresh)
        if remaining <= 0:
            self._keepalives.pop(lease_id, None)
        return remaining

    def revoke_lease(self, lease_id: int) -> None:
        stream = self._keepalives.pop(lease_id, None)
        if stream is not None:
            stream.close()
        try:
            self._call("revoke lease", lambda c: c.revoke_lease(lease_id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    def watch_prefix(
        self, prefix: str, callback: WatchCallback, *, start_revision: int = 0, end: str | None = None
    ) -> WatchHandle:
        watch = EtcdWatch(self, prefix, callback, start_revision, end)
        try:
            self._call(f"watch {prefix}", lambda c: watch.subscribe())
        except BaseException:
            watch.cancel()
            raise
        return watch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            for stream in list(self._keepalives.values()):
                stream.close()
            try:
                self._etcd.close()
            except Exception:  # closing a channel to a dead server may raise; it is gone either way
                pass
