"""A standby machine's standbys warm in the sandbox from another node's recordings, with no shared directory.

Three agents on loopback, each with its own run directory and the launcher's default
``--tm-record-dir <run dir>/recordings``: two active nodes of 2 ranks (TP1·PP2·DP2 placed by
``--use-tp-pp-dp-mapping``, so each node holds one data-parallel replica; n0 holds both recorder
ranks) and a standby machine of 2 slots. The machine's standbys copy the recordings from n0's agent
(job token required) and warm both roles in the sandbox: their member records say ``sandbox`` and
where the copies came from. Then n1 is lost, its two ranks move into the machine's slots with state
from n0's replicas, and the run is bit-identical to a fault-free one (dropout 0.1)."""

from __future__ import annotations

import os
import time

import pytest

from harness.nodes import Node
from helpers import JobProbe, tm_args, trajectory
from trainmover_ext.errors import StoreError
from trainmover_ext.etcd import free_port

ITERS = 400
"""Long enough that the machine's two standbys copy and warm two roles (at iteration 130-150 of 300 on the
2-core machine, beside 4 busy ranks) well before the end."""


def _warm_in_sandbox(probe: JobProbe, job) -> list[dict]:
    """The machine's (n2) standbys, once both report a finished warm-up (sandbox or not)."""
    deadline = time.time() + 240
    seen: list = []
    while time.time() < deadline:
        try:
            standbys = [m for m in probe.members("standby") if m["host"] == "n2"]
        except StoreError:  # the job is not in etcd yet
            time.sleep(0.3)
            continue
        seen = [(m["member_id"], m.get("warmup", {}).get("mode"), m.get("warming")) for m in standbys]
        if len(standbys) == 2 and all(m.get("warmup", {}).get("mode") in ("sandbox", "basic") for m in standbys):
            if all(not m.get("warming") for m in standbys):
                return standbys
        assert all(p.poll() is None for p in job.procs), f"a node exited: {seen}\n{job.errs()}"
        time.sleep(0.3)
    raise AssertionError(f"the standby machine's standbys did not finish warming: {seen}\n{job.errs()}")


@pytest.mark.slow
def test_a_standby_machine_warms_from_another_nodes_recordings_and_takes_a_lost_node(nodes_job, corpus, reference):
    args = tm_args(corpus, tp=1, pp=2, iters=ITERS, extra=["--use-tp-pp-dp-mapping"])
    # The reference records nothing: recording and copying must leave no trace in the training either.
    ref = reference(f"tp1pp2dp2_tp_pp_dp_{ITERS}", 4, args)
    sandbox = tm_args(corpus, tp=1, pp=2, iters=ITERS, extra=["--use-tp-pp-dp-mapping"], sandbox=True)
    port = free_port()  # a fixed port, as where a firewall opens only known ones
    job = nodes_job(
        sandbox, [Node(flags=("--recordings-port", str(port))), Node(), Node(machine=True)], "remotesandbox", per_node=2
    )
    probe = JobProbe(job.etcd.endpoints, job.name, job.token)
    standbys = _warm_in_sandbox(probe, job)
    print(f"warm at iteration {job.last_iteration()}")
    modes = [(m["warmup"]["mode"], m["warmup"].get("reason")) for m in standbys]
    assert [mode for mode, _ in modes] == ["sandbox", "sandbox"], modes
    for standby in standbys:
        assert sorted(r["role"] for r in standby["warmup"]["roles"]) == ["first", "last"], standby["warmup"]
    # Each role was copied once, from n0's agent into the machine's own run directory; the other standby
    # found the copy there.
    copies = [c for m in standbys for c in m["warmup"].get("copied", [])]
    assert {c["node"] for c in copies} == {"n0"}, copies
    assert sorted(c["role"] for c in copies if c["bytes"] > 0) == ["first", "last"], copies
    assert os.path.isfile(job.dir / "n2.run" / "recordings" / "first" / "tensors.bin")
    assert probe.view().nodes["n0"].recordings_url == f"http://127.0.0.1:{port}", probe.view().nodes["n0"]
    killed_at = job.last_iteration()
    assert killed_at < ITERS - 5, f"the machine was warm only at iteration {killed_at}: too late to test"
    job.kill_node(1)
    codes = job.finish()
    assert codes[0] == 0 and codes[2] == 0, job.errs()
    assert trajectory(job.metrics) == ref, "not bit-identical to the fault-free run"
    plans = [p for p in probe.plans() if p.reason == "failure"]
    assert len(plans) == 1, plans
    reps = sorted(plans[0].replacement_list(), key=lambda r: r.rank)
    assert [r.rank for r in reps] == [2, 3] and all(r.state_source["kind"] == "replica" for r in reps), reps
    joiners = {m["member_id"] for m in standbys}
    assert {r.joiner for r in reps} == joiners, "the lost node's ranks did not go to the sandbox-warmed standbys"
