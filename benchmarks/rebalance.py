#!/usr/bin/env python3
"""Throughput lost to scheduled rebalancing: the same job with a planned move every few seconds and with none.

The job is ``straggler.py``'s (4 ranks PP2 x DP2, the tests' tiny GPT, bf16, dropout 0.1, one standby,
``--iters`` iterations) with ``--tm-leaver-becomes-standby``, so that each move's leaver rejoins the pool
and the ranks rotate through it; the standbys run at the launcher's default CPU niceness (19), as users
run them. Each trial runs it twice, one right after the other (the order alternates between trials, so
that a drift of the machine's speed does not always favour one): with no schedule, and with
``--tm-rebalance-interval`` of ``--interval-s`` seconds.

- ``loss_pct``: the rebalanced run's wall time from the end of iteration ``--from`` - 1 to the end of the
  last over the other run's, less one, in percent: everything counts (each move's pause, the iterations
  after it, the rejoined leaver warming up again beside the ranks). ``rebalances`` counts the moves.
- ``lost_per_move_s``: that lost time over the moves.
- ``in_run``: the same loss measured inside the rebalanced run alone, which no drift between two runs
  touches: each move owns the ``PENALTY_WINDOW`` iterations after its switch point, and loses their time
  less as many of the run's median iteration outside every move's window (``pause_s``: the first of them
  alone, the move's pause). ``in_run.loss_pct`` is that lost time over the run's time less it.

The losses must match the run without moves bit for bit. The goal (under 3 %) is a ratio of a move's
cost to the interval: the defaults space the moves so that at least 5 fall in the run.

    python benchmarks/rebalance.py --json benchmarks/results/rebalance.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import measured_at, print_table, write_json  # noqa: E402
from lost_time import PENALTY_WINDOW, spread  # noqa: E402
from straggler import add_job_args, job_args, run, run_trials, span_s  # noqa: E402


def trial(workdir: str, n: int, opts) -> dict:
    base = job_args(opts.data_prefix, opts.iters, opts.standby_nice) + ["--tm-leaver-becomes-standby"]
    schedule = ["--tm-rebalance-interval", f"{opts.interval_s / 60:.6f}"]
    runs = {}
    for way in ("plain", "rebalanced") if n % 2 == 0 else ("rebalanced", "plain"):
        print(
            f"trial {n}: {'no rebalancing' if way == 'plain' else f'a move every {opts.interval_s:g} s'} ...",
            flush=True,
        )
        runs[way] = run(workdir, f"t{n}_{way}", base + (schedule if way == "rebalanced" else []), opts.timeout)
    plain, moved = runs["plain"], runs["rebalanced"]
    losses = {i: v[0] for i, v in plain["iterations"].items()}
    moves = sum(len(m.get("replacements", [])) for m in moved["moves"])
    lost = span_s(moved, opts.start) - span_s(plain, opts.start)
    return {
        "lost_per_move_s": round(lost / moves, 4) if moves else None,
        "plain_span_s": round(span_s(plain, opts.start), 4),
        "rebalanced_span_s": round(span_s(moved, opts.start), 4),
        "loss_pct": round(100 * (span_s(moved, opts.start) / span_s(plain, opts.start) - 1), 3),
        "rebalances": moves,
        "in_run": in_run_loss(moved, opts.start),
        "bit_identical": {i: v[0] for i, v in moved["iterations"].items()} == losses,
    }


def in_run_loss(result: dict, start: int) -> dict:
    """The moves' cost measured inside one run (see the module docstring)."""
    ends = {i: t for i, (_, t) in result["iterations"].items()}
    took = {i: ends[i] - ends[i - 1] for i in ends if i - 1 in ends and i >= start}
    owned = {s + k for s in result["switches"] for k in range(1, PENALTY_WINDOW + 1)}
    steady = statistics.median(t for i, t in took.items() if i not in owned)
    per_move = [sum(took.get(s + k, steady) - steady for k in range(1, PENALTY_WINDOW + 1)) for s in result["switches"]]
    lost = sum(per_move)
    span = sum(took.values())
    return {
        "steady_iteration_s": round(steady, 5),
        "lost_per_move_s": round(statistics.median(per_move), 4) if per_move else None,
        "pause_s": round(statistics.median(took.get(s + 1, steady) - steady for s in result["switches"]), 4)
        if per_move
        else None,
        "loss_pct": round(100 * lost / (span - lost), 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_args(parser, "two")
    parser.add_argument("--iters", type=int, default=1500, help="Iterations of every run.")
    parser.add_argument("--interval-s", type=float, default=20.0, help="Seconds between scheduled moves.")
    parser.add_argument("--from", dest="start", type=int, default=10, help="The first iteration compared.")
    opts = parser.parse_args(argv)
    workdir, trials, failed = run_trials(opts, "rebalance", trial)
    result = {
        "command": shlex.join(["python", "benchmarks/rebalance.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "job": "4 ranks PP2 x DP2, tiny GPT (4 layers, hidden 32), bf16, dropout 0.1, one standby (basic warm-up, "
        f"niceness {opts.standby_nice}), --tm-leaver-becomes-standby, {opts.iters} iterations; a planned move every "
        f"{opts.interval_s:g} s (CPU gloo, 2 cores)",
        "config": vars(opts) | {"json": None},
        "loss_pct": spread(t["loss_pct"] for t in trials),
        "rebalances": spread(t["rebalances"] for t in trials),
        "lost_per_move_s": spread(t["lost_per_move_s"] for t in trials),
        "in_run": {key: spread(t["in_run"][key] for t in trials) for key in ("loss_pct", "lost_per_move_s", "pause_s")},
        "bit_identical": bool(trials) and all(t["bit_identical"] for t in trials),
        "trials": trials,
        "failed": failed,
    }
    if opts.keep_logs or failed:
        print(f"run files kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(
        "throughput lost to scheduled rebalancing (percent)",
        [("loss_pct", result["loss_pct"]["median"], result["loss_pct"]["values"])]
        + [("rebalances", result["rebalances"]["median"], result["rebalances"]["values"])]
        + [(f"in_run.{k}", v["median"], v["values"]) for k, v in result["in_run"].items()],
        ("figure", "median", "trials"),
    )
    write_json(opts.json, result)
    enough = all(t["rebalances"] >= 5 for t in trials)
    return 0 if not failed and result["bit_identical"] and enough else 1


if __name__ == "__main__":
    sys.exit(main())
