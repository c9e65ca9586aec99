"""Where a failure epoch's state comes from and where the job resumes: the controller's part of a recovery.

Contract (pure functions of a :class:`View`, no I/O; :mod:`trainmover_ext.control.decide` applies them):
- :func:`state_source`: what a failure plan says a lost rank's state comes from (shown to operators):
  a live data-parallel replica, the holder of its optimizer-shard mirror, or the checkpoint, with why.
- :func:`decide_convergence`: once every stayer of the newest failure epoch reported what it holds,
  the one ``convergence/<e>`` record: the resume iteration and the state copies
  (:mod:`trainmover_ext.control.convergence` has the rules).
"""

from __future__ import annotations

from typing import Any

from trainmover_ext.control.actions import Action, CommitConvergence
from trainmover_ext.control.convergence import plan_convergence, plan_mirror_convergence
from trainmover_ext.control.records import ConvergenceRecord, RankRecord
from trainmover_ext.control.view import View


def state_source(view: View, rec: RankRecord, failed: set[int]) -> dict[str, Any]:
    """Where the plan expects the lost state to come from (shown to operators); which replica sends
    it, and whether the job must go back to the checkpoint after all, is the convergence decision."""

    def live(q: int) -> bool:
        return q not in failed and q in view.ranks and view.ranks[q].member_id in view.members

    if any(live(q) for q in rec.replicas):
        return {"kind": "replica"}
    if rec.holder is not None and rec.holder != rec.rank:
        holder = view.ranks.get(rec.holder)
        # A holder that joined in the recovery still under way has received no copy yet.
        fresh = holder is not None and holder.since_epoch == view.epoch and recovery_under_way(view)
        if live(rec.holder) and not fresh:
            return {"kind": "mirror", "rank": rec.holder}
        return {
            "kind": "checkpoint",
            "iteration": view.checkpoint_iteration,
            "why": f"the holder of rank {rec.rank}'s optimizer-shard mirror, rank {rec.holder}, is lost too"
            + (" (its replacement holds no copy yet)" if fresh else ""),
        }
    return {"kind": "checkpoint", "iteration": view.checkpoint_iteration}


def recovery_under_way(view: View) -> bool:
    plan = view.last_plan
    return (
        plan is not None and plan.reason == "failure" and plan.epoch == view.epoch and plan.epoch not in view.converged
    )


def decide_convergence(view: View, now: float, decided_by: str) -> list[Action]:
    """The resume point of the newest failure epoch, once every stayer reported (see the module doc)."""
    if not recovery_under_way(view) or not view.ranks:
        return []  # no rank record is readable (garbage, reported in view.malformed): nothing to resume yet
    plan = view.last_plan
    assert plan is not None  # recovery_under_way checked it
    joiners = {r.rank for r in plan.replacement_list()}
    reported = view.recovery.get(plan.epoch, {})
    stayers = set(view.ranks) - joiners
    if not stayers <= set(reported):
        return []  # still waiting; a stayer that dies meanwhile is a new failure (a newer plan)
    # A stayer whose state is unusable (a copy into it was cut short by this epoch) needs a copy
    # like a joiner.
    holding = {r: it for r in stayers if (it := reported[r]) is not None}
    holders = {r: rec.holder for r, rec in view.ranks.items() if rec.holder is not None}
    if holders and len(holders) == len(view.ranks):  # the distributed optimizer's mirror
        live = {r: held for r, held in view.mirrors.get(plan.epoch, {}).items() if r in holding}
        shards = {r: s for r, s in view.shards.get(plan.epoch, {}).items() if r in holding}
        staged = {r: s for r, s in view.staged.get(plan.epoch, {}).items() if r in holding}
        cplan = plan_mirror_convergence(holders, holding, shards, live, set(view.ranks) - set(holding), staged)
    else:
        rings = {r: sorted({r, *rec.replicas}) for r, rec in view.ranks.items()}
        cplan = plan_convergence(rings, holding, set(view.ranks) - set(holding))
    record = ConvergenceRecord(
        epoch=plan.epoch,
        resume_iteration=cplan.resume_iteration,
        copies=[list(pair) for pair in cplan.copies],
        from_checkpoint=cplan.from_checkpoint,
        mirror=cplan.mirror,
        reason=cplan.reason,
        decided_at=now,
        decided_by=decided_by,
    )
    return [
        CommitConvergence(
            record=record, expected_epoch_rev=view.epoch_rev, consumed=tuple(view.recovery_keys.get(plan.epoch, []))
        )
    ]
