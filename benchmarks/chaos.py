#!/usr/bin/env python3
"""Chaos run: seeded failure schedules at two failure rates, the same faults for every strategy, goals in iterations.

The demo job (8 ranks, TP2 x PP2 x DP2, Megatron's dropout 0.1, bf16) trains under each strategy twice
per (failure rate, seed), side by side in one invocation: a fault-free **twin**, then the **faulted** run
carrying out the schedule (``faults.make_schedule``: exponential gaps of mean ``gap`` iterations; kills
at random points inside iterations; ``--stop-share`` of them hangs, which stay SIGSTOP for every
strategy; every ``1/--cascade-share``-th failure cascades into a kill of its joiner, or of another rank,
during the recovery). Strategies (``--strategies``):

- ``trainmover``: ``--tm-standbys 3`` warm standbys, refilled as the job goes (``--tm-standby-duty``);
- ``trainmover_refills_deferred``: the A/B whose refills start only after the post-promotion window
  (``PENALTY_WINDOW`` + 5 steady iterations later), so that the refills' share of the penalty is
  measured, not attributed (turning refills off outright empties the pool of 3 within one cascade);
- ``restart_fork``: stop-restart from the latest checkpoint with forked ranks; ``restart``: the same
  with fresh interpreters (not in the default set);
- ``nvrx``: NVIDIA resiliency-ext's in-process restart (when it imports; ``requirements-bench.txt``).

Every strategy of a (rate, seed) checkpoints at the interval the Young/Daly rule gives for that rate
(``lost_time.young_daly_interval_iters``; the save time and steady iteration are measured once at the
start, or given with ``--checkpoint-cost-s``/``--steady-s``). Lost time per scheduled failure, ETTR
relative to the twin, per-event records (``events[]``), per-iteration lists (``iterations[]``) and every
rank's state hash come from ``strategies.compare``; the goals from ``chaos_goals.py``.

    python benchmarks/chaos.py --json benchmarks/results/chaos.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos_goals import GOALS, baseline_summary, goals_met, trainmover_summary  # noqa: E402
from common import measured_at, print_table, read_events, write_json  # noqa: E402
from faults import make_schedule  # noqa: E402
from lost_time import PENALTY_WINDOW, steady_iteration_s, young_daly_interval_iters  # noqa: E402
from strategies import Job, Strategy, compare, iteration_rows  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus  # noqa: E402

WORLD = 8
STRATEGIES = ("trainmover", "trainmover_refills_deferred", "restart_fork", "restart", "nvrx")


def job_args(data_prefix: str, iters: int, save_dir: str | None = None, save_interval: int = 0) -> list[str]:
    """The demo job in bf16 with Megatron's dropout; with ``save_dir``, checkpoints every ``save_interval``."""
    args = demo_args(data_prefix, iters) + ["--bf16"]
    if save_dir is not None:
        args += ["--save", save_dir, "--load", save_dir, "--save-interval", str(save_interval)]
    return args


def calibrate(workdir: str, data_prefix: str) -> tuple[float, float]:
    """(steady iteration, one checkpoint save) in seconds, from a plain 12-iteration run saving every 2."""
    job = Job(args=job_args(data_prefix, 12), world=WORLD, iters=12, save_interval=2)
    run = Strategy(name="restart_fork").run(workdir, "calibration", job, [], 0.0)
    records = read_events(run.files.metrics)
    ends = {r["iteration"]: r["t_end"] for r in records if r.get("event") == "iteration"}
    saves = [
        r["t"] - ends[r["iteration"]] for r in records if r.get("event") == "checkpoint" and r["iteration"] in ends
    ]
    if not saves:
        raise RuntimeError(f"the calibration run logged no checkpoint; see {run.files.err}")
    return steady_iteration_s(run.files.iterations()), statistics.median(saves)


def strategy_for(name: str, args, steady_s: float) -> Strategy:
    if name == "trainmover":
        return Strategy(
            name="trainmover",
            standbys=args.standbys,
            standby_duty=args.standby_duty,
            standby_reserves=args.standby_reserves,
        )
    if name == "trainmover_refills_deferred":
        return Strategy(
            name="trainmover",
            standbys=args.standbys,
            standby_duty=args.standby_duty,
            standby_reserves=args.standby_reserves,
            refill_delay_s=(PENALTY_WINDOW + 5) * steady_s,
        )
    return Strategy(name=name)


def parse_rates(text: str) -> list[tuple[int, int]]:
    """``"25:300,100:400"`` -> [(gap, iterations), ...]."""
    out = []
    for part in text.split(","):
        gap, iters = part.split(":")
        out.append((int(gap), int(iters)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--seeds", default="0,1,2", help="Seeds of the failure schedules (comma-separated).")
    parser.add_argument(
        "--rates",
        default="25:300,100:400",
        help="MEAN_GAP:ITERATIONS pairs: a failure about every MEAN_GAP iterations, in runs of ITERATIONS.",
    )
    parser.add_argument("--strategies", default="trainmover,trainmover_refills_deferred,restart_fork,nvrx")
    parser.add_argument("--stop-share", type=float, default=0.2, help="Share of failures that are hangs (SIGSTOP).")
    parser.add_argument("--cascade-share", type=float, default=0.25, help="Share of failures that cascade.")
    parser.add_argument("--window-from", type=int, default=3, help="Wall times are compared from this iteration.")
    parser.add_argument("--standbys", type=int, default=3, help="--tm-standbys of the trainmover strategy.")
    parser.add_argument("--standby-duty", type=float, default=0.25, help="--tm-standby-duty of TrainMover runs.")
    parser.add_argument("--standby-reserves", type=int, default=16, help="--tm-standby-reserves of TrainMover.")
    parser.add_argument("--checkpoint-cost-s", type=float, default=None, help="Skip the calibration: save time.")
    parser.add_argument("--steady-s", type=float, default=None, help="Skip the calibration: steady iteration.")
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="Keep every run's logs and records (the path is printed); its checkpoints go when it ends.",
    )
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    rates = parse_rates(args.rates)
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if set(chosen) - set(STRATEGIES) or not seeds or any(iters < 60 for _, iters in rates):
        parser.error(f"--strategies from {STRATEGIES}; at least one seed; at least 60 iterations per rate")
    ensure_corpus(args.data_prefix)
    skipped = {}
    if "nvrx" in chosen:
        from nvrx_inprocess import unavailable_reason

        if reason := unavailable_reason():
            skipped["nvrx"] = reason
            chosen.remove("nvrx")
    workdir = tempfile.mkdtemp(prefix="tm_chaos_")
    if args.checkpoint_cost_s is None or args.steady_s is None:
        print("calibration: steady iteration and checkpoint save time ...", flush=True)
        steady_s, save_s = calibrate(workdir, args.data_prefix)
    steady_s = args.steady_s if args.steady_s is not None else steady_s
    save_s = args.checkpoint_cost_s if args.checkpoint_cost_s is not None else save_s
    runs, events, rows, schedules, failed = [], [], [], {}, []
    for gap, iters in rates:
        interval = young_daly_interval_iters(save_s, steady_s, gap)
        for seed in seeds:
            schedule = make_schedule(
                seed, iters, gap, world=WORLD, stop_share=args.stop_share, cascade_share=args.cascade_share
            )
            schedules[f"{gap}/{seed}"] = schedule
            job = Job(args=job_args(args.data_prefix, iters), world=WORLD, iters=iters, save_interval=interval)
            for name in chosen:
                label = f"g{gap}/s{seed}/{name}"
                strategy = strategy_for(name, args, steady_s)
                try:
                    print(f"{label}: fault-free twin ({iters} iterations, checkpoint every {interval}) ...", flush=True)
                    twin = strategy.run(workdir, label.replace("/", "_") + "_twin", job, [], 0.0)
                    print(f"{label}: {len(schedule)} scheduled failures ...", flush=True)
                    s = steady_iteration_s(twin.files.iterations())
                    faulted = strategy.run(workdir, label.replace("/", "_"), job, schedule, s)
                    out = compare(faulted, twin, scheduled=len(schedule), window=(args.window_from, iters))
                except (RuntimeError, TimeoutError, ValueError) as exc:
                    print(f"{label} failed: {exc}", flush=True)
                    failed.append(f"{label}: {str(exc)[:500]}")
                    continue
                out |= {"gap": gap, "seed": seed, "strategy": name, "save_interval": interval}
                runs.append(out)
                events += [dict(e, gap=gap, seed=seed, strategy=name) for e in out["events"]]
                rows += iteration_rows(twin, label + "/twin") + iteration_rows(faulted, label + "/faulted")
    result = summarize(runs, args, argv, seeds, rates, (steady_s, save_s), schedules, skipped, failed)
    result.update(events=events, iterations=rows)
    if args.keep_logs or failed:
        print(f"run files kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print_rows(result)
    write_json(args.json, result)
    tm = result["trainmover"]
    return 0 if not failed and tm["state_identical"] and tm["bit_identical"] else 1


def summarize(runs, args, argv, seeds, rates, calibration, schedules, skipped, failed) -> dict:
    tm = trainmover_summary(runs)
    twins = [r["twin"] for r in runs if r["strategy"].startswith("trainmover")]
    return {
        "command": shlex.join(["python", "benchmarks/chaos.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "job": "demo: 8 ranks TP2 x PP2 x DP2, 4 layers, hidden 128, seq 128, bf16, dropout 0.1 (CPU gloo, 2 cores)",
        "definition": "lost = faulted wall - fault-free twin wall over iterations window_from..iters, per scheduled "
        "failure; in iterations of the twin's median steady iteration (benchmarks/lost_time.py, chaos_goals.py)",
        "config": {
            k: getattr(args, k)
            for k in ("stop_share", "cascade_share", "window_from", "standbys", "standby_duty", "standby_reserves")
        }
        | {"rates": [{"mean_gap": g, "iters": i} for g, i in rates], "strategies": args.strategies},
        "calibration": {"steady_s": round(calibration[0], 4), "checkpoint_s": round(calibration[1], 4)},
        "seeds": seeds,
        "gaps": [g for g, _ in rates],
        "skipped": skipped,
        "failed": failed,
        "trainmover": tm,
        "trainmover_refills_deferred": baseline_summary(runs, "trainmover_refills_deferred"),
        "restart_fork": baseline_summary(runs, "restart_fork"),
        "restart": baseline_summary(runs, "restart"),
        "nvrx": baseline_summary(runs, "nvrx"),
        "fault_free": {
            "plans": sum(t["plans"] for t in twins),
            "fenced": sum(t["fenced"] for t in twins),
            "runs": len(twins),
        },
        "goals": {k: f"{op} {bound}" for k, (op, bound) in GOALS.items()},
        "goals_met": goals_met(tm),
        "schedules": schedules,
        "runs": [{k: v for k, v in r.items() if k != "events"} for r in runs],
    }


def print_rows(result: dict) -> None:
    rows = [
        (
            f"g{r['gap']} s{r['seed']} {r['strategy']}",
            r["lost_per_failure_s"],
            r["ettr_rel"],
            r["scheduled_failures"],
            r["restarts"],
            f"{r['bit_identical']}/{r['state_identical']}",
        )
        for r in result["runs"]
    ]
    print_table("chaos runs", rows, ("run", "lost s/failure", "ETTR rel", "failures", "restarts", "loss/state same"))
    tm = result["trainmover"]
    print_table(
        "TrainMover goals (steady iterations)",
        [(k, tm.get(k), result["goals"][k], result["goals_met"][k]) for k in result["goals"]],
        ("measure", "value", "goal", "met"),
    )


if __name__ == "__main__":
    sys.exit(main())
