"""Unit tests of the pure decision functions, and of the executor against the in-memory fake."""

from __future__ import annotations

import pytest

from trainmover_ext.control.decide import (
    CommitConvergence,
    CommitSwitchPoint,
    DropStaleReport,
    PlanMigration,
    RaiseAlert,
    RejectRequest,
    decide,
)
from trainmover_ext.control.executor import Executor, Outcome
from trainmover_ext.control.records import FailureReport, MemberRecord, MigrationPlan, MigrationRequest, RankRecord
from trainmover_ext.control.view import View, epoch_value, read_view
from trainmover_ext.errors import LeadershipLost
from trainmover_ext.kv import Guard, MemoryKV
from trainmover_ext.kv.job import JobSpace

ROOT = "/trainmover/j/"
ALL = ["first", "middle", "last"]


def member(mid, kind="worker", host="h1", roles=(), t=0.0):
    return MemberRecord(member_id=mid, kind=kind, host=host, pid=1, warm_roles=list(roles), registered_at=t)


def base_view(**kw) -> View:
    """4 ranks: PP2 x DP2; ranks 0,1 are first-stage DP replicas, 2,3 last-stage replicas."""
    v = View(root=ROOT, epoch=3, epoch_rev=42)
    for r in range(4):
        v.members[f"w{r}"] = member(f"w{r}", host=f"h{r // 2}")
        v.ranks[r] = RankRecord(
            rank=r, member_id=f"w{r}", host=f"h{r // 2}", role="first" if r < 2 else "last", replicas=[r ^ 1]
        )
    v.members["s1"] = member("s1", "standby", host="h0", roles=ALL, t=1)
    v.members["s2"] = member("s2", "standby", host="h9", roles=ALL, t=2)
    v.checkpoint_iteration = 5
    for k, val in kw.items():
        setattr(v, k, val)
    return v


def only(actions, cls):
    found = [a for a in actions if isinstance(a, cls)]
    assert len(found) == 1, actions
    return found[0]


def report(rank, mid, t=100.0, by="w9", epoch=3):
    return FailureReport(
        rank=rank, member_id=mid, reporter=by, reason="Connection closed by peer", epoch=epoch, reported_at=t
    )


def test_healthy_job_decides_nothing():
    assert decide(base_view(), 200.0) == []


def test_rank_orphaned_by_lease_expiry_is_planned_with_replica_source():
    v = base_view()
    del v.members["w1"]  # lease expired (SIGSTOP)
    act = only(decide(v, 200.0), PlanMigration)
    assert act.expected_epoch == 3 and act.expected_epoch_rev == 42
    plan = act.plan
    assert plan.epoch == 4 and plan.reason == "failure"
    (rep,) = plan.replacement_list()
    # w1 lived on h0; s2 on h9 is preferred over s1 on the same host.
    assert (rep.rank, rep.leaver, rep.joiner, rep.role) == (1, "w1", "s2", "first")
    assert rep.state_source == {"kind": "replica"}
    assert plan.resume_iteration is None, "the convergence decision names it once the stayers reported"
    assert act.rank_updates[0].member_id == "s2" and act.rank_updates[0].since_epoch == 4
    assert act.why == ((1, "lease expired"),), "the timeline says how the loss was detected"


def test_member_dead_by_report_is_planned_before_lease_expiry():
    v = base_view(reports={ROOT + "reports/2/w3": report(2, "w2", t=99.5)})
    act = only(decide(v, 100.0), PlanMigration)
    assert act.plan.replacement_list()[0].leaver == "w2"
    assert act.plan.detected_at == 99.5 and act.plan.steps["decided"] == 100.0
    assert act.consumed == (ROOT + "reports/2/w3",)
    ((rank, why),) = act.why
    assert rank == 2 and why.startswith("link broken: "), why


def test_stale_report_is_dropped_without_a_plan():
    # Rank 2 was already migrated to s9; a late report about its old member w2 must not trigger anything.
    v = base_view(reports={ROOT + "reports/2/w3": report(2, "w2")})
    v.members["s9"] = member("s9", "standby", roles=ALL)
    v.ranks[2] = RankRecord(rank=2, member_id="s9", role="last", replicas=[3], since_epoch=3)
    del v.members["w2"]
    actions = decide(v, 200.0)
    assert [type(a) for a in actions] == [DropStaleReport]


def test_two_failures_at_once_make_one_plan():
    v = base_view()
    del v.members["w0"], v.members["w1"]  # both replicas of the first stage: no replica left
    act = only(decide(v, 200.0), PlanMigration)
    reps = act.plan.replacement_list()
    assert [r.rank for r in reps] == [0, 1] and {r.joiner for r in reps} == {"s1", "s2"}
    assert all(r.state_source == {"kind": "checkpoint", "iteration": 5} for r in reps)
    assert act.plan.resume_iteration == 5, "a shard restored from the checkpoint pulls every rank back to it"


def test_no_standby_left_raises_one_alert_and_partial_plan():
    v = base_view()
    del v.members["s2"]
    del v.members["w0"], v.members["w2"]
    actions = decide(v, 200.0)
    plan = only(actions, PlanMigration).plan
    alert = only(actions, RaiseAlert).alert
    assert [r.rank for r in plan.replacement_list()] == [0] and plan.unserved == [2]
    assert alert.rank == 2 and alert.member_id == "w2" and "no warm standby" in alert.reason
    # Once the alert is recorded it is not raised again.
    # Apply the plan by hand: s1 now serves rank 0, the alert is recorded; nothing is raised again.
    v.alerts[2] = alert
    v.ranks[0] = RankRecord(rank=0, member_id="s1", host="h0", role="first", replicas=[1])
    assert decide(v, 201.0) == []
    # A standby that registers later is used for the orphaned rank, and the alert is settled.
    v.members["s3"] = member("s3", "standby", roles=ALL)
    act = only(decide(v, 202.0), PlanMigration)
    assert act.plan.replacement_list()[0].rank == 2 and ROOT + "alerts/2" in act.consumed


def test_standby_without_the_role_is_not_chosen():
    v = base_view()
    v.members["s1"].warm_roles = ["middle"]
    v.members["s2"].warm_roles = ["first"]
    del v.members["w3"]  # a "last" rank
    actions = decide(v, 200.0)
    assert not any(isinstance(a, PlanMigration) for a in actions)
    assert only(actions, RaiseAlert).alert.rank == 3


def test_standby_that_kept_the_rank_model_is_preferred_on_the_same_side():
    v = base_view()
    v.members["s3"] = member("s3", "standby", host="h9", roles=ALL, t=3)
    v.members["s3"].kept_rank = 1
    v.members["s1"].kept_rank = 1  # kept it too, but on the dead rank's host: another host still comes first
    del v.members["w1"]
    (rep,) = only(decide(v, 200.0), PlanMigration).plan.replacement_list()
    assert rep.joiner == "s3"
    # Only standbys on the dead rank's host: the one that kept rank 1 beats an older one.
    del v.members["s2"], v.members["s3"]
    v.members["s1"].kept_rank = None
    v.members["s4"] = member("s4", "standby", host="h0", roles=ALL, t=4)
    v.members["s4"].kept_rank = 1
    (rep,) = only(decide(v, 200.0), PlanMigration).plan.replacement_list()
    assert rep.joiner == "s4"


def test_a_standby_done_warming_is_preferred_and_a_warming_one_still_serves():
    v = base_view()
    v.members["s1"].host = "h9"
    v.members["s1"].warming = True  # older, but its sandbox warm-up is still running
    del v.members["w1"]
    (rep,) = only(decide(v, 200.0), PlanMigration).plan.replacement_list()
    assert rep.joiner == "s2"
    # Only warming standbys left: one of them is taken rather than leaving the rank unserved.
    v.members["s2"].warming = True
    (rep,) = only(decide(v, 200.0), PlanMigration).plan.replacement_list()
    assert rep.joiner == "s1"


def test_planned_request_uses_the_leaver_as_source():
    req = MigrationRequest(request_id="r1", rank=3, to="s1", requested_at=50.0)
    act = only(decide(base_view(requests={ROOT + "requests/r1": req}), 60.0), PlanMigration)
    rep = act.plan.replacement_list()[0]
    assert (act.plan.reason, rep.leaver, rep.joiner) == ("planned", "w3", "s1")
    assert rep.state_source == {"kind": "leaver", "member": "w3"} and act.plan.resume_iteration is None


def test_a_planned_request_is_rejected_once_a_rank_finished_training():
    """No boundary is left for a move once ranks completed their last iteration (a scheduled or straggler move
    asked for at the very end); the same request is planned while every rank trains (above)."""
    req = MigrationRequest(request_id="r1", rank=3, to="s1", requested_at=50.0)
    view = base_view(requests={ROOT + "requests/r1": req}, finished={0, 1})
    rejected = only(decide(view, 60.0), RejectRequest)
    assert "the job is finishing: ranks [0, 1] completed their last iteration" in rejected.reason


@pytest.mark.parametrize(
    "req,msg",
    [
        (MigrationRequest(request_id="r", rank=7), "does not exist"),
        (MigrationRequest(request_id="r", rank=1, to="w2"), "not an idle standby"),
    ],
)
def test_bad_requests_are_rejected(req, msg):
    act = only(decide(base_view(requests={ROOT + "requests/r": req}), 1.0), RejectRequest)
    assert msg in act.reason


def test_failures_take_precedence_over_requests():
    v = base_view(requests={ROOT + "requests/r1": MigrationRequest(request_id="r1", rank=3)})
    del v.members["w0"]
    plan = only(decide(v, 1.0), PlanMigration).plan
    assert plan.reason == "failure" and ROOT + "requests/r1" in v.requests


def test_malformed_epoch_decides_nothing():
    v = base_view(epoch=None)
    del v.members["w0"]
    assert decide(v, 1.0) == []


def test_garbage_epoch_is_repaired_from_the_newest_plan_then_decisions_resume():
    """One garbage value in ``epoch`` must not stop every decision for good."""
    kv, space = seeded_space()
    plan = MigrationPlan(epoch=3, reason="failure", replacements=[], resume_iteration=None)
    space.put(space.key("migrations", "0000000003"), plan.to_bytes())
    space.put(space.key("epoch"), b"garbage")
    space.delete(space.key("members", "w0"))
    view = read_view(space)
    assert view.epoch is None
    from trainmover_ext.control.decide import RepairEpoch

    repair = only(decide(view, 1.0), RepairEpoch)
    assert repair.epoch == 3
    assert Executor(space).apply(repair) is Outcome.APPLIED
    view = read_view(space)
    assert view.epoch == 3
    assert only(decide(view, 2.0), PlanMigration).plan.epoch == 4, "rank 0's failure is planned after the repair"


# --- executor with the fake: CAS, fencing, epoch race ---


def seeded_space():
    kv = MemoryKV()
    space = JobSpace.create(kv, "j", "tok")
    space.put(space.key("epoch"), epoch_value(3))
    v = base_view()
    for m in v.members.values():
        space.put(space.key("members", m.member_id), m.to_bytes())
    for r in v.ranks.values():
        space.put(space.key("ranks", r.rank), r.to_bytes())
    return kv, space


def test_executor_commits_and_epoch_race_commits_once():
    kv, space = seeded_space()
    space.delete(space.key("members", "w1"))
    view = read_view(space)
    a1 = only(decide(view, 10.0, decided_by="c1"), PlanMigration)
    a2 = only(decide(view, 10.5, decided_by="c2"), PlanMigration)
    assert Executor(space).apply(a1) is Outcome.APPLIED
    assert Executor(space).apply(a2) is Outcome.CONFLICT, "the second decision on the same epoch must lose the CAS"
    after = read_view(space)
    assert after.epoch == 4 and after.ranks[1].member_id == "s2"
    assert after.last_plan.decided_by == "c1"
    assert decide(after, 11.0) == [], "after the plan the rank is served: nothing left to decide"
    assert len(kv.get_prefix(space.key("migrations/")).entries) == 1


def test_deposed_leader_cannot_write():
    kv, space = seeded_space()
    space.put(space.key("leader"), b"other")
    space.delete(space.key("members", "w1"))
    act = only(decide(read_view(space), 1.0), PlanMigration)
    with pytest.raises(LeadershipLost):
        Executor(space, leader_guard=Guard.value(space.key("leader"), b"me")).apply(act)
    assert read_view(space).epoch == 3


def test_malformed_values_are_reported_and_kept():
    kv, space = seeded_space()
    space.put(space.key("members", "junk"), b"\x00not json")
    space.put(space.key("ranks", "9"), b'{"tm": "rank", "v": 99, "data": {}}')
    view = read_view(space)
    assert set(view.malformed) == {space.key("members", "junk"), space.key("ranks", "9")}
    assert "schema version 99" in view.malformed[space.key("ranks", "9")]
    assert decide(view, 1.0) == []
    assert kv.get(space.key("members", "junk")).value == b"\x00not json"


def test_plan_record_round_trips():
    plan = MigrationPlan(epoch=2, reason="failure", replacements=[], resume_iteration=3)
    assert MigrationPlan.from_bytes(plan.to_bytes(), key="k") == plan


def _after_failure(reported: dict[int, int]) -> View:
    """Epoch 4 replaced rank 1 (first stage) with s2; ``reported`` are the stayers' reports so far."""
    v = base_view(epoch=4, epoch_rev=50)
    v.members["s2"] = member("s2", "worker", host="h9")
    v.ranks[1] = RankRecord(rank=1, member_id="s2", host="h9", role="first", replicas=[0], since_epoch=4)
    del v.members["w1"]
    v.last_plan = MigrationPlan(
        epoch=4,
        reason="failure",
        resume_iteration=None,
        replacements=[
            {"rank": 1, "leaver": "w1", "joiner": "s2", "role": "first", "state_source": {"kind": "replica"}}
        ],
    )
    v.recovery = {4: dict(reported)}
    v.recovery_keys = {4: [ROOT + f"recovery/0000000004/{r}" for r in reported]}
    return v


def test_convergence_waits_for_every_stayer_then_commits_once():
    assert decide(_after_failure({0: 10, 2: 10}), 300.0) == [], "rank 3 has not reported yet"
    act = only(decide(_after_failure({0: 10, 2: 9, 3: 10}), 300.0), CommitConvergence)
    rec = act.record
    assert (rec.epoch, rec.resume_iteration, rec.from_checkpoint) == (4, 10, False)
    # the joiner takes its replica's state, and rank 2, one step behind its replica 3, is brought level
    assert sorted(map(tuple, rec.copies)) == [(0, 1), (3, 2)]
    assert act.expected_epoch_rev == 50 and len(act.consumed) == 3
    v = _after_failure({0: 10, 2: 9, 3: 10})
    v.converged = {4}
    assert decide(v, 300.0) == [], "decided already"


def test_no_planned_move_while_a_recovery_is_under_way():
    v = _after_failure({0: 10})
    v.requests = {ROOT + "requests/r1": MigrationRequest(request_id="r1", rank=2, requested_at=1.0)}
    v.members["s3"] = member("s3", "standby", host="h8", roles=ALL)
    assert not [a for a in decide(v, 300.0) if isinstance(a, (PlanMigration, RejectRequest))]


def test_convergence_falls_back_to_the_checkpoint_without_a_replica():
    v = _after_failure({0: 10, 2: 10, 3: 10})
    for r in range(4):
        v.ranks[r].replicas = []  # the distributed optimizer: every shard exists once
    rec = only(decide(v, 300.0), CommitConvergence).record
    assert rec.from_checkpoint and "no live replica" in rec.reason


def test_a_newer_failure_voids_the_reports_of_the_old_epoch():
    v = _after_failure({0: 10, 2: 10})
    del v.members["w3"]  # rank 3 dies before it reported
    act = only(decide(v, 300.0), PlanMigration)
    assert act.plan.epoch == 5
    assert set(v.recovery_keys[4]) <= set(act.consumed), "epoch 4's reports are deleted with the new plan"


def test_executor_commits_convergence_only_in_its_epoch():
    from trainmover_ext.kv.codec import encode

    kv = MemoryKV()
    space = JobSpace.create(kv, "j", "tok")
    space.put(space.key("epoch"), epoch_value(4))
    entry = kv.get(space.key("epoch"))
    v = _after_failure({0: 10, 2: 9, 3: 10})
    v.root = space.root
    v.recovery_keys = {4: [space.key("recovery", "0000000004", r) for r in (0, 2, 3)]}
    for key in v.recovery_keys[4]:
        space.put(key, encode("recovery", {"iteration": 9}))
    act = CommitConvergence(
        record=only(decide(v, 300.0), CommitConvergence).record,
        expected_epoch_rev=entry.mod_revision,
        consumed=tuple(v.recovery_keys[4]),
    )
    assert Executor(space).apply(act) is Outcome.APPLIED
    assert kv.get(space.key("convergence", "0000000004")) is not None
    assert not kv.get_prefix(space.key("recovery") + "/").entries
    assert Executor(space).apply(act) is Outcome.CONFLICT, "written once"


def test_a_stayer_whose_copy_was_cut_short_receives_one_like_a_joiner():
    """Rank 2 reports no usable state (a copy into it was cut short by this epoch): it is a copy target."""
    act = only(decide(_after_failure({0: 10, 2: None, 3: 10}), 300.0), CommitConvergence)
    assert act.record.resume_iteration == 10
    assert sorted(map(tuple, act.record.copies)) == [(0, 1), (3, 2)]


def test_a_shard_whose_holders_are_all_unusable_falls_back_to_the_checkpoint():
    rec = only(decide(_after_failure({0: None, 2: 10, 3: 10}), 300.0), CommitConvergence).record
    assert rec.from_checkpoint, "rank 0 is the only other holder of rank 1's shard, and its state is unusable"


def _moving(steps: dict) -> View:
    """Epoch 4 is a planned move of rank 1 from w1 to s1; ranks/1 names s1 already."""
    v = base_view(epoch=4, epoch_rev=50)
    v.members["s1"].kind = "worker"
    v.ranks[1] = RankRecord(rank=1, member_id="s1", host="h0", role="first", replicas=[0], since_epoch=4)
    v.last_plan = MigrationPlan(
        epoch=4,
        reason="planned",
        resume_iteration=None,
        steps=dict(steps),
        replacements=[
            {
                "rank": 1,
                "leaver": "w1",
                "joiner": "s1",
                "role": "first",
                "state_source": {"kind": "leaver", "member": "w1"},
            }
        ],
    )
    return v


@pytest.mark.parametrize("how", ["report", "lease"])
def test_the_planned_leaver_lost_before_its_hand_over_is_a_failure_of_the_rank(how):
    v = _moving({"ready": 1.0})
    if how == "report":
        v.reports = {ROOT + "reports/1/a0": report(1, "w1", t=150.0, epoch=4)}
    else:
        del v.members["w1"]
    act = only(decide(v, 200.0), PlanMigration)
    (rep,) = act.plan.replacement_list()
    assert (act.plan.epoch, act.plan.reason, rep.rank, rep.leaver, rep.joiner) == (5, "failure", 1, "w1", "s1")
    assert rep.state_source == {"kind": "replica"}, "the joiner stays and takes rank 0's copy"
    assert act.rank_updates[0].member_id == "s1" and act.rank_updates[0].since_epoch == 5


@pytest.mark.parametrize("how", ["report", "lease"])
def test_the_planned_joiner_lost_before_the_hand_over_replaces_the_leaver_too(how):
    """s1, promoted into rank 1 by the planned move, dies in phase 1 while w1 still trains rank 1: the
    failure plan names w1 as the leaver (so that its agent fences it and it stops, instead of serving
    rank 1 beside the new joiner) and another standby as the joiner, with the state from a replica."""
    v = _moving({})
    v.members["s9"] = member("s9", "standby", host="h9", roles=ALL, t=9)
    if how == "report":
        v.reports = {ROOT + "reports/1/a0": report(1, "s1", t=150.0, epoch=4)}
    del v.members["s1"]
    act = only(decide(v, 200.0), PlanMigration)
    (rep,) = act.plan.replacement_list()
    assert (act.plan.epoch, act.plan.reason, rep.rank, rep.leaver) == (5, "failure", 1, "w1")
    assert rep.joiner not in ("s1", "w1") and rep.state_source == {"kind": "replica"}
    assert act.rank_updates[0].member_id == rep.joiner
    assert "joiner of a planned move" in dict(act.why)[1], act.why


def test_the_planned_leaver_gone_after_its_hand_over_is_not_a_failure():
    v = _moving({"ready": 1.0, "handed_over": 2.0})
    v.reports = {ROOT + "reports/1/a0": report(1, "w1", t=150.0, epoch=4)}
    del v.members["w1"]
    assert [type(a) for a in decide(v, 200.0)] == [DropStaleReport]


def test_the_controller_commits_the_planned_switch_point_once_the_leaver_is_ready():
    v = _moving({"ready": 1.0})
    assert not [a for a in decide(v, 200.0) if isinstance(a, CommitSwitchPoint)], "the leaver has not said where"
    v.last_plan.leaver_at, v.last_plan.last_boundary, v.last_plan_rev = 7, 11, 77
    act = only(decide(v, 200.0), CommitSwitchPoint)
    assert (act.epoch, act.switch_at, act.expected_plan_rev) == (4, 9, 77), (
        "two boundaries on: the leaver trains one more iteration and waits at the next"
    )
    v.last_plan.leaver_at = 10
    assert only(decide(v, 200.0), CommitSwitchPoint).switch_at == 11, "the last boundary comes first"
    v.last_plan.leaver_at = 11
    assert only(decide(v, 200.0), CommitSwitchPoint).switch_at == 11, "never beyond the last boundary"
    v.last_plan.switch_at = 11
    assert not [a for a in decide(v, 200.0) if isinstance(a, CommitSwitchPoint)], "committed already"


def test_record_event_appends_to_the_timeline_and_reports_etcd_trouble_without_raising():
    from trainmover_ext.control.executor import record_event
    from trainmover_ext.control.records import Event
    from trainmover_ext.errors import StoreError

    space = JobSpace.create(MemoryKV(), "j", "tok")
    assert record_event(space, "standby_started", {"member": "s1"}) is None
    (entry,) = space.kv.get_prefix(space.events_prefix).entries
    event = Event.from_bytes(entry.value, key=entry.key)
    assert (event.what, event.detail) == ("standby_started", {"member": "s1"})
    # The timeline only grows: it lies outside the range every controller round reads (and watches).
    control = space.kv.get_prefix(space.root, end=space.control_end).entries
    assert control and not [e.key for e in control if e.key.startswith(space.events_prefix)]

    def down(guards, ops):
        raise StoreError("etcd is away")

    space.kv.commit = down
    assert record_event(space, "stop_restart", {}) == "etcd is away"
