"""`trainmover drain --node`: every rank of an active node moves, in one two-phase planned epoch, into the
slots of a standby machine, each leaver handing its own state over; the job trains on bit-identically and
the drained node's agent is left serving nothing. Three agents on loopback as in test_node_loss."""

from __future__ import annotations

from harness.nodes import PER_NODE, Node
from helpers import JobProbe, read_metrics, tm_args, trainmover_cli, trajectory

ITERS = 60


def test_drain_moves_a_node_in_one_planned_epoch(nodes_job, corpus, reference):
    args = tm_args(corpus, iters=ITERS, extra=["--use-tp-pp-dp-mapping"])
    ref = reference(f"tp2pp2dp2_tp_pp_dp_{ITERS}", 8, args)
    job = nodes_job(args, [Node(), Node(), Node(machine=True)], "drain")
    probe = JobProbe(job.etcd.endpoints, job.name, job.token)
    job.wait_warm_machine("n2", probe.view)
    job.wait_iteration(3)
    flags = ["--tm-etcd-endpoints", ",".join(job.etcd.endpoints), "--tm-job", job.name, "--tm-job-token", job.token]
    out = trainmover_cli("drain", "--node", "n1", "--wait", "240", *flags, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr + job.errs()
    assert "node n1 is free" in out.stdout, out.stdout
    assert job.finish() == [0, 0, 0], job.errs()
    assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
    plans = probe.plans()
    assert [(p.reason, p.drain) for p in plans] == [("planned", "n1")], plans
    reps = sorted(plans[0].replacement_list(), key=lambda r: r.rank)
    assert [r.rank for r in reps] == [4, 5, 6, 7] and all(r.state_source["kind"] == "leaver" for r in reps)
    assert [r.local_rank for r in reps] == list(range(PER_NODE)), reps
    assert all(f"handed_over/{r}" in plans[0].steps for r in range(4, 8)), plans[0].steps
    resumed = [e for e in read_metrics(job.metrics, "recovered") if e.get("epoch") == plans[0].epoch]
    assert resumed and resumed[0]["reason"] == "planned", resumed


def test_drain_of_a_node_without_ranks_is_refused(nodes_job, corpus):
    job = nodes_job(tm_args(corpus, iters=ITERS), [Node(), Node()], "drainbad")
    job.wait_iteration(1)
    flags = ["--tm-etcd-endpoints", ",".join(job.etcd.endpoints), "--tm-job", job.name, "--tm-job-token", job.token]
    out = trainmover_cli("drain", "--node", "n7", *flags)
    assert out.returncode != 0 and "node 'n7' serves no rank" in out.stderr and "n0, n1" in out.stderr, out.stderr
    # No standby machine: the controller rejects the drain of a real node and says what to do.
    out = trainmover_cli("drain", "--node", "n1", "--wait", "60", *flags, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no machine has 4 idle standbys" in out.stderr and "--tm-role standby" in out.stderr, out.stderr
