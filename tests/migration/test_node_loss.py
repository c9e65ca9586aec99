"""Machines, not processes: three agents on loopback, two active nodes of 4 ranks (TP2·PP2·DP2 placed by
``--use-tp-pp-dp-mapping``, so each node holds one data-parallel replica) and one standby machine of 4
slots. A node is lost (its agent and every process it started are SIGKILLed): one plan moves all 4 of its
ranks into the standby machine's slots, each into the slot of its own local rank, with state from the
other node's replicas, bit-identically to a fault-free run (dropout 0.1)."""

from __future__ import annotations

import re
import time

import pytest

from helpers import read_metrics, tm_args, trajectory
from support.nodes import PER_NODE, Node, NodesJob
from trainmover_ext.errors import StoreError


def _wait_warm_machine(job: NodesJob, host: str, timeout: float = 240) -> None:
    """Until every standby of machine ``host`` is warm for some role."""
    deadline = time.time() + timeout
    seen: object = None
    while time.time() < deadline:
        try:
            view = job.probe.view()
        except StoreError as exc:  # the job is not in etcd yet
            seen = exc
            time.sleep(0.3)
            continue
        warm = [m for m in view.members.values() if m.kind == "standby" and m.host == host and m.warm_roles]
        if len(warm) == PER_NODE and host in view.nodes:
            return
        seen = (sorted(view.nodes), [(m.member_id, m.host, m.warm_roles) for m in view.members.values()])
        assert all(p.poll() is None for p in job.procs), f"{seen}\n{job.errs()}"
        time.sleep(0.3)
    raise AssertionError(f"standby machine {host} not warm: {seen}\n{job.errs()}")


ITERS = 60
"""Long enough that the standby machine's 4 standbys warm (beside 8 busy ranks on 2 cores) before the end."""


def _last_iteration(job: NodesJob) -> int:
    return max((r["iteration"] for r in read_metrics(job.metrics)), default=0)


@pytest.fixture
def nodes_job(tmp_path):
    jobs = []

    def start(args, nodes, name):
        jobs.append(NodesJob(tmp_path, args, nodes, name))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


def test_a_lost_node_moves_whole_to_one_standby_machine(nodes_job, corpus, reference):
    args = tm_args(corpus, iters=ITERS, extra=["--use-tp-pp-dp-mapping"])
    ref = reference(f"tp2pp2dp2_tp_pp_dp_{ITERS}", 8, args)
    job = nodes_job(args, [Node(), Node(), Node(machine=True)], "nodeloss")
    _wait_warm_machine(job, "n2")
    view = job.probe.view()
    assert {h: (n.role, n.slots) for h, n in view.nodes.items()} == {
        "n0": ("active", 4),
        "n1": ("active", 4),
        "n2": ("standby", 4),
    }
    job.wait_iteration(_last_iteration(job) + 2)
    job.kill_node(1)
    codes = job.finish()
    assert codes[0] == 0 and codes[2] == 0, job.errs()
    assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
    plans = [p for p in job.plans() if p.reason == "failure"]
    assert len(plans) == 1, f"the node's ranks were not replaced in one plan: {plans}"
    reps = sorted(plans[0].replacement_list(), key=lambda r: r.rank)
    assert [r.rank for r in reps] == [4, 5, 6, 7], reps
    slots = {m.member_id: m.slot for m in view.members.values() if m.kind == "standby"}
    assert [slots.get(r.joiner) for r in reps] == [0, 1, 2, 3], "a rank did not keep its local rank's slot"
    assert [r.local_rank for r in reps] == [0, 1, 2, 3]
    assert all(r.state_source["kind"] == "replica" for r in reps), reps
    assert plans[0].placement and "all to machine n2 (4 in their own slot)" in plans[0].placement[0]
    promoted = sorted(
        re.findall(r"promoted to rank (\d) \(local rank (\d),", job.err(2) + open(job.dir / "n2.out").read())
    )
    assert promoted == [("4", "0"), ("5", "1"), ("6", "2"), ("7", "3")], promoted
    assert "falling back" not in job.err(0) + job.err(2)
