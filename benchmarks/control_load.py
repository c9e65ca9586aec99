#!/usr/bin/env python3
"""What TrainMover's control plane costs a steady job: etcd's requests and every process's CPU.

Runs the same job (TP2 x PP2 x DP(ranks/4), ``--overlap-grad-reduce``, the tiny model by default) with
``--trainmover --tm-standbys 0`` and without it, alternating ``--rounds`` times. The TrainMover job runs on
torch's own process groups (``--tm-comm native``) unless ``--comm delta``: what is left is membership,
heartbeats, progress, the agent's watches and the controller, which is what this measures. In each job,
once ``--warmup`` iterations have run, it reads etcd's ``/metrics`` and every thread's CPU ticks
(``/proc/<pid>/task/*/stat``) of the launcher's process tree, waits ``--window`` seconds and reads them
again. Per job it reports:

- ``iteration_s``: the window over the iterations completed in it;
- ``etcd_per_s``: requests etcd received per second, by gRPC method (a ``LeaseKeepAlive`` message is one
  renewal), and ``etcd_streams_per_s``: streams it opened per second, by method;
- ``cpu_per_iteration_s``: core-seconds per iteration of ``etcd``, the ``agent`` (the launcher process),
  the ranks' ``rank_main`` threads, their gloo threads (``rank_gloo``) and their other threads
  (``rank_side``: the lease keep-alive, the heartbeat, the watches, gRPC's).

The summary gives, per key, the median of the rounds with its range (``median``, ``min``, ``max``,
``n``), and ``control_cpu_per_iteration_s``: etcd, the agent and the ranks' side threads of the
TrainMover job less the plain job's (each round's difference, then the median).

    python benchmarks/control_load.py --json benchmarks/results/control_load.json
    python benchmarks/control_load.py --rounds 1 --window 8        # a quick look
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from benchmarks.common import measured_at, print_table, write_json  # noqa: E402

ETCD_COUNTERS = ("grpc_server_msg_received_total", "grpc_server_started_total")
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def etcd_counters(text: str) -> dict[str, dict[str, float]]:
    """``{counter: {method: value}}`` of etcd's gRPC counters in a ``/metrics`` page."""
    out: dict[str, dict[str, float]] = {c: {} for c in ETCD_COUNTERS}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        found = re.search(r'grpc_method="([^"]+)"', line)
        if name in out and found:
            out[name][found.group(1)] = out[name].get(found.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counter_rates(before: dict, after: dict, seconds: float) -> dict[str, dict[str, float]]:
    """Per-second growth of each counter and method between two :func:`etcd_counters` readings."""
    return {
        counter: {
            method: round((value - before.get(counter, {}).get(method, 0.0)) / seconds, 2)
            for method, value in sorted(after[counter].items())
            if value > before.get(counter, {}).get(method, 0.0)
        }
        for counter in after
    }


def classify(pid: int, tid: int, launcher: int, cmdline: str, thread: str) -> str:
    """Which share a thread's CPU counts in: ``etcd``, ``agent``, ``rank_main``, ``rank_gloo`` or ``rank_side``."""
    if os.path.basename(cmdline.split("\0", 1)[0]).startswith("etcd"):
        return "etcd"
    if pid == launcher:
        return "agent"
    if tid == pid:
        return "rank_main"
    return "rank_gloo" if thread.startswith(GLOO_THREADS) else "rank_side"


def cpu_by_share(launcher: int) -> dict[tuple[int, int], tuple[str, int]]:
    """Every thread of ``launcher``'s process tree: (pid, tid) -> (share, CPU ticks)."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children[pid]
    out = {}
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in map(int, tids):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            thread = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[(pid, tid)] = (classify(pid, tid, launcher, cmdline, thread), int(fields[11]) + int(fields[12]))
    return out


def cpu_growth(before: dict, after: dict) -> dict[str, float]:
    """Core-seconds each share used between two :func:`cpu_by_share` readings (threads that ended are lost)."""
    hz = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = collections.Counter()
    for key, (share, ticks) in after.items():
        used[share] += (ticks - before.get(key, (share, 0))[1]) / hz
    return dict(used)


def _last_iteration(metrics: str) -> int:
    try:
        with open(metrics) as f:
            its = [json.loads(line).get("iteration", 0) for line in f if '"event": "iteration"' in line]
    except FileNotFoundError:
        return 0
    return max(its, default=0)


def _etcd_metrics(run_dir: str) -> dict:
    logs = glob.glob(os.path.join(run_dir, "etcd-*.log"))
    if not logs:
        raise RuntimeError(f"no etcd log in {run_dir}")
    with open(logs[0]) as f:
        url = re.search(r'listen-client-urls":\["([^"]+)"', f.read())
    if url is None:
        raise RuntimeError(f"no client URL in {logs[0]}")
    with urllib.request.urlopen(url.group(1) + "/metrics", timeout=10) as resp:
        return etcd_counters(resp.read().decode())


def run_job(args, workdir: str, tag: str, trainmover: bool) -> dict:
    """One job; its window's figures (see the module docstring)."""
    from benchmarks.comm import training_job_args
    from harness.jobs import ensure_corpus

    corpus = ensure_corpus(os.path.join(workdir, "corpus"))
    metrics, run_dir = os.path.join(workdir, f"{tag}.metrics.jsonl"), os.path.join(workdir, f"{tag}.run")
    tm = ["--trainmover", "--tm-standbys", "0"] + (["--tm-comm", "native"] if args.comm == "native" else [])
    cmd = [sys.executable, "-m", "trainmover_ext.cli", "launch", "--nproc-per-node", str(args.ranks)]
    job = training_job_args(args.model, args.ranks, corpus, args.iters)  # comm.py's steady-state job
    cmd += ["--run-dir", run_dir, os.path.join(ROOT, "pretrain_gpt.py"), *job]
    cmd += [*(tm if trainmover else []), "--tm-metrics-file", metrics]
    with open(os.path.join(workdir, f"{tag}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            deadline = time.monotonic() + args.timeout
            while _last_iteration(metrics) < args.warmup:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"job {tag} ended or stalled before iteration {args.warmup}; see its log")
                time.sleep(0.2)
            etcd0, cpu0, it0, t0 = _etcd_metrics(run_dir), cpu_by_share(proc.pid), _last_iteration(metrics), time.time()
            time.sleep(args.window)
            cpu1, it1, t1, etcd1 = cpu_by_share(proc.pid), _last_iteration(metrics), time.time(), _etcd_metrics(run_dir)
            if proc.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"job {tag} exited {proc.returncode}; see {workdir}/{tag}.log")
        finally:
            if proc.poll() is None:
                proc.kill()
    iterations = it1 - it0
    if iterations < 1 or it1 >= args.iters:
        raise RuntimeError(f"job {tag}: the window held {iterations} iterations and reached the end; raise --iters")
    rates = counter_rates(etcd0, etcd1, t1 - t0)
    used = cpu_growth(cpu0, cpu1)
    return {
        "iterations": iterations,
        "iteration_s": round((t1 - t0) / iterations, 4),
        "etcd_per_s": rates["grpc_server_msg_received_total"],
        "etcd_streams_per_s": rates["grpc_server_started_total"],
        "cpu_per_iteration_s": {k: round(v / iterations, 5) for k, v in sorted(used.items())},
    }


CONTROL_SHARES = ("etcd", "agent", "rank_side")


def _spread(values: list[float]) -> dict:
    """The project's figure: median, min, max and the number of runs."""
    return {
        "median": round(statistics.median(values), 5),
        "min": round(min(values), 5),
        "max": round(max(values), 5),
        "n": len(values),
    }


def summarize(rounds: list[dict]) -> dict:
    """Medians and ranges over the rounds (see the module docstring)."""
    out: dict = {}
    for job in ("trainmover", "plain"):
        jobs = [r[job] for r in rounds]
        out[job] = {
            "iteration_s": _spread([j["iteration_s"] for j in jobs]),
            "cpu_per_iteration_s": {
                share: _spread([j["cpu_per_iteration_s"].get(share, 0.0) for j in jobs])
                for share in sorted({s for j in jobs for s in j["cpu_per_iteration_s"]})
            },
            "etcd_per_s": {
                m: _spread([j["etcd_per_s"].get(m, 0.0) for j in jobs])
                for m in sorted({m for j in jobs for m in j["etcd_per_s"]})
            },
            "etcd_streams_per_s": {
                m: _spread([j["etcd_streams_per_s"].get(m, 0.0) for j in jobs])
                for m in sorted({m for j in jobs for m in j["etcd_streams_per_s"]})
            },
        }

    def control(job: dict) -> float:
        return sum(job["cpu_per_iteration_s"].get(s, 0.0) for s in CONTROL_SHARES)

    out["control_cpu_per_iteration_s"] = _spread([control(r["trainmover"]) - control(r["plain"]) for r in rounds])
    out["ratio"] = _spread([r["trainmover"]["iteration_s"] / r["plain"]["iteration_s"] for r in rounds])
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--rounds", type=int, default=3, help="pairs of jobs, alternating (default 3)")
    p.add_argument("--ranks", type=int, default=8, help="ranks of each job, a multiple of 4 (default 8)")
    p.add_argument("--model", choices=("tiny", "demo"), default="tiny", help="the model (default tiny)")
    p.add_argument(
        "--comm", choices=("native", "delta"), default="native", help="TrainMover's communicator (default native)"
    )
    p.add_argument("--iters", type=int, default=150, help="iterations of each job (default 150)")
    p.add_argument("--warmup", type=int, default=12, help="iterations before the window opens (default 12)")
    p.add_argument("--window", type=float, default=15.0, help="seconds measured in each job (default 15)")
    p.add_argument("--timeout", type=float, default=900.0, help="deadline of each job, seconds (default 900)")
    args = p.parse_args(argv)
    if args.ranks < 4 or args.ranks % 4:
        p.error(f"--ranks {args.ranks}: the layout is TP2 x PP2 x DP(ranks/4); give a multiple of 4")
    if args.rounds < 1 or args.window <= 0 or args.warmup < 1 or args.iters <= args.warmup:
        p.error("--rounds and --warmup must be at least 1, --window positive, --iters above --warmup")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="control_load_")
    rounds = []
    for rnd in range(args.rounds):
        pair = {job: run_job(args, workdir, f"{job}{rnd}", job == "trainmover") for job in ("trainmover", "plain")}
        rounds.append(pair)
        print(
            f"round {rnd}: " + json.dumps({j: (pair[j]["iteration_s"], pair[j]["cpu_per_iteration_s"]) for j in pair})
        )
    summary = summarize(rounds)
    payload = {
        "command": " ".join(["python", "benchmarks/control_load.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {"cpus": os.cpu_count()},
        "summary": summary,
        "rounds": rounds,
    }
    rows = [
        (
            share,
            summary["trainmover"]["cpu_per_iteration_s"].get(share, {}).get("median"),
            summary["plain"]["cpu_per_iteration_s"].get(share, {}).get("median"),
        )
        for share in ("etcd", "agent", "rank_main", "rank_gloo", "rank_side")
    ]
    print_table("core-seconds per iteration (medians)", rows, ("share", "trainmover", "plain"))
    tm = summary["trainmover"]
    print("etcd requests/s (trainmover):", {m: v["median"] for m, v in tm["etcd_per_s"].items()})
    print("etcd streams opened/s (trainmover):", {m: v["median"] for m, v in tm["etcd_streams_per_s"].items()})
    print("control CPU per iteration:", summary["control_cpu_per_iteration_s"], "ratio:", summary["ratio"])
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
