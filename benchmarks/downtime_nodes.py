"""The node-loss scenario of ``benchmarks/downtime.py``: a whole machine of 4 ranks lost at once.

The demo job (the caller's flags) with ``--use-tp-pp-dp-mapping`` runs on two active nodes of 4 ranks
(each holds one data-parallel replica) and one standby machine of 4 slots (``--tm-standbys 0`` on the
active nodes), as loopback agents of :mod:`harness.nodes` sharing the benchmark's etcd. Once every
standby of the machine is warm and 5 iterations ran since, node 1's agent and all its ranks are
SIGKILLed at a seeded random point inside an iteration. The lost time is measured as ``unexpected_s``
is (:func:`downtime_report.lost_time` from the kill to the end of the first iteration after the
logging rank's ``recovered``, or its joiner's ``promoted``, event, minus one steady iteration).

Called from ``downtime.main`` only; a failed run raises ``RuntimeError`` naming the logs to read.
"""

from __future__ import annotations

import os
import random
import time

from common import wait_until
from downtime_report import iterations, lost_time, phases_of, resume_event, sleep_into_iteration, trajectory

from harness.nodes import Node, NodesJob

MAPPING = ["--use-tp-pp-dp-mapping"]
"""Places TP2·PP2·DP2 so that each node of 4 ranks holds one whole data-parallel replica."""

LOST_NODE = 1
MACHINE = "n2"
"""The standby machine's node name (the third agent)."""

STEADY_ITERATIONS = 5
"""Iterations after the machine is warm that set the steady iteration time (as the sandbox runs do)."""


def node_loss_trial(
    workdir: str,
    name: str,
    job_args: list[str],
    etcd,
    inside: float,
    *,
    at_iteration: int = 0,
    warm_timeout: float = 900,
) -> tuple[dict, dict[int, float]]:
    """One run that loses node 1 at ``inside`` (0..1) of an iteration after ``at_iteration`` at the earliest
    (as the single-rank kill, past the sandbox's recorded first iterations): ``(lost time, trajectory)``.

    ``job_args``: the script's flags including ``MAPPING`` (not the TrainMover ones, added here);
    ``etcd``: the benchmark's ``downtime.Etcd`` (its server, token, ``view`` and ``plan_steps``)."""
    args = [*job_args, "--trainmover", "--tm-standbys", "0"]
    nodes = [Node(), Node(), Node(machine=True)]
    job = NodesJob(os.path.join(workdir, name), args, nodes, name, etcd=etcd.server, token=etcd.token)
    where = f"see {job.dir}/n*.err"
    try:
        job.wait_warm_machine(MACHINE, lambda: etcd.view(name), timeout=warm_timeout)
        # Steady iterations are measured once the machine's standbys stopped competing for the cores.
        steady_after = time.time()
        after = len(job.iterations())
        wait_until(lambda: len(job.iterations()) >= after + STEADY_ITERATIONS, 900, 0.01)
        job.wait_iteration(at_iteration, timeout=900)
        sleep_into_iteration(job.metrics, inside)
        t0 = time.time()
        job.kill_node(LOST_NODE)
        codes = job.finish(timeout=1200)
    finally:
        job.close()
    if codes[0] != 0 or codes[2] != 0:
        raise RuntimeError(f"{name}: the surviving nodes exited {codes}; {where}")
    resumed = resume_event(job.metrics, t0)
    if resumed is None:
        raise RuntimeError(f"{name}: the logging rank recorded no recovery; {where}")
    result = lost_time(job.metrics, t0, resumed, steady_after=steady_after)
    plans = etcd.plan_steps(name)
    failures = [p for p in plans if p["reason"] == "failure"]
    if failures:
        result["phases"] = phases_of(failures[0]["steps"], t0)
    # one plan for the whole node is the design; more would mean the ranks were replaced one by one
    result["failure_plans"] = len(failures)
    result["killed_after_iteration"] = max(e["iteration"] for e in iterations(job.metrics) if e["t_end"] <= t0)
    return result, trajectory(job.metrics)


def node_loss_runs(
    workdir: str,
    job_args: list[str],
    reference: dict[int, float],
    etcd,
    trials: int,
    rng: random.Random,
    *,
    at_iteration: int = 0,
) -> dict:
    """``trials`` node losses; ``node_loss_s`` is the median trial's downtime. ``reference``: the trajectory
    of a fault-free run with the same flags (``job_args`` plus ``MAPPING``)."""
    runs = []
    for trial in range(trials):
        inside = rng.random()
        print(
            f"TrainMover, two nodes of 4 ranks and a standby machine: SIGKILL of node {LOST_NODE} (ranks 4-7) "
            f"at {inside:.2f} of an iteration (trial {trial + 1}/{trials}) ...",
            flush=True,
        )
        res, traj = node_loss_trial(
            workdir, f"nodeloss{trial}", [*job_args, *MAPPING], etcd, inside, at_iteration=at_iteration
        )
        runs.append(dict(res, kill_inside_iteration=round(inside, 3), bit_identical=traj == reference))
    median_run = sorted(runs, key=lambda r: r["downtime_s"])[len(runs) // 2]
    return {
        "node_loss_s": median_run["downtime_s"],
        "node_loss_trials_s": [round(r["downtime_s"], 4) for r in runs],
        "iteration_s": median_run["iteration_s"],
        "bit_identical": all(r["bit_identical"] for r in runs),
        "median": median_run,
        "trials": runs,
    }
