#!/usr/bin/env python3
"""Lost time of a whole machine: lost (4 ranks at once) or drained onto a standby machine, against a twin.

The demo job (8 ranks, TP2 x PP2 x DP2, bf16, dropout 0.1) with ``--use-tp-pp-dp-mapping`` runs on two
active loopback nodes of 4 ranks (each holds one data-parallel replica) and one standby machine of 4
slots, as agents of :mod:`harness.nodes` sharing this benchmark's etcd. Each trial runs a fault-free
**twin** and then the faulted run, the same way: once every standby of the machine is warm and 5
iterations ran since (and ``--at-iteration`` is logged), node 1 (ranks 4-7)

- is lost (``node_loss_lost_s``): its agent and all its ranks SIGKILLed at the trial's seeded point
  inside the next iteration; or
- is drained (``drain_lost_s``): ``trainmover drain --node n1`` moves its 4 ranks in one planned epoch
  (asked again every 2 s while the controller rejects it because the machine's standbys have not
  warmed the node's roles yet; the fault's time is the accepted request's).

Lost time is ``lost_time.py``'s: the faulted run's wall time minus the twin's over the same iterations
(``--window-before`` before the fault's iteration to ``--window-after`` after it). Each event's record
has the plan's phases, every rank's resume (``harness.recorder``), the first iteration's end and the
penalty window; ``state_identical`` compares every rank's state hash with the twin's.

    python benchmarks/downtime_nodes.py --json benchmarks/results/downtime_nodes.json
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_records as rr  # noqa: E402
from common import ROOT, measured_at, print_table, read_events, wait_until, write_json  # noqa: E402
from lost_time import (  # noqa: E402
    Fault,
    event_record,
    iterations_from_records,
    lost_per_failure_s,
    spread,
    steady_iteration_s,
)
from strategies import fault_window, pre_fault_ratio  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, RECORDED_PRETRAIN, demo_args, ensure_corpus  # noqa: E402
from harness.nodes import Node, NodesJob  # noqa: E402
from harness.recorder import RECORDS_ENV  # noqa: E402

MAPPING = ["--use-tp-pp-dp-mapping"]
"""Places TP2·PP2·DP2 so that each node of 4 ranks holds one whole data-parallel replica."""
MOVED_NODE, MACHINE = 1, "n2"
"""The active node lost or drained (ranks 4-7; the logging rank is on node 0), the standby machine."""
STEADY_ITERATIONS = 5
DRAIN_WAIT_S = 120


class Etcd:
    """An etcd that outlives the jobs, so that the plans can be read after each run."""

    def __init__(self, workdir: str):
        from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig

        self.server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=os.path.join(workdir, "etcd"))).start(timeout=60)
        self.token = secrets.token_hex(16)
        self.flags = ["--tm-etcd-endpoints", ",".join(self.server.endpoints), "--tm-job-token", self.token]

    def _space(self, job: str):
        from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
        from trainmover_ext.kv.job import JobSpace

        return JobSpace.open(EtcdKV(EtcdClientConfig(endpoints=",".join(self.server.endpoints))), job, self.token)

    def view(self, job: str):
        from trainmover_ext.control.view import read_view

        space = self._space(job)
        try:
            return read_view(space)
        finally:
            space.kv.close()

    def plans(self, job: str) -> list[dict]:
        from trainmover_ext.control.records import MigrationPlan

        space = self._space(job)
        try:
            entries = space.kv.get_prefix(space.key("migrations") + "/").entries
            plans = [MigrationPlan.from_bytes(e.value, key=e.key) for e in entries]
        finally:
            space.kv.close()
        return [{"epoch": p.epoch, "reason": p.reason, "steps": p.steps} for p in sorted(plans, key=lambda p: p.epoch)]

    def stop(self) -> None:
        self.server.stop()


def kill_node_inside(inside: float, steady_s: float) -> Callable[[NodesJob], tuple[float, int]]:
    """SIGKILL node 1 whole at ``inside`` of a steady iteration after the last one logged: (t0, iteration)."""

    def act(job: NodesJob) -> tuple[float, int]:
        seen = job.last_iteration()
        wait_until(lambda: job.last_iteration() > seen, 300, 0.005)  # right after an iteration ended
        time.sleep(inside * steady_s)
        landed = job.last_iteration() + 1
        t0 = time.time()
        job.kill_node(MOVED_NODE)
        return t0, landed

    return act


def drain_node(job_name: str, etcd: Etcd) -> Callable[[NodesJob], tuple[float, int]]:
    """``trainmover drain --node n1`` to its end: (when it was asked, the iteration then)."""

    def act(job: NodesJob) -> tuple[float, int]:
        cmd = [sys.executable, "-m", "trainmover_ext.cli", "drain", "--node", f"n{MOVED_NODE}"]
        cmd += ["--wait", str(DRAIN_WAIT_S), "--tm-job", job_name, *etcd.flags]
        deadline = time.time() + DRAIN_WAIT_S
        while True:
            landed = job.last_iteration() + 1
            t0 = time.time()
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DRAIN_WAIT_S + 60)
            if out.returncode == 0:
                return t0, landed
            # Rejected while the machine's standbys still warm the node's roles: an operator asks again.
            if "rejected" not in out.stdout + out.stderr or time.time() > deadline:
                raise RuntimeError(f"trainmover drain exited {out.returncode}: {out.stdout}{out.stderr}")
            time.sleep(2.0)

    return act


def run_nodes(workdir: str, name: str, args: list[str], etcd: Etcd, at_iteration: int, act=None) -> dict:
    """One run of the three nodes; ``act(job) -> t0`` once the machine is warm and the job steady."""
    records = os.path.join(workdir, f"{name}.records")
    env = ((RECORDS_ENV, records),)
    nodes = [Node(env=env), Node(env=env), Node(machine=True, env=env)]
    job = NodesJob(
        os.path.join(workdir, name), [*args, "--trainmover", "--tm-standbys", "0"], nodes, name,
        etcd=etcd.server, token=etcd.token, script=RECORDED_PRETRAIN,
    )  # fmt: skip
    t0 = landed = None
    try:
        job.wait_warm_machine(MACHINE, lambda: etcd.view(name), timeout=900)
        after = len(job.iterations())
        wait_until(lambda: len(job.iterations()) >= after + STEADY_ITERATIONS, 900, 0.01)
        job.wait_iteration(at_iteration, timeout=900)
        if act is not None:
            t0, landed = act(job)
        codes = job.finish(timeout=1200)
    finally:
        job.close()
    if any(code != 0 for node, code in enumerate(codes) if not (act is not None and node == MOVED_NODE)):
        raise RuntimeError(f"{name}: the nodes exited {codes}; see {job.dir}/n*.err")
    return {"metrics": job.metrics, "records": rr.RunFiles(os.path.join(workdir, name)), "t0": t0, "landed": landed}


def trial(workdir: str, kind: str, n: int, args: list[str], etcd: Etcd, opts, point: float) -> dict:
    """Twin, then the faulted run, of one trial of ``kind`` (``node_loss`` or ``drain``)."""
    label = f"{kind}{n}"
    print(f"{label}: fault-free twin (two nodes and a standby machine) ...", flush=True)
    twin = run_nodes(workdir, label + "_twin", args, etcd, opts.at_iteration)
    t_its = iterations_from_records(read_events(twin["metrics"]))
    steady = steady_iteration_s(t_its)
    act = kill_node_inside(point, steady) if kind == "node_loss" else drain_node(label, etcd)
    print(f"{label}: {'SIGKILL of node 1' if kind == 'node_loss' else 'trainmover drain --node n1'} ...", flush=True)
    faulted = run_nodes(workdir, label, args, etcd, opts.at_iteration, act)
    f_its = iterations_from_records(read_events(faulted["metrics"]))
    k, t0 = faulted["landed"], faulted["t0"]
    records = faulted["records"].process_records()
    window = fault_window(records, f_its, t0, k, opts.window_before, opts.window_after, opts.iters)
    reason = "failure" if kind == "node_loss" else "planned"
    plans = [p for p in etcd.plans(label) if p["reason"] == reason]
    steps = plans[0]["steps"] if plans else {}
    fault = Fault(
        kind="node_kill" if kind == "node_loss" else "drain",
        rank=4 * MOVED_NODE,
        t=t0,
        iteration=k,
        detected_t=steps.get("detected") if kind == "node_loss" else None,
        resume_t_by_rank=rr.resume_times(records, t0, float("inf")),
        extra={
            "node": f"n{MOVED_NODE}",
            "ranks": list(range(4 * MOVED_NODE, 4 * MOVED_NODE + 4)),
            "plans": len(plans),  # one plan for the whole node is the design
            "plan": {"epoch": plans[0]["epoch"], "steps_s": {s: round(v - t0, 4) for s, v in steps.items()}}
            if plans
            else None,
            "joiner_started": "standby machine (forked at its start)",
            "idle_standbys": 4,
        },
    )
    f_traj, t_traj = rr.trajectory(read_events(faulted["metrics"])), rr.trajectory(read_events(twin["metrics"]))
    states = rr.compare_states(rr.state_hashes(records), rr.state_hashes(twin["records"].process_records()), 8)
    return {
        "lost_per_failure_s": round(lost_per_failure_s(f_its, t_its, 1, *window), 4),
        "steady_iteration_s": round(steady, 4),
        "window": list(window),
        "pre_fault_ratio": pre_fault_ratio(f_its, t_its, k),
        "kill_inside_iteration": point if kind == "node_loss" else None,
        "bit_identical": bool(f_traj) and f_traj == t_traj,
        **states,
        "events": [event_record(fault, f_its, t_its, window[1] + 1, steady)],
        "iterations": [
            {
                "run": f"{kind}/{n}/{which}",
                "iteration": it.iteration,
                "start": round(it.start, 4),
                "end": round(it.end, 4),
            }
            for which, its in (("twin", t_its), ("faulted", f_its))
            for it in its
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--trials", type=int, default=3, help="Trials (twin + faulted run) per scenario.")
    parser.add_argument("--scenarios", default="node_loss,drain", help="node_loss, drain (comma-separated).")
    parser.add_argument("--iters", type=int, default=60, help="Iterations of every run.")
    parser.add_argument("--at-iteration", type=int, default=10, help="The earliest iteration after which to act.")
    parser.add_argument("--window-before", type=int, default=3, help="Compared from this many iterations before ...")
    parser.add_argument("--window-after", type=int, default=20, help="... to this many after the fault's iteration.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kill points inside the iteration.")
    parser.add_argument("--keep-logs", action="store_true", help="Keep every run's files (the path is printed).")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    opts = parser.parse_args(argv)
    ensure_corpus(opts.data_prefix)
    rng = random.Random(opts.seed)
    points = [round(rng.random(), 3) for _ in range(opts.trials)]
    args = demo_args(opts.data_prefix, opts.iters) + ["--bf16", *MAPPING]
    workdir = tempfile.mkdtemp(prefix="tm_nodes_")
    etcd = Etcd(workdir)
    out: dict = {}
    events, rows, failed = [], [], []
    try:
        for kind in [s.strip() for s in opts.scenarios.split(",") if s.strip()]:
            trials = []
            for n, point in enumerate(points):
                try:
                    trials.append(trial(workdir, kind, n, args, etcd, opts, point))
                except (RuntimeError, AssertionError, TimeoutError, ValueError) as exc:
                    print(f"{kind} trial {n} failed: {str(exc)[:300]}", flush=True)
                    failed.append(f"{kind} {n}: {str(exc)[:500]}")
                    continue
                events += [dict(e, scenario=kind, trial=n) for e in trials[-1].pop("events")]
                rows += trials[-1].pop("iterations")
            out[kind] = {
                "lost_s": spread(t["lost_per_failure_s"] for t in trials),
                "lost_iters": spread(t["lost_per_failure_s"] / t["steady_iteration_s"] for t in trials),
                "bit_identical": bool(trials) and all(t["bit_identical"] for t in trials),
                "state_identical": bool(trials) and all(t["state_identical"] for t in trials),
                "trials": trials,
            }
    finally:
        etcd.stop()
    result = {
        "command": shlex.join(["python", "benchmarks/downtime_nodes.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "job": "demo: 8 ranks TP2 x PP2 x DP2 (--use-tp-pp-dp-mapping), two nodes of 4 and a standby machine of 4 "
        "slots on loopback, bf16, dropout 0.1 (CPU gloo, 2 cores)",
        "config": vars(opts) | {"json": None},
        "node_loss_lost_s": out.get("node_loss", {}).get("lost_s", {}).get("median"),
        "drain_lost_s": out.get("drain", {}).get("lost_s", {}).get("median"),
        "scenarios": out,
        "failed": failed,
        "events": events,
        "iterations": rows,
    }
    if opts.keep_logs or failed:
        print(f"run files kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(
        "lost time of a machine (seconds)",
        [
            (k, s["lost_s"]["median"], s["lost_s"]["values"], s["bit_identical"], s["state_identical"])
            for k, s in out.items()
        ],
        ("scenario", "median", "trials", "loss same", "state same"),
    )
    write_json(opts.json, result)
    return 0 if not failed and all(s["bit_identical"] and s["state_identical"] for s in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
