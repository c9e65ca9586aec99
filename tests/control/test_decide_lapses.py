"""A lapsed lease is evidence, not proof: a rank whose node's agent lives waits ``View.rejoin_s`` for the
rank to register again; while the controller's own lease lapsed that recently (etcd stalled) no lapse
replaces anything; a whole node lost while etcd serves is still replaced at once. Pure logic."""

from __future__ import annotations

from trainmover_ext.control.decide import PlanMigration, decide
from trainmover_ext.control.lapses import etcd_stalled, note_unseen_lapses
from trainmover_ext.control.records import FailureReport

from .test_decide_nodes import NOW, _lose_node, _view

REJOIN_S = 5.0


def _plans(actions) -> list[PlanMigration]:
    return [a for a in actions if isinstance(a, PlanMigration)]


def _lapse(v, *members: str, ago: float) -> None:
    for m in members:
        del v.members[m]
        v.gone_at[m] = NOW - ago


def _lapsing_view(**kw):
    v = _view({"m1": 4}, **kw)
    v.own_member, v.rejoin_s = "a0", REJOIN_S
    return v


def test_a_lapsed_rank_whose_agent_lives_waits_to_register_again():
    v = _lapsing_view(beside=1)
    _lapse(v, "w2", ago=2.0)  # past settle_s (1.2 s here), within rejoin_s
    assert _plans(decide(v, NOW)) == [], "a live agent's rank has rejoin_s to register again"
    plan = _plans(decide(v, NOW + REJOIN_S - 2.0))
    assert [r.rank for r in plan[0].plan.replacement_list()] == [2], "past rejoin_s the lapse is proof"


def test_a_reported_exit_is_acted_on_at_once():
    v = _lapsing_view(beside=1)
    _lapse(v, "w2", ago=0.1)
    key = f"{v.root}reports/2/a0"
    v.reports[key] = FailureReport(
        rank=2, member_id="w2", reporter="a0", reason="process exited with code -9", reported_at=NOW, epoch=2
    )
    assert [r.rank for r in _plans(decide(v, NOW))[0].plan.replacement_list()] == [2]


def test_every_lease_lapsed_with_the_controllers_own_replaces_nothing():
    """etcd was paused past the TTL: every lease, agents' and the controller's own included, lapsed together."""
    v = _lapsing_view(beside=1)
    everyone = [m for m in v.members]
    _lapse(v, *everyone, ago=0.5)
    assert etcd_stalled(v, NOW)
    assert _plans(decide(v, NOW)) == [], "no lost node, no orphaned rank while the controller's own lease lapsed"
    # The members registered again within rejoin_s: nothing is ever replaced.
    v2 = _lapsing_view(beside=1)
    v2.gone_at = dict(v.gone_at)
    assert _plans(decide(v2, NOW + REJOIN_S)) == []


def test_a_whole_node_lost_while_etcd_serves_is_replaced_at_once():
    v = _lapsing_view()
    _lose_node(v, 1, expired=(4, 5, 6, 7))
    plan = _plans(decide(v, NOW))
    assert [r.rank for r in plan[0].plan.replacement_list()] == [4, 5, 6, 7]


def test_without_rejoin_s_a_lapse_is_proof_at_once():
    """The companion of the first test: the wait is what ``rejoin_s`` buys, not an accident of the view."""
    v = _view({"m1": 4}, beside=1)
    v.settle_s = 0.0
    _lapse(v, "w2", ago=1.0)
    assert [r.rank for r in _plans(decide(v, NOW))[0].plan.replacement_list()] == [2]


def test_the_lapses_of_one_node_are_planned_together():
    """A node cut off from etcd while its agent's lease holds: its ranks' leases lapse moments apart. When
    the first one's wait is over, the others that lapsed with it join its plan, although their own waits
    run a little longer; a rank of the node whose lease holds, and a lapse on another node, do not."""
    v = _lapsing_view()
    _lapse(v, "w4", ago=REJOIN_S + 0.1)
    _lapse(v, "w5", "w7", ago=REJOIN_S - 0.4)
    _lapse(v, "w1", ago=REJOIN_S - 0.4)  # n0: its own wait is not over
    plan = _plans(decide(v, NOW))
    assert [r.rank for r in plan[0].plan.replacement_list()] == [4, 5, 7]
    assert all(why == "lease expired" for _, why in plan[0].why)


def _read_before_seen():
    """Node n1 cut off from etcd, its agent's lease still held: the leases of ranks 4, 5 and 6 expired
    moments apart and a round reads all three gone, but the controller's watch has delivered only rank 4's
    deletion (6 ms ago): ranks 5 and 6 have no time."""
    v = _lapsing_view()
    _lapse(v, "w4", ago=0.006)
    for m in ("w5", "w6"):
        del v.members[m]
    return v


def test_a_lapse_read_before_its_deletion_is_seen_waits_like_one_seen():
    """The controller runner starts the clock of a lapse it reads before its watch delivers it; without
    that, ranks 5 and 6 skipped the wait and dragged rank 4 into a plan at once, without rank 7, whose
    lease had not lapsed yet: one lost node in two plans (and a live rank whose keepalive was late, replaced)."""
    v = _read_before_seen()
    assert [r.rank for r in _plans(decide(v, NOW))[0].plan.replacement_list()] == [4, 5, 6], "the hazard, as it was"
    v = _read_before_seen()
    note_unseen_lapses(v, v.gone_at, {}, NOW)
    assert v.gone_at["w5"] == v.gone_at["w6"] == NOW and v.gone_at["w4"] == NOW - 0.006, "a seen deletion is kept"
    assert _plans(decide(v, NOW)) == [], "each lapse waits from the round that first read it"
    # Then rank 7's lease lapses, and the agent's: the node is lost, and one plan takes all four.
    _lapse(v, "w7", "a1", ago=0.0)
    plan = _plans(decide(v, NOW + 0.5))
    assert [r.rank for r in plan[0].plan.replacement_list()] == [4, 5, 6, 7]


def test_a_lapse_after_a_registration_again_is_a_new_one():
    """A member that lapsed, registered again and lapsed again: the first deletion's time is stale once the
    runner saw the registration; a deletion seen after the registration stands."""
    v = _lapsing_view()
    for m in ("w4", "w5"):
        del v.members[m]
    gone_at = {"w4": NOW - 60.0, "w5": NOW - 0.2}
    note_unseen_lapses(v, gone_at, {"w4": NOW - 30.0, "w5": NOW - 30.0}, NOW)
    assert gone_at == {"w4": NOW, "w5": NOW - 0.2}
