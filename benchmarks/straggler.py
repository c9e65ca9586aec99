#!/usr/bin/env python3
"""Throughput lost to a straggler: no action, TrainMover moving it, and the ideal, side by side.

The job: 4 ranks (PP2 x DP2) of the tests' tiny GPT in bf16 at dropout 0.1, one standby (basic warm-up,
at CPU niceness ``--standby-nice``; the pool's refill after the move at 19), ``--iters`` iterations, under
``trainmover launch``. Each trial runs it three ways, one after the other:

- ``ideal``: no rank is slow (``--tm-straggler-action report``: any rank it names is a false positive);
- ``no_action``: rank 1 computes ``--factor`` times slower from iteration ``--from`` on
  (``--tm-inject-slowdown``), and nothing is done about it (``--tm-straggler-action off``);
- ``trainmover``: the same slowdown with ``--tm-straggler-action migrate``: the controller names rank 1 and
  moves it to the standby with a planned move.

A run's **throughput loss** is its wall time from the end of iteration ``--from`` - 1 to the end of the
last iteration over the ideal run's of the same trial, less one, in percent: everything lost counts
(the slow iterations before detection, the planned move, the iterations after it). A trial's
``detected_after_iterations`` is the iteration the straggler was named at minus ``--from`` + 1;
``false_positives`` counts ranks named in the ideal run and ranks other than 1 named in the others.
Every run must train the ideal run's losses bit for bit.

    python benchmarks/straggler.py --json benchmarks/results/straggler.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ROOT, measured_at, print_table, write_json  # noqa: E402
from lost_time import spread  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, ensure_corpus, launch_cmd, model_args  # noqa: E402

SLOWED_RANK = 1
WAYS = ("ideal", "no_action", "trainmover")


def job_args(data_prefix: str, iters: int, standby_nice: int, refill_nice: int = 19) -> list[str]:
    """The 4-rank job; its first standby at CPU niceness ``standby_nice``, refills at ``refill_nice``."""
    args = model_args(layers=4, hidden=32, heads=4, seq=32, mbs=1, gbs=8, iters=iters, lr=1e-3, dropout=0.1)
    args += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--bf16"]
    args += ["--data-path", data_prefix + "_text_document"]
    args += ["--trainmover", "--tm-standbys", "1", "--tm-standby-nice", str(standby_nice), "--tm-no-sandbox"]
    return args + ["--tm-refill-nice", str(refill_nice)]


def run(workdir: str, name: str, args: list[str], timeout_s: float) -> dict:
    """One launch; its iterations (iteration -> (loss, end time)) and the stragglers it named."""
    metrics = os.path.join(workdir, f"{name}.metrics.jsonl")
    run_dir = os.path.join(workdir, f"{name}.run")
    with open(os.path.join(workdir, f"{name}.err"), "w") as err:
        code = subprocess.run(
            launch_cmd(4, args + ["--tm-metrics-file", metrics], "--run-dir", run_dir),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            timeout=timeout_s,
        ).returncode
    if code != 0:
        raise RuntimeError(f"{name} exited {code}; see {workdir}/{name}.err")
    its = {}
    for line in open(metrics):
        rec = json.loads(line)
        if rec.get("event") == "iteration":
            its[rec["iteration"]] = (rec["loss"], rec["t_end"])
    events = []
    path = os.path.join(run_dir, "events.jsonl")
    if os.path.exists(path):
        events = [json.loads(line) for line in open(path) if line.strip()]
    named = sorted((e["detail"] for e in events if e.get("what") == "straggler"), key=lambda d: d["iteration"])
    moves = [e["detail"] for e in events if e.get("what") == "migration_planned"]
    switches = sorted(e["detail"]["switch_at"] for e in events if e.get("what") == "switch_point")
    return {"iterations": its, "named": named, "moves": moves, "switches": switches}


def span_s(result: dict, start: int) -> float:
    its = result["iterations"]
    return its[max(its)][1] - its[start - 1][1]


def trial(workdir: str, n: int, opts) -> dict:
    base = job_args(opts.data_prefix, opts.iters, opts.standby_nice)
    slow = ["--tm-inject-slowdown", f"{SLOWED_RANK}:{opts.factor}:{opts.start}"]
    runs = {}
    for way, extra in (
        ("ideal", ["--tm-straggler-action", "report"]),
        ("no_action", ["--tm-straggler-action", "off", *slow]),
        ("trainmover", ["--tm-straggler-action", "migrate", *slow]),
    ):
        print(f"trial {n}: {way} ...", flush=True)
        runs[way] = run(workdir, f"t{n}_{way}", base + extra, opts.timeout)
    ideal = runs["ideal"]
    losses = {i: v[0] for i, v in ideal["iterations"].items()}
    out: dict = {}
    for way, r in runs.items():
        out[way] = {
            "span_s": round(span_s(r, opts.start), 4),
            "loss_pct": round(100 * (span_s(r, opts.start) / span_s(ideal, opts.start) - 1), 3),
            "bit_identical": {i: v[0] for i, v in r["iterations"].items()} == losses,
            "named": [(d["rank"], d["iteration"]) for d in r["named"]],
            "moves": [(rep["rank"], rep["joiner"]) for m in r["moves"] for rep in m.get("replacements", [])],
        }
    tm = runs["trainmover"]["named"]
    found = [d for d in tm if d["rank"] == SLOWED_RANK]
    out["detected_after_iterations"] = found[0]["iteration"] - opts.start + 1 if found else None
    out["false_positives"] = len(ideal["named"]) + sum(d["rank"] != SLOWED_RANK for d in tm)
    return out


def add_job_args(parser: argparse.ArgumentParser, runs_per_trial: str, standby_nice: int = 19) -> None:
    """The flags every benchmark of this 4-rank job takes (``straggler.py``, ``rebalance.py``)."""
    parser.add_argument(
        "--standby-nice",
        type=int,
        default=standby_nice,
        help=f"The standbys' CPU niceness (--tm-standby-nice; default {standby_nice}, the launcher's 19): on a "
        "shared CPU a standby at 0 takes the training's cores while it warms up (after each move, the pool's "
        "new standby does).",
    )
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--trials", type=int, default=3, help=f"Trials ({runs_per_trial} runs each).")
    parser.add_argument("--timeout", type=float, default=900, help="Seconds one run may take.")
    parser.add_argument("--keep-logs", action="store_true", help="Keep every run's files (the path is printed).")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")


def run_trials(opts, name: str, trial: Callable[[str, int, argparse.Namespace], dict]) -> tuple[str, list, list]:
    """``opts.trials`` trials in a fresh work folder: (the folder, the trials' results, the failures)."""
    ensure_corpus(opts.data_prefix)
    workdir = tempfile.mkdtemp(prefix=f"tm_{name}_")
    trials, failed = [], []
    for n in range(opts.trials):
        try:
            trials.append(trial(workdir, n, opts))
        except (RuntimeError, subprocess.TimeoutExpired, KeyError) as exc:
            print(f"trial {n} failed: {str(exc)[:300]}", flush=True)
            failed.append(f"{n}: {str(exc)[:500]}")
    return workdir, trials, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The standby at niceness 0: warm before the slowdown begins in every run (at 19, the launcher's default, it
    # warms beside the ranks at an iteration no run can foresee, and the runs' spans spread by +-20 %).
    add_job_args(parser, "three", standby_nice=0)
    parser.add_argument("--iters", type=int, default=150, help="Iterations of every run.")
    parser.add_argument("--factor", type=float, default=1.2, help="How many times slower rank 1 computes.")
    parser.add_argument("--from", dest="start", type=int, default=20, help="The first slowed iteration.")
    opts = parser.parse_args(argv)
    workdir, trials, failed = run_trials(opts, "straggler", trial)
    result = {
        "command": shlex.join(["python", "benchmarks/straggler.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "job": "4 ranks PP2 x DP2, tiny GPT (4 layers, hidden 32), bf16, dropout 0.1, one standby (basic warm-up, "
        f"niceness {opts.standby_nice}, refills 19), {opts.iters} iterations; rank {SLOWED_RANK} {opts.factor}x "
        f"slower from iteration {opts.start} "
        "(CPU gloo, 2 cores)",
        "config": vars(opts) | {"json": None},
        "no_action": {"loss_pct": spread(t["no_action"]["loss_pct"] for t in trials)},
        "trainmover": {"loss_pct": spread(t["trainmover"]["loss_pct"] for t in trials)},
        "detected_after_iterations": spread(t["detected_after_iterations"] for t in trials),
        "false_positives": sum(t["false_positives"] for t in trials),
        "bit_identical": bool(trials) and all(t[w]["bit_identical"] for t in trials for w in WAYS),
        "trials": trials,
        "failed": failed,
    }
    if opts.keep_logs or failed:
        print(f"run files kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(
        "throughput lost to a straggler, against the ideal run (percent)",
        [(w, result[w]["loss_pct"]["median"], result[w]["loss_pct"]["values"]) for w in ("no_action", "trainmover")]
        + [("detected after (iterations)", result["detected_after_iterations"]["median"], "")],
        ("run", "median", "trials"),
    )
    write_json(opts.json, result)
    return 0 if not failed and result["bit_identical"] and result["false_positives"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
