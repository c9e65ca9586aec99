"""Several ``trainmover launch`` agents of one job on loopback, each a "node" with its own name
(``TRAINMOVER_NODE_NAME``), sharing one etcd the test starts: active nodes of 4 ranks, and standby
machines (``--tm-role standby``). Each agent runs in its own process group, so a test can kill a
whole node (agent and every process it started) at once."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass

from harness.jobs import REPO_ROOT
from helpers import JobProbe, launch_cmd, read_metrics

PER_NODE = 4


@dataclass(frozen=True)
class Node:
    """``standbys``: the script's ``--tm-standbys`` on an active node; ``machine``: a standby machine."""

    standbys: int = 0
    machine: bool = False


class NodesJob:
    """One job over ``nodes``; active nodes take node ranks 0, 1, ... in order, named n0, n1, ..."""

    def __init__(self, tmp_path, args: list[str], nodes: list[Node], name: str):
        from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig, free_port

        self.dir, self.name, self.nodes = tmp_path, name, nodes
        self.etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=str(tmp_path / "etcd"))).start(timeout=60)
        self.token = secrets.token_hex(16)
        self.metrics = str(tmp_path / "metrics.jsonl")
        self.procs: list[subprocess.Popen] = []
        self.probe = JobProbe(self.etcd.endpoints, name, self.token)
        self.leader, self.plans = self.probe.leader, self.probe.plans
        port = str(free_port())
        active = sum(not n.machine for n in nodes)
        node_rank = 0
        for i, node in enumerate(nodes):
            script = list(args) + ["--tm-metrics-file", self.metrics]
            script[script.index("--tm-standbys") + 1] = str(node.standbys)
            role = ["--tm-role", "standby"] if node.machine else ["--node-rank", str(node_rank)]
            node_rank += not node.machine
            cmd = launch_cmd(
                PER_NODE,
                script,
                "--nnodes",
                str(active),
                *role,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--run-dir",
                str(tmp_path / f"n{i}.run"),
                "--tm-job",
                name,
                "--tm-etcd-endpoints",
                ",".join(self.etcd.endpoints),
                "--tm-job-token",
                self.token,
            )
            env = dict(os.environ, TRAINMOVER_NODE_NAME=f"n{i}", PYTHONUNBUFFERED="1")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=open(tmp_path / f"n{i}.out", "w"),
                    stderr=open(tmp_path / f"n{i}.err", "w"),
                    env=env,
                    cwd=REPO_ROOT,
                    start_new_session=True,
                )
            )

    def err(self, node: int) -> str:
        return open(self.dir / f"n{node}.err").read()

    def errs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- n{i}\n{self.err(i)[-tail:]}" for i in range(len(self.nodes)))

    def wait_iteration(self, iteration: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(r["iteration"] >= iteration for r in read_metrics(self.metrics)):
                return
            assert all(p.poll() is None for p in self.procs), self.errs()
            time.sleep(0.1)
        raise AssertionError(f"iteration {iteration} not reached:\n{self.errs()}")

    def rank_pid(self, rank: int) -> int:
        """The pid of ``rank`` as its active node started it."""
        return json.loads(re.findall(r"pids (\[[\d, ]+\])", self.err(rank // PER_NODE))[0])[rank % PER_NODE]

    def kill_node(self, node: int) -> None:
        """SIGKILL node ``node``'s agent and every process of its group: the machine is gone."""
        os.killpg(self.procs[node].pid, signal.SIGKILL)

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
                os.killpg(p.pid, signal.SIGKILL)
        self.etcd.stop()
