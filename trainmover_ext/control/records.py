"""The records the control plane keeps in etcd, their keys, and their JSON form.

Every key of a job, all under ``/trainmover/<job>/``, with who writes and who reads it. The
job's etcd user may read and write that prefix and nothing else (:mod:`trainmover_ext.etcd.auth`).
The job's timeline, ``~events/``, and the rendezvous store, ``~store/<generation>/`` (written through
``trainmover_ext.kv.torch_store``: torch's rendezvous, link rendezvous, ``nccl_delta/ledgers/e<e>/<rank>``,
state-transfer pairs), sort after every control key, so the controller reads and watches
``[/trainmover/<job>/, /trainmover/<job>/~)`` and never sees them (``JobSpace.control_end``):

======================  =============================================  ==========================  ==============================
key                     value                                          written by                  read by
======================  =============================================  ==========================  ==============================
``job``                 the job record (token digest)                  the first launcher          every client (token guard)
``fingerprint``         :class:`FingerprintRecord`: the model config   the first worker (once)     every standby (before it
                        standbys must match                                                        advertises a warm role),
                                                                                                   every later worker
``members/<id>``        :class:`MemberRecord` on the member's lease    each member                 controller, ``status``, metrics
``nodes/<host>``        :class:`NodeRecord`: a machine and its agent   its agent (at start)        controller (node loss),
                        (no lease: it outlives the agent)                                          ``status``, standbys (the
                                                                                                   recordings URL)
``ranks/<r>``           :class:`RankRecord`: who serves rank r         launcher; controller        controller, agents, ``status``
``epoch``               ``{"epoch": e}``, compare-and-swap only         controller                  controller
``migrations/<e>``      :class:`MigrationPlan` that opened epoch e     controller; steps: ranks    every rank, agent, controller
                        (the last 16 epochs': ``executor.PLANS_KEPT``)
``reports/<r>/<by>``    :class:`FailureReport`: r's process died       agents                      controller
``requests/<id>``       :class:`MigrationRequest`                      ``trainmover migrate``      controller
``alerts/<r>``          :class:`Alert`: no standby can serve rank r    controller                  controller, ``status``
``recovery/<e>/<r>``    ``{"iteration": k|null}``: r holds k steps     that stayer (once)          controller only
``convergence/<e>``     :class:`ConvergenceRecord`: resume and copies  controller                  every rank of epoch e (one key)
                        (the last 16 epochs', as plans)
``checkpoint``          ``{"iteration": k}``: newest full checkpoint   rank 0                      controller
``finished/<r>``        ``{"iteration": k}``: rank r completed         that rank                   controller, ``trainmover controller``
``recordings/<role>``   the sandbox's recording index                  the recording rank          standbys
``links/<e>/...``       phase-1 link rendezvous (scale check only)     the scale check             the scale check
``leader``              the controller leader's id, on its lease       the election                candidates, ``status``
``compute/<host>``      :class:`ComputeReport`: the node's ranks'      its agent (about once a     the controller's straggler
                        recent compute times per iteration             second, while they train)   watch
``health/<host>``       :class:`GpuHealthReport`: what makes the node's  its agent (on a change)    the straggler watch
                        GPUs unfit, per slot
``policy/stragglers``   :class:`StragglerPolicy`                       the first agent;            the straggler watch,
                                                                       ``trainmover straggler``    ``status``
``policy/rebalance``    :class:`RebalancePolicy`                       the first agent;            the rebalancer, ``status``
                                                                       ``trainmover rebalance``;
                                                                       the rebalancer (last_at)
``stragglers/<r>``      :class:`StragglerRecord`: rank r was flagged   the straggler watch         ``status``, ``events``
``slow_links/<a>-<b>``  :class:`SlowLinkRecord`: ranks a < b wait on   the straggler watch         ``status``, ``events``
                        each other longer than their peers
``quarantine/<host>/    :class:`Quarantine`: a slow slot no standby    the straggler watch         controller (placement),
<slot>``                in it is promoted into                         (cleared by ``trainmover    ``status``
                                                                       quarantine --clear``)
``~events/<ns>-<id>``   :class:`Event`, the job's timeline (outside    controller, CLI, agents     ``events``, the run archive
                        the control range: it only grows)
``~store/<g>/...``      the ranks' rendezvous store, start number g    ranks (torch, nccl_delta)   ranks
======================  =============================================  ==========================  ==============================

Each record type converts to and from versioned JSON (:mod:`trainmover_ext.kv.codec`)
with ``to_bytes`` / ``from_bytes``; unknown fields from newer writers are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from trainmover_ext.control.json_types import field_type_problems
from trainmover_ext.control.stragglers import StragglerConfig
from trainmover_ext.errors import MalformedValue
from trainmover_ext.kv.codec import decode, encode

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace

ROLES = ("first", "middle", "last")
"""Pipeline stage kinds a standby can warm: embedding stage, middle stages, output/loss stage."""
KINDS = ("worker", "standby", "agent")

T = TypeVar("T", bound="Record")


class Record:
    """Mixin: versioned-JSON (de)serialization of a dataclass."""

    KIND: ClassVar[str]
    PLAIN: ClassVar[bool] = False  # only JSON values at any depth: encoded without asdict's deep copy

    def to_bytes(self) -> bytes:
        if self.PLAIN:
            return encode(self.KIND, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # type: ignore[arg-type]
        return encode(self.KIND, dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_bytes(cls: type[T], raw: bytes, *, key: str, strict: bool = False) -> T:
        """The record in ``raw``; :class:`MalformedValue` when it is not one. ``strict`` also rejects a
        field whose JSON type is not its annotated one (:meth:`problems`): the controller reads this way,
        because a ``null`` where a list belongs would otherwise surface as a TypeError in a decision."""
        data = decode(raw, kind=cls.KIND, key=key)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        try:
            record = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise MalformedValue(
                f"{key} is a {cls.KIND!r} record with missing fields ({exc}); the value is left untouched"
            ) from exc
        problems = record.problems() if strict else []
        if problems:
            raise MalformedValue(
                f"{key} is a {cls.KIND!r} record with fields of the wrong type "
                f"({'; '.join(problems)[:300]}); the value is left untouched"
            )
        return record

    def problems(self) -> list[str]:
        """The fields whose value does not have its annotated JSON type (empty: the record is sound)."""
        return field_type_problems(self)


@dataclass(kw_only=True)
class MemberRecord(Record):
    """A live process of the job (worker, standby or agent)."""

    KIND: ClassVar[str] = "member"
    member_id: str
    """Unique id, e.g. ``<host>-<pid>-<random>``."""
    kind: str
    """``worker``, ``standby`` or ``agent``."""
    host: str
    """Host name (the controller prefers a standby on another host than the leaver)."""
    pid: int
    """Process id on ``host``."""
    warm_roles: list[str] = field(default_factory=list)
    """Stage roles a standby may serve (subset of :data:`ROLES`); empty until its model fingerprint matched."""
    warming: bool = False
    """True while a standby's sandbox warm-up runs: it may already serve ``warm_roles`` (its warm-up stops
    at the next shadow iteration when promoted), only colder; the controller prefers a standby done warming."""
    kept_rank: int | None = None
    """The rank whose model a sandbox standby keeps built, ready to adopt (``--tm-keep-role``)."""
    health: str = "ok"
    """``ok`` or a reason the member should not be chosen."""
    registered_at: float = 0.0
    """Wall-clock time of registration."""
    slot: int | None = None
    """A standby of a standby machine: its slot (device index, the ``LOCAL_RANK`` it serves a rank
    with); None for a standby that shares an active node's devices."""


@dataclass(kw_only=True)
class NodeRecord(Record):
    """A machine of the job and its agent (``nodes/<host>``), written by the agent when it starts and
    kept without a lease: the controller tells a lost node (this record, its agent's member key gone)
    from a job without agents."""

    KIND: ClassVar[str] = "node"
    host: str
    agent: str
    """The member id of the node's agent; its ``members/`` key lives on the agent's lease."""
    role: str
    """``active`` (it starts ranks) or ``standby`` (a standby machine: one standby per slot)."""
    slots: int
    """Processes per node (``--nproc-per-node``): ranks of an active node, standbys of a standby machine."""
    registered_at: float = 0.0
    recordings_url: str = ""
    """Where the node's agent serves its sandbox recordings to standbys of other nodes (``http://host:port``,
    job token required, see :mod:`trainmover_ext.launch.recording_server`); empty: it serves none."""


@dataclass(kw_only=True)
class RankRecord(Record):
    """Which member serves logical rank ``rank`` (a logical rank never changes)."""

    KIND: ClassVar[str] = "rank"
    rank: int
    member_id: str
    host: str = ""
    """Host of ``member_id``, kept here because the member record vanishes with its lease."""
    role: str = "middle"
    """Stage role of this rank (:data:`ROLES`)."""
    replicas: list[int] = field(default_factory=list)
    """Other ranks holding the same parameter shard (its data-parallel peers); empty with a distributed optimizer."""
    holder: int | None = None
    """The rank keeping this rank's optimizer shard in host memory (the distributed optimizer's mirror);
    None without one."""
    since_epoch: int = 0
    """Epoch at which ``member_id`` started serving the rank."""
    local_rank: int = 0
    """The slot of ``host`` the rank runs in (its ``LOCAL_RANK``: the device it uses)."""


@dataclass(kw_only=True)
class FailureReport(Record):
    """Fast-path detection: ``reporter`` saw its link to ``rank`` (served by ``member_id``) break."""

    KIND: ClassVar[str] = "report"
    rank: int
    member_id: str
    """The member the reporter believed served the rank; a report on a replaced member is stale."""
    reporter: str
    reason: str
    epoch: int
    reported_at: float
    suspect: bool = False
    """A peer rank's report (its link to the rank broke): on its own not proof that the rank died, as
    the rank's agent reports a dead child itself. The controller probes the rank's node instead
    (:class:`ProbeRecord`); an agent's report of a child's exit is not a suspicion."""


@dataclass(kw_only=True)
class ProbeRecord(Record):
    """The controller asks a node's agent whether it lives (``probes/<host>``): written when a rank of the
    node is suspected, answered by the agent with ``acked_at``. Left unanswered for ``View.probe_s``,
    the node is lost (its agent died with the machine) before the agent's lease says so."""

    KIND: ClassVar[str] = "probe"
    host: str
    agent: str
    """The agent asked (a probe of an agent that has since been replaced on the host counts for nothing)."""
    probed_at: float
    suspected_at: float
    """When the first suspicion that led to the probe was reported (the start of detection)."""
    ranks: list[int] = field(default_factory=list)
    """The suspected ranks of the node."""
    acked_at: float | None = None


@dataclass(kw_only=True)
class MigrationRequest(Record):
    """A planned migration asked for by ``trainmover migrate``."""

    KIND: ClassVar[str] = "request"
    request_id: str
    rank: int
    """The rank to move (-1 for a drain)."""
    to: str | None = None
    """A chosen standby member id; None lets the controller pick."""
    node: str | None = None
    """A drain (``trainmover drain --node``): every rank of this node moves, in one planned epoch, to the
    slots of one standby machine."""
    requested_by: str = ""
    requested_at: float = 0.0


@dataclass(kw_only=True)
class Replacement:
    """One rank's move inside a :class:`MigrationPlan`."""

    rank: int
    leaver: str
    joiner: str
    role: str
    state_source: dict[str, Any]
    """``{"kind": "replica"}``, ``{"kind": "mirror", "rank": holder}`` (the distributed optimizer's
    host-memory mirror), ``{"kind": "checkpoint", "iteration": k|None[, "why": ...]}`` or, for a
    planned move, ``{"kind": "leaver", "member": m}``."""
    local_rank: int = 0
    """The ``LOCAL_RANK`` (device) the joiner serves the rank with: its slot on a standby machine, else
    the rank's own (a standby beside the ranks takes the lost rank's device)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Replacement:
        """One entry of :attr:`MigrationPlan.replacements`; unknown fields from newer writers are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(kw_only=True)
class MigrationPlan(Record):
    """The decision that opens epoch ``epoch``; carried out by the migration layer."""

    KIND: ClassVar[str] = "migration"
    epoch: int
    reason: str
    """``failure`` or ``planned``."""
    replacements: list[dict[str, Any]]
    """:class:`Replacement` as dicts (JSON)."""
    resume_iteration: int | None
    """Iteration every rank resumes at; None for a planned move (decided at the next iteration boundary)."""
    unserved: list[int] = field(default_factory=list)
    """Failed ranks with no warm standby left (an :class:`Alert` is raised for each)."""
    detected_at: float | None = None
    """Earliest detection time (report or lease loss) behind this plan."""
    decided_at: float = 0.0
    decided_by: str = ""
    status: str = "planned"
    """``planned`` here; the migration layer moves it on (``preparing``, ``switched``, ``done``, ``aborted``)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Per-step wall-clock timestamps (``detected``, ``decided``, and later steps by the migration layer)."""
    leaver_at: int | None = None
    """A planned move: the iteration boundary (completed steps) where the leaver, its joiner ready, said
    so; written by the leaver, which trains one more iteration and waits at the next boundary for the
    switch point (at the last boundary it waits at once)."""
    last_boundary: int | None = None
    """A planned move: the job's last iteration boundary (``--train-iters`` - 1), written with ``leaver_at``."""
    switch_at: int | None = None
    """A planned move: the boundary where the leaver hands over and the stayers switch; committed by the
    controller from ``leaver_at``: two boundaries later, or the last boundary (nobody can pass the
    boundary after the one where the leaver waits)."""
    drain: str | None = None
    """A planned move of every rank of this node at once (``trainmover drain``)."""
    placement: list[str] = field(default_factory=list)
    """How the joiners were placed, in words, for operators: a lost node's ranks on one standby machine,
    or what was done instead when no whole machine was free."""

    def replacement_list(self) -> list[Replacement]:
        return [Replacement.from_dict(r) for r in self.replacements]

    def rank_done(self, step: str, rank: int) -> bool:
        """Whether ``step`` (e.g. ``handed_over``) is done for ``rank``'s move: its own ``<step>/<rank>``,
        or the plan's ``<step>``, marked once every rank's is (see ``timeline.mark_rank_step``)."""
        return step in self.steps or f"{step}/{rank}" in self.steps

    def problems(self) -> list[str]:
        out = super().problems()
        if not out:  # replacements is a list of dicts: each must also be a sound Replacement
            for i, r in enumerate(self.replacements):
                try:
                    out += [f"replacements[{i}].{p}" for p in field_type_problems(Replacement.from_dict(r))]
                except TypeError as exc:
                    out.append(f"replacements[{i}] is not a replacement ({exc})")
        return out


@dataclass(kw_only=True)
class ConvergenceRecord(Record):
    """Where every rank of failure epoch ``epoch`` resumes, decided by the controller once every
    stayer reported what it holds (``recovery/<e>/<r>``); the ranks only carry it out."""

    KIND: ClassVar[str] = "convergence"
    epoch: int
    resume_iteration: int
    """Completed steps every rank holds after the copies (-1 with ``from_checkpoint``)."""
    copies: list[list[int]] = field(default_factory=list)
    """``[source, target]`` rank pairs: each target receives the source's whole training state."""
    from_checkpoint: bool = False
    """True: some state has no live replica; every rank loads the latest checkpoint instead."""
    mirror: bool = False
    """The copies are of optimizer shards from their holders' mirrors (the source holds the target's);
    every rank then rebuilds its model parameters from the main parameters."""
    reason: str = ""
    decided_at: float = 0.0
    decided_by: str = ""


def recovery_key(space: JobSpace, epoch: int, rank: int) -> str:
    """``recovery/<e>/<r>``: what stayer ``rank`` holds after failure epoch ``epoch`` (it writes it once)."""
    return space.key("recovery", migration_key_suffix(epoch), rank)


def convergence_key(space: JobSpace, epoch: int) -> str:
    """``convergence/<e>``: the controller's :class:`ConvergenceRecord` for failure epoch ``epoch``."""
    return space.key("convergence", migration_key_suffix(epoch))


@dataclass(kw_only=True)
class FingerprintRecord(Record):
    """The job's model fingerprint (:mod:`trainmover_ext.control.fingerprint`): what a standby's
    model and optimizer state must share with a rank's to take it over. Written once, never changed."""

    KIND: ClassVar[str] = "fingerprint"
    fields: dict[str, Any]
    """Field name -> value (JSON scalars): model shape, precision, parallel layout, optimizer, batch, versions."""
    digest: str
    """SHA-256 of ``fields`` in canonical JSON; equal digests mean equal fields."""
    published_by: str = ""
    """The member id of the worker that wrote it."""
    published_at: float = 0.0


@dataclass(kw_only=True)
class Alert(Record):
    """Rank ``rank`` lost member ``member_id`` and no warm standby could take it."""

    KIND: ClassVar[str] = "alert"
    rank: int
    member_id: str
    epoch: int
    reason: str
    raised_at: float


@dataclass(kw_only=True)
class ComputeReport(Record):
    """A node's ranks' recent compute times (``compute/<host>``), written by its agent: per rank, its last
    samples as ``[iteration, seconds]`` pairs, oldest first (:mod:`trainmover_ext.launch.compute_relay`)."""

    KIND: ClassVar[str] = "compute"
    PLAIN: ClassVar[bool] = True
    host: str
    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    """Rank (a decimal string: JSON keys are strings) -> ``[[iteration, compute_s, peer, wait_s, ...], ...]``:
    after the compute time, the seconds the rank waited in point-to-point ops with each peer it waited on
    (a logical rank), in that iteration."""
    published_at: float = 0.0


@dataclass(kw_only=True)
class GpuHealthReport(Record):
    """What makes a node's GPUs unfit (``health/<host>``), written by its agent when it changes
    (:mod:`trainmover_ext.launch.gpu_health`): per slot (a decimal string), the problems in words; a slot
    with none is fit."""

    KIND: ClassVar[str] = "gpu_health"
    host: str
    unfit: dict[str, list[str]] = field(default_factory=dict)
    read_at: float = 0.0


STRAGGLER_ACTIONS = ("report", "migrate", "off")


@dataclass(kw_only=True)
class StragglerPolicy(Record):
    """What the controller does with a straggler (``policy/stragglers``): set from the first agent's flags
    (``--tm-straggler-*``), changed at run time by ``trainmover straggler``."""

    KIND: ClassVar[str] = "straggler_policy"
    action: str = "report"
    """``report``: log it, record it under ``stragglers/`` and on the timeline; ``migrate``: also move it to a
    warm standby and quarantine its slot; ``off``: nothing is judged."""
    threshold: float = StragglerConfig.threshold
    window: int = StragglerConfig.window
    set_by: str = ""
    set_at: float = 0.0

    def check(self) -> StragglerPolicy:
        """Itself when sound; :class:`ConfigError` saying which flag is wrong otherwise."""
        from trainmover_ext.errors import ConfigError

        if self.action not in STRAGGLER_ACTIONS:
            raise ConfigError(
                f"--tm-straggler-action must be one of {', '.join(STRAGGLER_ACTIONS)}, got {self.action!r}"
            )
        if not (math.isfinite(self.threshold) and self.threshold > 1.0):
            raise ConfigError(
                f"--tm-straggler-threshold must be > 1 (a rank this many times slower than its peers' median), "
                f"got {self.threshold}"
            )
        if self.window < 1:
            raise ConfigError(f"--tm-straggler-window must be >= 1 iteration, got {self.window}")
        return self


@dataclass(kw_only=True)
class RebalancePolicy(Record):
    """Scheduled rotation through the standby pool (``policy/rebalance``): every ``interval_s`` the leading
    controller asks for one planned move of the rank served longest (:mod:`trainmover_ext.control.rebalance`)."""

    KIND: ClassVar[str] = "rebalance_policy"
    interval_s: float = 0.0
    """Seconds between scheduled moves; 0: none."""
    last_at: float = 0.0
    """When the last scheduled move was asked for (0: never); the next is due ``interval_s`` after it, or after
    ``set_at`` when later."""
    set_by: str = ""
    set_at: float = 0.0

    def check(self) -> RebalancePolicy:
        from trainmover_ext.errors import ConfigError

        if not (math.isfinite(self.interval_s) and self.interval_s >= 0):
            raise ConfigError(
                f"--tm-rebalance-interval must be >= 0 minutes (0 turns scheduled moves off), got {self.interval_s / 60:g}"
            )
        return self


@dataclass(kw_only=True)
class StragglerRecord(Record):
    """Rank ``rank``, served by ``member_id`` on ``host`` slot ``slot``, computed ``ratio`` times its peers'
    median for ``window`` iterations up to ``iteration`` (``stragglers/<rank>``)."""

    KIND: ClassVar[str] = "straggler"
    rank: int
    member_id: str
    host: str
    slot: int
    iteration: int
    ratio: float
    peers_median_s: float
    action: str
    """What the policy did: ``report`` or ``migrate`` (then ``request`` names the planned move's request)."""
    reason: str = ""
    """Why, when not its pace: the problems of its GPU (``health/<host>``)."""
    request: str | None = None
    flagged_at: float = 0.0


@dataclass(kw_only=True)
class SlowLinkRecord(Record):
    """Ranks ``ranks`` (a < b) waited ``ratio`` times as long on each other's point-to-point ops as the pairs in
    the same position (their peers' median) for ``window`` iterations up to ``iteration``, while neither
    computed slower than its peers: their link, not either rank, is slow (``slow_links/<a>-<b>``). Reported,
    never acted on: moving either end may not help."""

    KIND: ClassVar[str] = "slow_link"
    ranks: list[int]
    hosts: list[str]
    """Each rank's host, in the same order."""
    iteration: int
    ratio: float
    peers_median_s: float
    """The other pairs' median seconds waited per iteration."""
    waited_s: float
    """This pair's seconds waited per iteration (its pace)."""
    flagged_at: float = 0.0


@dataclass(kw_only=True)
class Quarantine(Record):
    """A slot no standby is promoted into until an operator clears it (``quarantine/<host>/<slot>``)."""

    KIND: ClassVar[str] = "quarantine"
    host: str
    slot: int
    reason: str
    pid: int = 0
    """The slow process: should it stay as a standby (``--tm-leaver-becomes-standby``), it is never promoted."""
    since: float = 0.0

    def holds(self, member: MemberRecord) -> bool:
        """Whether standby ``member`` may not be promoted: it is the slow process, or a standby machine's
        standby in the slot. (A standby beside an active node's ranks has no slot of its own.)"""
        if member.host != self.host:
            return False
        return (self.pid != 0 and member.pid == self.pid) or member.slot == self.slot


def quarantine_key(space: JobSpace, host: str, slot: int) -> str:
    return space.key("quarantine", host, slot)


@dataclass(kw_only=True)
class Event(Record):
    """One line of the ``trainmover events`` timeline."""

    KIND: ClassVar[str] = "event"
    time: float
    what: str
    detail: dict[str, Any] = field(default_factory=dict)


def event_key_suffix(now: float | None = None) -> str:
    """A sortable, unique key suffix of an event (after ``JobSpace.events_prefix``)."""
    return f"{int((now if now is not None else time.time()) * 1e9):020d}-{os.urandom(3).hex()}"


MAX_EPOCH = 10**10 - 1
"""The newest epoch a ``migrations/<e>`` key can name: keys are zero-padded to 10 digits so that they sort by
epoch (the newest plan is the last key). An ``epoch`` beyond it is malformed, and none is ever planned."""


def migration_key_suffix(epoch: int) -> str:
    return f"{epoch:010d}"
