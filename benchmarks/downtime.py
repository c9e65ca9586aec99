#!/usr/bin/env python3
"""Downtime of one failure or one planned move: TrainMover against stop-restart, side by side.

All runs train the same job (the demo job: 8 ranks, TP2 x PP2 x DP2, unless
``--scale`` changes the world size) on this machine, one after the other:

Every run trains with Megatron's dropout (0.1) in bf16 (``--precision``, ``--dropout``).

- ``restart_s``: stop-restart from the latest checkpoint (``benchmarks/restart_baseline.py``):
  SIGKILL of one rank, every rank restarts as a fresh interpreter (spawn, what a
  real stop-restart pays), loads the checkpoint and trains on. ``restart_fork_s``:
  the same with ranks forked from the warm agent (a lower bound), side by side.
- ``unexpected_s``: the same SIGKILL under ``--trainmover --tm-standbys 1``: a warm
  standby takes the rank, its state comes from a data-parallel replica. The kill
  lands at a random point inside an iteration (seeded, ``--seed``), over
  ``--unexpected-trials`` runs: the median, with ``unexpected_range_s`` and every trial.
- ``planned_s``: ``trainmover migrate --rank R`` while the job trains.
- ``node_loss_s``: a whole machine lost, 4 ranks at once (``benchmarks/downtime_nodes.py``): the
  same job with ``--use-tp-pp-dp-mapping`` on two loopback nodes of 4 ranks and a standby machine of
  4 slots; node 1 is SIGKILLed whole at a random point inside an iteration once the machine is warm,
  over ``--node-loss-trials`` runs (0 skips): the median, and ``node_loss_over_unexpected`` (goal <= 1.5).
- ``drain_s``: the same three nodes, ``trainmover drain --node n1`` once the machine is warm: node 1's 4
  ranks move onto it in one two-phase planned epoch, measured as ``planned_s`` is, over ``--drain-trials``
  runs (0 skips): the median, and ``drain_over_iteration`` (goal <= 1.5 steady iterations of that run).
- ``scale``: ``unexpected_s`` at 4, 8 and 16 ranks (a smaller model, so that 16
  ranks fit on the machine), to show that the cost does not grow with the world;
  the median of ``--scale-trials`` SIGKILLs each (every trial in ``trials_s``).

Downtime of a run is the time it lost: from the SIGKILL (or the migrate command)
to the end of the first iteration after the resume, minus one steady iteration
(the issue's definition; an iteration rolled back and re-run counts as lost).
A planned move keeps training while it prepares, so from the migrate command
every newly completed iteration in the window is credited, not just one.
``bit_identical`` is true only when every TrainMover run's loss trajectory equals a
fault-free run of the same job (per scenario in ``bit_identical_by_scenario``).

    python benchmarks/downtime.py --json bench_out/downtime.json [--plot bench_out/downtime.png]

- ``sandbox``: the same SIGKILL with ``--tm-record-dir`` (the standby warms in the sandbox and keeps
  the last role's model), once the standby is warm: of rank 4, the kept role's recorded rank, whose
  model the standby adopts, and of ``--victim``, for which it builds one (``--sandbox-iters``).
- ``nvrx_inprocess_s``: the same SIGKILL under NVIDIA resiliency-ext 0.4.1's in-process
  restart (``benchmarks/nvrx_inprocess.py``: spare ranks, restore from the latest
  checkpoint), when ``nvidia-resiliency-ext`` imports (``requirements-bench.txt``);
  otherwise "nvrx_inprocess_s skipped: <reason>" is printed and the key is null.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, rank_pids, read_events, start_launcher, wait_until, write_json  # noqa: E402
from downtime_baselines import nvrx_baseline, restart_baseline  # noqa: E402
from downtime_nodes import (
    MAPPING,
    drain_runs,
    node_loss_runs,
    nodes_keys,
    nodes_phase_rows,
    nodes_rows,
    trainmover_command,
)  # noqa: E402
from downtime_report import iterations, lost_time, phases_of, plot, resume_event, sleep_into_iteration, trajectory  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus, model_args  # noqa: E402

PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
SETTINGS = {"precision": "bf16", "dropout": 0.1}
"""What every run trains with (set from --precision and --dropout in main)."""


def job_args(data_prefix: str, iters: int, ranks: int) -> list[str]:
    """The demo job at 8 ranks; a smaller model of the same shape family for the scale runs."""
    dropout = ["--hidden-dropout", str(SETTINGS["dropout"]), "--attention-dropout", str(SETTINGS["dropout"])]
    precision = PRECISION_FLAGS[SETTINGS["precision"]]
    if ranks == 8:
        return demo_args(data_prefix, iters) + dropout + precision
    tp, pp = {4: (1, 2), 16: (2, 2)}[ranks]
    return (
        model_args(layers=4, hidden=64, heads=4, seq=64, mbs=1, gbs=16, iters=iters, lr=1e-3)
        + [
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            "--data-path",
            data_prefix + "_text_document",
            "--tokenizer-type",
            "ByteLevelTokenizer",
        ]
        + dropout
        + precision
    )


class Etcd:
    """An embedded etcd that outlives the job, so the migration timeline can be read afterwards."""

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
        """``job``'s control state as its controller reads it (raises ``StoreError`` before it exists)."""
        from trainmover_ext.control.view import read_view

        space = self._space(job)
        try:
            return read_view(space)
        finally:
            space.kv.close()

    def plan_steps(self, job: str) -> list[dict]:
        from trainmover_ext.control.records import MigrationPlan

        space = self._space(job)
        try:
            plans = [
                MigrationPlan.from_bytes(e.value, key=e.key)
                for e in space.kv.get_prefix(space.key("migrations") + "/").entries
            ]
        finally:
            space.kv.close()
        return [{"epoch": p.epoch, "reason": p.reason, "steps": p.steps, "switch_at": p.switch_at} for p in plans]

    def stop(self) -> None:
        self.server.stop()


def reference(
    workdir: str, data_prefix: str, iters: int, ranks: int, name: str = "reference", extra: tuple = ()
) -> dict[int, float]:
    """The fault-free run's trajectory, one launcher of ``ranks``; ``extra``: more script flags."""
    metrics = os.path.join(workdir, f"{name}.jsonl")
    proc = start_launcher(
        ranks,
        job_args(data_prefix, iters, ranks) + [*extra, "--trainmover", "--tm-metrics-file", metrics],
        ["--run-dir", os.path.join(workdir, f"{name}.run")],
        os.path.join(workdir, name),
    )
    if proc.wait(1200) != 0:
        raise RuntimeError(f"fault-free run failed; see {workdir}/{name}.err")
    return trajectory(metrics)


def run_trainmover(
    workdir: str,
    name: str,
    data_prefix: str,
    iters: int,
    ranks: int,
    at_iteration: int,
    action,
    etcd: Etcd,
    extra_args: tuple = (),
    ready=None,
) -> tuple[dict, dict[int, float], list[dict]]:
    """Train under --trainmover with one standby; at ``at_iteration`` (and once ``ready(log_prefix)``, if
    given) call ``action(log_prefix)`` -> t0."""
    metrics = os.path.join(workdir, f"{name}.jsonl")
    log = os.path.join(workdir, name)
    proc = start_launcher(
        ranks,
        job_args(data_prefix, iters, ranks)
        + ["--trainmover", "--tm-standbys", "1", "--tm-metrics-file", metrics, *extra_args],
        ["--run-dir", os.path.join(workdir, f"{name}.run"), "--tm-job", name, "--metrics-port", "-1", *etcd.flags],
        log,
    )
    try:
        wait_until(lambda: any(e["iteration"] >= at_iteration for e in iterations(metrics)), 900, 0.01)
        steady_after = None
        if ready is not None:
            wait_until(lambda: ready(log), 900, 0.05)
            # Steady iterations are measured once the standby stopped competing for the cores.
            steady_after = time.time()
            after = len(iterations(metrics))
            wait_until(lambda: len(iterations(metrics)) >= after + 5, 900, 0.01)
        t0 = action(log)
        if proc.wait(1200) != 0:
            raise RuntimeError(f"{name} failed; see {log}.err")
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = resume_event(metrics, t0)
    if resumed is None:
        raise RuntimeError(f"{name}: the logging rank recorded no recovery; see {log}.err")
    result = lost_time(metrics, t0, resumed, planned=resumed.get("reason") == "planned", steady_after=steady_after)
    promoted = [e for e in read_events(metrics) if e.get("event") == "promoted" and "groups_built" in e]
    if promoted:  # only when the joiner is the logging rank (the scale runs kill it)
        e = promoted[0]
        result["joiner"] = {
            "groups_s": e["groups_built"] - e["promoted_at"],
            "model_s": e["session_built"] - e["groups_built"],
            "links_up_s": e["links_up"] - e["groups_built"],
            "state_s": e["state_ready"] - max(e["session_built"], e["links_up"]),
        }
    plans = etcd.plan_steps(name)
    if plans:
        result["phases"] = phases_of(plans[0]["steps"], t0)
        result["epochs"] = len(plans)
    return result, trajectory(metrics), plans


def sandbox_standby_warm(log: str) -> bool:
    """Whether the launcher's standby finished its sandbox warm-up (it prints so, then waits)."""
    text = "".join(open(log + ext).read() for ext in (".out", ".err") if os.path.exists(log + ext))
    return re.search(r"standby \S+ warm in [\d.]+s \(sandbox", text) is not None


def sandbox_runs(workdir: str, data_prefix: str, iters: int, victims: dict[str, int], etcd: Etcd) -> dict:
    """SIGKILL under ``--tm-record-dir`` once the standby is warm: per case, the downtime and whether the
    standby adopted its kept model (``--tm-keep-role last``: the last role's recorded rank is 4)."""
    ref = reference(workdir, data_prefix, iters, 8, name="reference_sandbox")
    out = {"iters": iters}
    for case, victim in victims.items():
        name = f"sandbox_{case}"
        res, traj, _ = run_trainmover(
            workdir,
            name,
            data_prefix,
            iters,
            8,
            3,
            kill_rank(victim),
            etcd,
            extra_args=("--tm-record-dir", os.path.join(workdir, f"rec_{case}")),
            ready=sandbox_standby_warm,
        )
        text = "".join(open(os.path.join(workdir, name + ext)).read() for ext in (".out", ".err"))
        res.update(
            victim=victim,
            bit_identical=traj == ref,
            adopted=re.search(rf"adopted its kept \w+ model for rank {victim} ", text) is not None,
        )
        out[case] = res
    return out


def kill_rank(rank: int, inside: float | None = None):
    """SIGKILL ``rank``: at once, or ``inside`` (0..1) of a steady iteration after the last logged one ended,
    i.e. at that point inside the next iteration."""

    def action(log: str) -> float:
        pid = rank_pids(log + ".err")[0][rank]
        if inside is not None:
            sleep_into_iteration(log + ".jsonl", inside)
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        return t0

    return action


def migrate_rank(rank: int, name: str, etcd: Etcd):
    def action(log: str) -> float:
        return trainmover_command(["migrate", "--rank", str(rank)], name, etcd.flags, timeout=120)[0]

    return action


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--plot", default=None, help="Also draw the downtimes side by side as a PNG.")
    parser.add_argument("--iters", type=int, default=16, help="Training iterations of each run.")
    parser.add_argument(
        "--planned-iters",
        type=int,
        default=30,
        help="Training iterations of the planned-move run: enough that the standby joins and the move "
        "lands while the job trains (at 16, a slow join met the job's last boundary, where every rank waits).",
    )
    parser.add_argument("--victim", type=int, default=5, help="Rank killed / migrated (8-rank layout).")
    parser.add_argument("--at-iteration", type=int, default=6, help="Act once this iteration is logged.")
    parser.add_argument(
        "--unexpected-trials",
        type=int,
        default=5,
        help="SIGKILL trials of the unexpected scenario, each at a random point inside iteration "
        "AT_ITERATION + 1; the median is unexpected_s.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random kill points.")
    parser.add_argument(
        "--node-loss-trials",
        type=int,
        default=1,
        help="Runs of the node-loss scenario (two nodes of 4 ranks and a standby machine; node 1 SIGKILLed "
        "whole at a random point inside an iteration); the median is node_loss_s. 0 skips it.",
    )
    parser.add_argument(
        "--node-loss-iters",
        type=int,
        default=40,
        help="Iterations of the node-loss and drain runs and their fault-free reference (the standby machine's 4 "
        "standbys must warm, and 5 steady iterations pass, before the kill, and no earlier than after "
        "AT_ITERATION).",
    )
    parser.add_argument(
        "--drain-trials",
        type=int,
        default=1,
        help="Runs of the drain scenario (the node-loss job; `trainmover drain --node n1` once the machine is "
        "warm); the median is drain_s. 0 skips it.",
    )
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISION_FLAGS),
        default="bf16",
        help="Precision of every run (default bf16, as people train).",
    )
    parser.add_argument(
        "--dropout", type=float, default=0.1, help="Hidden and attention dropout of every run (default Megatron's 0.1)."
    )
    parser.add_argument("--scale", default="4,8,16", help="World sizes of the scale runs ('' to skip).")
    parser.add_argument(
        "--scale-trials",
        type=int,
        default=3,
        help="SIGKILL trials per scale world size; the median is reported (single trials on a "
        "shared 2-core machine vary by 2x at 16 ranks).",
    )
    parser.add_argument("--skip-restart", action="store_true", help="Skip the stop-restart baseline.")
    parser.add_argument(
        "--sandbox-iters",
        type=int,
        default=40,
        help="Iterations of the two sandbox-standby runs (the standby must warm before the kill; 0 skips them).",
    )
    parser.add_argument(
        "--skip-nvrx",
        action="store_true",
        help="Skip the NVIDIA resiliency-ext in-process restart baseline (nvrx_inprocess_s, "
        "about 2-3 minutes; it runs only when nvidia-resiliency-ext is installed).",
    )
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    args = parser.parse_args(argv)
    if args.scale_trials < 1 or args.unexpected_trials < 1:
        parser.error("--scale-trials and --unexpected-trials must be at least 1")
    if args.node_loss_trials < 0 or args.drain_trials < 0:
        parser.error("--node-loss-trials and --drain-trials must be 0 (skip) or more")
    SETTINGS.update(precision=args.precision, dropout=args.dropout)
    rng = random.Random(args.seed)
    ensure_corpus(args.data_prefix)
    workdir = tempfile.mkdtemp(prefix="tm_downtime_")
    etcd = Etcd(workdir)
    ok_run = nvrx_failed = False
    node_loss = drain = None
    try:
        print("fault-free reference run (8 ranks) ...", flush=True)
        ref = reference(workdir, args.data_prefix, args.iters, 8)
        unexpected_trials = []
        for trial in range(args.unexpected_trials):
            inside = rng.random()
            print(
                f"TrainMover, SIGKILL of rank {args.victim} at {inside:.2f} of iteration {args.at_iteration + 1} "
                f"(trial {trial + 1}/{args.unexpected_trials}) ...",
                flush=True,
            )
            res, traj, _ = run_trainmover(
                workdir,
                f"unexpected{trial}",
                args.data_prefix,
                args.iters,
                8,
                args.at_iteration,
                kill_rank(args.victim, inside),
                etcd,
            )
            unexpected_trials.append(dict(res, kill_inside_iteration=round(inside, 3), bit_identical=traj == ref))
        unexpected = sorted(unexpected_trials, key=lambda t: t["downtime_s"])[len(unexpected_trials) // 2]
        print(
            f"TrainMover, trainmover migrate --rank {args.victim} after iteration {args.at_iteration} ...", flush=True
        )
        # Its own length: the move must land while the job trains, not at its last boundary (a joiner
        # that is ready only after the job's last iteration makes every rank wait there).
        ref_planned = ref
        if args.planned_iters != args.iters:
            print(f"fault-free reference run (8 ranks, {args.planned_iters} iterations) ...", flush=True)
            ref_planned = reference(workdir, args.data_prefix, args.planned_iters, 8, name="reference_planned")
        planned, traj_p, _ = run_trainmover(
            workdir,
            "planned",
            args.data_prefix,
            args.planned_iters,
            8,
            args.at_iteration,
            migrate_rank(args.victim, "planned", etcd),
            etcd,
        )
        if args.node_loss_trials or args.drain_trials:
            print("fault-free reference run (8 ranks, --use-tp-pp-dp-mapping) ...", flush=True)
            ref_nodes = reference(
                workdir, args.data_prefix, args.node_loss_iters, 8, name="reference_nodes", extra=tuple(MAPPING)
            )
            nodes_args = job_args(args.data_prefix, args.node_loss_iters, 8)
            if args.node_loss_trials:
                node_loss = node_loss_runs(
                    workdir, nodes_args, ref_nodes, etcd, args.node_loss_trials, rng, at_iteration=args.at_iteration
                )
            if args.drain_trials:
                drain = drain_runs(
                    workdir, nodes_args, ref_nodes, etcd, args.drain_trials, at_iteration=args.at_iteration
                )
        restart = restart_fork = None
        if not args.skip_restart:
            print("stop-restart baseline (same job, checkpoint every 5 iterations), fresh interpreters ...", flush=True)
            restart = restart_baseline(args.data_prefix, args.iters, "spawn", job_args(args.data_prefix, args.iters, 8))
            print("stop-restart baseline, ranks forked from the warm agent ...", flush=True)
            restart_fork = restart_baseline(
                args.data_prefix, args.iters, "fork", job_args(args.data_prefix, args.iters, 8)
            )
        try:
            nvrx, nvrx_skipped = nvrx_baseline(args, workdir, ref)
        except Exception as exc:  # noqa: BLE001 - one failed baseline must not lose the other figures
            nvrx_failed = True
            nvrx, nvrx_skipped = None, f"the nvrx run failed ({str(exc)[:300]}); logs in {workdir}/nvrx"
            print(f"nvrx_inprocess_s: {nvrx_skipped}", flush=True)
        sandbox = None
        if args.sandbox_iters:
            print(
                f"TrainMover with a sandbox standby: SIGKILL of rank 4 (its kept model) and of rank {args.victim} ...",
                flush=True,
            )
            sandbox = sandbox_runs(
                workdir, args.data_prefix, args.sandbox_iters, {"kept_rank": 4, "other_rank": args.victim}, etcd
            )
        scale = []
        for ranks in [int(r) for r in args.scale.split(",") if r.strip()]:
            print(f"scale: {ranks} ranks, SIGKILL of the last rank ...", flush=True)
            ref_s = reference(workdir, args.data_prefix, args.iters, ranks) if ranks != 8 else ref
            trials = []
            for trial in range(args.scale_trials):
                res, traj, _ = run_trainmover(
                    workdir,
                    f"scale{ranks}_{trial}",
                    args.data_prefix,
                    args.iters,
                    ranks,
                    args.at_iteration,
                    kill_rank(ranks - 1),
                    etcd,
                )
                trials.append((res, traj == ref_s))
            # The median trial stands for the world size; every trial must be bit-identical.
            res, _ = sorted(trials, key=lambda t: t[0]["downtime_s"])[len(trials) // 2]
            scale.append(
                {
                    "ranks": ranks,
                    "unexpected_s": res["downtime_s"],
                    "iteration_s": res["iteration_s"],
                    # in steady iterations of the same world: contention on shared cores slows both alike
                    "unexpected_over_iteration": round(res["downtime_s"] / res["iteration_s"], 3),
                    "bit_identical": all(same for _, same in trials),
                    "trials_s": [round(t[0]["downtime_s"], 4) for t in trials],
                    "phases": res.get("phases", {}),
                    "joiner": res.get("joiner", {}),
                }
            )
        ok_run = True
    finally:
        etcd.stop()
        nodes_failed = any(runs and runs["failed"] for runs in (node_loss, drain))
        if ok_run and not nvrx_failed and not nodes_failed:  # a failed nvrx or node run keeps its logs too
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"a run failed: its logs are kept in {workdir}", file=sys.stderr)
    by_scenario = {
        "unexpected": all(t["bit_identical"] for t in unexpected_trials),
        "planned": traj_p == ref_planned,
        **{f"scale_{s['ranks']}": s["bit_identical"] for s in scale},
        **{f"sandbox_{c}": sandbox[c]["bit_identical"] for c in ("kept_rank", "other_rank") if sandbox},
        **({"node_loss": node_loss["bit_identical"]} if node_loss else {}),
        **({"drain": drain["bit_identical"]} if drain else {}),
    }
    downtimes = [t["downtime_s"] for t in unexpected_trials]
    result = {
        "command": shlex.join(["python", "benchmarks/downtime.py", *(sys.argv[1:] if argv is None else argv)]),
        "job": f"demo: 8 ranks TP2 x PP2 x DP2, 4 layers, hidden 128, seq 128, {args.precision}, dropout "
        f"{args.dropout} (CPU gloo, 2 cores)",
        "config": {
            "hidden_dropout": args.dropout,
            "attention_dropout": args.dropout,
            "precision": args.precision,
            "seed": args.seed,
            "unexpected_trials": args.unexpected_trials,
            "iters": args.iters,
            "planned_iters": args.planned_iters,
            "victim": args.victim,
            "at_iteration": args.at_iteration,
            "node_loss_trials": args.node_loss_trials,
            "node_loss_iters": args.node_loss_iters,
            "drain_trials": args.drain_trials,
        },
        "iteration_s": unexpected["iteration_s"],
        "unexpected_s": unexpected["downtime_s"],
        "unexpected_range_s": [min(downtimes), max(downtimes)],
        "unexpected": unexpected,
        "unexpected_trials": unexpected_trials,
        "planned_s": planned["downtime_s"],
        "planned": planned,
        "restart_s": restart["restart_s"] if restart else None,
        "restart": restart,
        "restart_fork_s": restart_fork["restart_s"] if restart_fork else None,
        "restart_fork": restart_fork,
        "nvrx_inprocess_s": nvrx["nvrx_inprocess_s"] if nvrx else None,
        "nvrx": nvrx if nvrx else {"skipped": nvrx_skipped},
        "bit_identical": all(by_scenario.values()),
        "bit_identical_by_scenario": by_scenario,
        "scale": scale,
        "sandbox": sandbox,
        **nodes_keys(node_loss, drain, unexpected["downtime_s"]),
    }
    if restart:
        result["unexpected_over_restart"] = result["unexpected_s"] / restart["restart_s"]
        result["unexpected_over_restart_fork"] = result["unexpected_s"] / restart_fork["restart_s"]
    if nvrx:
        result["unexpected_over_nvrx"] = result["unexpected_s"] / nvrx["nvrx_inprocess_s"]
    result["planned_over_iteration"] = result["planned_s"] / result["iteration_s"]
    by_ranks = {s["ranks"]: s["unexpected_s"] for s in scale}
    if 4 in by_ranks and 16 in by_ranks:
        result["scale_16_over_4"] = by_ranks[16] / by_ranks[4]
    rows = [
        ("restart_s (spawn)", f"{result['restart_s']:.3f}" if restart else "skipped"),
        ("restart_fork_s", f"{result['restart_fork_s']:.3f}" if restart_fork else "skipped"),
        (
            "unexpected_s (median)",
            f"{result['unexpected_s']:.3f} (range {downtimes and min(downtimes):.3f}-"
            f"{max(downtimes):.3f}, kill points {[t['kill_inside_iteration'] for t in unexpected_trials]})",
        ),
        ("unexpected_s / restart_s", f"{result['unexpected_over_restart']:.4f} (goal <= 0.03)" if restart else "-"),
        *nodes_rows(result),
        ("planned_s", f"{result['planned_s']:.3f}"),
        ("nvrx_inprocess_s", f"{nvrx['nvrx_inprocess_s']:.3f}" if nvrx else "skipped"),
        ("iteration_s", f"{result['iteration_s']:.3f}"),
        ("bit_identical", f"{result['bit_identical']} {by_scenario}"),
    ]
    rows += [(f"  unexpected {k}", f"{v:.3f}") for k, v in unexpected.get("phases", {}).items()]
    rows += nodes_phase_rows(result)
    if nvrx:
        rows += [
            ("unexpected_s / nvrx_inprocess_s", f"{result['unexpected_over_nvrx']:.3f} (goal <= 0.5)"),
            ("nvrx bit_identical (vs its own fault-free run)", str(nvrx["bit_identical"])),
            (
                "nvrx fault-free run = TrainMover's fault-free run",
                f"{nvrx.get('fault_free_matches_reference')} (first difference "
                f"{nvrx.get('first_difference_from_reference')})",
            ),
            ("nvrx ranks terminated by its hard timeout", str(nvrx["terminated_by_nvrx"])),
        ]
        rows += [(f"  nvrx {k}", f"{v:.3f}") for k, v in nvrx["phases"].items()]
    for case in ("kept_rank", "other_rank") if sandbox else ():
        r = sandbox[case]
        rows.append(
            (
                f"sandbox standby, rank {r['victim']} killed",
                f"{r['downtime_s']:.3f} s (adopted its kept model: {r['adopted']}, bit-identical {r['bit_identical']})",
            )
        )
        rows += [(f"  {k}", f"{v:.3f}") for k, v in r.get("phases", {}).items()]
    rows += [
        (
            f"scale {s['ranks']} ranks",
            f"{s['unexpected_s']:.3f} s (trials {s['trials_s']}, iteration "
            f"{s['iteration_s']:.3f} s, bit-identical {s['bit_identical']})",
        )
        for s in scale
    ]
    print_table("downtime (seconds)", rows, ("measure", "value"))
    write_json(args.json, result)
    if args.plot and restart:
        plot(args.plot, result)
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
