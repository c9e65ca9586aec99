"""The controller prefers a machine that runs no ranks: a standby machine's agent campaigns at once and
takes the lead from an active node's controller as soon as nothing is in flight, and the active ones take
it back at once when no preferred candidate is alive. Real etcd, real controllers."""

from __future__ import annotations

import os
import time

import pytest

from trainmover_ext.control.controller import Controller, ControllerConfig, quiet
from trainmover_ext.control.membership import Membership
from trainmover_ext.control.records import FailureReport, MemberRecord, MigrationPlan, NodeRecord
from trainmover_ext.control.view import View
from trainmover_ext.kv.job import JobSpace


def _agent(space: JobSpace, agent: str, host: str, role: str) -> Membership:
    member = Membership(space, MemberRecord(member_id=agent, kind="agent", host=host, pid=os.getpid()), ttl_s=2)
    member.register()
    node = NodeRecord(host=host, agent=agent, role=role, slots=4, registered_at=time.time())
    space.put(space.key("nodes", host), node.to_bytes())
    return member


def _until(pred, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("role", ["standby", "active"], ids=["standby-machine", "companion-active-node"])
def test_a_standby_machines_agent_takes_the_lead_and_hands_it_back_when_it_leaves(kv, role):
    """The agent sets ``preferred`` for a standby machine; the companion is a second active node, which
    must leave the lead where it is."""
    space = JobSpace.create(kv, "placement")
    active = _agent(space, "a0", "n0", "active")
    c0 = Controller(space, ControllerConfig(controller_id="a0", ttl_s=2)).start()
    spare = cm = None
    try:
        assert _until(lambda: c0.is_leader), "the only candidate leads"
        spare = _agent(space, "m", "m", role)
        cm = Controller(space, ControllerConfig(controller_id="m", ttl_s=2, preferred=role == "standby")).start()
        moved = _until(lambda: cm.is_leader and not c0.is_leader, timeout_s=6.0)
        if role == "active":
            assert not moved and c0.is_leader, "another active node takes nothing from a leader"
            return
        assert moved, "the standby machine's agent should lead once nothing is in flight"
        cm.close()  # the standby machine goes away: its lease is revoked, the lead is vacant
        spare.close()
        t0 = time.monotonic()
        assert _until(lambda: c0.is_leader, timeout_s=6.0), "the active node's controller takes the lead again"
        assert time.monotonic() - t0 < 2.0, "no preferred candidate is alive, so it need not defer"
    finally:
        for obj in (cm, spare, c0, active):
            if obj is not None:
                obj.close()


def test_the_lead_changes_hands_by_choice_only_when_nothing_is_in_flight():
    view = View(root="/trainmover/j/", epoch=3)
    assert quiet(view)
    view.last_plan = MigrationPlan(epoch=3, reason="failure", replacements=[], resume_iteration=None)
    assert not quiet(view), "a failure plan that has not converged"
    view.converged.add(3)
    assert quiet(view)
    view.reports["/trainmover/j/reports/1/a0"] = FailureReport(
        rank=1, member_id="w1", reporter="a0", reason="exit", epoch=3, reported_at=1.0
    )
    assert not quiet(view), "a report waits for a decision"
    view.reports.clear()
    view.last_plan = MigrationPlan(epoch=3, reason="planned", replacements=[], resume_iteration=None)
    assert not quiet(view), "a planned move under way"
    view.last_plan.steps["transferred"] = 2.0
    assert quiet(view)
