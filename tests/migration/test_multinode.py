"""Two agents ("nodes" n0 and n1 on loopback, 4 ranks each) sharing one etcd: a standby of one node takes a
rank of the other, and a hung controller leader loses the migration to the other agent's controller."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time

import pytest

from harness.jobs import REPO_ROOT
from helpers import JobProbe, launch_cmd, read_metrics, tm_args, trajectory


class TwoNodeJob:
    """Two ``trainmover launch`` agents of one job, each with its own ``--tm-standbys``."""

    def __init__(self, tmp_path, corpus, standbys: tuple[int, int], name: str):
        from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig, free_port

        self.dir, self.name = tmp_path, name
        self.etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=str(tmp_path / "etcd"))).start(timeout=60)
        self.token = secrets.token_hex(16)
        self.metrics = str(tmp_path / "metrics.jsonl")
        self.procs = []
        self.probe = JobProbe(self.etcd.endpoints, name, self.token)
        self.leader, self.plans = self.probe.leader, self.probe.plans
        port = str(free_port())
        for node in (0, 1):
            args = tm_args(corpus, extra=["--tm-metrics-file", self.metrics])
            args[args.index("--tm-standbys") + 1] = str(standbys[node])
            cmd = launch_cmd(
                4,
                args,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--run-dir",
                str(tmp_path / f"n{node}.run"),
                "--tm-job",
                name,
                "--tm-etcd-endpoints",
                ",".join(self.etcd.endpoints),
                "--tm-job-token",
                self.token,
            )
            env = dict(os.environ, TRAINMOVER_NODE_NAME=f"n{node}", PYTHONUNBUFFERED="1")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=open(tmp_path / f"n{node}.out", "w"),
                    stderr=open(tmp_path / f"n{node}.err", "w"),
                    env=env,
                    cwd=REPO_ROOT,
                )
            )

    def err(self, node: int) -> str:
        return open(self.dir / f"n{node}.err").read()

    def wait_iteration(self, iteration: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(r["iteration"] >= iteration for r in read_metrics(self.metrics)):
                return
            assert all(p.poll() is None for p in self.procs), self.err(0)[-2000:] + self.err(1)[-2000:]
            time.sleep(0.1)
        raise AssertionError(f"iteration {iteration} not reached:\n{self.err(0)[-2000:]}\n{self.err(1)[-2000:]}")

    def rank_pid(self, rank: int) -> int:
        return json.loads(re.findall(r"pids (\[[\d, ]+\])", self.err(rank // 4))[0])[rank % 4]

    def finish(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.etcd.stop()


@pytest.fixture
def two_nodes(tmp_path, corpus):
    jobs = []

    def start(standbys, name):
        jobs.append(TwoNodeJob(tmp_path, corpus, standbys, name))
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
    assert job.finish() == [0, 0], job.err(0)[-2000:] + job.err(1)[-2000:]
    assert trajectory(job.metrics) == ref
    assert "rank 6 -> standby-n0" in job.err(0) and "on another node" in job.err(1), job.err(1)[-2000:]
    assert "falling back" not in job.err(0) + job.err(1)


def test_hung_leader_loses_the_migration_to_the_other_controller(two_nodes, corpus, reference):
    """SIGSTOP the agent whose controller leads, then kill a rank of the other node: the failure report
    waits for a leader; the leader's lease expires, the other agent's controller wins and writes the plan
    (fenced writes keep the stopped one from committing anything). The old leader resumes as a follower."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = two_nodes((1, 1), "hungleader")
    job.wait_iteration(4)
    leader = job.leader()
    node = int(re.match(r"agent-n(\d)-", leader).group(1))
    other = 1 - node
    job.procs[node].send_signal(signal.SIGSTOP)
    try:
        os.kill(job.rank_pid(4 * other + 2), signal.SIGKILL)
        deadline = time.time() + 60
        while not job.plans() and time.time() < deadline:
            time.sleep(0.2)
        plans = job.plans()
    finally:
        job.procs[node].send_signal(signal.SIGCONT)
    assert plans, "no plan while the old leader was stopped"
    assert plans[0].decided_by != leader and plans[0].decided_by.startswith(f"agent-n{other}-"), plans[0]
    assert job.finish() == [0, 0], job.err(0)[-2000:] + job.err(1)[-2000:]
    assert trajectory(job.metrics) == ref
    assert len(job.plans()) == 1, "the migration was decided twice"
