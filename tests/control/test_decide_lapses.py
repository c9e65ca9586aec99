"""A lapsed lease is evidence, not proof: a rank whose node's agent lives waits ``View.rejoin_s`` for the
rank to register again; while the controller's own lease lapsed that recently (etcd stalled) no lapse
replaces anything; a whole node lost while etcd serves is still replaced at once. Pure logic."""

from __future__ import annotations

from trainmover_ext.control.decide import PlanMigration, decide
from trainmover_ext.control.lapses import etcd_stalled
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
