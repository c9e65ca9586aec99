#!/usr/bin/env python3
"""Lost time of one failure or one planned move: TrainMover against stop-restart and nvrx, side by side.

Every scenario trains the same job (the demo job: 8 ranks, TP2 x PP2 x DP2, 4 layers, hidden 128,
Megatron's dropout 0.1, bf16; the same model at every scale point) with the same checkpoint interval
(``--save-interval``), in one invocation. Each trial runs a fault-free **twin** and then the **faulted**
run, with the same flags and seed; the fault is the same for every strategy of a trial: a SIGKILL of
rank ``--victim`` at the trial's random point inside iteration ``--at-iteration + 1`` (the points come
from ``--seed``). TrainMover's first fault waits until its standby finished warming (the event's
``iteration`` says where it landed).

**Lost time** (``lost_time.py``) = the faulted run's wall time minus its twin's over iterations
``--window-from`` to the last, per scheduled failure (one here). It counts the killed iteration's computed
part, detection, recovery, re-run iterations and any slower iterations after. Reported, each the median
of ``--trials`` with its range and every trial:

- ``unexpected_lost_s``: TrainMover, ``--trainmover --tm-standbys 1``: a warm standby takes the rank.
- ``restart_lost_s``: stop-restart from the latest checkpoint, every rank a fresh interpreter (spawn).
- ``restart_fork_lost_s``: the same with ranks forked from the warm agent (``--restart-start-method fork``).
- ``nvrx_lost_s``: NVIDIA resiliency-ext 0.4.1's in-process restart (``nvrx_inprocess.py``; needs
  ``pip install -r requirements-bench.txt``, otherwise null with the reason).
- ``planned_lost_s``: ``trainmover migrate --rank VICTIM`` while the job trains (``--planned-iters``);
  ``planned_lost_iters`` the same in steady iterations. ``planned_switch_s`` (and ``_iters``): its phase
  2 alone, the extra time of the step the joiner's resume falls in (``lost_time.resume_step_excess_s``:
  the hand-over and the swap at the agreed boundary, and the joiner's first iteration), median of the
  trials; phase 1 (the joiner's set-up and the stayers' new groups, beside the training on the same
  cores) is the rest of ``planned_lost_s``.
- ``distopt_lost_s``: ``unexpected`` with ``--use-distributed-optimizer`` (``--distopt-trials``): the lost
  rank's optimizer shard comes from its holder's host-memory mirror; ``distopt_over_unexpected`` is its
  ratio to the replicated case of the same run (goal <= 1.5).
- ``scale``: ``unexpected`` at ``--scale`` world sizes, the last rank killed.

Every faulted run also gives ``events[]`` (kind, rank, wall time, iteration, ``fraction_inside``,
``detect_s``, ``resume_s_by_rank`` of every rank, ``first_iteration_s``, the plan, how the joiner was
started and whether it was warm, idle standbys, the penalty window) and its per-iteration list
(``iterations[]``: run, iteration, start, end). ``bit_identical``: the loss trajectory equals the twin's;
``state_identical``: every rank's parameters and optimizer state hash equal the twin's at the end.

    python benchmarks/downtime.py --json benchmarks/results/downtime.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import faults  # noqa: E402
from common import measured_at, print_table, write_json  # noqa: E402
from lost_time import spread, steady_iteration_s  # noqa: E402
from strategies import Job, Strategy, compare, fault_window, iteration_rows  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, ensure_corpus, model_args  # noqa: E402

PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
LAYOUTS = {4: (1, 2), 8: (2, 2), 16: (2, 2)}
"""World size -> (TP, PP); data parallelism takes the rest (DP 2, 2, 4)."""
BASELINES = ("restart", "restart_fork", "nvrx")


def job_args(data_prefix: str, iters: int, ranks: int, precision: str, dropout: float) -> list[str]:
    """The demo job's model at any of :data:`LAYOUTS`' world sizes."""
    tp, pp = LAYOUTS[ranks]
    return (
        model_args(iters=iters, dropout=dropout)
        + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        + ["--data-path", data_prefix + "_text_document", "--tokenizer-type", "ByteLevelTokenizer"]
        + PRECISION_FLAGS[precision]
    )


def trial_pair(
    workdir: str, label: str, strategy: Strategy, job: Job, schedule: list[dict], args, rows: list[dict]
) -> dict:
    """Twin, then faulted run, of one trial; their per-iteration lists go to ``rows``. A trial whose
    fault never landed (the job ended first) raises ``RuntimeError``."""
    print(f"{label}: fault-free twin ...", flush=True)
    twin = strategy.run(workdir, label.replace("/", "_") + "_twin", job, [], 0.0)
    print(f"{label}: faulted run ...", flush=True)
    steady = steady_iteration_s(twin.files.iterations())
    faulted = strategy.run(workdir, label.replace("/", "_"), job, schedule, steady)
    rows += iteration_rows(twin, label + "/twin") + iteration_rows(faulted, label + "/faulted")
    if len(faulted.injected) < len(schedule):
        raise RuntimeError(f"{label}: the fault did not land before the job ended (raise --iters); {faulted.files.err}")
    fault = faulted.injected[0]
    records, its = faulted.files.process_records(), faulted.files.iterations()
    window = fault_window(
        records, its, fault["t"], fault["iteration"], args.window_before, args.window_after, job.iters
    )
    out = compare(faulted, twin, scheduled=len(schedule), window=window)
    return dict(out, kill_inside_iteration=schedule[0]["inside"] if schedule else None)


class Scenario:
    """The trials of one strategy on one job; a trial that fails is listed, the others still count."""

    def __init__(self, name: str, strategy: Strategy, job: Job):
        self.name, self.strategy, self.job = name, strategy, job
        self.trials: list[dict] = []
        self.failed: list[str] = []

    def trial(self, workdir: str, n: int, schedule: list[dict], args, rows: list[dict], events: list[dict]) -> dict:
        """Run trial ``n``; returns its comparison ({} when it failed)."""
        try:
            out = trial_pair(workdir, f"{self.name}/{n}", self.strategy, self.job, schedule, args, rows)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            print(f"{self.name} trial {n} failed: {exc}", flush=True)
            self.failed.append(f"trial {n}: {str(exc)[:500]}")
            return {}
        self.trials.append(out)
        events += [dict(e, scenario=self.name, trial=n) for e in out["events"]]
        return out

    def summary(self) -> dict:
        trials = self.trials
        return {
            "lost_s": spread(t["lost_per_failure_s"] for t in trials),
            "lost_iters": spread(t["lost_per_failure_s"] / t["steady_iteration_s"] for t in trials),
            "steady_iteration_s": spread(t["steady_iteration_s"] for t in trials),
            "pre_fault_ratio": spread(t["pre_fault_ratio"] for t in trials),
            "resume_step_excess_s": spread(e.get("resume_step_excess_s") for t in trials for e in t["events"]),
            "bit_identical": bool(trials) and all(t["bit_identical"] for t in trials),
            "state_identical": bool(trials) and all(t["state_identical"] for t in trials),
            "failed": self.failed,
            "trials": [{k: v for k, v in t.items() if k != "events"} for t in trials],
        }


def landed(schedule: list[dict], out: dict) -> list[dict]:
    """``schedule`` moved to where TrainMover's fault landed (it waited for a warm standby), so that
    every strategy of the trial gets the same fault: the same iteration, rank and point inside it."""
    if not out.get("events"):
        return schedule
    return [dict(schedule[0], after_iteration=out["events"][0]["iteration"] - 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--trials", type=int, default=3, help="Trials (twin + faulted run) per strategy.")
    parser.add_argument(
        "--iters",
        type=int,
        default=100,
        help="Iterations of every run: TrainMover's fault waits for a warm standby, at most until the "
        "window after it still fits (on 2 shared cores a standby warms at idle priority beside 8 ranks in "
        "about 60 iterations of the demo job).",
    )
    parser.add_argument(
        "--at-iteration",
        type=int,
        default=10,
        help="The kill lands inside the next iteration (TrainMover's later if its standby is not warm yet; "
        "the trial's other strategies then get the fault where TrainMover's landed).",
    )
    parser.add_argument(
        "--window-before",
        type=int,
        default=3,
        help="Wall times are compared from this many iterations before the fault's iteration ...",
    )
    parser.add_argument(
        "--window-after",
        type=int,
        default=20,
        help="... to this many after it, or after every rank resumed if that came later (a planned move): the "
        "post-promotion penalty window; the same iterations in both runs.",
    )
    parser.add_argument("--victim", type=int, default=5, help="Rank killed or moved (8-rank layout).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kill points inside the iteration.")
    parser.add_argument("--save-interval", type=int, default=5, help="Checkpoint interval of every run.")
    parser.add_argument(
        "--strategies",
        default="trainmover,restart,restart_fork,nvrx",
        help="Which of trainmover, restart, restart_fork, nvrx to run (comma-separated).",
    )
    parser.add_argument(
        "--planned-trials",
        type=int,
        default=None,
        help="Planned-move trials (default: --trials; 0 skips; at most --trials: each runs at one trial's fault "
        "point).",
    )
    parser.add_argument(
        "--distopt-trials",
        type=int,
        default=None,
        help="Trials of the unexpected scenario with --use-distributed-optimizer (its shard from the mirror; 0 "
        "skips; default and most: --trials, as above).",
    )
    parser.add_argument(
        "--planned-iters",
        type=int,
        default=100,
        help="Iterations of the planned-move runs: the job trains on while the joiner prepares, and a move "
        "still pending at the job's last boundary makes every rank wait there for it.",
    )
    parser.add_argument("--scale", default="4,16", help="More world sizes of the unexpected scenario ('' skips).")
    parser.add_argument(
        "--scale-trials", type=int, default=None, help="Trials per scale world size (default and most: --trials)."
    )
    parser.add_argument("--precision", choices=sorted(PRECISION_FLAGS), default="bf16")
    parser.add_argument("--dropout", type=float, default=0.1, help="Hidden and attention dropout (Megatron's 0.1).")
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="Keep every run's logs and records (the path is printed); its checkpoints go when it ends.",
    )
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(chosen) - {"trainmover", *BASELINES}
    if unknown or not chosen:
        parser.error(f"--strategies: choose from trainmover, {', '.join(BASELINES)} (unknown: {sorted(unknown)})")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    for name in ("planned_trials", "distopt_trials", "scale_trials"):
        n = getattr(args, name)
        if n is None:
            setattr(args, name, args.trials)
        elif not 0 <= n <= args.trials:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {n}: between 0 and --trials ({args.trials}); each runs at one trial's fault point")
    if not args.window_before < args.at_iteration < args.iters - args.window_after:
        parser.error(
            f"need --window-before ({args.window_before}) < --at-iteration ({args.at_iteration}) < --iters "
            f"({args.iters}) - --window-after ({args.window_after})"
        )
    ensure_corpus(args.data_prefix)
    rng = random.Random(args.seed)
    points = [round(rng.random(), 3) for _ in range(args.trials)]
    workdir = tempfile.mkdtemp(prefix="tm_downtime_")
    rows: list[dict] = []
    events: list[dict] = []

    def job_of(ranks: int, iters: int = args.iters) -> Job:
        flags = job_args(args.data_prefix, iters, ranks, args.precision, args.dropout)
        return Job(args=flags, world=ranks, iters=iters, save_interval=args.save_interval)

    skipped = {}
    if "nvrx" in chosen:
        from nvrx_inprocess import unavailable_reason

        reason = unavailable_reason()
        if reason:
            skipped["nvrx"] = reason
            chosen.remove("nvrx")
            print(f"nvrx skipped: {reason}", flush=True)
    warm_until = args.iters - args.window_after - 1
    runs = {
        ("unexpected" if name == "trainmover" else name): Scenario(
            "unexpected" if name == "trainmover" else name, Strategy(name=name), job_of(8)
        )
        for name in sorted(chosen, key=lambda n: n != "trainmover")  # TrainMover first: see landed()
    }
    for run in runs.values():
        run.strategy.warm_until_iteration = warm_until if run.strategy.name == "trainmover" else 0
    tm = Strategy(name="trainmover", warm_until_iteration=warm_until)
    if "trainmover" in chosen and args.planned_trials:
        runs["planned"] = Scenario("planned", tm, job_of(8, args.planned_iters))
    if "trainmover" in chosen and args.distopt_trials:
        base = job_of(8)
        distopt = Job(args=[*base.args, "--use-distributed-optimizer"], world=8, iters=base.iters)
        runs["distopt"] = Scenario("distopt", tm, dataclasses.replace(distopt, save_interval=base.save_interval))
    for ranks in [int(r) for r in args.scale.split(",") if r.strip()] if "trainmover" in chosen else []:
        runs[f"scale_{ranks}"] = Scenario(f"scale_{ranks}", tm, job_of(ranks))
    for n, point in enumerate(points):
        kill = faults.single_kill(args.victim, args.at_iteration, point)
        for key, run in runs.items():
            if key == "planned":
                if n < args.planned_trials:
                    run.trial(workdir, n, [dict(kill[0], kind="migrate")], args, rows, events)
            elif key == "distopt":
                if n < args.distopt_trials:
                    run.trial(workdir, n, kill, args, rows, events)
            elif key.startswith("scale_"):
                if n < args.scale_trials:
                    ranks = run.job.world
                    run.trial(workdir, n, faults.single_kill(ranks - 1, args.at_iteration, point), args, rows, events)
            else:
                out = run.trial(workdir, n, kill, args, rows, events)
                if key == "unexpected":
                    kill = landed(kill, out)
    scenarios = {key: run.summary() for key, run in runs.items()}
    result = summarize(scenarios, skipped, args, argv)
    result.update(events=events, iterations=rows)
    if args.keep_logs or any(s["failed"] for s in scenarios.values()):
        print(f"run files kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table("lost time per failure (seconds)", table_rows(result), ("scenario", "median", "range", "identical"))
    write_json(args.json, result)
    return 0 if result["bit_identical"] and result["state_identical"] else 1


def summarize(scenarios: dict[str, dict], skipped: dict[str, str], args, argv) -> dict:
    """The JSON: headline medians under the issue's names, ratios, every scenario in full."""

    def median_of(key: str) -> float | None:
        return scenarios[key]["lost_s"]["median"] if key in scenarios else None

    def range_of(key: str) -> list | None:
        s = scenarios.get(key)
        return [s["lost_s"]["min"], s["lost_s"]["max"]] if s and s["lost_s"]["n"] else None

    out: dict = {
        "command": shlex.join(["python", "benchmarks/downtime.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "job": f"demo model (4 layers, hidden 128, seq 128), {args.precision}, dropout {args.dropout}, CPU gloo, "
        "2 cores; 8 ranks TP2 x PP2 x DP2 unless a scale row says otherwise",
        "definition": "lost = faulted wall - fault-free twin wall over the same iterations (window_before "
        "before the fault's iteration to window_after after it), per scheduled failure (benchmarks/lost_time.py)",
        "config": {k: getattr(args, k) for k in ("trials", "iters", "at_iteration", "victim", "seed")}
        | {"window_before": args.window_before, "window_after": args.window_after}
        | {"save_interval": args.save_interval, "precision": args.precision, "dropout": args.dropout},
        "skipped": skipped,
    }
    for key, name in (("unexpected", "unexpected"), ("restart", "restart"), ("restart_fork", "restart_fork")):
        out[f"{name}_lost_s"], out[f"{name}_lost_range_s"] = median_of(key), range_of(key)
    out["nvrx_lost_s"], out["nvrx_lost_range_s"] = median_of("nvrx"), range_of("nvrx")
    out["planned_lost_s"], out["planned_lost_range_s"] = median_of("planned"), range_of("planned")
    out["distopt_lost_s"], out["distopt_lost_range_s"] = median_of("distopt"), range_of("distopt")
    d, u = out["distopt_lost_s"], out["unexpected_lost_s"]
    out["distopt_over_unexpected"] = round(d / u, 4) if d is not None and u else None
    steady = [
        s["steady_iteration_s"]["median"]
        for k, s in scenarios.items()
        if not k.startswith("scale") and s["steady_iteration_s"]["n"]
    ]
    out["iteration_s"] = round(statistics.median(steady), 4) if steady else None
    # The communicator's figures (issue "native data plane"): every group runs on its native
    # communicator now; the link-ring communicator it replaced was not kept behind a flag, so no
    # same-run "before" exists.
    out["unexpected_lost_s_native"] = out["unexpected_lost_s"]
    out["unexpected_lost_s_before"] = None
    # The planned move's phase 2 (lost_time.resume_step_excess_s): the stall at the agreed boundary and
    # the joiner's first iteration, beside the move's whole lost time (phase 1 included) in iterations.
    planned, it = out["planned_lost_s"], out["iteration_s"]
    out["planned_lost_iters"] = round(planned / it, 3) if planned is not None and it else None
    switch = scenarios["planned"]["resume_step_excess_s"] if "planned" in scenarios else None
    out["planned_switch_s"] = switch["median"] if switch else None
    out["planned_switch_range_s"] = [switch["min"], switch["max"]] if switch and switch["n"] else None
    out["planned_switch_iters"] = round(switch["median"] / it, 3) if switch and switch["n"] and it else None
    tm = out["unexpected_lost_s"]
    for base in BASELINES:
        b = out[f"{base}_lost_s"]
        out[f"unexpected_over_{base}"] = round(tm / b, 4) if tm is not None and b else None
    out["scale"] = [
        {
            "ranks": int(k.split("_")[1]),
            "lost_s": s["lost_s"],
            "lost_iters": s["lost_iters"],
            "bit_identical": s["bit_identical"],
            "state_identical": s["state_identical"],
        }
        for k, s in scenarios.items()
        if k.startswith("scale_")
    ]
    if "unexpected" in scenarios:
        u = scenarios["unexpected"]
        out["scale"].append(
            {"ranks": 8, "lost_s": u["lost_s"], "lost_iters": u["lost_iters"], "bit_identical": u["bit_identical"]}
            | {"state_identical": u["state_identical"]}
        )
        out["scale"].sort(key=lambda s: s["ranks"])
    # The names `trainmover simulate --downtimes-json` reads, holding the same lost times.
    out["aliases"] = {"unexpected_s": "unexpected_lost_s", "restart_s": "restart_lost_s"} | {
        "planned_s": "planned_lost_s",
        "nvrx_inprocess_s": "nvrx_lost_s",
        "scale[].unexpected_s": "scale[].lost_s.median",
    }
    out |= {alias: out[key] for alias, key in out["aliases"].items() if not alias.startswith("scale")}
    for s in out["scale"]:
        s["unexpected_s"] = s["lost_s"]["median"]
    out["bit_identical"] = all(s["bit_identical"] for s in scenarios.values())
    out["state_identical"] = all(s["state_identical"] for s in scenarios.values())
    out["scenarios"] = scenarios
    return out


def table_rows(result: dict) -> list[tuple]:
    rows = []
    for key, s in result["scenarios"].items():
        lost = s["lost_s"]
        rng = f"{lost['min']:.3f}-{lost['max']:.3f}" if lost["n"] else "-"
        median = f"{lost['median']:.3f}" if lost["n"] else "failed"
        rows.append((key, median, rng, f"loss {s['bit_identical']}, state {s['state_identical']}"))
    for base in BASELINES:
        if result.get(f"unexpected_over_{base}") is not None:
            rows.append((f"unexpected / {base}", f"{result[f'unexpected_over_{base}']:.4f}", "", ""))
    return rows


if __name__ == "__main__":
    sys.exit(main())
