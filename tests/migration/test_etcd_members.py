"""An etcd that survives a node: the job's control plane on a 3-member etcd cluster; the member listed
first (the one a launcher on the first node would embed) is SIGKILLed mid-run. Leases, plans and
training carry on through the other two: the job finishes bit-identically, with no migration and no
restart, and a failure after the member loss is still recovered."""

from __future__ import annotations

import os
import signal

from harness.nodes import Node, NodesJob
from helpers import JobProbe, tm_args, trajectory
from trainmover_ext.etcd.cluster import LocalEtcdCluster

ITERS = 40


def test_losing_the_first_etcd_member_loses_nothing(tmp_path, corpus, reference):
    args = tm_args(corpus, iters=ITERS)
    ref = reference("tp2pp2dp2-i40", 8, args)
    cluster = LocalEtcdCluster(base_dir=tmp_path / "etcd3", size=3).start(timeout=60)
    job = NodesJob(tmp_path / "job", args, [Node(standbys=1), Node(standbys=1)], "etcd3", etcd=cluster)
    try:
        job.wait_iteration(4)
        cluster.kill_member(0)
        start = job.last_iteration()
        job.wait_iteration(start + 4)  # trains on without the member
        os.kill(job.rank_pid(6), signal.SIGKILL)  # and the control plane still decides
        assert job.finish() == [0, 0], job.errs()
        assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
        plans = JobProbe(cluster.endpoints[1:], job.name, job.token).plans()
        assert [(p.reason, [r["rank"] for r in p.replacements]) for p in plans] == [("failure", [6])], plans
        assert "falling back" not in job.err(0) + job.err(1)
    finally:
        job.close()
        cluster.stop()
