"""Two agents ("nodes" n0 and n1 on loopback, 4 ranks each) sharing one etcd: a standby of one node takes a
rank of the other, and a hung controller leader loses the migration to the other agent's controller."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from harness.nodes import Node, NodesJob
from helpers import JobProbe, tm_args, trajectory, wait_until


@pytest.fixture
def two_nodes(tmp_path, corpus):
    jobs = []

    def start(standbys, name):
        jobs.append(NodesJob(tmp_path, tm_args(corpus), [Node(standbys=n) for n in standbys], name))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


def test_a_standby_of_another_node_takes_the_rank(two_nodes, corpus, reference):
    """The only standby runs on n0; rank 6 of n1 is killed. n0's agent adopts it, n1's agent retires rank 6."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = two_nodes((1, 0), "xnode")
    job.wait_iteration(4)
    os.kill(job.rank_pid(6), signal.SIGKILL)
    assert job.finish() == [0, 0], job.errs()
    assert trajectory(job.metrics) == ref
    assert "rank 6 -> standby-n0" in job.err(0) and "on another node" in job.err(1), job.err(1)[-2000:]
    assert "falling back" not in job.err(0) + job.err(1)


def test_hung_leader_loses_the_migration_to_the_other_controller(two_nodes, corpus, reference):
    """SIGSTOP the agent whose controller leads, then kill a rank of the other node: the failure report
    waits for a leader; the leader's lease expires, the other agent's controller wins and writes the plan
    (fenced writes keep the stopped one from committing anything). The old leader resumes as a follower."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = two_nodes((1, 1), "hungleader")
    probe = JobProbe(job.etcd.endpoints, job.name, job.token)
    job.wait_iteration(4)
    assert not probe.plans(), f"a migration before the drill: {probe.plans()}\n{job.errs()}"
    assert wait_until(probe.leader, timeout_s=30), "no controller leader"
    leader = probe.leader()
    node = int(re.match(r"agent-n(\d)-", leader).group(1))
    other = 1 - node
    job.procs[node].send_signal(signal.SIGSTOP)
    try:
        os.kill(job.rank_pid(4 * other + 2), signal.SIGKILL)
        deadline = time.time() + 60
        while not probe.plans() and time.time() < deadline:
            time.sleep(0.2)
        plans = probe.plans()
    finally:
        job.procs[node].send_signal(signal.SIGCONT)
    assert plans, "no plan while the old leader was stopped"
    assert plans[0].decided_by != leader and plans[0].decided_by.startswith(f"agent-n{other}-"), plans[0]
    assert job.finish() == [0, 0], job.errs()
    assert trajectory(job.metrics) == ref
    assert len(probe.plans()) == 1, "the migration was decided twice"
