"""A consistent, parsed picture of one job's control state: the input of ``decide``.

Contract: :func:`read_view` reads the whole job prefix in one etcd range request,
so every record comes from one revision. A malformed or old-version value never
aborts the read: it is listed in ``View.malformed`` (key -> message) and left in
etcd untouched, and the record is treated as absent. Malformed means anything but
the record as TrainMover writes it: bytes that are not its JSON, a field of the
wrong JSON type (``null`` for a list, ``"3"`` for a rank, ``Infinity``), a record
under another record's key, an epoch outside 0..``MAX_EPOCH``. A malformed ``epoch``
makes ``View.epoch`` None: :func:`~trainmover_ext.control.decide.decide` then decides
nothing but the epoch's repair (from the newest migration plan, which records
every epoch), because every other decision is a compare-and-swap on the epoch.

Example::

    view = read_view(space)            # space: trainmover_ext.kv.job.JobSpace
    actions = decide(view, time.time())
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover_ext.control.records import (
    MAX_EPOCH,
    Alert,
    ComputeReport,
    FailureReport,
    GpuHealthReport,
    MemberRecord,
    MigrationPlan,
    MigrationRequest,
    NodeRecord,
    ProbeRecord,
    Quarantine,
    RankRecord,
    RebalancePolicy,
    SlowLinkRecord,
    StragglerPolicy,
    StragglerRecord,
    migration_key_suffix,
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
    shards: dict[int, dict[int, int]] = field(default_factory=dict)
    """The distributed optimizer's mirror, per failure epoch: rank -> the boundary its own optimizer
    shard is at (from the same reports)."""
    staged: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """Per failure epoch: rank -> the boundaries of its own last staged shard copies."""
    mirrors: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """Per failure epoch: holder rank -> the iterations of its ward's shard it holds committed."""
    recovery_keys: dict[int, list[str]] = field(default_factory=dict)
    """The full keys behind ``recovery``, per epoch (a decision deletes the ones it settles)."""
    converged: set[int] = field(default_factory=set)
    """Failure epochs whose ``convergence/<e>`` record exists."""
    checkpoint_iteration: int | None = None
    last_plan: MigrationPlan | None = None
    last_plan_rev: int = 0
    """mod_revision of the newest plan's key (a decision that rewrites the plan compares against it)."""
    newest_plan_epoch: int = 0
    """The epoch of the newest ``migrations/<e>`` key, readable or not: the job's epoch reached it."""
    leader: str | None = None
    stragglers: dict[int, StragglerRecord] = field(default_factory=dict)
    """The last straggler flagged in each rank (``stragglers/<r>``)."""
    slow_links: list[SlowLinkRecord] = field(default_factory=list)
    """The slow links flagged (``slow_links/<a>-<b>``), the last of each pair."""
    straggler_policy: StragglerPolicy | None = None
    """The job's straggler policy (``policy/stragglers``); None until the first agent recorded it."""
    rebalance_policy: RebalancePolicy | None = None
    """The job's rebalancing schedule (``policy/rebalance``); None: none was ever set."""
    rebalance_policy_rev: int = 0
    """mod_revision of ``policy/rebalance`` (the rebalancer's write of it compares against it)."""
    compute: dict[str, ComputeReport] = field(default_factory=dict)
    """The nodes' ranks' recent compute times by host (``compute/<host>``), fed to the straggler watch."""
    gpu_health: dict[str, GpuHealthReport] = field(default_factory=dict)
    """What makes each node's GPUs unfit, by host (``health/<host>``)."""
    quarantine: list[Quarantine] = field(default_factory=list)
    """Slow slots and processes no standby is promoted from (``quarantine/<host>/<slot>``)."""
    malformed: dict[str, str] = field(default_factory=dict)
    """Keys whose value could not be read, with the reason; never modified by the controller."""
    gone_at: dict[str, float] = field(default_factory=dict)
    """When the controller saw a member's key disappear (lease expiry); filled by the runner, optional."""
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    """The job's machines by host (``nodes/<host>``); a node whose agent is no member is lost."""
    probes: dict[str, ProbeRecord] = field(default_factory=dict)
    """The controller's liveness probes of nodes by host (``probes/<host>``)."""
    probe_s: float = 0.0
    """How long a node's agent has to answer a probe before the node counts as lost. Set by the runner;
    0 turns probing off (suspicions then wait for the leases)."""
    unresponsive: frozenset[str] = frozenset()
    """Hosts whose agent left a probe unanswered for ``probe_s``: lost like a node whose agent's lease
    expired. Derived by ``decide`` from ``probes`` and its ``now``."""
    own_member: str | None = None
    """The deciding controller's own member id (its agent's). Set by the runner."""
    rejoin_s: float = 0.0
    """How long a lapsed lease is evidence only, not proof: a live member whose lease etcd dropped (a
    starved keepalive, an etcd that stalled past the TTL) registers again within it. A rank whose
    lease lapsed while its node's agent lives waits this long (its agent reports it at once if its
    process died, froze or stalled), and while the controller's own lease lapsed this recently every
    lapse waits (etcd's, not the members'). Set by the runner (0: a lapse is proof at once)."""
    settle_s: float = 0.0
    """How long a rank whose lease expired on a node whose agent still looks alive waits before it is
    planned alone: the other leases of a lost node expire within one TTL of each other,
    so waiting this long lets one plan replace the whole node. Set by the runner (0: plan at once)."""


def epoch_value(epoch: int) -> bytes:
    return encode("epoch", {"epoch": epoch})


def parse_view(space: JobSpace, snap: Snapshot) -> View:
    """Build a :class:`View` from a prefix snapshot of ``space.root``.

    A record is read strictly (every field of its annotated JSON type) and only under its own key
    (``members/<id>`` holds member ``id``, ``ranks/<r>`` rank ``r``, ``migrations/<e>`` the plan of epoch ``e``):
    a record under another record's key would shadow or outlive the real one."""
    view = View(root=space.root, revision=snap.revision)
    root = space.root
    for entry in snap.entries:
        key = entry.key
        rel = key[len(root) :]
        head, _, rest = rel.partition("/")
        try:
            if rel == "epoch":
                view.epoch_rev = entry.mod_revision  # what a decision, or the repair of garbage, compares against
                view.epoch = _epoch(decode(entry.value, kind="epoch", key=key).get("epoch"), key)
            elif head == "members" and rest:
                m = MemberRecord.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, m.member_id, key)
                view.members[m.member_id] = m
            elif head == "nodes" and rest:
                n = NodeRecord.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, n.host, key)
                view.nodes[n.host] = n
            elif head == "ranks" and rest:
                r = RankRecord.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, str(r.rank), key)
                view.ranks[r.rank] = r
            elif head == "reports" and rest:
                view.reports[key] = FailureReport.from_bytes(entry.value, key=key, strict=True)
            elif head == "probes" and rest:
                probe = ProbeRecord.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, probe.host, key)
                view.probes[probe.host] = probe
            elif head == "requests" and rest:
                view.requests[key] = MigrationRequest.from_bytes(entry.value, key=key, strict=True)
            elif head == "alerts" and rest:
                a = Alert.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, str(a.rank), key)
                view.alerts[a.rank] = a
            elif head == "recovery" and rest:
                epoch_part, _, rank_part = rest.partition("/")
                epoch, rank = _number(epoch_part, key), _number(rank_part, key)
                data = decode(entry.value, kind="recovery", key=key)
                if "iteration" not in data:
                    raise MalformedValue(f"{key} has no iteration; the value is left untouched")
                held = data["iteration"]
                view.recovery.setdefault(epoch, {})[rank] = None if held is None else _count(held, key)
                if data.get("shard") is not None:
                    view.shards.setdefault(epoch, {})[rank] = _count(data["shard"], key)
                if isinstance(data.get("staged"), list):
                    view.staged.setdefault(epoch, {})[rank] = [_count(i, key) for i in data["staged"]]
                mirror = data.get("mirror")
                if isinstance(mirror, dict) and isinstance(mirror.get("iterations"), list):
                    view.mirrors.setdefault(epoch, {})[rank] = [_count(i, key) for i in mirror["iterations"]]
                view.recovery_keys.setdefault(epoch, []).append(key)
            elif head == "convergence" and rest:
                view.converged.add(_number(rest, key))
            elif head == "stragglers" and rest:
                st = StragglerRecord.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, str(st.rank), key)
                view.stragglers[st.rank] = st
            elif head == "slow_links" and rest:
                view.slow_links.append(SlowLinkRecord.from_bytes(entry.value, key=key, strict=True))
            elif rel == "policy/stragglers":
                view.straggler_policy = StragglerPolicy.from_bytes(entry.value, key=key, strict=True)
            elif rel == "policy/rebalance":
                view.rebalance_policy = RebalancePolicy.from_bytes(entry.value, key=key, strict=True)
                view.rebalance_policy_rev = entry.mod_revision
            elif head == "compute" and rest:
                c = ComputeReport.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, c.host, key)
                view.compute[c.host] = c
            elif head == "health" and rest:
                h = GpuHealthReport.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, h.host, key)
                view.gpu_health[h.host] = h
            elif head == "quarantine" and rest:
                q = Quarantine.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, f"{q.host}/{q.slot}", key)
                view.quarantine.append(q)
            elif head == "finished" and rest:
                view.finished.add(_number(rest, key))
            elif rel == "checkpoint":
                view.checkpoint_iteration = _count(
                    decode(entry.value, kind="checkpoint", key=key).get("iteration"), key
                )
            elif head == "migrations" and rest:
                if len(rest) == 10 and rest.isascii() and rest.isdigit():
                    # The executor writes migrations/<e> in the transaction that moves epoch to e: the key
                    # alone says the job reached e, even when its value is unreadable.
                    view.newest_plan_epoch = max(view.newest_plan_epoch, int(rest))
                plan = MigrationPlan.from_bytes(entry.value, key=key, strict=True)
                _own_key(rest, migration_key_suffix(_epoch(plan.epoch, key)), key)
                # Entries are sorted by key and migration keys are zero-padded: the last one wins.
                view.last_plan = plan
                view.last_plan_rev = entry.mod_revision
            elif rel == "leader":
                leader = decode(entry.value, kind="leader", key=key).get("id")
                if leader is not None and not isinstance(leader, str):
                    raise MalformedValue(
                        f"{key} names leader {leader!r:.40}, not a member id; the value is left untouched"
                    )
                view.leader = leader
        # RecursionError: json's answer to deeply nested garbage; ValueError: to a number of > 4300 digits.
        except (MalformedValue, KeyError, ValueError, TypeError, RecursionError) as exc:
            view.malformed[key] = str(exc)
            if rel == "epoch":
                view.epoch = None
    return view


def _epoch(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
        raise MalformedValue(
            f"{key} holds epoch {value!r:.40}, not a whole number from 0 to {MAX_EPOCH}; the value is left untouched"
        )
    return value


def _count(value: object, key: str) -> int:
    """An iteration count: a whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedValue(
            f"{key} holds iteration {value!r:.40}, not a whole number >= 0; the value is left untouched"
        )
    return value


def _number(text: str, key: str) -> int:
    """A rank or epoch in a key: decimal digits only (``int`` would also take ``-1``, `` 7`` or ``1_0``)."""
    if not (text.isascii() and text.isdigit()):
        raise MalformedValue(f"{key} is not a key TrainMover writes ({text!r} is not a number); it is left untouched")
    return int(text)


def _own_key(rest: str, expected: str, key: str) -> None:
    if rest != expected:
        raise MalformedValue(
            f"{key} holds the record of {expected!r:.40}, which belongs under its own key; the value is left untouched"
        )


def read_view(space: JobSpace) -> View:
    """One consistent read of the job's control state (see the module docstring)."""
    return parse_view(space, space.kv.get_prefix(space.root, end=space.control_end))
