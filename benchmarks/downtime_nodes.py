"""The node scenarios of ``benchmarks/downtime.py``: a whole machine of 4 ranks lost at once, or drained.

The demo job (the caller's flags) with ``--use-tp-pp-dp-mapping`` runs on two active nodes of 4 ranks
(each holds one data-parallel replica) and one standby machine of 4 slots (``--tm-standbys 0`` on the
active nodes), as loopback agents of :mod:`harness.nodes` sharing the benchmark's etcd. Once every
standby of the machine is warm and 5 iterations ran since, node 1 (ranks 4-7) either

- is lost (``node_loss_s``): its agent and all its ranks are SIGKILLed at a seeded random point inside
  an iteration. The lost time is measured as ``unexpected_s`` is (:func:`downtime_report.lost_time`
  from the kill to the end of the first iteration after the logging rank's ``recovered``, or its
  joiner's ``promoted``, event, minus one steady iteration); or
- is drained (``drain_s``): ``trainmover drain --node n1`` moves its 4 ranks onto the machine in one
  two-phase planned epoch. The lost time is measured as ``planned_s`` is: from the command's start to
  the end of the first iteration after the logging rank's (a stayer's) ``recovered`` event of reason
  ``planned``, minus every newly completed iteration in that window.

Called from ``downtime.main`` only (and :func:`trainmover_command` from its ``migrate_rank``); a failed
run raises ``RuntimeError`` naming the logs to read.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable

from common import ROOT, wait_until
from downtime_report import iterations, lost_time, phases_of, resume_event, sleep_into_iteration, trajectory

from harness.nodes import Node, NodesJob

MAPPING = ["--use-tp-pp-dp-mapping"]
"""Places TP2·PP2·DP2 so that each node of 4 ranks holds one whole data-parallel replica."""

MOVED_NODE = 1
"""The active node that is lost or drained (ranks 4-7; the logging rank is on node 0)."""
MACHINE = "n2"
"""The standby machine's node name (the third agent)."""

STEADY_ITERATIONS = 5
"""Iterations after the machine is warm that set the steady iteration time (as the sandbox runs do)."""

DRAIN_WAIT_S = 120
"""``trainmover drain --wait``: warm joiners were ready within 3 s and the leavers hand over a few
iterations later; a drain that hangs fails its trial after this long instead of the command's 300 s."""


def trainmover_command(cli_args: list[str], job: str, etcd_flags: list[str], timeout: float) -> tuple[float, str]:
    """Run ``trainmover <cli_args>`` for ``job`` to its end: ``(t0, stdout)``, t0 when the command started
    (the operator's request, from which a planned move's lost time is counted). A non-zero exit raises
    ``RuntimeError`` with the command's output."""
    cmd = [sys.executable, "-m", "trainmover_ext.cli", *cli_args, "--tm-job", job, *etcd_flags]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"`trainmover {' '.join(cli_args)}` exited {out.returncode}: {out.stdout}{out.stderr}")
    return t0, out.stdout


def nodes_trial(
    workdir: str,
    name: str,
    job_args: list[str],
    etcd,
    act: Callable[[NodesJob], float],
    *,
    reason: str,
    lost: int | None = None,
    at_iteration: int = 0,
    warm_timeout: float = 900,
) -> tuple[dict, dict[int, float]]:
    """One run of the three nodes that calls ``act(job)`` -> t0 once the machine is warm, the job steady
    and ``at_iteration`` logged: ``(lost time, trajectory)``. ``reason``: the plan's (``failure`` or
    ``planned``, whose newly completed iterations are credited); ``lost``: the node ``act`` kills, whose
    exit code is not checked.

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
        t0 = act(job)
        codes = job.finish(timeout=1200)
    finally:
        job.close()
    if any(code != 0 for node, code in enumerate(codes) if node != lost):
        killed = "" if lost is None else f" (node {lost} was killed)"
        raise RuntimeError(f"{name}: the nodes exited {codes}{killed}; {where}")
    resumed = resume_event(job.metrics, t0, reason=reason)
    if resumed is None:
        raise RuntimeError(f"{name}: the logging rank recorded no {reason} recovery; {where}")
    result = lost_time(job.metrics, t0, resumed, planned=reason == "planned", steady_after=steady_after)
    plans = [p for p in etcd.plan_steps(name) if p["reason"] == reason]
    if plans:
        result["phases"] = phases_of(plans[0]["steps"], t0)
        result["switch_at"] = plans[0]["switch_at"]
    # one plan for the whole node is the design; more would mean the ranks were moved one by one
    result["plans"] = len(plans)
    result["after_iteration"] = max(e["iteration"] for e in iterations(job.metrics) if e["t_end"] <= t0)
    return result, trajectory(job.metrics)


def kill_node_inside(inside: float) -> Callable[[NodesJob], float]:
    """SIGKILL node :data:`MOVED_NODE` whole at ``inside`` (0..1) of the next iteration."""

    def act(job: NodesJob) -> float:
        sleep_into_iteration(job.metrics, inside)
        t0 = time.time()
        job.kill_node(MOVED_NODE)
        return t0

    return act


def drain_node(name: str, etcd, drained: list[str]) -> Callable[[NodesJob], float]:
    """``trainmover drain --node n1`` to its end (the node is free); its output goes to ``drained``."""

    def act(job: NodesJob) -> float:
        cli = ["drain", "--node", f"n{MOVED_NODE}", "--wait", str(DRAIN_WAIT_S)]
        t0, out = trainmover_command(cli, name, etcd.flags, timeout=DRAIN_WAIT_S + 60)
        drained.append(out.strip())
        return t0

    return act


def trial_runs(scenario: str, trials: int, one_trial: Callable[[int], dict]) -> dict:
    """``one_trial(trial)`` -> the run, for each of ``trials``; ``<scenario>_s`` is the median run's downtime
    and ``<scenario>_trials_s`` every run's. A trial that raises ``RuntimeError`` is listed in ``failed``
    (its logs stay in the work directory) and the others still count: one failed move must not lose the
    other figures. ``bit_identical`` holds only when every trial finished equal to the reference."""
    runs, failed = [], []
    for trial in range(trials):
        try:
            runs.append(one_trial(trial))
        except RuntimeError as exc:
            print(f"{scenario} trial {trial + 1}/{trials} failed: {exc}", flush=True)
            failed.append(str(exc)[:1000])
    median_run = sorted(runs, key=lambda r: r["downtime_s"])[len(runs) // 2] if runs else None
    return {
        f"{scenario}_s": median_run["downtime_s"] if runs else None,
        f"{scenario}_trials_s": [round(r["downtime_s"], 4) for r in runs],
        "iteration_s": median_run["iteration_s"] if runs else None,
        "bit_identical": not failed and all(r["bit_identical"] for r in runs),
        "failed": failed,
        "median": median_run or {},
        "trials": runs,
    }


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
    """``trials`` node losses (:func:`trial_runs`). ``reference``: the trajectory of a fault-free run with
    the same flags (``job_args`` plus ``MAPPING``)."""

    def one_trial(trial: int) -> dict:
        inside = rng.random()
        print(
            f"TrainMover, two nodes of 4 ranks and a standby machine: SIGKILL of node {MOVED_NODE} (ranks 4-7) "
            f"at {inside:.2f} of an iteration (trial {trial + 1}/{trials}) ...",
            flush=True,
        )
        act = kill_node_inside(inside)
        res, traj = nodes_trial(
            workdir,
            f"nodeloss{trial}",
            [*job_args, *MAPPING],
            etcd,
            act,
            reason="failure",
            lost=MOVED_NODE,
            at_iteration=at_iteration,
        )
        return dict(res, kill_inside_iteration=round(inside, 3), bit_identical=traj == reference)

    return trial_runs("node_loss", trials, one_trial)


def drain_runs(
    workdir: str, job_args: list[str], reference: dict[int, float], etcd, trials: int, *, at_iteration: int = 0
) -> dict:
    """``trials`` drains of node 1 onto the standby machine (:func:`trial_runs`), and
    ``drain_over_iteration``: ``drain_s`` over the median run's steady iteration. ``reference`` as for
    :func:`node_loss_runs`."""

    def one_trial(trial: int) -> dict:
        print(
            f"TrainMover, two nodes of 4 ranks and a standby machine: trainmover drain --node n{MOVED_NODE} "
            f"(ranks 4-7) after iteration {at_iteration} at the earliest (trial {trial + 1}/{trials}) ...",
            flush=True,
        )
        name, drained = f"drain{trial}", []
        act = drain_node(name, etcd, drained)
        res, traj = nodes_trial(
            workdir, name, [*job_args, *MAPPING], etcd, act, reason="planned", at_iteration=at_iteration
        )
        return dict(res, command_output=drained[0], bit_identical=traj == reference)

    out = trial_runs("drain", trials, one_trial)
    out["drain_over_iteration"] = out["drain_s"] / out["iteration_s"] if out["trials"] else None
    return out


SCENARIOS = {
    "node_loss": ("node loss", "4 ranks at once", "node_loss_over_unexpected", "unexpected_s", "1.5 x unexpected_s"),
    "drain": ("drain", "4 ranks to a standby machine", "drain_over_iteration", "its iteration_s", "1.5 iterations"),
}
"""Per result key prefix: the table's name, what moves, the goal's ratio key, its denominator and the goal."""


def nodes_keys(node_loss: dict | None, drain: dict | None, unexpected_s: float) -> dict:
    """The result keys of the node scenarios: ``<scenario>_s``, ``<scenario>_trials_s``, the runs and the
    goals' ratios (``node_loss_over_unexpected`` only when run); None where a scenario was skipped."""
    out: dict = {}
    for scenario, runs in (("node_loss", node_loss), ("drain", drain)):
        for key in (f"{scenario}_s", f"{scenario}_trials_s"):
            out[key] = runs[key] if runs else None
        out[scenario] = runs
    if node_loss and node_loss["trials"]:
        out["node_loss_over_unexpected"] = node_loss["node_loss_s"] / unexpected_s
    out["drain_over_iteration"] = drain["drain_over_iteration"] if drain else None
    return out


def nodes_rows(result: dict) -> list[tuple[str, str]]:
    """The summary table's rows of the node scenarios: the median, and its ratio with the goal."""
    rows = []
    for scenario, (_, what, ratio, over, goal) in SCENARIOS.items():
        runs = result[scenario]
        done = bool(runs and runs["trials"])
        if done:
            seconds = (
                f"{runs[f'{scenario}_s']:.3f} (trials {runs[f'{scenario}_trials_s']}, "
                f"iteration {runs['iteration_s']:.3f} s)"
            )
        else:
            seconds = "skipped" if not runs else "failed"
        if runs and runs["failed"]:
            seconds += f"; {len(runs['failed'])} trial(s) failed, logs kept"
        rows.append((f"{scenario}_s ({what}, median)", seconds))
        rows.append((f"{scenario}_s / {over}", f"{result[ratio]:.3f} (goal <= {goal})" if done else "-"))
    return rows


def nodes_phase_rows(result: dict) -> list[tuple[str, str]]:
    """The phases of each node scenario's median run, for the summary table."""
    return [
        (f"  {name} {k}", f"{v:.3f}")
        for scenario, (name, *_) in SCENARIOS.items()
        if result[scenario]
        for k, v in result[scenario]["median"].get("phases", {}).items()
    ]
