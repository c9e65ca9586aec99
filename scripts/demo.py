#!/usr/bin/env python3
"""``make demo``: a rank is SIGKILLed mid-run and a warm standby takes its place, with no restart.

1. Starts an etcd for the demo (so the job's records outlive the job).
2. Trains the demo GPT on 8 CPU ranks (TP2 x PP2 x DP2) with ``--trainmover
   --tm-standbys 1`` and ``--tm-inject-fault`` (default: rank 5 SIGKILLs itself
   in the backward pass of iteration 12). It scrapes the agent's /metrics while
   the job runs and prints the iteration and migration counters.
3. Prints the migration's timeline (``trainmover events --plot``: each phase
   with its duration) and writes ``timeline.png``.
4. Trains a fault-free reference of the same job and says whether every loss
   is bit-identical. Exit code 0 only when the job survived and they are.

Builds the corpus on first use (Python stdlib docstrings, offline). About a
minute or two on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the demo job's flags live in benchmarks/harness/jobs.py

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus, launch_cmd  # noqa: E402

TIMEOUT_S = 600  # per training run; the demo takes well under this on 2 cores


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def scrape(url: str) -> dict[str, float]:
    """The counters the demo follows, from one /metrics scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=2) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "trainmover_iterations_total":
                out["iterations"] = s.value
            elif s.name == "trainmover_migrations_total" and s.labels.get("kind") == "failure":
                out["migrations"] = s.value
    return out


def run_failover(cmd: list[str], log_path: str) -> tuple[int, list[dict]]:
    """Run the job, echo its output, scrape /metrics until it ends; returns (exit code, scrapes)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    found: dict[str, str] = {}

    def echo() -> None:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                print(line, end="", flush=True)
                m = re.search(r"metrics: (http://\S+/metrics)", line)
                if m:
                    found["url"] = m.group(1)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    scrapes: list[dict] = []
    last_shown = (-1.0, -1.0)
    deadline = time.time() + TIMEOUT_S
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.25)
        if "url" not in found:
            continue
        try:
            sample = scrape(found["url"])
        except OSError:
            continue  # not up yet, or the job just ended
        scrapes.append(sample)
        it, mig = sample.get("iterations", 0.0), sample.get("migrations", 0.0)
        if mig != last_shown[1] or it >= last_shown[0] + 5:
            say(
                f"/metrics scrape: trainmover_iterations_total={it:.0f} "
                f'trainmover_migrations_total{{kind="failure"}}={mig:.0f}'
            )
            last_shown = (it, mig)
    if proc.poll() is None:
        proc.kill()
        say(f"the job did not finish in {TIMEOUT_S}s; stopped it")
    code = proc.wait(30)
    reader.join(10)
    return code, scrapes


def trajectory(path: str) -> dict[int, float]:
    """iteration -> loss (an iteration re-run after a failure must log the same loss)."""
    out: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("event") == "iteration":
                if out.setdefault(rec["iteration"], rec["loss"]) != rec["loss"]:
                    out[rec["iteration"]] = float("nan")  # re-ran differently: never equal
    return out


def compare(got: dict[int, float], ref: dict[int, float]) -> bool:
    same = [it for it in ref if it in got and got[it] == ref[it]]
    missing = [it for it in ref if it not in got]
    differ = [it for it in ref if it in got and got[it] != ref[it]]
    ok = len(same) == len(ref) and not missing
    say(
        f"losses vs the fault-free reference: {len(same)}/{len(ref)} iterations bit-identical"
        + (f"; missing {missing}" if missing else "")
        + (f"; DIFFERENT at {differ}" if differ else "")
    )
    say(
        "RESULT: "
        + ("bit-identical: the failure cost a few seconds and changed nothing" if ok else "NOT bit-identical")
    )
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=24, help="Training iterations of each run.")
    parser.add_argument(
        "--fault",
        default="5:12:backward",
        help="--tm-inject-fault RANK:ITERATION:PHASE[:KILL|STOP] for the failover run.",
    )
    parser.add_argument("--no-reference", action="store_true", help="Skip the fault-free reference run.")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    parser.add_argument(
        "--run-dir", default=os.path.join(ROOT, "runs", "demo"), help="Logs, metrics, etcd data and timeline.png."
    )
    args = parser.parse_args(argv)
    ensure_corpus(args.data_prefix)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    os.makedirs(args.run_dir)
    metrics, ref_metrics = (os.path.join(args.run_dir, n) for n in ("metrics.jsonl", "reference.metrics.jsonl"))
    png = os.path.join(args.run_dir, "timeline.png")

    from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig

    etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=os.path.join(args.run_dir, "etcd"))).start(timeout=60)
    try:
        endpoints, token = ",".join(etcd.endpoints), secrets.token_hex(16)
        conn = ["--tm-etcd-endpoints", endpoints, "--tm-job-token", token]
        train = demo_args(args.data_prefix, args.iters) + ["--trainmover"]
        say(
            "8 CPU ranks, TP2 x PP2 x DP2, GPT 4 layers / hidden 128 / seq 128 on the stdlib-docstring corpus, "
            f"{args.iters} iterations, 1 warm standby; injected fault {args.fault} (rank:iteration:phase)"
        )
        cmd = launch_cmd(
            8,
            train + ["--tm-standbys", "1", "--tm-inject-fault", args.fault, "--tm-metrics-file", metrics],
            "--run-dir",
            os.path.join(args.run_dir, "failover"),
            "--tm-job",
            "demo",
            *conn,
        )
        say(
            "$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd).replace(token, "$TOKEN")
        )
        t0 = time.time()
        code, scrapes = run_failover(cmd, os.path.join(args.run_dir, "failover.log"))
        say(f"failover run exited {code} after {time.time() - t0:.0f}s")
        if scrapes:
            first, last = scrapes[0], scrapes[-1]
            say(
                f"/metrics during the run: iteration counter {first.get('iterations', 0):.0f} -> "
                f"{last.get('iterations', 0):.0f}, failure migrations {first.get('migrations', 0):.0f} -> "
                f"{last.get('migrations', 0):.0f}"
            )
        if code != 0:
            say(f"the job did not survive the fault: see {os.path.join(args.run_dir, 'failover.log')}")
            return 1

        say("the migration's timeline (trainmover events --plot):")
        events = [
            sys.executable,
            "-m",
            "trainmover_ext.cli",
            "events",
            "--tm-job",
            "demo",
            *conn,
            "--plot",
            png,
            "--metrics-file",
            metrics,
        ]
        if subprocess.call(events, cwd=ROOT, timeout=120) != 0:
            return 1

        if args.no_reference:
            return 0
        say("fault-free reference run of the same job (output in reference.log) ...")
        t0 = time.time()
        with open(os.path.join(args.run_dir, "reference.log"), "w") as log:
            ref_code = subprocess.call(
                launch_cmd(
                    8,
                    train + ["--tm-metrics-file", ref_metrics],
                    "--run-dir",
                    os.path.join(args.run_dir, "reference"),
                    "--tm-job",
                    "demo-reference",
                    "--metrics-port",
                    "-1",
                    *conn,
                ),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=TIMEOUT_S,
            )
        say(f"reference run exited {ref_code} after {time.time() - t0:.0f}s")
        if ref_code != 0:
            return 1
        ok = compare(trajectory(metrics), trajectory(ref_metrics))
        say(f"timeline: {os.path.relpath(png, ROOT)}")
        return 0 if ok else 1
    finally:
        etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
