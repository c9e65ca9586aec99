"""The controller runner: election + watch + decide + execute, on one background thread.

Contract:
- Run one :class:`Controller` per agent. Exactly one of them leads at a time
  (:mod:`~trainmover_ext.control.election`); the others wait on a watch and take
  over within about one lease TTL after the leader dies or hangs.
- The controller has no state of its own. Each round reads the whole job state
  at one revision, calls the pure :func:`~trainmover_ext.control.decide.decide`
  and applies the actions through the :class:`~trainmover_ext.control.executor.Executor`,
  fenced by the leader key. A new leader therefore neither loses nor repeats a
  decision.
- Rounds are triggered by a watch on the job's control keys (members, ranks,
  reports, requests, epoch, leader, the stayers' recovery reports), so a failure is acted on within
  milliseconds; a round also runs every ``ttl_s / 3`` as a backstop, and when a pending probe of a
  node runs out (:mod:`~trainmover_ext.control.probes`).
- A standby machine's agent is the preferred leader (``ControllerConfig.preferred``): losing a
  machine that runs ranks then never takes the controller with it.
- The leader also runs the straggler watch (:mod:`~trainmover_ext.control.straggler_watch`) and the
  rebalancing schedule (:mod:`~trainmover_ext.control.rebalance`) after each round that had nothing left
  to decide.
- :meth:`Controller.close` stops the thread and resigns (revoking the leader
  lease so a successor is elected at once). It is safe to call twice, or on a
  controller that never started.

Example::

    ctl = Controller(space, ControllerConfig(controller_id="agent-n1", ttl_s=2))
    ctl.start()
    ...
    ctl.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from trainmover_ext.control.decide import PlanMigration, RaiseAlert, decide
from trainmover_ext.control.election import LeaderElection
from trainmover_ext.control.executor import Executor, Outcome
from trainmover_ext.control.lapses import note_unseen_lapses
from trainmover_ext.control.probes import next_probe_deadline, probe_timeout_s
from trainmover_ext.control.rebalance import Rebalancer
from trainmover_ext.control.records import NodeRecord
from trainmover_ext.control.straggler_watch import StragglerWatch
from trainmover_ext.control.view import View, read_view
from trainmover_ext.deadline import RecoveryTimeouts
from trainmover_ext.errors import ConfigError, LeadershipLost, MalformedValue, TrainMoverError
from trainmover_ext.kv.base import WatchEvent, WatchHandle
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


class ControlObserver(Protocol):
    """What the controller reports as it works (``trainmover_ext.metrics.ControlMetrics`` exports it)."""

    def observe_leadership(self, is_leader: bool) -> None:
        """After every campaign round."""

    def observe_view(self, members_by_kind: dict[str, int], epoch: int | None) -> None:
        """After every read of the job's view."""

    def observe_plan(self, epoch: int, detection_paths: list[str], latency_s: float | None) -> None:
        """A plan was committed; for a failure plan, how each leaver was detected ("lease" or
        "report") and the time from detection to the commit."""

    def observe_alert(self) -> None:
        """An alert was raised (a rank left with no standby to take it)."""


def quiet(view: View) -> bool:
    """Nothing in flight: no report, request or pending probe, and the newest plan carried out (a failure
    plan converged, a planned move transferred). Only then may the lead change hands by choice."""
    if view.reports or view.requests:
        return False
    if any(p.acked_at is None and p.agent in view.members for p in view.probes.values()):
        return False
    plan = view.last_plan
    if plan is None:
        return True
    if plan.epoch != view.epoch:
        return False
    return plan.epoch in view.converged if plan.reason == "failure" else "transferred" in plan.steps


def rejoin_s(ttl_s: float) -> float:
    """``View.rejoin_s`` for a lease TTL: two TTLs and a second. A live member learns that etcd dropped its
    lease at its next renewal (a third of a TTL, later on a starved machine) and registers again in one
    write."""
    return 2.0 * float(ttl_s) + 1.0


def node_settle_s(ttl_s: float) -> float:
    """``View.settle_s`` for a lease TTL: one TTL plus etcd's half-second expiry check. The leases of
    processes that died together expire within one TTL of each other: one renewal interval apart when
    their keepers ran on time, up to a whole TTL when a starved keeper renewed late."""
    return float(ttl_s) + 0.5


_TRIGGERS = (
    "members",
    "nodes",
    "ranks",
    "reports",
    "probes",
    "requests",
    "epoch",
    "leader",
    "checkpoint",
    "recovery",
)


@dataclass(kw_only=True)
class ControllerConfig:
    """Settings of one controller candidate."""

    controller_id: str
    """Unique candidate id (usually the agent's member id)."""
    ttl_s: int = 2
    """Leader lease TTL in seconds (``--tm-lease-ttl``); failover happens within about this long."""
    max_rounds: int = 8
    """Decide/apply rounds per trigger before waiting again (bounds work under constant conflicts)."""
    preferred: bool = False
    """This candidate's machine runs no ranks (a standby machine's agent). It campaigns at once; the
    others, while a preferred candidate lives, campaign only once the leader key has been gone for
    ``defer_s``, and a leader that is not preferred hands the lead to a live preferred candidate
    whenever nothing is in flight. So losing a machine that runs ranks does not take the controller
    with it (its new leader would be elected only after the dead one's lease expired)."""

    def __post_init__(self) -> None:
        if not self.controller_id:
            raise ConfigError("controller_id must be set (the agent passes its member id)")
        if self.ttl_s < 1:
            raise ConfigError("--tm-lease-ttl must be at least 1 second")


class Controller:
    """See the module docstring."""

    def __init__(self, space: JobSpace, config: ControllerConfig, *, metrics: ControlObserver | None = None) -> None:
        self.space, self.config = space, config
        self.metrics = metrics
        self.election = LeaderElection(space, candidate_id=config.controller_id, ttl_s=config.ttl_s)
        self.committed: list[PlanMigration] = []
        """Plans this controller committed (tests and the benchmark read it)."""
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._gone_at: dict[str, float] = {}
        """When this controller saw each member's key disappear (its watch, or a round that read it gone
        first: :func:`~trainmover_ext.control.lapses.note_unseen_lapses`)."""
        self._back_at: dict[str, float] = {}
        """When its watch last saw each member's key written (a registration, or a registration again)."""
        self._handed_to: set[str] = set()
        """Preferred candidates this leader resigned for (never twice for one)."""
        self._vacant_since: float | None = None
        """``time.monotonic()`` when this candidate first saw the lead vacant (None: somebody leads)."""
        self._defer_due: float | None = None
        self._probe_due: float | None = None
        """When the earliest pending probe of the last view runs out."""
        self._thread: threading.Thread | None = None
        self._watch: WatchHandle | None = None
        self.stragglers: StragglerWatch | None = None
        """The leader's straggler watch (:mod:`~trainmover_ext.control.straggler_watch`); None while not leading."""
        self.rebalancer: Rebalancer | None = None
        """The leader's rebalancing schedule (:mod:`~trainmover_ext.control.rebalance`); None while not leading."""

    # -- lifecycle --
    def start(self) -> Controller:
        start = self.space.kv.get_prefix(self.space.key("leader")).revision + 1
        self._watch = self.space.kv.watch_prefix(
            self.space.root, self._on_events, start_revision=start, end=self.space.control_end
        )
        self._thread = threading.Thread(
            target=self._run, name=f"tm-controller-{self.config.controller_id}", daemon=True
        )
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._watch is not None:
            self._watch.cancel()
        try:
            self.election.resign()
        except TrainMoverError as exc:  # etcd gone: the lease expires by itself
            logger.info("resign failed: %s", exc)

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    # -- triggers --
    def _on_events(self, events: list[WatchEvent]) -> None:
        root = self.space.root
        relevant = False
        for ev in events:
            head = ev.key[len(root) :].partition("/")[0]
            if head in _TRIGGERS:
                relevant = True
                if head == "members":
                    # A deletion: when the lease expiry was observed (the start of slow-path detection
                    # latency); a write: when the member registered (again).
                    seen = self._gone_at if ev.kind == "delete" else self._back_at
                    seen[ev.key[len(root) + len("members/") :]] = time.time()
        if relevant:
            self._wake.set()

    @property
    def defer_s(self) -> float:
        """How long a candidate that is not preferred lets a live preferred one take a vacant lead."""
        return self.config.ttl_s / 4

    def _preferred_alive(self) -> bool:
        """Whether another candidate that is preferred (a standby machine's agent) is a live member."""
        kv, prefix = self.space.kv, self.space.key("nodes") + "/"
        for entry in kv.get_prefix(prefix).entries:
            try:
                node = NodeRecord.from_bytes(entry.value, key=entry.key)
            except MalformedValue:
                continue
            if node.role == "standby" and node.agent != self.config.controller_id:
                if kv.get(self.space.key("members", node.agent)) is not None:
                    return True
        return False

    def _may_campaign(self) -> bool:
        """Whether to campaign now (see ``ControllerConfig.preferred``)."""
        if self.config.preferred or self.election.is_leader:
            return True
        if self.space.kv.get(self.election.key) is not None:
            self._vacant_since = None
            return False  # somebody leads: a campaign could only lose
        now = time.monotonic()
        if self._vacant_since is None:
            self._vacant_since = now
        if now - self._vacant_since >= self.defer_s or not self._preferred_alive():
            return True
        self._defer_due = self._vacant_since + self.defer_s
        return False

    def _hand_over_if_quiet(self, view: View) -> None:
        """A leader that is not preferred resigns for a live preferred candidate when nothing is in flight."""
        if self.config.preferred or not quiet(view):
            return
        others = [
            n.agent
            for n in view.nodes.values()
            if n.role == "standby"
            and n.agent in view.members
            and n.agent != self.config.controller_id
            and n.agent not in self._handed_to
        ]
        if not others:
            return
        # Once per candidate: one that took the lead and lost it again (its controller is not working)
        # is not handed the lead a second time.
        self._handed_to.update(others)
        logger.info("controller %s hands the lead to a standby machine's agent (%s)", self.config.controller_id, others)
        self.election.resign()
        self._vacant_since = time.monotonic()

    def _run(self) -> None:
        backstop = RecoveryTimeouts(self.config.ttl_s).renew_every_s
        while not self._stop.is_set():
            self._defer_due = None
            try:
                if self._may_campaign() and self.election.campaign():
                    view = self._reconcile()
                    if view is not None:
                        self._leader_duties(view)
                        self._hand_over_if_quiet(view)
                else:
                    self.stragglers = self.rebalancer = None  # a later lead starts afresh
                if self.metrics is not None:
                    self.metrics.observe_leadership(self.election.is_leader)
            except LeadershipLost as exc:
                logger.warning("%s", exc)
                self.election.resign()
            except TrainMoverError as exc:
                # etcd unreachable or refusing: keep the thread alive and retry; the error is visible to callers.
                self.error = exc
                logger.warning("controller %s round failed: %s", self.config.controller_id, exc)
            wait = backstop
            if self._probe_due is not None:  # a pending probe runs out: decide again right then
                wait = min(wait, max(0.0, self._probe_due - time.time() + 0.005))
            if self._defer_due is not None:  # the vacant lead is ours to take then
                wait = min(wait, max(0.0, self._defer_due - time.monotonic() + 0.005))
            self._wake.wait(wait)
            self._wake.clear()

    def _leader_duties(self, view: View) -> None:
        """After a round with nothing left to decide: the straggler watch, then the rebalancing schedule."""
        if self.stragglers is None:
            self.stragglers = StragglerWatch(self.space, self.config.controller_id, self.election.guard)
        if self.rebalancer is None:
            self.rebalancer = Rebalancer(self.space, self.config.controller_id, self.election.guard)
        self.stragglers.tick(view)
        self.rebalancer.tick(view)

    def _reconcile(self) -> View | None:
        """Decide and apply until a round has nothing to do; returns that round's view (None when the
        rounds ran out first)."""
        executor = Executor(self.space, leader_guard=self.election.guard())
        for _ in range(self.config.max_rounds):
            view = read_view(self.space)
            note_unseen_lapses(view, self._gone_at, self._back_at, time.time())
            view.gone_at = dict(self._gone_at)
            view.settle_s = node_settle_s(self.config.ttl_s)
            view.own_member = self.config.controller_id
            view.rejoin_s = rejoin_s(self.config.ttl_s)
            view.probe_s = probe_timeout_s(self.config.ttl_s)
            self._probe_due = next_probe_deadline(view, time.time())
            if self.metrics is not None:
                self.metrics.observe_view(dict(Counter(m.kind for m in view.members.values())), view.epoch)
            actions = decide(view, time.time(), decided_by=self.config.controller_id)
            if not actions:
                return view
            conflict = False
            for action in actions:
                outcome = executor.apply(action)
                if outcome is Outcome.CONFLICT:
                    conflict = True
                    break
                self._record(action)
            if not conflict:
                return None
        return None

    def _record(self, action: object) -> None:
        if isinstance(action, PlanMigration):
            self.committed.append(action)
            plan = action.plan
            logger.info("epoch %d: %s", plan.epoch, plan.replacements)
            if self.metrics is not None:
                paths = ["lease" if r.leaver in self._gone_at else "report" for r in plan.replacement_list()]
                latency = None
                if plan.reason == "failure" and plan.detected_at is not None:
                    latency = max(0.0, plan.decided_at - plan.detected_at)
                self.metrics.observe_plan(plan.epoch, paths if plan.reason == "failure" else [], latency)
        elif isinstance(action, RaiseAlert) and self.metrics is not None:
            self.metrics.observe_alert()
