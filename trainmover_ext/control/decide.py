"""Pure decision functions of the controller: ``decide(view, now) -> [actions]``.

Contract: no I/O, no clock, no randomness; the same view and ``now`` give the
same actions. The executor (:mod:`trainmover_ext.control.executor`) applies them
with compare-and-swap; if the epoch moved meanwhile, nothing is applied and the
controller decides again from a fresh view. Decisions are level-triggered: they
depend only on what etcd holds, so a new leader re-derives whatever an old one
did not commit, and never repeats what it did commit.

Cases:
- **rank orphaned**: ``ranks/<r>`` names a member whose key is gone (lease
  expired: SIGSTOP, hang, machine loss) -> migrate r.
- **member dead**: a fresh report says r's link broke (SIGKILL, crash) -> migrate r
  without waiting for the lease.
- **stale report**: the report names a member that no longer serves r -> drop it.
- **leaver lost mid-move**: the leaver of the current planned move dies (report)
  or loses its lease before it handed its state over -> a failure plan for r
  whose joiner is the planned joiner (it already serves r in ``ranks/<r>``);
  the state then comes from a data-parallel replica or the checkpoint.
- **joiner lost mid-move**: the joiner of the current planned move dies before
  the hand-over (``ranks/<r>`` names it, while the leaver still trains r) -> a
  failure plan for r whose leaver is the planned leaver (its agent fences it:
  it must not serve r beside the new joiner) and whose joiner is another
  standby; the state comes from a replica or the checkpoint.
- **failure during a recovery**: a newer plan supersedes the recovery under
  way; the ranks restart recovery at the newest epoch (a stayer whose state a
  cut-short copy spoiled reports ``None`` and receives a copy like a joiner).
- **two failures at once**: one plan replaces every failed rank (one epoch step).
- **suspicion**: a rank whose link to r broke reports r as a suspect (``suspect`` in
  its report). That alone replaces nothing: r's agent reports r's exit itself. The
  controller probes r's node instead (``probes/<host>``, :class:`ProbeHost`); an agent
  that does not answer within ``View.probe_s`` died with its machine, and its node is
  lost (below) without waiting for the agent's lease. An answered probe settles the
  suspicions it consumed; a hung rank is then found by its lease.
- **node lost**: a node (``nodes/<host>``) whose agent is no member any more and one
  of whose ranks failed or is suspected, or whose agent left a probe unanswered, lost
  every rank it ran: one plan replaces them all,
  preferably with the free slots of one standby machine, each rank in the slot of
  its own local rank (a tensor-parallel group that shared a node shares one
  again); the standbys of a lost node are never chosen. A rank whose lease
  expired while its node's agent still looks alive waits ``View.rejoin_s``
  first: a live rank registers again, a dead, frozen or stalled one is reported
  by its agent, and the agent's lease may be about to expire too. Once one such
  wait is over, every rank of that node whose lease lapsed as well joins the same
  plan.
- **etcd stalled**: the controller's own lease lapsed within ``View.rejoin_s``
  although it runs: every lapse of that moment is etcd's (a pause longer than the
  TTL, a disk stall), so lapsed leases and lapsed agents replace nothing until
  the members had ``View.rejoin_s`` to register again. Reports (a process exit,
  a hang its agent saw) and unanswered probes still act at once. When no machine has
  enough free slots, each rank takes any free standby and the plan's
  ``placement`` says so.
- **placement of one rank**: a standby on another host than the leaver, then one
  that kept the rank's model, one done warming, one on a machine already partly
  in use (whole machines stay free for whole nodes), the slot of the rank's own
  local rank.
- **no standby left**: the rank is listed in ``unserved`` and an alert is raised
  once per (rank, member); it is planned as soon as a standby registers.
- **convergence**: once every stayer of the newest failure epoch reported what
  it holds (``recovery/<e>/<r>``), the controller commits where every rank
  resumes and which state copies bring it there (``convergence/<e>``,
  :mod:`~trainmover_ext.control.convergence`). Ranks never decide this
  themselves, and each waits on that one key.
- **planned request**: handled only when nothing has failed and no recovery is
  under way; the leaver is the state source. An unknown rank or an unusable
  ``--to`` standby is rejected.
- **drain**: a request for a node (``trainmover drain``) moves every rank it serves in one
  planned epoch, each leaver the state source of its rank, to one standby machine (slots as
  for a lost node); rejected when no machine has that many idle warm standbys.
- **switch point**: once a planned move's joiner is ready and its leaver said so
  at a boundary (``leaver_at``), the controller commits the boundary where the
  leaver hands over and the stayers switch (``switch_at`` in the plan): two
  boundaries on, so the leaver trains on while the controller decides.
- **epoch race / malformed epoch**: an unreadable epoch, or one behind the newest
  ``migrations/<e>`` key (rolled back by hand: a plan for it + 1 would reopen a
  planned epoch), is repaired from the newest plan (each plan opened one epoch,
  and its key says which even when its value is unreadable) and nothing else is
  decided in that round; a lost race is the executor's CAS returning False. At
  ``MAX_EPOCH`` (only a forged epoch gets there) no further plan is opened.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainmover_ext.control.actions import (
    Action,
    CommitConvergence,
    CommitSwitchPoint,
    DropStaleReport,
    PlanMigration,
    RaiseAlert,
    RejectRequest,
    RepairEpoch,
)
from trainmover_ext.control.lapses import etcd_stalled, lapse_waits
from trainmover_ext.control.placement import (
    available_standbys,
    lost_hosts,
    machine_for,
    pick_standby,
    slot_or,
)
from trainmover_ext.control.probes import node_lost, suspicions, unresponsive_hosts
from trainmover_ext.control.records import (
    MAX_EPOCH,
    Alert,
    FailureReport,
    MigrationPlan,
    MigrationRequest,
    RankRecord,
    Replacement,
)
from trainmover_ext.control.resume import decide_convergence, recovery_under_way, state_source
from trainmover_ext.control.view import View

__all__ = [  # the actions are re-exported: callers take them with the function that returns them
    "Action",
    "CommitConvergence",
    "CommitSwitchPoint",
    "DropStaleReport",
    "PlanMigration",
    "RaiseAlert",
    "RejectRequest",
    "RepairEpoch",
    "decide",
]


@dataclass(kw_only=True)
class _Failure:
    rank: RankRecord
    reason: str
    detected_at: float | None
    consumed: list[str] = field(default_factory=list)
    keep_joiner: str | None = None
    """The joiner of an unfinished planned move whose leaver failed: it stays the rank's joiner."""


def _handover_pending(view: View) -> dict[int, Replacement]:
    """The moves of the current epoch's planned plan (one rank, or every rank of a drained node) whose
    leaver has not handed its state over, by rank."""
    plan = view.last_plan
    if plan is None or plan.reason != "planned" or plan.epoch != view.epoch:
        return {}
    # A move whose joiner is its leaver moves nothing (only a forged plan says so): its leaver's failure
    # is a plain failure of the rank.
    return {
        r.rank: r
        for r in plan.replacement_list()
        if r.joiner != r.leaver
        and not plan.rank_done("handed_over", r.rank)
        and not plan.rank_done("transferred", r.rank)
    }


def _lost_joiner(moving: dict[int, Replacement], rec: RankRecord, view: View, reason: str) -> tuple[RankRecord, str]:
    """The rank record a failure of ``rec``'s member (for ``reason``) replaces, and the failure's reason.

    The joiner of a planned move that dies before the hand-over already serves r in ``ranks/<r>``
    while the leaver still trains r: the failure plan names the leaver as the one that leaves, so that
    it stops (it finds itself replaced) and never serves r beside the standby that now takes it."""
    move = moving.get(rec.rank)
    if move is None or rec.member_id != move.joiner or move.leaver not in view.members:
        return rec, reason
    return dataclasses.replace(rec, member_id=move.leaver), f"the joiner of a planned move was lost: {reason}"


def _failures(view: View, now: float) -> tuple[list[_Failure], list[Action]]:
    failed: dict[int, _Failure] = {}
    actions: list[Action] = []
    rec: RankRecord | None
    moving = _handover_pending(view)
    stalled = etcd_stalled(view, now)
    lost = set(view.unresponsive) if stalled else lost_hosts(view)
    for r, rec in sorted(view.ranks.items()):
        if r in view.finished:
            continue  # its worker completed training and left: nothing to replace
        if rec.member_id not in view.members and not stalled and not lapse_waits(view, rec, now, lost):
            leaving, why = _lost_joiner(moving, rec, view, "lease expired")
            failed[r] = _Failure(rank=leaving, reason=why, detected_at=view.gone_at.get(rec.member_id))
    # Lapses on one host are decided together: once one rank's wait is over, every rank of that host whose
    # lease lapsed too joins the same plan (each waiting out its own clock would split one node's loss).
    lapsed_hosts = {f.rank.host for f in failed.values()}
    for r, rec in sorted(view.ranks.items()):
        lapsed_beside = rec.host in lapsed_hosts and rec.member_id not in view.members
        if lapsed_beside and r not in failed and r not in view.finished:
            leaving, why = _lost_joiner(moving, rec, view, "lease expired")
            failed[r] = _Failure(rank=leaving, reason=why, detected_at=view.gone_at.get(rec.member_id))
    # The leaver of a planned move still holds the rank's only copy of its state until the hand-over:
    # losing it then is a failure of the rank, whose joiner (named in ranks/<r> already) stays.
    leaver_lost: dict[int, _Failure] = {}
    for move in moving.values():
        rec = view.ranks.get(move.rank)
        if rec is not None and move.rank not in view.finished and rec.member_id == move.joiner:
            leaver_lost[move.rank] = _Failure(
                rank=dataclasses.replace(rec, member_id=move.leaver),
                reason="the leaver of a planned move was lost before its hand-over",
                detected_at=view.gone_at.get(move.leaver),
                keep_joiner=move.joiner,
            )
            if move.leaver not in view.members and not stalled:
                failed.setdefault(move.rank, leaver_lost[move.rank])
    suspects: dict[str, list[tuple[str, FailureReport]]] = {}
    for key, rep in sorted(view.reports.items()):
        rec = view.ranks.get(rep.rank)
        if rep.rank in leaver_lost and rep.member_id == moving[rep.rank].leaver and not rep.suspect:
            f = failed.setdefault(rep.rank, leaver_lost[rep.rank])
            f.consumed.append(key)
            if f.detected_at is None or rep.reported_at < f.detected_at:
                f.detected_at = rep.reported_at
            continue
        if rec is None or rec.member_id != rep.member_id or rep.rank in view.finished:
            actions.append(DropStaleReport(key=key, reason=f"rank {rep.rank} is no longer served by {rep.member_id}"))
            continue
        if rep.suspect:
            suspects.setdefault(rec.host, []).append((key, rep))
            continue
        leaving, why = _lost_joiner(moving, rec, view, f"link broken: {rep.reason}")
        f = failed.setdefault(rep.rank, _Failure(rank=leaving, reason=why, detected_at=rep.reported_at))
        f.consumed.append(key)
        if f.detected_at is None or rep.reported_at < f.detected_at:
            f.detected_at = rep.reported_at
    # A lost node took every rank it ran, whether or not their own leases have expired yet. An agent
    # whose lease lapsed while its ranks all live (a stall) loses nothing, even where a peer suspects
    # one of them (a neighbour that cut its links looks like a closed connection); one that left a
    # probe unanswered was probed because a rank of its node was suspected.
    for host in sorted((lost & {f.rank.host for f in failed.values()}) | view.unresponsive):
        why, detected = node_lost(view, host)
        for r, rec in sorted(view.ranks.items()):
            if rec.host == host and r not in failed and r not in view.finished:
                failed[r] = _Failure(rank=rec, reason=why, detected_at=detected)
    probes, consumed = suspicions(view, now, suspects, set(failed))
    for r, keys in consumed.items():
        failed[r].consumed += keys
    return [failed[r] for r in sorted(failed)], actions + probes


def _place_lost_nodes(view: View, failures: list[_Failure], taken: set[str]) -> tuple[dict[int, str], list[str]]:
    """Joiners for the ranks of each lost node with two or more failed ranks (one machine each, where one
    is free), and the placement notes of the plan."""
    picks: dict[int, str] = {}
    notes: list[str] = []
    lost = lost_hosts(view)
    for host in sorted(lost):
        ranks = [f.rank for f in failures if f.rank.host == host and f.keep_joiner is None]
        if len(ranks) < 2:
            continue
        found = machine_for(view, ranks, available_standbys(view, taken))
        if found is None:
            notes.append(
                f"node {host} lost {len(ranks)} ranks and no machine has {len(ranks)} free standbys warm for "
                "them: each rank takes any free standby (a tensor-parallel group may now span nodes)"
            )
            continue
        pick, kept = found
        picks.update(pick)
        taken.update(pick.values())
        machine = view.members[next(iter(pick.values()))].host
        notes.append(f"node {host} lost {len(ranks)} ranks: all to machine {machine} ({kept} in their own slot)")
    return picks, notes


def _plan_failures(view: View, now: float, failures: list[_Failure], decided_by: str) -> list[Action]:
    assert view.epoch is not None
    if view.epoch >= MAX_EPOCH:
        return []  # no migrations/<e> key is left for the next epoch
    failed_ranks = {f.rank.rank for f in failures}
    taken: set[str] = set()
    replacements: list[Replacement] = []
    updates: list[RankRecord] = []
    consumed: list[str] = []
    unserved: list[_Failure] = []
    machine, placement = _place_lost_nodes(view, failures, taken)
    for f in failures:
        joiner = (
            f.keep_joiner or machine.get(f.rank.rank) or pick_standby(view, available_standbys(view, taken), f.rank)
        )
        if joiner is None:
            unserved.append(f)
            continue
        taken.add(joiner)
        local_rank = slot_or(view.members[joiner], f.rank.local_rank) if joiner in view.members else f.rank.local_rank
        replacements.append(
            Replacement(
                rank=f.rank.rank,
                leaver=f.rank.member_id,
                joiner=joiner,
                role=f.rank.role,
                state_source=state_source(view, f.rank, failed_ranks),
                local_rank=local_rank,
            )
        )
        host = view.members[joiner].host if joiner in view.members else view.ranks[f.rank.rank].host
        updates.append(
            dataclasses.replace(f.rank, member_id=joiner, host=host, since_epoch=view.epoch + 1, local_rank=local_rank)
        )
        consumed += f.consumed
        if f.rank.rank in view.alerts:
            consumed.append(_alert_key(view, f.rank.rank))
    actions: list[Action] = []
    for f in unserved:
        old = view.alerts.get(f.rank.rank)
        if old is None or old.member_id != f.rank.member_id:
            actions.append(
                RaiseAlert(
                    alert=Alert(
                        rank=f.rank.rank,
                        member_id=f.rank.member_id,
                        epoch=view.epoch,
                        raised_at=now,
                        reason=f"{f.reason}; no warm standby with role {f.rank.role!r} is left: start one "
                        "(`trainmover launch --tm-role standby`) or restart the job from its checkpoint",
                    )
                )
            )
    if not replacements:
        return actions
    # Known now only when the checkpoint pulls every rank back; otherwise the convergence decision
    # names it once the stayers reported.
    resume = view.checkpoint_iteration if any(r.state_source["kind"] == "checkpoint" for r in replacements) else None
    detected = [
        f.detected_at for f in failures if f.detected_at is not None and f.rank.rank in {r.rank for r in replacements}
    ]
    detected_at = min(detected) if detected else now
    plan = MigrationPlan(
        epoch=view.epoch + 1,
        reason="failure",
        replacements=[dataclasses.asdict(r) for r in replacements],
        resume_iteration=resume,
        unserved=[f.rank.rank for f in unserved],
        placement=placement,
        detected_at=detected_at,
        decided_at=now,
        decided_by=decided_by,
        steps={"detected": detected_at, "decided": now},
    )
    # Reports of an epoch this plan supersedes are moot: the stayers report again for the new one.
    consumed += [k for e, keys in view.recovery_keys.items() if e <= view.epoch for k in keys]
    actions.append(
        PlanMigration(
            plan=plan,
            expected_epoch=view.epoch,
            expected_epoch_rev=view.epoch_rev,
            rank_updates=tuple(updates),
            consumed=tuple(consumed),
            why=tuple((f.rank.rank, f.reason) for f in failures if f not in unserved),
        )
    )
    return actions


def _decide_switch_point(view: View) -> list[Action]:
    """The planned move's switch point, once its joiner is ready and its leaver said so at boundary b
    (``leaver_at``): b + 2, or the last boundary if that comes first. The leaver trains iteration b + 1
    meanwhile and waits at boundary b + 1 until the point is known, so no rank can complete iteration
    b + 2 before it, and each reads the point at boundary b + 2 at the latest (at the last boundary
    everyone waits for it). A leaver that said so at the last boundary waits there: that one."""
    plan = view.last_plan
    if (
        plan is None
        or plan.reason != "planned"
        or plan.epoch != view.epoch
        or plan.switch_at is not None
        or plan.leaver_at is None
        or "ready" not in plan.steps
    ):
        return []
    last = plan.last_boundary if plan.last_boundary is not None else plan.leaver_at
    return [
        CommitSwitchPoint(
            epoch=plan.epoch,
            switch_at=min(plan.leaver_at + 2, max(last, plan.leaver_at)),
            expected_plan_rev=view.last_plan_rev,
        )
    ]


def _alert_key(view: View, rank: int) -> str:
    return f"{view.root}alerts/{rank}"


def _plan_request(view: View, now: float, decided_by: str) -> list[Action]:
    assert view.epoch is not None
    if view.epoch >= MAX_EPOCH:
        return []  # no migrations/<e> key is left for the next epoch
    actions: list[Action] = []
    for key, req in sorted(view.requests.items(), key=lambda kv: (kv[1].requested_at, kv[0])):
        if view.finished:  # a planned move needs every rank at a later boundary: there is none
            actions.append(
                RejectRequest(
                    key=key,
                    request_id=req.request_id,
                    reason=f"the job is finishing: ranks {sorted(view.finished)} completed their last iteration",
                )
            )
            continue
        if req.node is not None:
            action = _plan_drain(view, now, key, req, decided_by)
            actions.append(action)
            if isinstance(action, PlanMigration):
                break  # at most one migration per epoch
            continue
        rec = view.ranks.get(req.rank)
        if rec is None:
            actions.append(RejectRequest(key=key, request_id=req.request_id, reason=f"rank {req.rank} does not exist"))
            continue
        standbys = available_standbys(view, set())
        if req.to is not None:
            if req.to not in standbys:
                actions.append(
                    RejectRequest(
                        key=key,
                        request_id=req.request_id,
                        reason=f"{req.to} is not an idle standby (see `trainmover status`)",
                    )
                )
                continue
            if rec.role not in view.members[req.to].warm_roles:
                actions.append(
                    RejectRequest(
                        key=key, request_id=req.request_id, reason=f"{req.to} has not warmed role {rec.role!r}"
                    )
                )
                continue
            joiner: str | None = req.to
        else:
            joiner = pick_standby(view, standbys, rec)
        if joiner is None:
            actions.append(
                RejectRequest(
                    key=key,
                    request_id=req.request_id,
                    reason=f"no idle standby has warmed role {rec.role!r}; start one and retry",
                )
            )
            continue
        rep = Replacement(
            rank=rec.rank,
            leaver=rec.member_id,
            joiner=joiner,
            role=rec.role,
            state_source={"kind": "leaver", "member": rec.member_id},
            local_rank=slot_or(view.members[joiner], rec.local_rank),
        )
        plan = MigrationPlan(
            epoch=view.epoch + 1,
            reason="planned",
            replacements=[dataclasses.asdict(rep)],
            resume_iteration=None,
            detected_at=req.requested_at,
            decided_at=now,
            decided_by=decided_by,
            steps={"requested": req.requested_at, "decided": now},
        )
        actions.append(
            PlanMigration(
                plan=plan,
                expected_epoch=view.epoch,
                expected_epoch_rev=view.epoch_rev,
                rank_updates=(
                    dataclasses.replace(
                        rec,
                        member_id=joiner,
                        host=view.members[joiner].host,
                        since_epoch=view.epoch + 1,
                        local_rank=rep.local_rank,
                    ),
                ),
                consumed=(key,),
            )
        )
        break  # at most one migration per epoch; the next request waits for the next round
    return actions


def _plan_drain(view: View, now: float, key: str, req: MigrationRequest, decided_by: str) -> Action:
    """A drain of node ``req.node``: one planned epoch moves every rank it serves to one standby machine,
    each into the slot of its own local rank where it can; rejected when no machine has room."""
    assert view.epoch is not None and req.node is not None
    node = req.node
    ranks = [rec for r, rec in sorted(view.ranks.items()) if rec.host == node and r not in view.finished]
    if not ranks:
        known = ", ".join(sorted({rec.host for rec in view.ranks.values()})) or "none"
        return RejectRequest(
            key=key, request_id=req.request_id, reason=f"node {node!r} serves no rank (nodes with ranks: {known})"
        )
    free = [c for c in available_standbys(view, set()) if view.members[c].host != node]
    found = machine_for(view, ranks, free)
    if found is None:
        return RejectRequest(
            key=key,
            request_id=req.request_id,
            reason=f"no machine has {len(ranks)} idle standbys warm for the ranks of node {node!r}: start a standby "
            "machine (`trainmover launch --tm-role standby --nproc-per-node N ...`) and retry",
        )
    pick, kept = found
    reps = [
        Replacement(
            rank=rec.rank,
            leaver=rec.member_id,
            joiner=pick[rec.rank],
            role=rec.role,
            state_source={"kind": "leaver", "member": rec.member_id},
            local_rank=slot_or(view.members[pick[rec.rank]], rec.local_rank),
        )
        for rec in ranks
    ]
    machine = view.members[reps[0].joiner].host
    plan = MigrationPlan(
        epoch=view.epoch + 1,
        reason="planned",
        replacements=[dataclasses.asdict(r) for r in reps],
        resume_iteration=None,
        drain=node,
        placement=[f"drain of node {node}: all {len(reps)} ranks to machine {machine} ({kept} in their own slot)"],
        detected_at=req.requested_at,
        decided_at=now,
        decided_by=decided_by,
        steps={"requested": req.requested_at, "decided": now},
    )
    return PlanMigration(
        plan=plan,
        expected_epoch=view.epoch,
        expected_epoch_rev=view.epoch_rev,
        rank_updates=tuple(
            dataclasses.replace(
                rec,
                member_id=rep.joiner,
                host=machine,
                since_epoch=view.epoch + 1,
                local_rank=rep.local_rank,
            )
            for rec, rep in zip(ranks, reps, strict=True)
        ),
        consumed=(key,),
    )


def decide(view: View, now: float, *, decided_by: str = "") -> list[Action]:
    """The actions that move the job toward a healthy membership (see the module docstring)."""
    # Every epoch was opened by a plan: the newest plan's epoch is the true one.
    newest = max(view.newest_plan_epoch, view.last_plan.epoch if view.last_plan is not None else 0)
    if view.epoch is None:
        key = f"{view.root}epoch"
        if key in view.malformed and view.epoch_rev:
            return [RepairEpoch(epoch=newest, expected_epoch_rev=view.epoch_rev, garbage=view.malformed[key][:200])]
        return []
    if view.epoch < newest:
        return [
            RepairEpoch(
                epoch=newest,
                expected_epoch_rev=view.epoch_rev,
                garbage=f"epoch {view.epoch}, behind the plan of epoch {newest}",
            )
        ]
    view = dataclasses.replace(view, unresponsive=unresponsive_hosts(view, now))
    failures, actions = _failures(view, now)
    if failures:
        return actions + _plan_failures(view, now, failures, decided_by)
    if recovery_under_way(view):
        return actions + decide_convergence(view, now, decided_by)
    switch = _decide_switch_point(view)
    if switch:
        return actions + switch
    return actions + _plan_request(view, now, decided_by)
