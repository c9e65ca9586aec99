#!/usr/bin/env python3
"""Stop-restart downtime of the demo job: the baseline TrainMover is measured against.

The demo job (8 ranks, TP2 x PP2 x DP2) runs under ``trainmover launch
--max-restarts 1`` with periodic checkpoints. After a few iterations past a
checkpoint one rank is SIGKILLed. The agent stops every rank and starts all of
them again as fresh processes, which import, rendezvous, build the model, load
the checkpoint and train.

    restart_s = (end of the first iteration after the restart) - (SIGKILL time) - steady iteration time

Phases come from the restarted logging rank's start-up record. Work lost since
the checkpoint (recomputed iterations) is reported separately, not included.

    python benchmarks/restart_baseline.py --json bench_out/restart.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median, print_table, rank_pids, read_events, start_launcher, wait_until, write_json  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus  # noqa: E402


def one_trial(
    workdir: str,
    data_prefix: str,
    iters: int,
    save_interval: int,
    kill_after: int,
    *,
    job_args: list[str] | None = None,
    restart_start_method: str = "spawn",
) -> dict:
    """One stop-restart of the demo job (or ``job_args``, 8 ranks); ``restart_start_method`` 'spawn' starts
    fresh interpreters (what a real stop-restart pays), 'fork' forks them from the warm agent."""
    ckpt = os.path.join(workdir, "ckpt")
    metrics = os.path.join(workdir, "metrics.jsonl")
    args = (job_args or demo_args(data_prefix, iters)) + [
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--save-interval",
        str(save_interval),
        "--tm-metrics-file",
        metrics,
    ]
    log = os.path.join(workdir, "launch")
    proc = start_launcher(8, args, ["--max-restarts", "1", "--restart-start-method", restart_start_method], log)
    kill_iter = save_interval + kill_after

    def reached():
        its = [e for e in read_events(metrics) if e.get("event") == "iteration"]
        return its and its[-1]["iteration"] >= kill_iter

    wait_until(reached, 600)
    victim = rank_pids(log + ".err")[0][3]
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    if proc.wait(900) != 0:
        raise RuntimeError(f"baseline job failed; see {log}.err")
    events = read_events(metrics)
    startups = [e for e in events if e["event"] == "startup"]
    if len(startups) != 2:
        raise RuntimeError(f"expected one restart, saw {len(startups) - 1}; see {log}.err")
    before = [e for e in events if e["event"] == "iteration" and e["t_end"] <= t_kill]
    after = [e for e in events if e["event"] == "iteration" and e["t_end"] > t_kill]
    steady = median([e["iteration_s"] for e in before[2:]])
    restart = startups[1]
    first = after[0]
    phases = {
        "detect_and_teardown_s": restart["process_start"] - t_kill,
        "process_start_and_imports_s": restart["args_parsed"] - restart["process_start"],
        "rendezvous_s": restart["rendezvous"] - restart["args_parsed"],
        "model_build_s": restart["model_built"] - restart["rendezvous"],
        "checkpoint_load_s": restart["checkpoint_loaded"] - restart["model_built"],
        "first_iteration_s": first["t_end"] - restart["checkpoint_loaded"],
    }
    return {
        "restart_s": first["t_end"] - t_kill - steady,
        "iteration_s": steady,
        "phases": phases,
        "killed_after_iteration": before[-1]["iteration"],
        "resumed_from_iteration": restart["resumed_iteration"],
        "lost_iterations": before[-1]["iteration"] - restart["resumed_iteration"],
        "restart_start_method": restart_start_method,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--trials", type=int, default=1, help="Repeat and report the median restart time.")
    parser.add_argument("--iters", type=int, default=16, help="Training iterations of the job.")
    parser.add_argument("--save-interval", type=int, default=5, help="Checkpoint interval in iterations.")
    parser.add_argument("--kill-after", type=int, default=2, help="Kill this many iterations after a checkpoint.")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    args = parser.parse_args(argv)
    ensure_corpus(args.data_prefix)
    trials = []
    for n in range(args.trials):
        workdir = tempfile.mkdtemp(prefix="tm_restart_")
        try:
            print(f"trial {n + 1}/{args.trials}: training, then SIGKILL of one rank ...", flush=True)
            trials.append(one_trial(workdir, args.data_prefix, args.iters, args.save_interval, args.kill_after))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    best = sorted(trials, key=lambda t: t["restart_s"])[len(trials) // 2]
    result = {
        "job": "demo: 8 ranks TP2 x PP2 x DP2, 4 layers, hidden 128, seq 128, global batch 16 (CPU gloo)",
        "restart_s": best["restart_s"],
        "iteration_s": best["iteration_s"],
        "phases": best["phases"],
        "lost_iterations": best["lost_iterations"],
        "trials": trials,
    }
    rows = [(k, f"{v:.3f}") for k, v in best["phases"].items()]
    rows += [
        ("restart_s (total - 1 iteration)", f"{best['restart_s']:.3f}"),
        ("steady iteration_s", f"{best['iteration_s']:.3f}"),
    ]
    print_table("stop-restart baseline (median trial)", rows, ("phase", "seconds"))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
