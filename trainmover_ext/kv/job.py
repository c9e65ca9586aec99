"""One job's namespace in etcd, ``/trainmover/<job>/``, gated by the job token.

Contract:
- :meth:`JobSpace.create` registers a job: it stores the SHA-256 of the token
  (generated when not given) at ``/trainmover/<job>/job``. Creating an existing
  job with the same token is a no-op (agents on several nodes all call it); with
  another token it raises :class:`AuthError`.
- :meth:`JobSpace.open` checks the token against that record and raises
  :class:`AuthError` on a mismatch, before anything is read or written.
- Every write goes through :meth:`JobSpace.commit`, which adds a guard on the
  exact job record. A write by a process holding a wrong or stale token (the job
  was re-created) is refused by etcd atomically and raises :class:`AuthError`.
- Keys of different jobs never mix: job names cannot contain ``/`` and the
  namespace ends with ``/``.

The token guard protects a job from other TrainMover jobs and stale processes. Against a
hostile etcd client, the job's etcd has authentication on: the launcher creates the job's
etcd user, :func:`job_user`, whose role may read and write ``/trainmover/<job>/`` and nothing
else (:mod:`trainmover_ext.etcd.auth`). Its password, :func:`job_password`, is derived from
the token, so a process that holds the token logs in and nobody else can; no second secret
travels. See ``docs/security.md``.

Example::

    space = JobSpace.create(kv, "llama7b", token=None)    # launcher; space.token is the new token
    space = JobSpace.open(kv, "llama7b", token)           # every other process
    space.commit([], [Put(space.key("ranks", "0"), encode("rank", {...}))])
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainmover_ext.errors import AuthError, ConfigError, StoreError
from trainmover_ext.kv.base import KV, Delete, Guard, Put
from trainmover_ext.kv.codec import decode, encode

if TYPE_CHECKING:
    from trainmover_ext.kv.etcd import EtcdClientConfig

ROOT = "/trainmover/"
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def new_token() -> str:
    """A fresh random job token: 192 bits as 48 hex digits.

    Hex, not URL-safe base64: a token starting with ``-`` (1 in 64 of those) reads as a flag to
    every command line that takes ``--tm-job-token TOKEN``; argparse then exits with "expected one
    argument". A test's member process failed that way in CI."""
    return secrets.token_hex(24)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


STORE_DIR = "~store/"
"""The ranks' rendezvous store inside a job's namespace. ``~`` sorts after every character a
control key uses, so ``[root, root + "~")`` is the control plane and the store is outside it."""


EVENTS_DIR = "~events/"
"""The job's timeline (``Event`` records), outside the control range like the store: it only grows, and
no read of the control plane's view (every controller round) carries it."""


def store_prefix(job: str, generation: int) -> str:
    """Where the ranks of start number ``generation`` keep their rendezvous store."""
    return f"{job_root(job)}{STORE_DIR}{int(generation)}/"


def job_user(job: str) -> str:
    """The job's etcd user (and role): ``tm-<job>``."""
    job_root(job)  # validates the name
    return f"tm-{job}"


def job_password(job: str, token: str) -> str:
    """The job user's etcd password: HMAC-SHA256 of the job name under the token (64 hex digits).

    Not the token itself, and not the digest stored in the job record: etcd keeps only a bcrypt
    hash of it, and reading the job record does not reveal it."""
    if not token:
        raise AuthError(
            f"job {job!r} needs its token to log in to etcd: pass --tm-job-token or set TRAINMOVER_JOB_TOKEN"
        )
    return hmac.new(token.encode(), f"trainmover etcd password of job {job}".encode(), hashlib.sha256).hexdigest()


def job_login(config: EtcdClientConfig, job: str, token: str | None) -> EtcdClientConfig:
    """``config`` (an ``EtcdClientConfig``) logging in as the job's user, unless it names a user of
    its own (``--tm-etcd-user``) or there is no token. A server without auth is used without login."""
    if config.user is not None or not token:
        return config
    return dataclasses.replace(config, user=job_user(job), password=job_password(job, token), login_if_enabled=True)


def job_root(job: str) -> str:
    """``/trainmover/<job>/`` after validating the job name."""
    if not _JOB_NAME.match(job or ""):
        raise ConfigError(f"--tm-job {job!r} is not a valid job name: use letters, digits, '.', '_' or '-' (no '/')")
    return f"{ROOT}{job}/"


class JobSpace:
    """See the module docstring. Build with :meth:`create` or :meth:`open`."""

    def __init__(self, kv: KV, job: str, token: str, record: bytes) -> None:
        self.kv, self.job, self.token = kv, job, token
        self.root = job_root(job)
        self._record = record

    def key(self, *parts: object) -> str:
        """The full key of ``parts`` inside this job, e.g. ``key("ranks", 3)``."""
        return self.root + "/".join(str(p) for p in parts)

    @property
    def job_key(self) -> str:
        return self.root + "job"

    @property
    def control_end(self) -> str:
        """End of the control plane's key range: ``[root, control_end)`` holds every control key and
        none of the rendezvous store (:data:`STORE_DIR`)."""
        return self.root + "~"

    @property
    def events_prefix(self) -> str:
        """Prefix of the job's timeline (:data:`EVENTS_DIR`): ``events_prefix + suffix`` is one event."""
        return self.root + EVENTS_DIR

    @classmethod
    def create(cls, kv: KV, job: str, token: str | None = None) -> JobSpace:
        """Register ``job`` (or join it with the same token); see the module docstring."""
        token = token or new_token()
        root = job_root(job)
        record = encode("job", {"job": job, "token_sha256": _digest(token), "created_at": time.time()})
        if kv.put_if_absent(root + "job", record):
            return cls(kv, job, token, record)
        return cls.open(kv, job, token)

    @classmethod
    def open(cls, kv: KV, job: str, token: str | None) -> JobSpace:
        """Join an existing job; :class:`AuthError` on a wrong token, :class:`StoreError` if there is no such job."""
        root = job_root(job)
        if not token:
            raise AuthError(f"job {job!r} needs its token: pass --tm-job-token or set TRAINMOVER_JOB_TOKEN")
        entry = kv.get(root + "job")
        if entry is None:
            raise StoreError(
                f"no job {job!r} in etcd: check --tm-job and --tm-etcd-endpoints, or start it with `trainmover launch`"
            )
        data = decode(entry.value, kind="job", key=root + "job")
        if not hmac.compare_digest(str(data.get("token_sha256", "")), _digest(token)):
            raise AuthError(
                f"wrong job token for job {job!r}: use the token printed by `trainmover launch` "
                "(--tm-job-token / TRAINMOVER_JOB_TOKEN)"
            )
        return cls(kv, job, token, entry.value)

    def token_guard(self) -> Guard:
        """Holds while the job record is the one this process authenticated against."""
        return Guard.value(self.job_key, self._record)

    def commit(self, guards: Sequence[Guard], ops: Sequence[Put | Delete]) -> bool:
        """:meth:`KV.commit` plus the token guard; :class:`AuthError` if the token no longer matches."""
        for op in ops:
            if not op.key.startswith(self.root) or op.key == self.job_key:
                raise StoreError(f"refusing to write {op.key} from job {self.job!r}: outside its namespace {self.root}")
        if self.kv.commit([self.token_guard(), *guards], ops):
            return True
        if not self.kv.commit([self.token_guard()], []):
            raise AuthError(
                f"etcd refused a write to job {self.job!r}: the job record changed (wrong or stale token, or the "
                "job was re-created). Restart this process with the current --tm-job-token"
            )
        return False

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        """Token-gated unconditional write."""
        self.commit([], [Put(key, value, lease)])

    def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        return self.commit([Guard.absent(key)], [Put(key, value, lease)])

    def delete(self, key: str) -> None:
        self.commit([], [Delete(key)])
