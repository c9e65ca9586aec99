"""What a decision asks the executor to do: the actions :func:`~trainmover_ext.control.decide.decide`
returns and :class:`~trainmover_ext.control.executor.Executor` applies (each a compare-and-swap)."""

from __future__ import annotations

from dataclasses import dataclass

from trainmover_ext.control.records import Alert, ConvergenceRecord, MigrationPlan, ProbeRecord, RankRecord


@dataclass(frozen=True, kw_only=True)
class PlanMigration:
    """Open epoch ``plan.epoch`` with ``plan``; CAS on ``expected_epoch_rev``."""

    plan: MigrationPlan
    expected_epoch: int
    expected_epoch_rev: int
    rank_updates: tuple[RankRecord, ...]
    """New ``ranks/<r>`` records naming the joiners."""
    consumed: tuple[str, ...] = ()
    """Report/request/alert keys this plan settles; deleted in the same transaction."""
    why: tuple[tuple[int, str], ...] = ()
    """(rank, how its loss was detected) for each replaced rank of a failure plan, for the timeline."""


@dataclass(frozen=True, kw_only=True)
class DropStaleReport:
    key: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ProbeHost:
    """Ask a node's agent whether it lives (write ``probes/<host>``), deleting the suspicions it answers."""

    probe: ProbeRecord
    consumed: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RaiseAlert:
    alert: Alert


@dataclass(frozen=True, kw_only=True)
class RejectRequest:
    key: str
    request_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class CommitConvergence:
    """Write ``convergence/<e>`` while ``epoch`` is unchanged; delete the reports it settles."""

    record: ConvergenceRecord
    expected_epoch_rev: int
    consumed: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CommitSwitchPoint:
    """Write ``switch_at`` into the planned move's plan (CAS on the plan key's revision)."""

    epoch: int
    switch_at: int
    expected_plan_rev: int


@dataclass(frozen=True, kw_only=True)
class RepairEpoch:
    """Rewrite an unreadable ``epoch`` with the epoch the newest plan opened (CAS on its revision)."""

    epoch: int
    expected_epoch_rev: int
    garbage: str


Action = (
    PlanMigration
    | DropStaleReport
    | ProbeHost
    | RaiseAlert
    | RejectRequest
    | CommitConvergence
    | CommitSwitchPoint
    | RepairEpoch
)
