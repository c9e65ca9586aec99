"""A consistent, parsed picture of one job's control state: the input of ``decide``.

Contract: :func:`read_view` reads the whole job prefix in one etcd range request,
so every record comes from one revision. A malformed or old-version value never
aborts the read: it is listed in ``View.malformed`` (key -> message) and left in
etcd untouched, and the record is treated as absent. A malformed ``epoch`` makes
``View.epoch`` None: :func:`~trainmover_ext.control.decide.decide` then decides
nothing but the epoch's repair (from the newest migration plan, which records
every epoch), because every other decision is a compare-and-swap on the epoch.

Example::

    view = read_view(space)            # space: trainmover_ext.kv.job.JobSpace
    actions = decide(view, time.time())
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover_ext.control.records import (
    Alert, FailureReport, MemberRecord, MigrationPlan, MigrationRequest, RankRecord,
)
from trainmover_ext.errors import MalformedValue
from trainmover_ext.kv.base import Snapshot
from trainmover_ext.kv.codec import decode, encode
from trainmover_ext.kv.job import JobSpace


@dataclass(kw_only=True)
class View:
    """Everything ``decide`` may look at; plain data, built by :func:`parse_view` or by tests."""

    root: str = ""
    """The job namespace (``/trainmover/<job>/``); keys in actions are full keys under it."""
    revision: int = 0
    """etcd revision of the snapshot."""
    epoch: int | None = 0
    """Current membership epoch; None when the ``epoch`` key is malformed."""
    epoch_rev: int = 0
    """mod_revision of the ``epoch`` key (0: not yet written); decisions compare-and-swap on it."""
    members: dict[str, MemberRecord] = field(default_factory=dict)
    """Live members (their lease holds)."""
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    reports: dict[str, FailureReport] = field(default_factory=dict)
    """Failure reports by full key."""
    requests: dict[str, MigrationRequest] = field(default_factory=dict)
    """Planned-migration requests by full key."""
    alerts: dict[int, Alert] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    """Ranks whose worker completed training (``finished/<r>``); never replaced."""
    recovery: dict[int, dict[int, int | None]] = field(default_factory=dict)
    """Stayers' reports per failure epoch: epoch -> rank -> completed steps, or None for a rank
    whose state is unusable (a copy into it was cut short) (``recovery/<e>/<r>``)."""
    recovery_keys: dict[int, list[str]] = field(default_factory=dict)
    """The full keys behind ``recovery``, per epoch (a decision deletes the ones it settles)."""
    converged: set[int] = field(default_factory=set)
    """Failure epochs whose ``convergence/<e>`` record exists."""
    checkpoint_iteration: int | None = None
    last_plan: MigrationPlan | None = None
    last_plan_rev: int = 0
    """mod_revision of the newest plan's key (a decision that rewrites the plan compares against it)."""
    leader: str | None = None
    malformed: dict[str, str] = field(default_factory=dict)
    """Keys whose value could not be read, with the reason; never modified by the controller."""
    gone_at: dict[str, float] = field(default_factory=dict)
    """When the controller saw a member's key disappear (lease expiry); filled by the runner, optional."""


def epoch_value(epoch: int) -> bytes:
    return encode("epoch", {"epoch": epoch})


def parse_view(space: JobSpace, snap: Snapshot) -> View:
    """Build a :class:`View` from a prefix snapshot of ``space.root``."""
    view = View(root=space.root, revision=snap.revision)
    root = space.root
    for entry in snap.entries:
        rel = entry.key[len(root):]
        head, _, rest = rel.partition("/")
        try:
            if rel == "epoch":
                view.epoch = int(decode(entry.value, kind="epoch", key=entry.key)["epoch"])
                view.epoch_rev = entry.mod_revision
            elif head == "members" and rest:
                m = MemberRecord.from_bytes(entry.value, key=entry.key)
                view.members[m.member_id] = m
            elif head == "ranks" and rest:
                r = RankRecord.from_bytes(entry.value, key=entry.key)
                view.ranks[r.rank] = r
            elif head == "reports" and rest:
                view.reports[entry.key] = FailureReport.from_bytes(entry.value, key=entry.key)
            elif head == "requests" and rest:
                view.requests[entry.key] = MigrationRequest.from_bytes(entry.value, key=entry.key)
            elif head == "alerts" and rest:
                a = Alert.from_bytes(entry.value, key=entry.key)
                view.alerts[a.rank] = a
            elif head == "recovery" and rest:
                epoch, _, rank = rest.partition("/")
                held = decode(entry.value, kind="recovery", key=entry.key)["iteration"]
                it = None if held is None else int(held)
                view.recovery.setdefault(int(epoch), {})[int(rank)] = it
                view.recovery_keys.setdefault(int(epoch), []).append(entry.key)
            elif head == "convergence" and rest:
                view.converged.add(int(rest))
            elif head == "finished" and rest:
                view.finished.add(int(rest))
            elif rel == "checkpoint":
                view.checkpoint_iteration = int(decode(entry.value, kind="checkpoint", key=entry.key)["iteration"])
            elif head == "migrations" and rest:
                # Entries are sorted by key and migration keys are zero-padded: the last one wins.
                view.last_plan = MigrationPlan.from_bytes(entry.value, key=entry.key)
                view.last_plan_rev = entry.mod_revision
            elif rel == "leader":
                view.leader = decode(entry.value, kind="leader", key=entry.key).get("id")
        except (MalformedValue, KeyError, ValueError, TypeError) as exc:
            view.malformed[entry.key] = str(exc)
            if rel == "epoch":
                view.epoch = None
                view.epoch_rev = entry.mod_revision  # what a repair compares against
    return view


def read_view(space: JobSpace) -> View:
    """One consistent read of the job's control state (see the module docstring)."""
    return parse_view(space, space.kv.get_prefix(space.root))
