"""Membership-scale check: what one migration touches in a job of 1,000+ logical ranks.

Contract: :func:`run_scale_check` builds a whole job in one process, with the REAL
control plane: :class:`~trainmover_ext.kv.memory.MemoryKV` (the in-memory etcd
fake), :class:`~trainmover_ext.kv.job.JobSpace`, ``init_job``, one
:class:`~trainmover_ext.control.membership.PlanInbox` per rank, the pure
``decide(view, now)`` and the CAS :class:`~trainmover_ext.control.executor.Executor`.
It then kills one rank (its lease is revoked, as when a machine dies) and, in a
second round, requests a planned move of another rank, and counts:

- store transactions and keys written to commit each decision (expected O(1));
- plan notifications: every rank's watcher hears of the new epoch once (O(N) small
  watch events: a synchronous job must pause everywhere, and etcd fans them out);
- the communicators rebuilt: only those of the groups that contain the leaving rank, of the groups
  megatron-core creates for the layout (:func:`megatron_groups`), against every group of the job
  for a global rebuild; their number does not grow with the job (their members do, for the
  data-parallel kinds), and WORLD is never among them.

:func:`run_recovery_check` follows one unexpected failure's recovery through the same
code a rank runs (``report_recovery`` and ``wait_convergence``, each rank on a client of
its own that counts what it reads, writes and hears) and the controller's real
convergence decision, and reports the etcd work per rank: reads, writes and watch events
must not grow with the job (``recovery[]`` in the JSON).

The groups are megatron-core's own rank lists (its ``RankGenerator``, the kinds its
``initialize_model_parallel`` creates for a dense layout); ``tests/nccl_delta/test_native.py``
checks them against the groups of a real job. The communicators' rendezvous runs on the ranks' own
store, not on the control plane, and is not counted here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainmover_ext.control.decide import PlanMigration, decide
from trainmover_ext.control.executor import Executor, Outcome
from trainmover_ext.control.membership import (
    PlanInbox,
    init_job,
    report_recovery,
    request_migration,
    wait_convergence,
)
from trainmover_ext.control.records import ROLES, MemberRecord, RankRecord
from trainmover_ext.control.view import read_view
from trainmover_ext.errors import ConfigError
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.kv.memory import MemoryKV


class CountingKV(MemoryKV):
    """MemoryKV that counts committed transactions, keys written and keys read."""

    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(clock=lambda: self.now)
        self.transactions = 0
        self.keys_written = 0
        self.keys_read = 0

    def commit(self, guards, ops) -> bool:
        applied = super().commit(guards, ops)
        if applied and ops:
            self.transactions += 1
            self.keys_written += len(ops)
        return applied

    def get_prefix(self, prefix: str, *, end=None, since: int = 0):
        snap = super().get_prefix(prefix, end=end, since=since)
        self.keys_read += len(snap.entries)
        return snap


MEGATRON_KINDS = (
    # (kind, rank generator, token): every group megatron-core 0.16's initialize_model_parallel
    # creates for a dense layout (context and expert parallelism 1), in its order.
    ("dp-cp", "decoder", "dp-cp"),
    ("dp", "decoder", "dp"),
    ("cp", "decoder", "cp"),
    ("mp", "decoder", "tp-pp"),
    ("tp", "decoder", "tp"),
    ("pp", "decoder", "pp"),
    ("embedding", "decoder", "pp"),
    ("position-embedding", "decoder", "pp"),
    ("tp-dp-cp", "decoder", "tp-dp-cp"),
    ("tp-dp", "decoder", "tp-dp"),
    ("tp-cp", "decoder", "tp-cp"),
    ("ep", "expert", "ep"),
    ("expert-tp", "expert", "tp"),
    ("tp-ep", "expert", "tp-ep"),
    ("tp-ep-pp", "expert", "tp-ep-pp"),
    ("expert-dp", "expert", "dp"),
    ("dist-opt-instance", "expert", "tp-ep-pp"),  # concatenated: see megatron_groups
)


def megatron_groups(ranks: int, tp: int, pp: int) -> list[tuple[str, list[int]]]:
    """Every group megatron-core creates for TP x DP x PP in its default order (``tp-cp-ep-dp-pp``):
    (kind, members), one entry per communicator, groups of one member included. One spans the whole
    job (the distributed optimizer's instance group, with one instance)."""
    from megatron.core.parallel_state import RankGenerator

    if tp < 1 or pp < 1 or ranks % (tp * pp):
        raise ConfigError(f"--scale-check: {ranks} ranks is not a multiple of TP {tp} x PP {pp}")
    dp = ranks // (tp * pp)
    generators = {
        "decoder": RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp"),
        "expert": RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp"),
    }
    out = []
    for kind, generator, token in MEGATRON_KINDS:
        for members in generators[generator].get_ranks(token):
            if kind == "dist-opt-instance":
                continue  # below: one group of every tp-ep-pp group together (one optimizer instance)
            if kind == "embedding":
                members = [members[0], members[-1]] if len(members) > 1 else list(members)
            elif kind == "position-embedding":
                members = [members[0]]
            out.append((kind, list(members)))
    # megatron's INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP with --num-distributed-optimizer-instances 1:
    # the tp-ep-pp groups of the whole expert-data-parallel extent together, i.e. the whole job.
    out.append(("dist-opt-instance", sorted(r for m in generators["expert"].get_ranks("tp-ep-pp") for r in m)))
    return out


@dataclass
class Rebuilt:
    """What replacing one rank rebuilds: the communicators of its groups of more than one member."""

    groups: int
    members: int
    world: bool
    """Whether one of them spans the whole job (never: such a group is built only on use, see nccl_delta)."""
    by_kind: dict[str, int]
    acting: int
    """Ranks other than the replaced one that take part."""


def rebuilt_by(communicators: list[tuple[str, list[int]]], rank: int, ranks: int) -> Rebuilt:
    """What a replacement of ``rank`` rebuilds among ``communicators`` (kind, members): the groups that hold
    it, but not the ones of the whole job, which nccl_delta builds only when they are used."""
    hit = [(kind, members) for kind, members in communicators if rank in members and len(members) < ranks]
    by_kind: dict[str, int] = {}
    for kind, _ in hit:
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return Rebuilt(
        groups=len(hit),
        members=sum(len(m) for _, m in hit),
        world=False,
        by_kind=by_kind,
        acting=len({m for _, members in hit for m in members} - {rank}),
    )


def layout_groups(ranks: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The TP, DP and PP groups of :func:`megatron_groups` (the replicas of a rank: its DP group)."""
    groups: dict[str, list[list[int]]] = {"tp": [], "dp": [], "pp": []}
    for kind, members in megatron_groups(ranks, tp, pp):
        if kind in groups:
            groups[kind].append(members)
    return groups


@dataclass
class MigrationCount:
    """What one decided migration touched."""

    kind: str
    rank: int
    decided: bool
    store_transactions: int
    store_keys_written: int
    controller_keys_read: int
    plan_notifications: int
    ranks_acting: int
    """Ranks other than the leaving one that take part in rebuilding a communicator."""
    groups_rebuilt: int
    """Communicators rebuilt: one per group (of more than one member) that holds the leaving rank."""
    members_rebuilt: int
    """Their members, summed."""
    world_rebuilt: bool
    """Whether one of them spans the whole job (never: WORLD has no communicator)."""
    groups_by_kind: dict[str, int] = field(default_factory=dict)


@dataclass
class ScaleCheckResult:
    """Counts for one job size; ``to_json`` gives the ``scale_check`` JSON block."""

    ranks: int
    tp: int
    pp: int
    dp: int
    groups_total: int
    """Communicators of the job (groups of more than one member)."""
    migrations: list[MigrationCount]

    def to_json(self) -> dict:
        return asdict(self)


def _role(p: int, pp: int) -> str:
    return "first" if p == 0 else ("last" if p == pp - 1 else "middle")


def _decide_and_apply(kv: CountingKV, space: JobSpace) -> tuple[bool, int]:
    """One controller round; returns (a plan committed, controller keys read)."""
    before = kv.keys_read
    view = read_view(space)
    read = kv.keys_read - before
    executor = Executor(space)
    committed = False
    for action in decide(view, kv.now, decided_by="scale-check"):
        outcome = executor.apply(action)
        committed |= isinstance(action, PlanMigration) and outcome is Outcome.APPLIED
    return committed, read


def run_scale_check(ranks: int = 1024, tp: int = 8, pp: int = 8, standbys: int = 2) -> ScaleCheckResult:
    """Build a ``ranks``-rank job on the real control plane, migrate twice, count (see module docstring)."""
    if ranks < 2:
        raise ConfigError(f"--scale-check: need at least 2 ranks, got {ranks}")
    groups = layout_groups(ranks, tp, pp)
    communicators = [(kind, members) for kind, members in megatron_groups(ranks, tp, pp) if len(members) > 1]
    dp = ranks // (tp * pp)
    kv = CountingKV()
    space = JobSpace.create(kv, "scale-check")
    dp_peers = {r: g for g in groups["dp"] for r in g}
    records = []
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * p)
                records.append(
                    RankRecord(
                        rank=r,
                        member_id=f"w{r}",
                        host=f"node{r // 8}",
                        role=_role(p, pp),
                        replicas=[q for q in dp_peers[r] if q != r],
                    )
                )
    init_job(space, records)
    leases = {}
    for rec in records:
        leases[rec.member_id] = kv.grant_lease(10)
        member = MemberRecord(member_id=rec.member_id, kind="worker", host=rec.host, pid=rec.rank)
        space.put(space.key("members", rec.member_id), member.to_bytes(), lease=leases[rec.member_id])
    for i in range(standbys):
        sb = MemberRecord(
            member_id=f"s{i}", kind="standby", host=f"spare{i}", pid=i, warm_roles=list(ROLES), registered_at=float(i)
        )
        space.put(space.key("members", sb.member_id), sb.to_bytes(), lease=kv.grant_lease(10))
    heard: list[int] = []
    watchers = [PlanInbox(space, on_plan=lambda plan, r=r: heard.append(r)) for r in range(ranks)]
    migrations = []
    try:
        # a middle-stage rank in the middle of the job: it has neighbours in every group
        victims = (("unexpected", (ranks // 2) + tp + 1), ("planned", ranks // 4 + 3))
        for kind, rank in victims:
            rank %= ranks
            if kind == "unexpected":
                kv.revoke_lease(leases[f"w{rank}"])  # the machine dies: its member key vanishes
            else:
                request_migration(space, rank=rank, requested_by="scale-check")
            # count from here: the trigger (lease loss, request) is not the migration's cost
            tx0, keys0, heard0 = kv.transactions, kv.keys_written, len(heard)
            committed, read = _decide_and_apply(kv, space)
            epoch = read_view(space).epoch
            rebuilt = rebuilt_by(communicators, rank, ranks)
            migrations.append(
                MigrationCount(
                    kind=kind,
                    rank=rank,
                    decided=committed,
                    store_transactions=kv.transactions - tx0,
                    store_keys_written=kv.keys_written - keys0,
                    controller_keys_read=read,
                    plan_notifications=len(heard) - heard0,
                    ranks_acting=rebuilt.acting,
                    groups_rebuilt=rebuilt.groups,
                    members_rebuilt=rebuilt.members,
                    world_rebuilt=rebuilt.world,
                    groups_by_kind=rebuilt.by_kind,
                )
            )
            if committed and kind == "unexpected":
                # Let that recovery finish before the planned move (the controller holds requests
                # while one is under way): every stayer reports, and the controller converges.
                # Its per-rank cost is what run_recovery_check counts.
                for r in range(ranks):
                    if r != rank:
                        report_recovery(space, epoch=epoch, rank=r, iteration=7)
                _decide_and_apply(kv, space)
    finally:
        for w in watchers:
            w.close()
    return ScaleCheckResult(ranks=ranks, tp=tp, pp=pp, dp=dp, groups_total=len(communicators), migrations=migrations)


def format_result(result: ScaleCheckResult) -> str:
    """A short table of the counts."""
    lines = [
        f"Membership-scale check: {result.ranks:,} logical ranks (TP{result.tp} x DP{result.dp} x PP{result.pp}), "
        f"real decide() + executor on the in-memory etcd fake; {result.groups_total:,} communicators in the job",
        f"{'migration':<11} {'rank':>5} {'txns':>5} {'keys written':>13} {'ctl keys read':>14} "
        f"{'plan notices':>13} {'groups rebuilt':>15} {'their members':>14} {'WORLD':>6}",
    ]
    for m in result.migrations:
        lines.append(
            f"{m.kind:<11} {m.rank:>5} {m.store_transactions:>5} {m.store_keys_written:>13} "
            f"{m.controller_keys_read:>14,} "
            f"{m.plan_notifications:>13,} {m.groups_rebuilt:>15} {m.members_rebuilt:>14} "
            f"{'yes' if m.world_rebuilt else 'no':>6}" + ("" if m.decided else "  (NOT decided)")
        )
    return "\n".join(lines)


class RankClient:
    """One simulated rank's connection to the shared store: counts what this rank reads (requests),
    writes (keys) and hears (watch events); everything else is the shared store's."""

    def __init__(self, kv: MemoryKV) -> None:
        self._kv = kv
        self.reads = self.writes = self.watch_events = 0
        self.watches = 0
        """Watches this rank opened (the check starts deciding once every rank waits)."""

    def get(self, key: str):
        self.reads += 1
        return self._kv.get(key)

    def get_prefix(self, prefix: str, *, end=None, since: int = 0):
        self.reads += 1
        return self._kv.get_prefix(prefix, end=end, since=since)

    def commit(self, guards, ops) -> bool:
        self.writes += len(ops)
        return self._kv.commit(guards, ops)

    def watch_prefix(self, prefix: str, callback, *, start_revision: int = 0, end=None):
        def counted(events):
            self.watch_events += len(events)
            callback(events)

        handle = self._kv.watch_prefix(prefix, counted, start_revision=start_revision, end=end)
        self.watches += 1
        return handle

    def __getattr__(self, name: str):
        return getattr(self._kv, name)


@dataclass
class RecoveryCount:
    """The etcd work of one recovery in a job of ``ranks`` ranks (``recovery[]`` in the JSON)."""

    ranks: int
    per_rank_max_reads: int
    per_rank_max_writes: int
    per_rank_max_watch_events: int
    total_reads: int
    total_writes: int
    total_watch_events: int
    controller_keys_read: int
    """Keys the controller's final round read (it aggregates: O(N) once, not per rank)."""
    resume_iteration: int


def run_recovery_check(ranks: int, tp: int = 4, pp: int = 5, timeout_s: float = 600.0, wait=None) -> RecoveryCount:
    """One unexpected failure's recovery on the real control plane, counted per rank (module doc).

    ``wait(space, epoch, timeout_s, ranks)`` replaces what a rank does after reporting (default: the
    runtime's ``wait_convergence``); the tests pass a rank that gathers every other rank's report
    instead, to show that the count catches O(N) work per rank."""
    import threading

    if ranks % (tp * pp):
        raise ConfigError(f"--scale-check: {ranks} ranks is not a multiple of TP {tp} x PP {pp}")
    groups = layout_groups(ranks, tp, pp)
    dp_peers = {r: g for g in groups["dp"] for r in g}
    kv = CountingKV()
    space = JobSpace.create(kv, "recovery-check", "token")
    records = [
        RankRecord(
            rank=r,
            member_id=f"w{r}",
            host=f"node{r // 8}",
            role=_role(r // (ranks // pp), pp),
            replicas=[q for q in dp_peers[r] if q != r],
        )
        for r in range(ranks)
    ]
    init_job(space, records)
    leases = {}
    for rec in records:
        leases[rec.member_id] = kv.grant_lease(10)
        space.put(
            space.key("members", rec.member_id),
            MemberRecord(member_id=rec.member_id, kind="worker", host=rec.host, pid=rec.rank).to_bytes(),
            lease=leases[rec.member_id],
        )
    space.put(
        space.key("members", "s0"),
        MemberRecord(member_id="s0", kind="standby", host="spare", pid=0, warm_roles=list(ROLES)).to_bytes(),
        lease=kv.grant_lease(10),
    )
    clients = [RankClient(kv) for _ in range(ranks)]
    spaces = [JobSpace(client, space.job, space.token, space._record) for client in clients]
    watchers = [PlanInbox(sp, on_plan=lambda plan: None, resync_s=3600) for sp in spaces]
    try:
        for c in clients:  # count from the failure on
            c.reads = c.writes = c.watch_events = 0
        victim = ranks // 2 + 1
        kv.revoke_lease(leases[f"w{victim}"])
        committed, _ = _decide_and_apply(kv, space)
        if not committed:
            raise RuntimeError("the controller planned no migration")
        epoch = read_view(space).epoch
        results: dict[int, object] = {}

        def rank_main(r: int) -> None:
            if r != victim:  # every stayer reports once; the joiner (served by s0) only waits
                report_recovery(spaces[r], epoch=epoch, rank=r, iteration=7)
            # The watch's once-a-second safety re-read depends on how long this simulation of
            # thousands of ranks on one core takes, not on the protocol: counted without it.
            if wait is not None:
                results[r] = wait(spaces[r], epoch, timeout_s, ranks)
            else:
                results[r] = wait_convergence(spaces[r], epoch, timeout_s, recheck_s=timeout_s)

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ranks)]
        for t in threads:
            t.start()
        # Decide once every rank waits (its watch is open), as the controller's decision comes after
        # the last report in a real job; a rank that only got to wait after it would read it at once.
        while any(t.is_alive() for t in threads) and not all(c.watches >= 2 for c in clients):
            threading.Event().wait(0.1)
        _, controller_read = _decide_and_apply(kv, space)  # the convergence decision, real code
        for t in threads:
            t.join(timeout_s)
        records_seen = [results.get(r) for r in range(ranks)]
        if any(rec is None for rec in records_seen):
            raise RuntimeError("some rank never saw the convergence record")
    finally:
        for w in watchers:
            w.close()
    return RecoveryCount(
        ranks=ranks,
        per_rank_max_reads=max(c.reads for c in clients),
        per_rank_max_writes=max(c.writes for c in clients),
        per_rank_max_watch_events=max(c.watch_events for c in clients),
        total_reads=sum(c.reads for c in clients),
        total_writes=sum(c.writes for c in clients),
        total_watch_events=sum(c.watch_events for c in clients),
        controller_keys_read=controller_read,
        resume_iteration=getattr(records_seen[0], "resume_iteration", -1),
    )


def format_recovery(counts: list[RecoveryCount]) -> str:
    lines = [
        "Recovery after one SIGKILL, etcd work per rank (real report/wait code, real convergence decision):",
        f"{'ranks':>6} {'max reads':>10} {'max writes':>11} {'max watch events':>17} {'total writes':>13} "
        f"{'total watch events':>19} {'controller keys read':>21}",
    ]
    for c in counts:
        lines.append(
            f"{c.ranks:>6} {c.per_rank_max_reads:>10} {c.per_rank_max_writes:>11} "
            f"{c.per_rank_max_watch_events:>17} {c.total_writes:>13} {c.total_watch_events:>19} "
            f"{c.controller_keys_read:>21}"
        )
    return "\n".join(lines)
