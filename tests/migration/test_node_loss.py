"""Machines, not processes: three agents on loopback, two active nodes of 4 ranks (TP2·PP2·DP2 placed by
``--use-tp-pp-dp-mapping``, so each node holds one data-parallel replica) and one standby machine of 4
slots. A node is lost (its agent and every process it started are SIGKILLed): one plan moves all 4 of its
ranks into the standby machine's slots, each into the slot of its own local rank, with state from the
other node's replicas, bit-identically to a fault-free run (dropout 0.1)."""

from __future__ import annotations

import re

from harness.nodes import Node
from helpers import JobProbe, tm_args, trajectory

ITERS = 60
"""Long enough that the standby machine's 4 standbys warm (beside 8 busy ranks on 2 cores) before the end."""


def test_a_lost_node_moves_whole_to_one_standby_machine(nodes_job, corpus, reference):
    args = tm_args(corpus, iters=ITERS, extra=["--use-tp-pp-dp-mapping"])
    ref = reference(f"tp2pp2dp2_tp_pp_dp_{ITERS}", 8, args)
    job = nodes_job(args, [Node(), Node(), Node(machine=True)], "nodeloss")
    probe = JobProbe(job.etcd.endpoints, job.name, job.token)
    job.wait_warm_machine("n2", probe.view)
    view = probe.view()
    assert {h: (n.role, n.slots) for h, n in view.nodes.items()} == {
        "n0": ("active", 4),
        "n1": ("active", 4),
        "n2": ("standby", 4),
    }
    job.wait_iteration(job.last_iteration() + 2)
    job.kill_node(1)
    codes = job.finish()
    assert codes[0] == 0 and codes[2] == 0, job.errs()
    assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
    plans = [p for p in probe.plans() if p.reason == "failure"]
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
    whys = {r["rank"]: r.get("why") for ev in probe.events("migration_planned") for r in ev["replacements"]}
    print(f"detected: {whys}; steps {plans[0].steps}")


def test_a_node_cut_off_from_etcd_is_replaced_as_a_lost_one(nodes_job, corpus, reference, etcd):
    """Node n1 reaches etcd through a proxy, which is cut mid-run while every process of n1 lives and its
    network to the other ranks stays up: its agent's lease and its ranks' lapse, the controller's own does
    not, so n1 is lost. One plan moves its 4 ranks to the standby machine, bit-identically; n1's processes,
    which cannot read the plan, lose their peers and never touch the job again."""
    import secrets

    from support.tcp_proxy import CuttableProxy

    host, port = etcd.endpoints[0].rsplit(":", 1)
    proxy = CuttableProxy((host, int(port)))
    args = tm_args(corpus, iters=ITERS, extra=["--use-tp-pp-dp-mapping"])
    ref = reference(f"tp2pp2dp2_tp_pp_dp_{ITERS}", 8, args)
    cut_off = Node(flags=("--tm-etcd-endpoints", f"127.0.0.1:{proxy.port}"))
    job = nodes_job(args, [Node(), cut_off, Node(machine=True)], "cutoff", etcd=etcd, token=secrets.token_hex(16))
    probe = JobProbe(etcd.endpoints, job.name, job.token)
    try:
        job.wait_warm_machine("n2", probe.view)
        job.wait_iteration(job.last_iteration() + 2)
        proxy.cut()
        codes = [job.procs[i].wait(300) for i in (0, 2)]
        assert codes == [0, 0], job.errs()
        assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
        plans = [p for p in probe.plans() if p.reason == "failure"]
        assert len(plans) == 1, f"the cut-off node's ranks were not replaced in one plan: {plans}"
        assert sorted(r.rank for r in plans[0].replacement_list()) == [4, 5, 6, 7]
        whys = {r["rank"]: r.get("why") for ev in probe.events("migration_planned") for r in ev["replacements"]}
        assert all(why == "lease expired" or "node n1 lost" in str(why) for why in whys.values()), whys
        assert "falling back" not in job.err(0) + job.err(2)
        assert job.procs[1].poll() is None, "n1's agent, alive and cut off, was expected to be still waiting"
    finally:
        proxy.close()
