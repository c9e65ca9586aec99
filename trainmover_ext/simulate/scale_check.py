"""Membership-scale check: what one migration touches in a job of 1,000+ logical ranks.

Contract: :func:`run_scale_check` builds a whole job in one process, with the REAL
control plane: :class:`~trainmover_ext.kv.memory.MemoryKV` (the in-memory etcd
fake), :class:`~trainmover_ext.kv.job.JobSpace`, ``init_job``, one
:class:`~trainmover_ext.control.membership.DecisionWatcher` per rank, the pure
``decide(view, now)`` and the CAS :class:`~trainmover_ext.control.executor.Executor`.
It then kills one rank (its lease is revoked, as when a machine dies) and, in a
second round, requests a planned move of another rank, and counts:

- store transactions and keys written to commit each decision (expected O(1));
- plan notifications: every rank's watcher hears of the new epoch once (O(N) small
  watch events: a synchronous job must pause everywhere, and etcd fans them out);
- ranks that act and links replaced: only the leaver's ring neighbours in each of its
  TP, DP and PP groups (O(neighbours)), against every link of the job for a global rebuild.

Links follow the delta communicator's rule (``nccl_delta.group.DeltaGroup.ring_peers``:
two ring neighbours per group); they are derived from the logical layout here so the
check needs no torch. Phase-1 link rendezvous keys (``links/<epoch>/<group>/<a>-<b>``)
are written as ARCHITECTURE.md lays them out; the migration layer that writes them in
production is not part of this check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainmover_ext.control.decide import PlanMigration, decide
from trainmover_ext.control.executor import Executor, Outcome
from trainmover_ext.control.membership import DecisionWatcher, init_job, request_migration
from trainmover_ext.control.records import ROLES, MemberRecord, RankRecord
from trainmover_ext.control.view import read_view
from trainmover_ext.errors import ConfigError
from trainmover_ext.kv.base import Put
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

    def get_prefix(self, prefix: str):
        snap = super().get_prefix(prefix)
        self.keys_read += len(snap.entries)
        return snap


def layout_groups(ranks: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Megatron's default order (TP fastest, then DP, then PP): the TP, DP and PP groups."""
    if tp < 1 or pp < 1 or ranks % (tp * pp):
        raise ConfigError(f"--scale-check: {ranks} ranks is not a multiple of TP {tp} x PP {pp}")
    dp = ranks // (tp * pp)

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    return {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def ring_neighbours(members: list[int], rank: int) -> list[int]:
    """The ring neighbours of ``rank`` in a group (same rule as ``DeltaGroup.ring_peers``)."""
    if len(members) == 1 or rank not in members:
        return []
    i = members.index(rank)
    return sorted({members[(i + 1) % len(members)], members[(i - 1) % len(members)]})


def ring_links(members: list[int]) -> set[tuple[int, int]]:
    """Every link of one group's ring, as ordered pairs."""
    return {(min(a, b), max(a, b)) for a in members for b in ring_neighbours(members, a)}


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
    links_replaced: int
    links_by_group: dict[str, int] = field(default_factory=dict)


@dataclass
class ScaleCheckResult:
    """Counts for one job size; ``to_json`` gives the ``scale_check`` JSON block."""

    ranks: int
    tp: int
    pp: int
    dp: int
    links_total: int
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
    dp = ranks // (tp * pp)
    kv = CountingKV()
    space = JobSpace.create(kv, "scale-check")
    dp_peers = {r: g for g in groups["dp"] for r in g}
    records = []
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * p)
                records.append(RankRecord(rank=r, member_id=f"w{r}", host=f"node{r // 8}", role=_role(p, pp),
                                          replicas=[q for q in dp_peers[r] if q != r]))
    init_job(space, records)
    leases = {}
    for rec in records:
        leases[rec.member_id] = kv.grant_lease(10)
        member = MemberRecord(member_id=rec.member_id, kind="worker", host=rec.host, pid=rec.rank)
        space.put(space.key("members", rec.member_id), member.to_bytes(), lease=leases[rec.member_id])
    for i in range(standbys):
        sb = MemberRecord(member_id=f"s{i}", kind="standby", host=f"spare{i}", pid=i, warm_roles=list(ROLES),
                          registered_at=float(i))
        space.put(space.key("members", sb.member_id), sb.to_bytes(), lease=kv.grant_lease(10))
    heard: list[int] = []
    watchers = [DecisionWatcher(space, on_plan=lambda plan, r=r: heard.append(r)) for r in range(ranks)]
    all_links = {name: [ring_links(g) for g in gs] for name, gs in groups.items()}
    links_total = sum(len(links) for per_group in all_links.values() for links in per_group)
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
            by_group: dict[str, int] = {}
            neighbours: set[int] = set()
            link_puts = []
            for name, gs in groups.items():
                for index, members in enumerate(gs):
                    if rank in members:
                        peers = ring_neighbours(members, rank)
                        by_group[name] = len(peers)
                        neighbours.update(peers)
                        link_puts += [Put(space.key("links", epoch, f"{name}{index}", f"{min(rank, q)}-{max(rank, q)}"), b"{}")
                                      for q in peers]
            if committed and link_puts:
                space.commit([], link_puts)  # phase 1: the joiner's link rendezvous, one txn
            migrations.append(MigrationCount(
                kind=kind, rank=rank, decided=committed,
                store_transactions=kv.transactions - tx0,
                store_keys_written=kv.keys_written - keys0,
                controller_keys_read=read, plan_notifications=len(heard) - heard0,
                ranks_acting=len(neighbours), links_replaced=sum(by_group.values()), links_by_group=by_group,
            ))
    finally:
        for w in watchers:
            w.close()
    return ScaleCheckResult(ranks=ranks, tp=tp, pp=pp, dp=dp, links_total=links_total, migrations=migrations)


def format_result(result: ScaleCheckResult) -> str:
    """A short table of the counts."""
    lines = [
        f"Membership-scale check: {result.ranks:,} logical ranks (TP{result.tp} x DP{result.dp} x PP{result.pp}), "
        f"real decide() + executor on the in-memory etcd fake; {result.links_total:,} links in the job",
        f"{'migration':<11} {'rank':>5} {'txns':>5} {'keys written':>13} {'ctl keys read':>14} "
        f"{'plan notices':>13} {'ranks acting':>13} {'links replaced':>15}",
    ]
    for m in result.migrations:
        lines.append(
            f"{m.kind:<11} {m.rank:>5} {m.store_transactions:>5} {m.store_keys_written:>13} {m.controller_keys_read:>14,} "
            f"{m.plan_notifications:>13,} {m.ranks_acting:>13} {m.links_replaced:>15}"
            + ("" if m.decided else "  (NOT decided)")
        )
    return "\n".join(lines)
