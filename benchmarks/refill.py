#!/usr/bin/env python3
"""What refilling the standby pool costs the job: a pre-forked reserve against a new interpreter.

After a promotion the launcher starts a standby to keep the pool at ``--tm-standbys``. It either
wakes a child it forked at the start (``--tm-standby-reserves``, the default) or, with
``--tm-standby-reserves 0``, starts a new interpreter that imports torch and megatron-core while the
ranks train on the same cores. This runs the demo job (8 ranks, TP2 x PP2 x DP2, bf16, dropout 0.1,
one standby) once each way, side by side, SIGKILLs rank 3 after iteration ``--kill-after``, and
samples every process of the job from ``/proc`` until the end. Reported per run:

- ``refill``: how the new standby was started (``pre-forked`` or ``spawn``);
- ``refill_cpu_s``: the CPU seconds (user + system) the new standby used from its start until the
  end of the run, its interpreter start and warm-up included;
- ``refill_warm_s``: seconds from the launcher's "started standby" line until the standby's
  "warm" line (both polled every 0.2 s);
- ``after_over_before``: median iteration time of the ``--window`` iterations after the recovery's
  first one, over the median of the ``--window`` iterations before the kill.

    python benchmarks/refill.py --json bench_out/refill.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chaos  # noqa: E402
from common import median, print_table, rank_pids, read_events, start_launcher, wait_until, write_json  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, ensure_corpus  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")
REFILL_RE = re.compile(r"started standby (\S+) \(pid (\d+), (pre-forked|spawn)\)")


def cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / HZ


def one_run(workdir: str, data_prefix: str, iters: int, kill_after: int, window: int, reserves: int) -> dict:
    metrics = os.path.join(workdir, "metrics.jsonl")
    args = chaos.job_args(data_prefix, iters, os.path.join(workdir, "ckpt"), 10 * iters) + [
        "--trainmover",
        "--tm-standbys",
        "1",
        "--tm-standby-reserves",
        str(reserves),
        "--tm-metrics-file",
        metrics,
    ]
    log = os.path.join(workdir, "job")
    proc = start_launcher(8, args, ["--run-dir", os.path.join(workdir, "run"), "--metrics-port", "-1"], log)
    err, out = log + ".err", log + ".out"

    def iterations() -> list[dict]:
        return [e for e in read_events(metrics) if e.get("event") == "iteration"]

    try:
        wait_until(lambda: len(iterations()) >= kill_after or proc.poll() is not None, 900, 0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before iteration {kill_after}: see {err}")
        victim = rank_pids(err)[0][3]
        before = len(open(err).read())
        os.kill(victim, signal.SIGKILL)
        t_kill = time.time()
        print(f"  [reserves={reserves}] SIGKILL rank 3 (pid {victim}) after iteration {kill_after}", flush=True)
        refill = wait_until(lambda: REFILL_RE.search(open(err).read(), before) or proc.poll() is not None, 300, 0.05)
        if not isinstance(refill, re.Match):
            raise RuntimeError(f"no standby was started after the kill: see {err}")
        member, pid, how = refill.group(1), int(refill.group(2)), refill.group(3)
        t_started, t_warm = time.time(), None
        used = cpu_s(pid) or 0.0
        while proc.poll() is None:  # sample until the end: the standby lives as long as the job
            now = cpu_s(pid)
            used = now if now is not None else used
            if t_warm is None and f"standby {member} warm in" in open(out).read():
                t_warm = time.time()
            time.sleep(0.2)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"the job exited {proc.returncode}: see {err}")
    its = iterations()
    times = {e["iteration"]: e["iteration_s"] for e in its}
    first = min(e["iteration"] for e in its if e["t_end"] > t_kill)  # the recovery's first iteration
    pre = [times[i] for i in range(kill_after - window + 1, kill_after + 1) if i in times]
    post = [times[i] for i in range(first + 1, first + 1 + window) if i in times]
    return {
        "reserves": reserves,
        "refill": how,
        "refill_cpu_s": round(used, 2),
        "refill_warm_s": round(t_warm - t_started, 1) if t_warm else None,
        "iteration_before_s": round(median(pre), 4),
        "iteration_after_s": round(median(post), 4),
        "after_over_before": round(median(post) / median(pre), 3),
        "post_iterations": len(post),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40, help="Training iterations of each run (default 40).")
    parser.add_argument("--kill-after", type=int, default=12, help="SIGKILL rank 3 after this iteration (default 12).")
    parser.add_argument(
        "--window",
        type=int,
        default=10,
        help="Iterations compared before the kill and after the recovery (default 10).",
    )
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    parser.add_argument("--json", default=None, help="Write the results here.")
    parser.add_argument("--keep", action="store_true", help="Keep each run's directory (logs, metrics).")
    args = parser.parse_args(argv)
    if args.kill_after < args.window or args.iters < args.kill_after + args.window + 5:
        parser.error("need --window <= --kill-after and --iters >= --kill-after + --window + 5")
    ensure_corpus(args.data_prefix)
    results = []
    for reserves in (4, 0):
        workdir = tempfile.mkdtemp(prefix=f"tm_refill_{reserves}_")
        try:
            results.append(one_run(workdir, args.data_prefix, args.iters, args.kill_after, args.window, reserves))
        finally:
            if args.keep:
                print(f"  kept {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    pre, spawn = results
    payload = {
        "runs": results,
        "cpu_ratio": round(pre["refill_cpu_s"] / spawn["refill_cpu_s"], 3),
        "settings": {"iters": args.iters, "kill_after": args.kill_after, "window": args.window},
    }
    print_table(
        "standby refill after a SIGKILL (demo job, 8 ranks, 2 cores)",
        [(r["reserves"], r["refill"], r["refill_cpu_s"], r["refill_warm_s"], r["after_over_before"]) for r in results],
        ("--tm-standby-reserves", "refill", "refill CPU s", "warm after s", "iteration after/before"),
    )
    print(f"refill CPU, pre-forked over spawn: {payload['cpu_ratio']}")
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
