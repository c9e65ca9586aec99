"""Suspicions and probes: a peer's suspicion of a rank probes its node's agent; an agent that does not
answer within ``probe_s`` lost its node, and one plan replaces every rank of it; an answered probe
replaces nothing. Pure decisions on hand-built views, and the agent's responder on a real etcd."""

from __future__ import annotations

import dataclasses
import time

import pytest
from control.test_decide_nodes import NOW, ROOT, _plan, _view

from trainmover_ext.control.decide import DropStaleReport, PlanMigration, decide
from trainmover_ext.control.probes import (
    ProbeResponder,
    next_probe_deadline,
    probe_timeout_s,
    unresponsive_hosts,
)
from trainmover_ext.control.records import FailureReport, NodeRecord, ProbeRecord
from trainmover_ext.control.view import View, read_view
from trainmover_ext.kv.job import JobSpace

PROBE_S = 0.5


def _suspect(v: View, rank: int, reporter: str, at: float = NOW - 0.2, member: str | None = None) -> str:
    key = f"{ROOT}reports/{rank}/{reporter}"
    v.reports[key] = FailureReport(
        rank=rank,
        member_id=member or v.ranks[rank].member_id,
        reporter=reporter,
        reason="link broke",
        epoch=v.epoch or 0,
        reported_at=at,
        suspect=True,
    )
    return key


def _probes(actions) -> list:
    return [a for a in actions if type(a).__name__ == "ProbeHost"]


def _probing_view() -> View:
    v = _view({"m1": 4})
    v.probe_s = PROBE_S
    return v


def test_a_suspicion_probes_the_node_and_replaces_nothing():
    v = _probing_view()
    keys = [_suspect(v, 4, "w0", at=NOW - 0.3), _suspect(v, 5, "w1", at=NOW - 0.2)]
    actions = decide(v, NOW)
    assert not [a for a in actions if isinstance(a, PlanMigration)], "a suspicion alone replaces no rank"
    (probe,) = _probes(actions)
    assert probe.probe == ProbeRecord(host="n1", agent="a1", probed_at=NOW, suspected_at=NOW - 0.3, ranks=[4, 5])
    assert sorted(probe.consumed) == sorted(keys), "the probe answers the suspicions it was written for"


def test_a_pending_probe_is_not_written_again_and_waits_for_its_answer():
    v = _probing_view()
    v.probes["n1"] = ProbeRecord(host="n1", agent="a1", probed_at=NOW - 0.2, suspected_at=NOW - 0.3, ranks=[4])
    _suspect(v, 6, "w2")
    assert decide(v, NOW) == [], "one probe at a time; its answer or its silence decides"
    assert next_probe_deadline(v, NOW) == pytest.approx(NOW - 0.2 + PROBE_S)


def test_an_unanswered_probe_loses_the_whole_node_in_one_plan():
    v = _probing_view()
    v.probes["n1"] = ProbeRecord(host="n1", agent="a1", probed_at=NOW - PROBE_S, suspected_at=NOW - 0.7, ranks=[4])
    act = _plan(decide(v, NOW))
    reps = sorted(act.plan.replacement_list(), key=lambda r: r.rank)
    assert [r.rank for r in reps] == [4, 5, 6, 7], "every rank of the node, though only rank 4 was suspected"
    assert [r.joiner for r in reps] == [f"s-m1-{i}" for i in range(4)], "one machine, slot by slot"
    assert act.plan.placement == ["node n1 lost 4 ranks: all to machine m1 (4 in their own slot)"]
    assert dict(act.why)[6] == "node n1 lost: its agent did not answer a probe within 0.50s"
    assert act.plan.detected_at == NOW - 0.7, "detection starts at the first suspicion"
    assert next_probe_deadline(v, NOW) is None, "an expired probe sets no further deadline"


def test_a_probe_just_short_of_its_time_loses_nothing():
    v = _probing_view()
    v.probes["n1"] = ProbeRecord(host="n1", agent="a1", probed_at=NOW - PROBE_S + 0.01, suspected_at=NOW, ranks=[4])
    assert decide(v, NOW) == []
    assert unresponsive_hosts(v, NOW) == frozenset()


def test_an_answered_probe_keeps_the_node_and_a_new_suspicion_probes_again():
    v = _probing_view()
    v.probes["n1"] = ProbeRecord(
        host="n1", agent="a1", probed_at=NOW - 3, suspected_at=NOW - 3, ranks=[4], acked_at=NOW - 2.9
    )
    assert decide(v, NOW) == [], "answered: nothing is lost however old the probe"
    _suspect(v, 5, "w1")
    (probe,) = _probes(decide(v, NOW))
    assert probe.probe.ranks == [5] and probe.probe.acked_at is None


def test_a_probe_of_a_replaced_agent_counts_for_nothing():
    v = _probing_view()
    v.probes["n1"] = ProbeRecord(host="n1", agent="a-old", probed_at=NOW - 9, suspected_at=NOW - 9, ranks=[4])
    assert decide(v, NOW) == [], "the node's agent is a1 now: the old agent's silence says nothing"


def test_a_suspect_its_agent_reported_dead_fails_alone_and_the_plan_deletes_the_suspicion():
    v = _probing_view()
    suspicion = _suspect(v, 4, "w0")
    exit_report = f"{ROOT}reports/4/a1"
    v.reports[exit_report] = FailureReport(
        rank=4, member_id="w4", reporter="a1", reason="process exited with code -9", epoch=2, reported_at=NOW - 0.1
    )
    actions = decide(v, NOW)
    assert not _probes(actions), "a rank that fails anyway needs no probe"
    act = _plan(actions)
    assert [r.rank for r in act.plan.replacement_list()] == [4]
    assert set(act.consumed) >= {suspicion, exit_report}


def test_a_node_whose_ranks_no_other_machine_could_take_is_not_probed():
    v = _view({})
    v.probe_s = PROBE_S
    _suspect(v, 4, "w0")
    assert decide(v, NOW) == [], "a single-node job (standbys only beside its ranks) waits for the leases"
    v = _view({}, beside=2)
    v.probe_s = PROBE_S
    _suspect(v, 4, "w0")
    assert _probes(decide(v, NOW)), "a standby on the other node could take them"


def test_a_suspicion_of_a_replaced_member_is_dropped():
    v = _probing_view()
    key = _suspect(v, 4, "w0", member="w4-old")
    (drop,) = decide(v, NOW)
    assert isinstance(drop, DropStaleReport) and drop.key == key


def test_without_probing_a_suspicion_waits_for_the_leases():
    v = _probing_view()
    v.probe_s = 0.0
    _suspect(v, 4, "w0")
    assert decide(v, NOW) == []


def test_a_suspect_on_a_node_whose_agent_lease_expired_waits_for_a_failed_rank():
    v = _probing_view()
    del v.members["a1"]
    v.gone_at["a1"] = NOW - 0.1
    _suspect(v, 4, "w0")
    assert decide(v, NOW) == [], "a stalled agent with live ranks loses nothing on a suspicion alone"
    del v.members["w5"]
    v.gone_at["w5"] = NOW - 0.1
    act = _plan(decide(v, NOW))
    assert sorted(r.rank for r in act.plan.replacement_list()) == [4, 5, 6, 7]
    assert dict(act.why)[4] == "node n1 lost: its agent's lease expired"


def test_the_probe_timeout_follows_the_lease_ttl():
    assert probe_timeout_s(2) == 0.25
    assert probe_timeout_s(8) == 1.0
    assert probe_timeout_s(1) == 0.25


def test_the_agent_answers_its_own_probes_only(kv):
    space = JobSpace.create(kv, "probes")
    space.put(
        space.key("nodes", "n1"), NodeRecord(host="n1", agent="a1", role="active", slots=4, registered_at=1).to_bytes()
    )
    key = space.key("probes", "n1")
    asked = ProbeRecord(host="n1", agent="a1", probed_at=time.time(), suspected_at=time.time(), ranks=[4])
    space.put(key, asked.to_bytes())  # written before the responder started: answered too
    responder = ProbeResponder(space, host="n1", agent_id="a1").start()
    other = ProbeResponder(space, host="n1", agent_id="a-old").start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and read_view(space).probes["n1"].acked_at is None:
            time.sleep(0.02)
        assert read_view(space).probes["n1"].acked_at is not None
        again = dataclasses.replace(asked, probed_at=time.time(), ranks=[5])
        space.put(key, again.to_bytes())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and read_view(space).probes["n1"].acked_at is None:
            time.sleep(0.02)
        answered = read_view(space).probes["n1"]
        assert answered.acked_at is not None and answered.ranks == [5]
        assert responder.answered == 2 and other.answered == 0, "only the agent the probe names answers"
    finally:
        responder.close()
        other.close()
