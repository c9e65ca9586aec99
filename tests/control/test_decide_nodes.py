"""The controller's decisions about machines: a lost node's ranks move in one plan to one standby
machine, each into the slot of its own local rank; a rank's expired lease waits briefly for its node's
agent; single failures fill machines already in use. Pure logic on hand-built views."""

from __future__ import annotations

from trainmover_ext.control.decide import PlanMigration, decide
from trainmover_ext.control.records import MemberRecord, NodeRecord, RankRecord
from trainmover_ext.control.view import View

ROOT = "/trainmover/j/"
ALL = ["first", "middle", "last"]
NOW = 500.0


def _member(mid: str, kind: str, host: str, slot: int | None = None, t: float = 0.0) -> MemberRecord:
    roles = ALL if kind == "standby" else []
    return MemberRecord(member_id=mid, kind=kind, host=host, pid=1, warm_roles=roles, slot=slot, registered_at=t)


def _view(machines: dict[str, int], beside: int = 0) -> View:
    """Active nodes n0 (ranks 0-3) and n1 (ranks 4-7), each rank's replica on the other node; standby
    machines by host -> free slots (standbys registered in reverse slot order, so the oldest is the
    highest slot); ``beside`` standbys on n0 next to its ranks."""
    v = View(root=ROOT, epoch=2, epoch_rev=7, settle_s=1.2)
    for node in (0, 1):
        host = f"n{node}"
        v.members[f"a{node}"] = _member(f"a{node}", "agent", host)
        v.nodes[host] = NodeRecord(host=host, agent=f"a{node}", role="active", slots=4)
        for local in range(4):
            r = 4 * node + local
            v.members[f"w{r}"] = _member(f"w{r}", "worker", host)
            v.ranks[r] = RankRecord(
                rank=r, member_id=f"w{r}", host=host, role="middle", replicas=[r ^ 4], local_rank=local
            )
    for host, free in machines.items():
        v.members[f"a-{host}"] = _member(f"a-{host}", "agent", host)
        v.nodes[host] = NodeRecord(host=host, agent=f"a-{host}", role="standby", slots=4)
        for slot in reversed(range(free)):
            v.members[f"s-{host}-{slot}"] = _member(f"s-{host}-{slot}", "standby", host, slot, t=10 - slot)
    for i in range(beside):
        v.members[f"b{i}"] = _member(f"b{i}", "standby", "n0", t=1)
    return v


def _plan(actions) -> PlanMigration:
    plans = [a for a in actions if isinstance(a, PlanMigration)]
    assert len(plans) == 1, actions
    return plans[0]


def _lose_node(v: View, node: int, expired: tuple[int, ...] = (5,)) -> None:
    """Node ``node``'s agent is gone, and so are the leases of ranks ``expired`` (the rest not yet)."""
    del v.members[f"a{node}"]
    v.gone_at[f"a{node}"] = NOW - 0.5
    for r in expired:
        del v.members[f"w{r}"]
        v.gone_at[f"w{r}"] = NOW - 0.1


def test_a_lost_node_moves_whole_into_one_machine_slot_by_slot():
    v = _view({"m1": 4}, beside=2)
    _lose_node(v, 1)
    act = _plan(decide(v, NOW))
    reps = sorted(act.plan.replacement_list(), key=lambda r: r.rank)
    assert [r.rank for r in reps] == [4, 5, 6, 7], "one plan for every rank of the node"
    assert [r.joiner for r in reps] == [f"s-m1-{i}" for i in range(4)], "each rank in its own local rank's slot"
    assert [r.local_rank for r in reps] == [0, 1, 2, 3]
    assert [u.local_rank for u in sorted(act.rank_updates, key=lambda u: u.rank)] == [0, 1, 2, 3]
    assert all(r.state_source == {"kind": "replica"} for r in reps)
    assert act.plan.placement == ["node n1 lost 4 ranks: all to machine m1 (4 in their own slot)"]
    assert dict(act.why)[4] == "node n1 lost: its agent's lease expired"


def test_the_machine_that_keeps_most_slots_wins():
    v = _view({"m1": 4, "m2": 4})
    # Both have 4 free standbys, but m1's slot 2 holds one without a slot: m2 keeps all 4 local ranks.
    del v.members["s-m1-2"]
    v.members["s-m1-x"] = _member("s-m1-x", "standby", "m1", None, t=0)
    _lose_node(v, 1)
    reps = _plan(decide(v, NOW)).plan.replacement_list()
    assert {r.joiner.rsplit("-", 1)[0] for r in reps} == {"s-m2"}, reps


def test_no_whole_machine_free_spreads_the_ranks_and_says_so():
    v = _view({"m1": 3}, beside=1)
    v.members["s-n1"] = _member("s-n1", "standby", "n1", t=0)  # dies with node n1: never chosen
    _lose_node(v, 1)
    act = _plan(decide(v, NOW))
    joiners = {r.joiner for r in act.plan.replacement_list()}
    assert joiners == {"s-m1-0", "s-m1-1", "s-m1-2", "b0"}, joiners
    assert "no machine has 4 free standbys" in act.plan.placement[0], act.plan.placement


def test_a_rank_lease_waits_for_its_agent_then_is_planned_alone():
    v = _view({"m1": 4})
    del v.members["w5"]
    v.gone_at["w5"] = NOW - 0.1
    assert not [a for a in decide(v, NOW) if isinstance(a, PlanMigration)], "planned before the settle time"
    act = _plan(decide(v, NOW + 1.2))
    assert [r.rank for r in act.plan.replacement_list()] == [5], "the agent lives: one hung rank"


def test_a_stalled_agent_whose_ranks_live_loses_nothing():
    v = _view({"m1": 4})
    del v.members["a1"]
    assert decide(v, NOW) == []


def test_a_single_failure_fills_a_machine_already_in_use_in_the_ranks_slot():
    v = _view({"m1": 4, "m2": 4})
    # m2 already serves a rank (slot 0 taken): a single failure goes there, not into the whole m1.
    del v.members["s-m2-0"]
    v.ranks[0] = RankRecord(rank=0, member_id="x", host="m2", role="middle", replicas=[4], local_rank=0)
    v.members["x"] = _member("x", "worker", "m2")
    del v.members["w6"]  # rank 6, local rank 2; its agent lives (no settle info: a new leader)
    (rep,) = _plan(decide(v, NOW)).plan.replacement_list()
    assert rep.joiner == "s-m2-2" and rep.local_rank == 2, rep


def test_no_settle_where_no_other_node_holds_a_standby():
    v = _view({})  # no standby machine: a whole-node plan cannot follow, so a hung rank is planned at once
    v.members["b0"] = _member("b0", "standby", "n1", t=1)  # beside the ranks of the rank's own node
    del v.members["w5"]
    v.gone_at["w5"] = NOW - 0.1
    (rep,) = _plan(decide(v, NOW)).plan.replacement_list()
    assert (rep.rank, rep.joiner) == (5, "b0"), rep
