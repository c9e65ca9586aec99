"""Several ``trainmover launch`` agents of one job on loopback, each a "node" with its own name
(``TRAINMOVER_NODE_NAME``), sharing one etcd: active nodes of :data:`PER_NODE` ranks, and standby
machines (``--tm-role standby``). Each agent runs in its own process group, so a caller can kill a
whole node (agent and every process it started) at once.

Used by the multi-node tests (``tests/migration/test_multinode.py``, ``test_node_loss.py``) and by the
node scenarios of ``benchmarks/downtime_nodes.py``. It reads no control keys itself: a caller that needs
the job's view passes a reader (the tests' ``JobProbe.view``, the benchmark's ``Etcd.view``).

On failure: a node that exits before the awaited iteration, or a wait that runs past its timeout,
raises ``AssertionError`` with the tail of every node's stderr.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.jobs import PRETRAIN, REPO_ROOT, launch_cmd
from trainmover_ext.errors import StoreError

PER_NODE = 4
"""Ranks of an active node, and standby slots of a standby machine."""


@dataclass(frozen=True)
class Node:
    """``standbys``: the script's ``--tm-standbys`` on an active node; ``machine``: a standby machine;
    ``env``: extra environment of the node's agent (e.g. ``CUDA_VISIBLE_DEVICES``: the node's GPUs);
    ``flags``: extra flags of its ``trainmover launch``."""

    standbys: int = 0
    machine: bool = False
    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()


class NodesJob:
    """One job over ``nodes``; active nodes take node ranks 0, 1, ... in order, named n0, n1, ...

    ``args`` are the script's flags and must contain ``--tm-standbys`` (each node's value replaces it).
    Logs go to ``workdir/n<i>.out|.err``, metrics of every rank to ``workdir/metrics.jsonl``.
    Without ``etcd`` the job starts its own etcd (data in ``workdir/etcd``) and stops it in :meth:`close`;
    with ``etcd`` (a started ``EmbeddedEtcd``) and ``token`` it joins that one and leaves it running.
    ``script``: what every agent runs (the benchmarks' ``RECORDED_PRETRAIN``)."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        args: list[str],
        nodes: list[Node],
        name: str,
        *,
        etcd=None,
        token: str | None = None,
        per_node: int = PER_NODE,
        script: str = PRETRAIN,
    ):
        from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig, free_port

        self.dir, self.name, self.nodes, self.per_node = Path(workdir), name, nodes, per_node
        self.dir.mkdir(parents=True, exist_ok=True)
        self._own_etcd = etcd is None
        if etcd is None:
            etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=str(self.dir / "etcd"))).start(timeout=60)
        self.etcd = etcd
        self.token = token or secrets.token_hex(16)
        self.metrics = str(self.dir / "metrics.jsonl")
        self.procs: list[subprocess.Popen] = []
        port = str(free_port())
        active = sum(not n.machine for n in nodes)
        node_rank = 0
        for i, node in enumerate(nodes):
            flags = list(args) + ["--tm-metrics-file", self.metrics]
            flags[flags.index("--tm-standbys") + 1] = str(node.standbys)
            role = ["--tm-role", "standby"] if node.machine else ["--node-rank", str(node_rank)]
            node_rank += not node.machine
            cmd = launch_cmd(
                per_node,
                flags,
                "--nnodes",
                str(active),
                *role,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--run-dir",
                str(self.dir / f"n{i}.run"),
                "--tm-job",
                name,
                "--tm-etcd-endpoints",
                ",".join(self.etcd.endpoints),
                "--tm-job-token",
                self.token,
                *node.flags,
                script=script,
            )
            env = dict(os.environ, TRAINMOVER_NODE_NAME=f"n{i}", PYTHONUNBUFFERED="1") | dict(node.env)
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=open(self.dir / f"n{i}.out", "w"),
                    stderr=open(self.dir / f"n{i}.err", "w"),
                    env=env,
                    cwd=REPO_ROOT,
                    start_new_session=True,
                )
            )

    def err(self, node: int) -> str:
        return open(self.dir / f"n{node}.err").read()

    def errs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- n{i}\n{self.err(i)[-tail:]}" for i in range(len(self.nodes)))

    def iterations(self) -> list[dict]:
        """The ``iteration`` records logged so far, in the order they were written."""
        if not os.path.exists(self.metrics):
            return []
        with open(self.metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [r for r in records if r.get("event") == "iteration"]

    def last_iteration(self) -> int:
        return max((r["iteration"] for r in self.iterations()), default=0)

    def _assert_running(self, what: object = "") -> None:
        assert all(p.poll() is None for p in self.procs), f"a node exited: {what}\n{self.errs()}"

    def wait_iteration(self, iteration: int, timeout: float = 180) -> None:
        """Until some rank logged ``iteration`` (or a later one)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.last_iteration() >= iteration:
                return
            self._assert_running(f"waiting for iteration {iteration}")
            time.sleep(0.1)
        raise AssertionError(f"iteration {iteration} not reached:\n{self.errs()}")

    def wait_warm_machine(self, host: str, view: Callable[[], object], timeout: float = 240) -> None:
        """Until machine ``host`` is registered and each of its ``per_node`` standbys is warm for some
        role, as ``view()`` (a :class:`~trainmover_ext.control.view.View` reader) shows it."""
        deadline = time.time() + timeout
        seen: object = None
        while time.time() < deadline:
            try:
                current = view()
            except StoreError as exc:  # the job is not in etcd yet
                seen = exc
                time.sleep(0.3)
                continue
            members = current.members.values()
            warm = [m for m in members if m.kind == "standby" and m.host == host and m.warm_roles]
            if len(warm) == self.per_node and host in current.nodes:
                return
            seen = (sorted(current.nodes), [(m.member_id, m.host, m.warm_roles) for m in members])
            self._assert_running(seen)
            time.sleep(0.3)
        raise AssertionError(f"standby machine {host} not warm: {seen}\n{self.errs()}")

    def rank_pid(self, rank: int) -> int:
        """The pid of ``rank`` as its active node started it."""
        return json.loads(re.findall(r"pids (\[[\d, ]+\])", self.err(rank // self.per_node))[0])[rank % self.per_node]

    def kill_node(self, node: int) -> None:
        """SIGKILL node ``node``'s agent and every process of its group: the machine is gone."""
        os.killpg(self.procs[node].pid, signal.SIGKILL)

    def finish(self, timeout: float = 300) -> list[int]:
        """Every node's exit code, once all exited; a node still running after ``timeout`` is killed."""
        try:
            return [p.wait(timeout) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()

    def close(self) -> None:
        """Kill what still runs (each node's whole group); stop the etcd if this job started it."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if self._own_etcd:
            self.etcd.stop()
