#!/usr/bin/env python3
"""Throughput lost to scheduled rebalancing: the same job with a planned move every few seconds and with none.

The job is ``straggler.py``'s (4 ranks PP2 x DP2, the tests' tiny GPT, bf16, dropout 0.1, one standby,
``--iters`` iterations) with ``--tm-leaver-becomes-standby``, so that each move's leaver rejoins the pool
and the ranks rotate through it. Each trial runs it twice, one after the other: with no schedule, and with
``--tm-rebalance-interval`` of ``--interval-s`` seconds. A run's throughput is its wall time from the end
of iteration ``--from`` - 1 to the end of the last; ``loss_pct`` is the rebalanced run's over the other's,
less one, in percent, with every move's pause in it. ``rebalances`` counts the moves carried out and
``lost_per_move_s`` is the time lost over them, per move; the losses must match the run without them bit
for bit. The goal (under 3 %) is a ratio of a move's cost to the interval: the defaults space the moves
so that at least 5 fall in the run.

    python benchmarks/rebalance.py --json benchmarks/results/rebalance.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import measured_at, print_table, write_json  # noqa: E402
from lost_time import spread  # noqa: E402
from straggler import add_job_args, job_args, run, run_trials, span_s  # noqa: E402


def trial(workdir: str, n: int, opts) -> dict:
    base = job_args(opts.data_prefix, opts.iters) + ["--tm-leaver-becomes-standby"]
    print(f"trial {n}: no rebalancing ...", flush=True)
    plain = run(workdir, f"t{n}_plain", base, opts.timeout)
    print(f"trial {n}: a move every {opts.interval_s:g} s ...", flush=True)
    moved = run(
        workdir, f"t{n}_rebalanced", base + ["--tm-rebalance-interval", f"{opts.interval_s / 60:.6f}"], opts.timeout
    )
    losses = {i: v[0] for i, v in plain["iterations"].items()}
    moves = sum(len(m.get("replacements", [])) for m in moved["moves"])
    lost = span_s(moved, opts.start) - span_s(plain, opts.start)
    return {
        "lost_per_move_s": round(lost / moves, 4) if moves else None,
        "plain_span_s": round(span_s(plain, opts.start), 4),
        "rebalanced_span_s": round(span_s(moved, opts.start), 4),
        "loss_pct": round(100 * (span_s(moved, opts.start) / span_s(plain, opts.start) - 1), 3),
        "rebalances": moves,
        "bit_identical": {i: v[0] for i, v in moved["iterations"].items()} == losses,
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
        f"niceness 0), --tm-leaver-becomes-standby, {opts.iters} iterations; a planned move every "
        f"{opts.interval_s:g} s (CPU gloo, 2 cores)",
        "config": vars(opts) | {"json": None},
        "loss_pct": spread(t["loss_pct"] for t in trials),
        "rebalances": spread(t["rebalances"] for t in trials),
        "lost_per_move_s": spread(t["lost_per_move_s"] for t in trials),
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
        + [("rebalances", result["rebalances"]["median"], result["rebalances"]["values"])],
        ("figure", "median", "trials"),
    )
    write_json(opts.json, result)
    enough = all(t["rebalances"] >= 5 for t in trials)
    return 0 if not failed and result["bit_identical"] and enough else 1


if __name__ == "__main__":
    sys.exit(main())
