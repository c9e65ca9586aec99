"""Membership: leases kept alive in the background, member registration, failure reports, decision watches.

Contract:
- :class:`LeaseKeeper` grants an etcd lease of ``ttl_s`` and refreshes it every
  ``ttl_s / 3`` on a daemon thread (no etcd client does this by itself). Only
  etcd's own answer that the lease is gone (a refresh returning TTL 0, or
  :class:`LeaseNotFound`) sets ``lost`` and runs ``on_lost`` once; the owner must
  then stop acting as that member (:class:`MembershipLost`). While etcd does not
  answer, however long, the keeper keeps trying: an etcd that was down, or that
  elects a new leader, extends every lease by its TTL when it serves again, so
  the lease outlives any outage its owner lives through. (A member cut off from
  a running etcd is the one that loses its lease, and learns so when it gets
  through again.)
- :class:`Membership` registers ``members/<id>`` on its own lease, so a killed
  or hung (SIGSTOP) process disappears from etcd within about one TTL. A member
  that serves no rank (an unpromoted standby, ``rejoin_on_loss``) registers
  again when it finds its lease lost, instead of leaving; so does a rank's
  worker, at once and on a thread of its own, unless the controller replaced it
  (:meth:`Membership.rejoin_in_background`): a lapse is evidence, not proof, and
  the controller waits ``View.rejoin_s`` for a live member to come back.
  ``close()`` revokes the lease: a clean leave is seen at once.
- :func:`report_failure` is the fast detection path: an agent whose child died
  writes ``reports/<r>/<reporter>``, and the controller acts on it without waiting
  for r's lease. A rank whose link to r broke writes a suspicion (``suspect``):
  the controller then probes r's node (:mod:`~trainmover_ext.control.probes`).
- :class:`PlanInbox` is every process's one inbox of ``migrations/<e>``: it hears of each plan
  within milliseconds of the controller's commit, keeps the newest write of each (until the executor
  prunes the plan, :data:`~trainmover_ext.control.executor.PLANS_KEPT` epochs later), and wakes waiters.

Example (an agent or worker)::

    member = Membership(space, MemberRecord(member_id=mid, kind="worker", host=host, pid=os.getpid()), ttl_s=2)
    member.register()
    inbox = PlanInbox(space, on_plan=lambda plan: abandon_iteration(plan))
    ...
    report_failure(space, rank=3, member_id=ranks[3], reporter=mid, reason=str(exc), epoch=epoch)
    ...
    inbox.close(); member.close()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from trainmover_ext.control.executor import event_put
from trainmover_ext.control.records import (
    ConvergenceRecord,
    FailureReport,
    MemberRecord,
    MigrationPlan,
    MigrationRequest,
    RankRecord,
    convergence_key,
    recovery_key,
)
from trainmover_ext.control.view import epoch_value
from trainmover_ext.deadline import Deadline, RecoveryTimeouts
from trainmover_ext.errors import ConfigError, LeaseNotFound, MalformedValue, MembershipLost, StoreError
from trainmover_ext.kv.base import Guard, Put, WatchEvent, wait_prefix
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)

T = TypeVar("T")


def new_member_id(kind: str) -> str:
    """``<kind>-<host>-<pid>-<random>``: unique across restarts on one host."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


RETRY_FIRST_S = 0.05
"""The first wait before a keeper asks again after etcd did not answer; it doubles up to the refresh
interval. Short: an etcd that comes back extends each lease by only one TTL from then."""

LATE_SHARE = 0.6
"""A renewal that comes more than this share of the TTL after the last one (or takes that long) is
logged: a lease expires when the gap reaches the TTL."""

WARN_EVERY_S = 5.0
"""A keeper that cannot reach etcd logs a warning at most this often (an outage can last minutes)."""


def _leave_idle_policy(tid: int = 0, what: str = "lease keepalive") -> None:
    """Put thread ``tid`` (0: the calling one) back under the normal scheduling policy if it inherited the
    idle one.

    A standby with lowered priority runs under ``SCHED_IDLE`` (``launch.priority``), which gets no CPU
    while the ranks keep the cores busy. Its keepalive must not starve with it, or its lease would
    lapse, nor the thread that hears its promotion, or every rank would wait for it: such a thread
    keeps the standby's niceness and leaves only the idle policy."""
    if not hasattr(os, "SCHED_IDLE"):
        return
    try:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError as exc:
        logger.warning("%s stays under the idle scheduling policy (%s): it may run late", what, exc)


REGISTER_ATTEMPTS = 5
"""Leases granted for one registration at most (each lost to a starvation past the TTL)."""
CLOSE_WAIT_S = 30.0
"""How long ``Membership.close`` waits for a registration in progress on the rejoin thread."""


class LeaseKeeper:
    """One lease kept alive on a daemon thread; see the module docstring.

    ``lost`` is set only on etcd's answer that the lease is gone; :attr:`unreachable_since` says
    whether (and since when) etcd has not answered the refreshes."""

    def __init__(
        self, space: JobSpace, ttl_s: int, *, on_lost: Callable[[], None] | None = None, name: str = "lease"
    ) -> None:
        if int(ttl_s) < 1:
            raise ConfigError("--tm-lease-ttl must be at least 1 second (etcd grants whole seconds)")
        self.space, self.ttl_s, self.on_lost, self.name = space, int(ttl_s), on_lost, name
        self.lost = threading.Event()
        self.unreachable_since: float | None = None
        """``time.monotonic()`` when the first refresh in a row that etcd did not answer was sent; None while
        etcd answers."""
        self._stop = threading.Event()
        self.lease_id = space.kv.grant_lease(self.ttl_s)
        self._thread = threading.Thread(target=self._run, name=f"tm-{name}-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _leave_idle_policy()
        interval = RecoveryTimeouts(self.ttl_s).renew_every_s
        wait, warned_at = interval, -WARN_EVERY_S
        renewed_at = time.monotonic()
        while not self._stop.wait(wait):
            asked_at = time.monotonic()
            if asked_at - renewed_at > LATE_SHARE * self.ttl_s:
                # The thread ran late (its process starved of CPU, or the GIL held by native code): say so,
                # since a lease that then expires looks like a hung member to the controller.
                logger.warning(
                    "%s keepalive ran %.1fs after the last renewal (TTL %ds): this process is starved of CPU "
                    "or a native call holds the GIL",
                    self.name,
                    asked_at - renewed_at,
                    self.ttl_s,
                )
            try:
                remaining = self.space.kv.refresh_lease(self.lease_id)
            except LeaseNotFound:
                remaining = 0
            except StoreError as exc:
                # etcd did not answer (down, restarting, no leader, or out of reach): that says nothing
                # about the lease, which etcd extends when it serves again. Ask again soon.
                now, first = time.monotonic(), self.unreachable_since is None
                since = asked_at if self.unreachable_since is None else self.unreachable_since
                self.unreachable_since = since
                if now - warned_at >= WARN_EVERY_S:
                    warned_at = now
                    logger.warning(
                        "%s keepalive: etcd has not answered for %.1fs (%s); still trying", self.name, now - since, exc
                    )
                wait = RETRY_FIRST_S if first else min(interval, wait * 2)
                continue
            if remaining <= 0:
                self.mark_lost()
                return
            if self.unreachable_since is not None:
                logger.warning(
                    "%s keepalive: etcd answers again after %.1fs; lease %x is alive",
                    self.name,
                    time.monotonic() - self.unreachable_since,
                    self.lease_id,
                )
                self.unreachable_since, warned_at = None, -WARN_EVERY_S
            renewed_at, wait = time.monotonic(), interval
            if renewed_at - asked_at > LATE_SHARE * self.ttl_s:
                logger.warning(
                    "%s keepalive: etcd took %.1fs to renew (TTL %ds)", self.name, renewed_at - asked_at, self.ttl_s
                )

    def mark_lost(self) -> None:
        """Declare the lease gone (etcd said so): sets ``lost`` and runs ``on_lost`` once."""
        if self.lost.is_set():
            return
        self.lost.set()
        logger.warning("%s lease %x lost", self.name, self.lease_id)
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:  # the callback is the owner's; never let it kill this thread silently
                logger.exception("on_lost callback of %s failed", self.name)

    def close(self, *, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` the lease (and its keys) end now. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                self.space.kv.revoke_lease(self.lease_id)
            except StoreError as exc:  # the lease expires by itself within one TTL
                logger.info("could not revoke %s lease: %s", self.name, exc)


class Membership:
    """A registered member of the job; see the module docstring."""

    def __init__(
        self,
        space: JobSpace,
        record: MemberRecord,
        *,
        ttl_s: int = 2,
        on_lost: Callable[[], None] | None = None,
        rejoin_on_loss: bool = False,
    ) -> None:
        self.space, self.record, self.ttl_s, self.on_lost = space, record, ttl_s, on_lost
        self.keeper: LeaseKeeper | None = None
        self.rejoin_on_loss = rejoin_on_loss
        """A member that serves no rank (an unpromoted standby) registers again when its lease is lost (e.g.
        starved of CPU past its TTL) instead of leaving: nobody waits on it. Turned off at promotion."""
        self.rejoins = 0
        self._rejoin_allowed: Callable[[], bool] | None = None
        self._closed = threading.Event()
        self._rejoining = threading.Lock()
        """Held while a lost lease is registered again: the owner's ``check()`` and the background rejoin
        (:meth:`rejoin_in_background`) may both find it lost at once, and only one may register."""

    @property
    def key(self) -> str:
        return self.space.key("members", self.record.member_id)

    def register(self) -> Membership:
        """Write ``members/<id>`` on a fresh lease; :class:`StoreError` if the id is already taken. A lease
        that expired before the write (a process or an etcd starved past the TTL) is granted again."""
        for attempt in range(REGISTER_ATTEMPTS):
            try:
                return self._register()
            except LeaseNotFound as exc:
                if self.keeper is not None:
                    self.keeper.close(revoke=False)
                if attempt == REGISTER_ATTEMPTS - 1:
                    raise
                logger.warning(
                    "member %s: its new lease expired before it registered (%s); again", self.record.member_id, exc
                )
        raise AssertionError("unreachable")

    def _register(self) -> Membership:
        self.keeper = LeaseKeeper(self.space, self.ttl_s, on_lost=self._lost, name=f"member {self.record.member_id}")
        if not self.record.registered_at:
            self.record.registered_at = time.time()
        ok = self.space.commit(
            [Guard.absent(self.key)],
            [
                Put(self.key, self.record.to_bytes(), self.keeper.lease_id),
                event_put(
                    self.space,
                    "member_joined",
                    {
                        "member": self.record.member_id,
                        "kind": self.record.kind,
                        "host": self.record.host,
                        "pid": self.record.pid,
                    },
                    time.time(),
                ),
            ],
        )
        if not ok:
            self.keeper.close()
            raise StoreError(
                f"member id {self.record.member_id} is already registered in job {self.space.job!r}: use a unique id"
            )
        return self

    def update(self, **changes: object) -> None:
        """Rewrite the record (e.g. ``warm_roles`` after warm-up) on the same lease."""
        self.check()
        for k, v in changes.items():
            setattr(self.record, k, v)
        assert self.keeper is not None
        if self.keeper.lost.is_set():
            return  # rejoin_on_loss, not registered again yet: the next registration writes the record
        try:
            self.space.put(self.key, self.record.to_bytes(), lease=self.keeper.lease_id)
        except LeaseNotFound:
            if not self.rejoin_on_loss:
                raise
            self.keeper.mark_lost()  # expired before its keeper saw it: register again with this record
            self.check()

    def rejoin_in_background(self, allowed: Callable[[], bool]) -> None:
        """From now on a lost lease is registered again at once, on a thread of its own, while ``allowed()``
        holds: for a rank's worker, whose lease etcd may drop while it lives (a stalled etcd, a starved
        keepalive). The controller waits ``View.rejoin_s`` for it before it replaces the rank; a rank it
        did replace is not allowed (it leaves)."""
        self._rejoin_allowed = allowed
        self.rejoin_on_loss = True

    def _lost(self) -> None:
        if self.on_lost is not None:
            self.on_lost()
        if self._rejoin_allowed is not None:
            threading.Thread(target=self._rejoin, name=f"tm-rejoin-{self.record.member_id}", daemon=True).start()

    def _rejoin(self) -> None:
        interval = RecoveryTimeouts(self.ttl_s).renew_every_s
        while not self._closed.is_set() and self.keeper is not None and self.keeper.lost.is_set():
            allowed = self._rejoin_allowed
            if allowed is None or not allowed():
                return
            try:
                self.check()  # registers again, or says why not yet
            except MembershipLost:  # no longer allowed (promoted or replaced in the meantime): the owner's call
                return
            if self.keeper is not None and not self.keeper.lost.is_set():
                return
            self._closed.wait(interval)

    def check(self) -> None:
        """Raise :class:`MembershipLost` if the lease is gone (with ``rejoin_on_loss``: register again)."""
        with self._rejoining:
            self._check()

    def _check(self) -> None:
        if self.keeper is not None and self.keeper.lost.is_set() and self.rejoin_on_loss and not self._closed.is_set():
            lost = self.keeper
            lost.close(revoke=False)
            try:
                self.register()  # the same record, on a fresh lease
            except StoreError as exc:  # etcd unreachable, or the old key not expired yet: try at the next check
                self.keeper = lost
                logger.warning("member %s lost its lease and cannot register again yet: %s", self.record.member_id, exc)
                return
            self.rejoins += 1
            logger.warning("member %s lost its lease; registered again", self.record.member_id)
            return
        if self.keeper is None or self.keeper.lost.is_set():
            raise MembershipLost(
                f"member {self.record.member_id} lost its lease in job {self.space.job!r}: "
                "it was declared dead; exit and let a standby take its place"
            )

    def close(self) -> None:
        """Leave the job cleanly (revokes the lease). Idempotent."""
        self._closed.set()
        # A registration in progress on the rejoin thread finishes first, so its fresh lease is revoked too.
        held = self._rejoining.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self.keeper is not None:
                self.keeper.close(revoke=True)
        finally:
            if held:
                self._rejoining.release()


def init_job(space: JobSpace, ranks: list[RankRecord]) -> None:
    """Launcher: create ``epoch`` (0) and the initial ``ranks/<r>`` if absent (idempotent across agents)."""
    space.put_if_absent(space.key("epoch"), epoch_value(0))
    for rec in ranks:
        space.put_if_absent(space.key("ranks", rec.rank), rec.to_bytes())


def report_failure(
    space: JobSpace, *, rank: int, member_id: str, reporter: str, reason: str, epoch: int, suspect: bool = False
) -> None:
    """Fast path: say that ``rank`` (served by ``member_id``) died (its agent saw it exit), or with
    ``suspect`` that the reporter's link to it broke (the controller then probes its node)."""
    rep = FailureReport(
        rank=rank,
        member_id=member_id,
        reporter=reporter,
        reason=reason,
        epoch=epoch,
        reported_at=time.time(),
        suspect=suspect,
    )
    space.put(space.key("reports", rank, reporter), rep.to_bytes())


def report_recovery(
    space: JobSpace, *, epoch: int, rank: int, iteration: int | None, mirror: dict[str, Any] | None = None
) -> None:
    """Stayer ``rank`` of failure epoch ``epoch``: say how many steps it completed, or ``None`` when
    its state is unusable (a copy into it was cut short by this newer epoch): it then receives a copy
    like a joiner. With the distributed optimizer's mirror, ``mirror`` adds the boundary its own shard
    is at (``shard``) and the committed copies it holds of its ward's (``mirror``: ward, iterations).
    One write; the controller decides the resume point from every stayer's report."""
    value: dict[str, Any] = {"iteration": None if iteration is None else int(iteration)}
    if mirror is not None:
        value.update(mirror)
    space.put(recovery_key(space, epoch, rank), encode("recovery", value))


def wait_convergence(
    space: JobSpace,
    epoch: int,
    timeout_s: float,
    superseded: Callable[[], bool] = lambda: False,
    recheck_s: float | None = None,
) -> ConvergenceRecord | None:
    """Block until the controller committed ``convergence/<epoch>`` and return it; None when
    ``superseded()`` turns true first (a newer plan: this epoch will never converge) or after
    ``timeout_s``. One key: a rank's etcd work does not grow with the job (one read, one watch
    event, and one more read per ``recheck_s`` waited: the watch's safety net, ``kv.base.RECHECK_S``)."""
    key = convergence_key(space, epoch)
    values = wait_prefix(space.kv, key, lambda v: key in v or superseded(), timeout_s, recheck_s)
    if values is None or key not in values:
        return None
    return ConvergenceRecord.from_bytes(values[key], key=key)


def request_migration(
    space: JobSpace, *, rank: int, to: str | None = None, node: str | None = None, requested_by: str = "cli"
) -> str:
    """Record a planned-migration request (of ``rank``, or with ``node`` a drain of every rank of that
    node, ``rank`` -1); returns its id."""
    request_id, puts = migration_request_puts(space, rank=rank, to=to, node=node, requested_by=requested_by)
    space.commit([], puts)
    return request_id


def migration_request_puts(
    space: JobSpace, *, rank: int, to: str | None = None, node: str | None = None, requested_by: str = "cli"
) -> tuple[str, list[Put]]:
    """A new request's id and the writes that record it and its timeline event (for a caller that
    commits them with writes of its own)."""
    req = MigrationRequest(
        request_id=uuid.uuid4().hex[:12],
        rank=rank,
        to=to,
        node=node,
        requested_by=requested_by,
        requested_at=time.time(),
    )
    return req.request_id, [
        Put(space.key("requests", req.request_id), req.to_bytes()),
        event_put(
            space,
            "migration_requested",
            {"request": req.request_id, "rank": rank, "to": to, "node": node},
            req.requested_at,
        ),
    ]


class PlanInbox:
    """Every process's one inbox of migration plans: it holds the newest write of each epoch's plan and
    wakes whoever waits on them; see the module docstring.

    - ``on_plan(plan)``, if given, runs on the watch thread for every write of a plan committed after
      the inbox opened (once per write: a plan is written again each time a step is marked on it), in
      revision order per plan, before waiters wake. Use it only for what must happen at once
      (abandoning a communicator, ending a pause); everything else waits with :meth:`wait_until`.
      ``after_plan(plan)`` runs likewise, once waiters can see the plan (severing a channel whose
      owner then looks for the plan that severed it).
    - ``since_start``: also deliver the plans committed before the inbox opened (a joiner whose
      promotion and inbox are not one instant).
    - :attr:`latest` maps each epoch to the newest write of its plan; :meth:`take` returns the writes
      delivered since the last call, in delivery order (for a caller that polls).

    The watch delivers plans at once. A backstop thread also reads, every ``resync_s``, the plans
    written since its last read, and delivers any write the watch did not (a rank that never heard of
    a failure plan would hang in its recovery; see ``kv.base.RECHECK_S``). In a steady job that read
    returns no plan, however long the job's history."""

    def __init__(
        self,
        space: JobSpace,
        on_plan: Callable[[MigrationPlan], None] | None = None,
        *,
        after_plan: Callable[[MigrationPlan], None] | None = None,
        resync_s: float = 2.0,
        since_start: bool = False,
    ) -> None:
        self.space, self.on_plan, self.after_plan = space, on_plan, after_plan
        self.latest: dict[int, MigrationPlan] = {}
        self._queue: list[MigrationPlan] = []
        self._cond = threading.Condition()
        self._seen: dict[str, int] = {}
        self._seen_lock = threading.Lock()
        self._prefix = space.key("migrations/")
        snapshot = space.kv.get_prefix(self._prefix)
        self._start = 1 if since_start else snapshot.revision + 1
        self._closed = threading.Event()
        if since_start:
            self._on_events(
                [
                    WatchEvent(kind="put", key=e.key, value=e.value, mod_revision=e.mod_revision)
                    for e in snapshot.entries
                ]
            )
        self._watch = space.kv.watch_prefix(self._prefix, self._on_events, start_revision=snapshot.revision + 1)
        tid = self._watch.delivery_thread_id()
        if tid is not None:  # a standby hears its promotion at once, however busy the ranks keep the cores
            _leave_idle_policy(tid, "the plan watch")
        self._backstop = threading.Thread(target=self._resync, args=(resync_s,), name="tm-plan-resync", daemon=True)
        self._backstop.start()

    def _resync(self, every_s: float) -> None:
        since = self._start
        while not self._closed.wait(every_s):
            try:
                # Only the plans written since the last read: a steady job's backstop reads no plan.
                snap = self.space.kv.get_prefix(self._prefix, since=since)
            except Exception as exc:  # noqa: BLE001 - etcd trouble: the watch may still deliver; read again later
                logger.info("plan resync failed: %s", exc)
                continue
            self._on_events(
                [WatchEvent(kind="put", key=e.key, value=e.value, mod_revision=e.mod_revision) for e in snap.entries]
            )
            since = snap.revision + 1

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.kind != "put":  # an old epoch's plan pruned by the executor: forget it here too
                with self._seen_lock, self._cond:
                    self._seen.pop(ev.key, None)
                    suffix = ev.key[len(self._prefix) :]
                    if suffix.isdigit():
                        self.latest.pop(int(suffix), None)
                continue
            # Each write once, whichever of the watch and the backstop saw it first, and the check and
            # the delivery under one lock: a plan's writes arrive in revision order (an older write
            # delivered after a newer one would hide the newer one's steps).
            with self._seen_lock:
                if ev.mod_revision <= self._seen.get(ev.key, 0):
                    continue
                self._seen[ev.key] = ev.mod_revision
                try:
                    plan = MigrationPlan.from_bytes(ev.value, key=ev.key)
                except MalformedValue as exc:
                    logger.error("ignoring unreadable plan: %s", exc)
                    continue
                if self.on_plan is not None:
                    self.on_plan(plan)
                with self._cond:
                    self.latest[plan.epoch] = plan
                    self._queue.append(plan)
                    self._cond.notify_all()
                if self.after_plan is not None:
                    self.after_plan(plan)

    def wait_until(self, pick: Callable[[dict[int, MigrationPlan]], T | None], timeout_s: float) -> T | None:
        """Block until ``pick(latest)`` returns something other than None, and return it; None after
        ``timeout_s``. ``pick`` runs under the inbox's lock: it must only read."""
        deadline = Deadline(timeout_s)
        with self._cond:
            while True:
                found = pick(self.latest)
                if found is not None or deadline.expired:
                    return found
                self._cond.wait(deadline.remaining())

    def newest(self, reason: str | None = None) -> MigrationPlan | None:
        """The plan of the newest epoch (of that ``reason``, if given), or None."""
        with self._cond:
            epochs = [e for e, p in self.latest.items() if reason is None or p.reason == reason]
            return self.latest[max(epochs)] if epochs else None

    def snapshot(self) -> dict[int, MigrationPlan]:
        """A copy of :attr:`latest`."""
        with self._cond:
            return dict(self.latest)

    def take(self) -> list[MigrationPlan]:
        """The plan writes delivered since the last call, oldest first."""
        with self._cond:
            taken, self._queue = self._queue, []
            return taken

    def wait_for_epoch(self, epoch: int, timeout: float) -> MigrationPlan:
        """Block until the plan opening ``epoch`` arrives; ``TimeoutError`` after ``timeout`` seconds."""
        plan = self.wait_until(lambda latest: latest.get(epoch), timeout)
        if plan is None:
            raise TimeoutError(f"no migration plan for epoch {epoch} within {timeout:.1f}s")
        return plan

    def close(self) -> None:
        self._closed.set()
        self._watch.cancel()
