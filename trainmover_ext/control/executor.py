"""The one place where controller decisions are written to etcd.

Contract: :meth:`Executor.apply` writes each action in one token-gated etcd
transaction. A :class:`PlanMigration` commits only if ``epoch`` is still at the
revision the decision saw *and* this controller still holds the leader key
(fencing: a deposed leader whose lease ran out cannot write). It bumps
``epoch``, writes ``migrations/<e+1>``, repoints ``ranks/<r>`` at the joiners,
deletes the reports/requests/alerts it settles and the plan and convergence of epoch
``e+1 - PLANS_KEPT`` (so etcd holds the last :data:`PLANS_KEPT` of each, and every controller
round's view read stays the same size however many epochs the job lives through; older plans are
in the run archive, ``RUN_DIR/migrations.jsonl``) and appends an event, all at one
revision. Hence at most one migration commits per epoch, and a decision is
either wholly visible or absent. A :class:`CommitConvergence` writes
``convergence/<e>`` only while the epoch is unchanged (a newer failure voids it)
and deletes the stayers' reports it settles. A :class:`CommitSwitchPoint` rewrites the
planned move's plan with its switch point, compare-and-swap on the plan key. A :class:`ProbeHost`
writes ``probes/<host>`` and deletes the suspicions it answers.

A lost race returns ``Outcome.CONFLICT`` (re-read and decide again); a lost
leadership raises :class:`LeadershipLost`.

Example::

    executor = Executor(space, leader_guard=election.guard())
    for action in decide(read_view(space), time.time()):
        executor.apply(action)
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any

from trainmover_ext.control.actions import (
    Action,
    CommitConvergence,
    CommitSwitchPoint,
    DropStaleReport,
    PlanMigration,
    ProbeHost,
    RaiseAlert,
    RejectRequest,
    RepairEpoch,
)
from trainmover_ext.control.records import Event, MigrationPlan, convergence_key, event_key_suffix, migration_key_suffix
from trainmover_ext.control.view import epoch_value
from trainmover_ext.errors import LeadershipLost, TrainMoverError
from trainmover_ext.kv.base import Delete, Guard, Put
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)

PLANS_KEPT = 16
"""How many epochs' plans (``migrations/<e>``) and convergences etcd keeps; only the newest is ever
decided on, the others serve ``trainmover status`` and the metrics."""


class Outcome(enum.Enum):
    APPLIED = "applied"
    CONFLICT = "conflict"


def _why(action: PlanMigration, rank: int) -> dict[str, str]:
    """``{"why": how rank's loss was detected}`` for a failure plan's replacement (empty otherwise)."""
    reasons = dict(action.why)
    return {"why": reasons[rank]} if rank in reasons else {}


def event_put(space: JobSpace, what: str, detail: dict[str, Any], now: float) -> Put:
    """A ``Put`` of one timeline event (append-only; keys sort by time)."""
    return Put(space.events_prefix + event_key_suffix(now), Event(time=now, what=what, detail=detail).to_bytes())


def record_event(space: JobSpace, what: str, detail: dict[str, Any]) -> str | None:
    """Append one event to the job's timeline outside any decision (``trainmover events``, the run
    archive). The timeline is a record, not a step of what the caller does: etcd trouble is returned as
    the reason it was not written (None: written), never raised."""
    try:
        space.kv.commit([], [event_put(space, what, detail, time.time())])
    except TrainMoverError as exc:
        return str(exc)
    return None


class Executor:
    """Applies :mod:`~trainmover_ext.control.decide` actions; see the module docstring."""

    def __init__(self, space: JobSpace, *, leader_guard: Guard | None = None) -> None:
        self.space = space
        self.leader_guard = leader_guard
        """When set, every write also requires this guard (the leader key still being ours)."""

    def _guards(self, *extra: Guard) -> list[Guard]:
        return ([self.leader_guard] if self.leader_guard else []) + list(extra)

    def _commit(self, guards: list[Guard], ops: list[Put | Delete]) -> Outcome:
        if self.space.commit(self._guards(*guards), ops):
            return Outcome.APPLIED
        if self.leader_guard is not None and not self.space.kv.commit([self.leader_guard], []):
            raise LeadershipLost(
                f"controller lost the leader key of job {self.space.job!r}; another controller decides now"
            )
        return Outcome.CONFLICT

    def apply(self, action: Action) -> Outcome:
        s = self.space
        if isinstance(action, PlanMigration):
            plan = action.plan
            ops: list[Put | Delete] = [
                Put(s.key("epoch"), epoch_value(plan.epoch)),
                Put(s.key("migrations", migration_key_suffix(plan.epoch)), plan.to_bytes()),
            ]
            ops += [Put(s.key("ranks", rec.rank), rec.to_bytes()) for rec in action.rank_updates]
            ops += [Delete(k) for k in action.consumed]
            if (gone := plan.epoch - PLANS_KEPT) >= 1:
                ops += [Delete(s.key("migrations", migration_key_suffix(gone))), Delete(convergence_key(s, gone))]
            ops.append(
                event_put(
                    s,
                    "migration_planned",
                    {
                        "epoch": plan.epoch,
                        "reason": plan.reason,
                        "unserved": plan.unserved,
                        "replacements": [
                            {k: r[k] for k in ("rank", "leaver", "joiner")} | _why(action, r["rank"])
                            for r in plan.replacements
                        ],
                    },
                    plan.decided_at,
                )
            )
            guards = [
                Guard.mod_revision(s.key("epoch"), action.expected_epoch_rev),
                Guard.absent(s.key("migrations", migration_key_suffix(plan.epoch))),
            ]
            outcome = self._commit(guards, ops)
            logger.info("plan for epoch %d (%s): %s", plan.epoch, plan.reason, outcome.value)
            return outcome
        if isinstance(action, CommitConvergence):
            rec = action.record
            key = convergence_key(s, rec.epoch)
            ops = [
                Put(key, rec.to_bytes()),
                *[Delete(k) for k in action.consumed],
                event_put(
                    s,
                    "convergence_decided",
                    {
                        "epoch": rec.epoch,
                        "resume_iteration": rec.resume_iteration,
                        "copies": rec.copies,
                        "from_checkpoint": rec.from_checkpoint,
                    },
                    rec.decided_at,
                ),
            ]
            outcome = self._commit(
                [Guard.mod_revision(s.key("epoch"), action.expected_epoch_rev), Guard.absent(key)], ops
            )
            logger.info("convergence of epoch %d: %s", rec.epoch, outcome.value)
            return outcome
        if isinstance(action, CommitSwitchPoint):
            key = s.key("migrations", migration_key_suffix(action.epoch))
            entry = s.kv.get(key)
            if entry is None or entry.mod_revision != action.expected_plan_rev:
                return Outcome.CONFLICT
            plan = MigrationPlan.from_bytes(entry.value, key=key)
            plan.switch_at = action.switch_at
            outcome = self._commit(
                [Guard.mod_revision(key, entry.mod_revision)],
                [
                    Put(key, plan.to_bytes()),
                    event_put(s, "switch_point", {"epoch": action.epoch, "switch_at": action.switch_at}, _now()),
                ],
            )
            logger.info("switch point of epoch %d at %d: %s", action.epoch, action.switch_at, outcome.value)
            return outcome
        if isinstance(action, RepairEpoch):
            return self._commit(
                [Guard.mod_revision(s.key("epoch"), action.expected_epoch_rev)],
                [
                    Put(s.key("epoch"), epoch_value(action.epoch)),
                    event_put(s, "epoch_repaired", {"epoch": action.epoch, "garbage": action.garbage}, _now()),
                ],
            )
        if isinstance(action, DropStaleReport):
            return self._delete_with_event(
                action.key, "stale_report_dropped", {"key": action.key, "reason": action.reason}
            )
        if isinstance(action, ProbeHost):
            p = action.probe
            return self._commit(
                [],
                [
                    Put(s.key("probes", p.host), p.to_bytes()),
                    *[Delete(k) for k in action.consumed],
                    event_put(s, "node_probed", {"host": p.host, "agent": p.agent, "ranks": p.ranks}, p.probed_at),
                ],
            )
        if isinstance(action, RaiseAlert):
            a = action.alert
            return self._commit(
                [],
                [
                    Put(s.key("alerts", a.rank), a.to_bytes()),
                    event_put(s, "alert", {"rank": a.rank, "member": a.member_id, "reason": a.reason}, a.raised_at),
                ],
            )
        if isinstance(action, RejectRequest):
            return self._delete_with_event(
                action.key, "request_rejected", {"request": action.request_id, "reason": action.reason}
            )
        raise TypeError(f"unknown action {action!r}")

    def _delete_with_event(self, key: str, what: str, detail: dict[str, Any]) -> Outcome:
        """Delete ``key`` as read now (CONFLICT if it is gone or changes meanwhile) and record why."""
        entry = self.space.kv.get(key)
        if entry is None:
            return Outcome.CONFLICT
        return self._commit(
            [Guard.mod_revision(key, entry.mod_revision)], [Delete(key), event_put(self.space, what, detail, _now())]
        )


def _now() -> float:
    import time

    return time.time()
