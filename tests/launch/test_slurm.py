"""scripts/slurm/trainmover.sbatch under a real Slurm (munged + slurmctld + 3 emulated slurmd).

The cluster is started once for the module and stopped by pid afterwards
(after scancel and an empty squeue); see ``slurm_harness``. Slurm is installed
with apt when missing, and a failure to do so fails the test: CI runs as root.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

from harness.jobs import REPO_ROOT
from helpers import pid_alive, read_metrics, run_job, tiny_args, trajectory
from support.slurm_harness import SlurmCluster
from trainmover_ext.netutil import free_ports

pytestmark = pytest.mark.slow

SBATCH = os.path.join(REPO_ROOT, "scripts", "slurm", "trainmover.sbatch")
DRAIN = os.path.join(REPO_ROOT, "scripts", "slurm", "drain_node.sh")
ITERS = 3


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, cpus_per_node=8)
    cluster.start(timeout=60)
    try:
        yield cluster
    finally:
        cluster.stop(timeout=30)
        alive = {name: p.pid for name, p in cluster.procs.items() if p.poll() is None}
        assert not alive, f"Slurm daemons still running after stop(): {alive}"


@pytest.fixture
def etcd_server(tmp_path):
    """A real single-member etcd for the job's control plane, stopped by pid."""
    from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig

    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd"))
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()


def _job_ports(etcd_members: int = 1) -> tuple[int, int]:
    """A master port and an etcd base port for one job, each free on loopback now: the base and the
    2 * ``etcd_members`` - 1 ports after it (member i takes client port base + 2i and peer port base + 2i + 1).

    They are drawn below the kernel's ephemeral range, so a connection some process opens meanwhile
    (the reference run's, etcd clients', gloo's) cannot take one of them before the job binds it; the
    ephemeral range is where bind(port 0) draws from. Call this just before submitting the job."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, low - 2 * etcd_members - 2)
        wanted = [base - 1] + [base + i for i in range(2 * etcd_members)]
        if all(_bindable(port) for port in wanted):
            return base - 1, base
    raise AssertionError(f"no {2 * etcd_members + 1} consecutive free ports below {low} on loopback")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read(path) -> str:
    return open(path).read() if os.path.exists(path) else f"(no file {path})"


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_sbatch_trains_on_two_nodes(slurm, tmp_path, tls):
    """2 nodes x 2 ranks (PP2 x DP2), embedded etcd on the first node (its auth on; with
    --tm-etcd-tls over TLS with the job's client certificates): training completes on both nodes."""
    master_port, etcd_port = _job_ports()
    logs, out = tmp_path / "logs", tmp_path / "batch.out"
    metrics = tmp_path / "metrics.jsonl"
    train = tiny_args(None, pp=2, iters=ITERS, gbs=4, extra=["--tm-metrics-file", str(metrics)])
    job = slurm.submit(
        SBATCH,
        [
            "--nproc-per-node",
            "2",
            "--master-port",
            str(master_port),
            "--etcd-port",
            str(etcd_port),
            "--log-dir",
            str(logs),
            "--python",
            sys.executable,
            *(["--tm-etcd-tls"] if tls else []),
            "--",
            *train,
        ],
        ["-N", "2", "--time", "5", "-o", str(out)],
        cwd=REPO_ROOT,
    )
    info = slurm.wait_job(job, timeout=150)
    node_logs = sorted(logs.glob("node-*.log"))
    report = f"batch output:\n{_read(out)[-3000:]}\n" + "\n".join(
        f"--- {p.name}:\n{_read(p)[-3000:]}" for p in node_logs
    )
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job {job}: {info['JobState']} {info['ExitCode']}\n{report}"
    )

    batch = _read(out)
    assert "world size 4" in batch and "rendezvous 127.0.0.1:" in batch, report
    assert f"agent logs: {logs}" in batch and "status: trainmover status --tm-etcd-endpoints 127.0.0.1:" in batch, (
        report
    )
    assert "training finished on all nodes" in batch, report
    # One agent per Slurm node, each knowing its Slurm node name and id.
    assert [p.name for p in node_logs] == ["node-0.log", "node-1.log"], report
    for node_id, path in enumerate(node_logs):
        text = _read(path)
        assert f"node n{node_id + 1} (id {node_id} of 2)" in text and "all ranks finished" in text, report
        # The agent's task holds every CPU of its node, not one (ConstrainCores would bind it to them).
        assert "cpus-per-task 8 of 8 on the node" in text, report
    assert "each node's agent: srun --cpus-per-task=8 --cpu-bind=none" in batch, report
    iters = sorted({rec["iteration"] for rec in read_metrics(str(metrics))})
    assert iters == list(range(1, ITERS + 1)), f"iterations logged: {iters}\n{report}"
    # The embedded etcd was stopped with the job, and the token file is private.
    etcd_pid = int(re.search(r"embedded on n1, pid (\d+)", batch).group(1))
    assert not pid_alive(etcd_pid), f"embedded etcd (pid {etcd_pid}) outlived the job"
    assert oct(os.stat(logs / "job-token").st_mode & 0o777) == "0o600"
    assert oct(os.stat(logs / "etcd-root-password").st_mode & 0o777) == "0o600"
    if tls:
        assert f"--tm-etcd-ca {logs}/etcd-tls/ca.pem" in batch, report
        assert oct(os.stat(logs / "etcd-tls" / "member.key").st_mode & 0o777) == "0o600"
        assert "https://" in _read(logs / "etcd.log"), report


def _failover_under_slurm(
    slurm, tmp_path, nodes: int, nproc: int, metrics_port: int, standby_nodes: int = 0
) -> tuple[list[str], str]:
    """Submit the sbatch script (``nodes`` x ``nproc`` ranks, PP2 x DP2, a warm standby per node, or with
    ``standby_nodes`` that many standby machines and none beside the ranks) with rank 3 SIGKILLed in
    iteration 3 (6 with standby machines: they start beside the job and must be warm by then); assert
    the job completed every iteration with no second migration or fallback. Returns the node logs (the
    standby machines' last) and a report for assertion messages."""
    master_port, etcd_port = _job_ports()
    logs, out = tmp_path / "logs", tmp_path / "batch.out"
    metrics = tmp_path / "metrics.jsonl"
    iters, fault = (10, "3:6:forward") if standby_nodes else (6, "3:3:forward")
    train = tiny_args(
        None,
        pp=2,
        iters=iters,
        gbs=4,
        # --tm-standby-nice 0: the drill fires at iteration 3, and at the lowest priority on
        # two busy cores the standbys may not be warm by then (see tests/helpers.tm_args)
        extra=[
            "--trainmover",
            "--tm-standbys",
            "0" if standby_nodes else "1",
            "--tm-standby-nice",
            "0",
            "--tm-inject-fault",
            fault,
            # 4 standbys of a standby node beside the ranks on 2 cores: the basic warm-up
            *(["--tm-no-sandbox"] if standby_nodes else []),
            "--tm-metrics-file",
            str(metrics),
        ],
    )
    job = slurm.submit(
        SBATCH,
        [
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(master_port),
            "--etcd-port",
            str(etcd_port),
            "--metrics-port",
            str(metrics_port),
            "--log-dir",
            str(logs),
            "--python",
            sys.executable,
            "--standby-nodes",
            str(standby_nodes),
            "--",
            *train,
        ],
        ["-N", str(nodes + standby_nodes), "--time", "5", "-o", str(out)],
        cwd=REPO_ROOT,
    )
    info = slurm.wait_job(job, timeout=240)
    node_logs = [_read(logs / f"node-{n}.log") for n in range(nodes)]
    node_logs += [_read(logs / f"standby-node-{n}.log") for n in range(standby_nodes)]
    report = f"batch output:\n{_read(out)[-3000:]}" + "".join(
        f"\n--- node-{n}.log:\n{text[-4000:]}" for n, text in enumerate(node_logs)
    )
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job {job}: {info['JobState']} {info['ExitCode']}\n{report}"
    )
    joined = "".join(node_logs)
    assert "epoch 2" not in joined and "falling back" not in joined and "restart" not in joined, report
    iterations = sorted({rec["iteration"] for rec in read_metrics(str(metrics))})
    assert iterations == list(range(1, iters + 1)), f"iterations logged: {iterations}\n{report}"
    return node_logs, report


def test_killed_rank_is_replaced_by_the_warm_standby(slurm, tmp_path):
    """One node task with 4 ranks (PP2 x DP2) and a warm standby (--tm-standbys 1), started by srun.
    Rank 3 is SIGKILLed in iteration 3: the standby takes rank 3 over, nobody restarts, training completes.
    (The cross-node case is the next test.)"""
    (metrics_port,) = free_ports(1)
    (node_log,), report = _failover_under_slurm(slurm, tmp_path, 1, 4, metrics_port)
    assert re.search(r"rank 3 \((worker-n0-3-\w+)\) exited with code -9; reported", node_log), report
    assert re.search(r"epoch 1 \(failure\): rank 3 -> (standby-n0-0-\w+) \(pid \d+\); state from replica", node_log), (
        report
    )
    assert f"metrics: http://{socket.gethostname()}:{metrics_port}/metrics" in node_log, report


def test_a_standby_node_takes_the_killed_rank_in_its_slot(slurm, tmp_path):
    """--standby-nodes 1 on a 2-node allocation: node n1 runs 4 ranks (PP2 x DP2) and no standby, node n2
    is a standby machine of 4 slots (its own job step). Rank 3 is SIGKILLed in iteration 6: a slot of the
    standby machine takes it over with its own slot as LOCAL_RANK, nobody restarts, training completes,
    and the standby machine leaves with the job."""
    # Both emulated nodes are this host: each agent takes a free metrics port.
    (active, machine), report = _failover_under_slurm(slurm, tmp_path, 1, 4, 0, standby_nodes=1)
    assert "node n2: standby machine with 4 slot(s) for a job of 1 node(s)" in machine, report
    assert re.search(r"rank 3 \(worker-n0-3-\w+\) exited with code -9; reported", active), report
    # The slot of rank 3's local rank when that standby is warm by iteration 6, else the first warm one
    # (the preference order is tested in tests/control/test_decide_nodes.py): it serves in its own slot.
    taken = re.search(r"epoch 1 \(failure\): rank 3 -> standby-m-(\d)-\w+ \(pid \d+\); state from replica", machine)
    assert taken, report
    assert f"promoted to rank 3 (local rank {taken.group(1)}," in machine, report


def test_drain_node_requests_a_drain_of_the_node_and_drains_slurm(slurm, tmp_path, etcd_server):
    """drain_node.sh asks for a drain of n2 (through the real `trainmover drain` against a real etcd; no
    controller runs here, so --wait 0 only queues it) and marks n2 DRAIN in Slurm."""
    from trainmover_ext.control.membership import init_job
    from trainmover_ext.control.records import MigrationRequest, RankRecord
    from trainmover_ext.kv import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import JobSpace

    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")
    job = slurm.submit(str(script), [], ["-N", "2", "--time", "3", "-o", str(tmp_path / "hold.out")], cwd=str(tmp_path))
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd_server.endpoints, timeout_s=3.0))
    try:
        slurm.wait_running(job, timeout=30)
        space = JobSpace.create(kv, "drain")
        init_job(
            space,
            [
                RankRecord(rank=r, member_id=f"w{r}", host=f"n{r // 2 + 1}", role=("first", "last")[r % 2], replicas=[])
                for r in range(4)
            ],
        )
        proc = subprocess.run(
            [
                "bash",
                DRAIN,
                "--node",
                "n2",
                "--wait",
                "0",
                "--slurm-drain",
                "--python",
                sys.executable,
                "--tm-etcd-endpoints",
                ",".join(etcd_server.endpoints),
                "--tm-job",
                "drain",
                "--tm-job-token",
                space.token,
            ],
            env=slurm.env(),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "requested drain" in proc.stdout and "of node n2 (ranks [2, 3])" in proc.stdout, proc.stdout
        requests = [
            MigrationRequest.from_bytes(e.value, key=e.key) for e in kv.get_prefix(space.key("requests/")).entries
        ]
        assert [(r.node, r.rank) for r in requests] == [("n2", -1)], requests
        state = subprocess.run(
            ["sinfo", "-h", "-n", "n2", "-o", "%T"], env=slurm.env(), capture_output=True, text=True, timeout=15
        ).stdout.strip()
        assert state in ("draining", "drained"), state
    finally:
        kv.close()
        subprocess.run(["scancel", str(job)], env=slurm.env(), capture_output=True, timeout=15)
        subprocess.run(
            ["scontrol", "update", "NodeName=n2", "State=RESUME"], env=slurm.env(), capture_output=True, timeout=15
        )


def test_killed_rank_is_taken_over_by_a_standby_of_another_node(slurm, tmp_path):
    """Two node tasks, 2 ranks (PP2 x DP2 over both) and a warm standby each. Rank 3 (second node) is
    SIGKILLed in iteration 3; the controller prefers a standby on another host, so the first node's
    standby takes rank 3 over; the second node's agent retires its rank; training completes."""
    # Both emulated nodes are this host: each agent takes a free metrics port.
    (logs0, logs1), report = _failover_under_slurm(slurm, tmp_path, 2, 2, 0)
    assert re.search(r"rank 3 \(worker-n1-1-\w+\) exited with code -9; reported", logs1), report
    assert re.search(r"epoch 1 \(failure\): rank 3 -> standby-n0-0-\w+ \(pid \d+\); state from replica", logs0), report
    assert "on another node" in logs1, report


def test_a_lost_node_moves_to_the_standby_node_and_the_allocation_survives(slurm, tmp_path):
    """-N 3 --standby-nodes 1: n1 and n2 train 4 ranks each (TP2·PP2·DP2 with --use-tp-pp-dp-mapping, so
    each node holds one data-parallel replica), n3 is a standby machine, and the job's embedded etcd has
    one member on each node. Once n3's standbys are warm, n2 is lost: its slurmd and every process Slurm
    runs there (agent, ranks, etcd member) are SIGKILLed. One plan moves all 4 ranks into n3's slots, etcd
    keeps its quorum on n1 and n3, training completes bit-identically to a fault-free run of the same
    flags, and Slurm keeps the allocation: the batch script ends once every rank finished."""
    iters = 40
    logs, out = tmp_path / "logs", tmp_path / "batch.out"
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--trainmover", "--tm-standbys", "0", "--tm-standby-nice", "0", "--tm-no-sandbox"]
    flags += ["--use-tp-pp-dp-mapping"]
    train = tiny_args(None, tp=2, pp=2, iters=iters, gbs=8, extra=flags)
    ref = trajectory(run_job(tmp_path, 8, train, name="ref").metrics_path)
    master_port, etcd_port = _job_ports(etcd_members=3)
    job = slurm.submit(
        SBATCH,
        [
            "--nproc-per-node", "4", "--standby-nodes", "1", "--master-port", str(master_port),
            "--etcd-port", str(etcd_port), "--etcd-members", "3", "--metrics-port", "0",
            "--log-dir", str(logs),
            "--python", sys.executable, "--", *train, "--tm-metrics-file", str(metrics),
        ],
        ["-N", "3", "--time", "8", "-o", str(out)],
        cwd=REPO_ROOT,
    )  # fmt: skip

    def report() -> str:
        parts = [f"batch output:\n{_read(out)[-3000:]}"]
        for path in sorted(logs.glob("*.log")) + sorted(logs.glob("etcd-member-*.out")):
            parts.append(f"--- {path.name}:\n{_read(path)[-3000:]}")
        return "\n".join(parts)

    try:
        slurm.wait_running(job, timeout=60)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            warm = _read(logs / "standby-node-0.log").count("waiting to be promoted")
            done = max((r["iteration"] for r in read_metrics(str(metrics))), default=0)
            if warm == 4 and done >= 3:
                break
            assert slurm.job(job)["JobState"] == "RUNNING", report()
            time.sleep(0.3)
        else:
            raise AssertionError(f"the standby node was not warm in time\n{report()}")
        killed = slurm.lose_node("n2")
        assert killed, "no process of the job ran on n2"
        info = slurm.wait_job(job, timeout=300)
    finally:
        slurm.restore_node("n2")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{report()}"
    assert "3 members on n1 n2 n3" in _read(out), report()
    assert "Node failure on n2" in _read(out), report()  # Slurm saw the node fail, and kept the job
    assert trajectory(str(metrics)) == ref, f"not bit-identical to the fault-free run\n{report()}"
    machine = _read(logs / "standby-node-0.log")
    assert "node n2 lost 4 ranks: all to machine n3 (4 in their own slot)" in machine, report()
    assert sorted(re.findall(r"promoted to rank (\d) \(local rank (\d),", machine)) == [
        ("4", "0"), ("5", "1"), ("6", "2"), ("7", "3"),
    ], report()  # fmt: skip


def test_the_time_limit_signal_saves_a_checkpoint_and_requeues(slurm, tmp_path):
    """`sbatch --signal=B:USR1@T --requeue` with --save/--load and --exit-signal-handler: Slurm's warning
    before the time limit (sent here at once with `scancel --signal=USR1 --batch`) makes the batch script
    stop the agents with SIGTERM; the ranks save a checkpoint at the next iteration boundary and exit; the
    job is requeued, and the second run resumes from that checkpoint, with a fresh embedded etcd, and
    trains every remaining iteration exactly as an uninterrupted run does."""
    iters = 30
    logs, out = tmp_path / "logs", tmp_path / "batch.out"
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    flags = ["--trainmover", "--tm-standbys", "0", "--tm-no-sandbox", "--exit-signal-handler"]
    train = tiny_args(None, pp=2, iters=iters, gbs=4, extra=flags)
    ref = trajectory(run_job(tmp_path, 4, train, name="ref").metrics_path)
    master_port, etcd_port = _job_ports()
    job = slurm.submit(
        SBATCH,
        [
            "--nproc-per-node", "4", "--master-port", str(master_port), "--etcd-port", str(etcd_port),
            "--metrics-port", "0", "--log-dir", str(logs), "--python", sys.executable, "--", *train,
            "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1000", "--tm-metrics-file", str(metrics),
        ],
        ["-N", "1", "--requeue", "--open-mode=append", "--time", "8", "-o", str(out)],
        cwd=REPO_ROOT,
        env=dict(os.environ, TM_TERM_TIMEOUT="60"),
    )  # fmt: skip
    slurm.wait_running(job, timeout=60)
    deadline = time.monotonic() + 180
    while max((r["iteration"] for r in read_metrics(str(metrics))), default=0) < 4:
        assert time.monotonic() < deadline, _read(out) + _read(logs / "node-0.log")
        time.sleep(0.2)
    slurm._run(["scancel", "--signal=USR1", "--batch", str(job)])
    deadline = time.monotonic() + 120
    while slurm.job(job).get("Restarts") != "1":  # requeued
        assert time.monotonic() < deadline, _read(out) + _read(logs / "node-0.log")
        time.sleep(0.3)
    # Slurm holds a requeued job back for a while (BeginTime); the test need not wait for it.
    slurm.start_requeued_now(job, timeout=120)
    info = slurm.wait_job(job, timeout=400)
    report = f"{info}\nbatch output:\n{_read(out)[-4000:]}\n--- node-0.log:\n{_read(logs / 'node-0.log')[-4000:]}"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", report
    assert info.get("Restarts") == "1", report
    assert "SIGUSR1 (time limit near)" in _read(out) and f"requeueing job {job}" in _read(out), report
    saved = sorted(int(p.name.split("_")[-1]) for p in ckpt.glob("iter_*"))
    assert saved and 4 <= saved[0] < iters, f"no checkpoint saved at the signal: {saved}\n{report}"
    assert trajectory(str(metrics)) == ref, f"the resumed run is not the uninterrupted one\n{report}"
