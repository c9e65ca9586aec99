"""Detection on real training jobs: per fault type, from the fault to the committed plan, who was named, who else.

Each trial is a whole job under ``trainmover launch`` (4 ranks, pipeline 2 x data 2, one warm
standby, dropout 0.1, every TrainMover default: lease TTL, hang timeout, progress bound). The fault
types:

- ``sigkill``, ``sigstop``: the victim's drill (``--tm-inject-fault R:I:forward[:STOP]``);
- ``hang_compute``: its main thread blocks in forward while its process lives (``...:forward:HANG``);
- ``hang_collective``: it blocks right after issuing its data-parallel gradient all-reduce
  (``...:in-reduce:HANG``): its peers wait in a collective for it, and must not be named;
- ``etcd_pause``: no rank fails; the job's etcd is stopped (SIGSTOP) for 3 lease TTLs, then resumed;
- ``load``: no rank fails; two CPU spinners at normal priority run beside the job for ``--load-iters``.

Latency: from the drill's own timestamp (the line it prints as it strikes) to the controller's
``migration_planned`` event of the first failure plan (one host clock). ``right_rank``: the first
plan replaced the victim and only it. ``false_replacements``: ranks replaced that nobody failed (in
every plan of the trial). A no-fault type reports its replacements and whether the job trained on.

    python benchmarks/detection.py --json benchmarks/results/detection.json [--trials 3] [--load-iters 1000]

Writes ``{"faults": [{kind, goal, median_s, max_s, min_s, trials, latencies_s, right_rank,
false_replacements, trained_on, per_trial}], "command", "measured_at", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import measured_at, write_json  # noqa: E402

from harness.jobs import REPO_ROOT, ensure_corpus, launch_cmd, model_args  # noqa: E402

VICTIM = 1
"""Data-parallel rank 1 of the first pipeline stage (rank = dp + 2 * pp)."""
FAULT_ITERATION = 10
"""Late enough that the progress watchdog knows the pace (it judges after a few iterations)."""
TTL_S = 2.0
"""The default lease TTL, which the etcd pause is sized on."""
DRILLS = {
    "sigkill": f"{VICTIM}:{FAULT_ITERATION}:forward",
    "sigstop": f"{VICTIM}:{FAULT_ITERATION}:forward:STOP",
    "hang_compute": f"{VICTIM}:{FAULT_ITERATION}:forward:HANG",
    "hang_collective": f"{VICTIM}:{FAULT_ITERATION}:in-reduce:HANG",
}
GOALS = {
    "sigkill": "<= 0.05 s",
    "sigstop": "<= 0.6 s",
    "hang_compute": "<= max(3 s, 5 iterations)",
    "hang_collective": "<= max(3 s, 5 iterations), culprit named",
    "etcd_pause": "0 replaced, trains on",
    "load": "0 replaced",
}
_STRUCK = re.compile(r"fault drill: rank (\d+) strikes itself with .* at t=([\d.]+)")


def job_args(corpus: str, iters: int) -> list[str]:
    return [
        *model_args(layers=2, hidden=64, heads=4, seq=64, mbs=1, gbs=8, iters=iters),
        "--pipeline-model-parallel-size",
        "2",
        "--data-path",
        corpus + "_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
        "--trainmover",
        "--tm-standbys",
        "1",
        "--tm-no-sandbox",
        "--tm-standby-nice",
        "0",
    ]


def _events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda e: e["time"])


def _iterations(metrics: str) -> int:
    """How many distinct iterations the job logged."""
    if not os.path.exists(metrics):
        return 0
    seen = set()
    with open(metrics) as f:
        for line in f:
            record = json.loads(line) if line.strip() else {}
            if record.get("event") == "iteration":
                seen.add(record["iteration"])
    return len(seen)


def _etcd_pid(run_dir: str) -> int | None:
    needle = os.path.join(run_dir, "etcd").encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline and b"etcd" in cmdline.split(b"\0")[0]:
            return int(pid)
    return None


def run_trial(kind: str, corpus: str, tmp: str, index: int, load_iters: int) -> dict:
    """One job with one fault of ``kind``; what was seen."""
    name = f"{kind}-{index}"
    run_dir, metrics = os.path.join(tmp, name + ".run"), os.path.join(tmp, name + ".metrics.jsonl")
    iters = load_iters if kind == "load" else 20
    args = job_args(corpus, iters) + ["--tm-metrics-file", metrics]
    if kind in DRILLS:
        args += ["--tm-inject-fault", DRILLS[kind]]
    out_path, err_path = os.path.join(tmp, name + ".out"), os.path.join(tmp, name + ".err")
    spinners: list[subprocess.Popen] = []
    if kind == "load":
        spin = "import time\nwhile True:\n    pass"
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        job = subprocess.Popen(
            launch_cmd(4, args, "--run-dir", run_dir),
            stdout=out,
            stderr=err,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    paused_at = None
    try:
        if kind == "etcd_pause":
            deadline = time.monotonic() + 300
            while _iterations(metrics) < FAULT_ITERATION and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            pid = _etcd_pid(run_dir)
            if pid is None:
                raise RuntimeError(f"{name}: the job's etcd process was not found")
            paused_at = time.time()
            os.kill(pid, signal.SIGSTOP)
            time.sleep(3 * TTL_S)
            os.kill(pid, signal.SIGCONT)
        code = job.wait(timeout=600 + (load_iters if kind == "load" else 0))
    except subprocess.TimeoutExpired:
        job.kill()
        code = None
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    logs = Path(out_path).read_text() + Path(err_path).read_text()
    plans = [e for e in _events(run_dir) if e["what"] == "migration_planned" and e["detail"].get("reason") == "failure"]
    replaced = [[r["rank"] for r in p["detail"]["replacements"]] for p in plans]
    victim = VICTIM if kind in DRILLS else None
    struck = [float(t) for rank, t in _STRUCK.findall(logs) if int(rank) == VICTIM]
    latency = plans[0]["time"] - struck[0] if struck and plans else None
    return {
        "kind": kind,
        "exit_code": code,
        "latency_s": latency,
        "first_plan": replaced[0] if replaced else None,
        "right_rank": bool(replaced) and replaced[0] == [victim] if victim is not None else None,
        "false_replacements": sum(1 for ranks in replaced for r in ranks if r != victim),
        "trained_on": code == 0 and _iterations(metrics) == iters,
        "whys": [r.get("why") for p in plans for r in p["detail"]["replacements"]],
        "paused_at": paused_at,
        "logs": tmp,
    }


def summarize(kind: str, trials: list[dict]) -> dict:
    lat = [t["latency_s"] for t in trials if t["latency_s"] is not None]
    return {
        "kind": kind,
        "goal": GOALS[kind],
        "median_s": statistics.median(lat) if lat else None,
        "max_s": max(lat) if lat else None,
        "min_s": min(lat) if lat else None,
        "trials": len(trials),
        "latencies_s": lat,
        "right_rank": all(t["right_rank"] for t in trials) if kind in DRILLS else None,
        "false_replacements": sum(t["false_replacements"] for t in trials),
        "trained_on": all(t["trained_on"] for t in trials),
        "per_trial": trials,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--trials", type=int, default=3, help="jobs per fault type (default 3)")
    ap.add_argument("--load-iters", type=int, default=1000, help="iterations of the load run (default 1000)")
    ap.add_argument(
        "--kinds",
        default=",".join(GOALS),
        help=f"comma-separated fault types to run (default all: {','.join(GOALS)})",
    )
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(GOALS))
    if unknown:
        ap.error(f"unknown fault types {unknown}; choose from {list(GOALS)}")
    corpus = ensure_corpus()
    results = []
    with tempfile.TemporaryDirectory(prefix="tm-detection-") as tmp:
        for kind in kinds:
            trials = []
            for i in range(1 if kind == "load" else args.trials):
                print(f"[detection] {kind} trial {i + 1} ...", flush=True)
                trial = run_trial(kind, corpus, tmp, i, args.load_iters)
                print(f"[detection]   {json.dumps({k: v for k, v in trial.items() if k != 'logs'})}", flush=True)
                trials.append(trial)
            results.append(summarize(kind, trials))
    out = {
        "command": "python benchmarks/detection.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "measured_at": measured_at(),
        "ranks": 4,
        "fault_iteration": FAULT_ITERATION,
        "faults": results,
    }
    write_json(args.json, out)
    print(f"{'fault':<17}{'median s':>10}{'max s':>9}{'trials':>8}{'right':>7}{'false':>7}{'on':>5}  goal")
    for r in results:
        med = f"{r['median_s']:.2f}" if r["median_s"] is not None else "-"
        mx = f"{r['max_s']:.2f}" if r["max_s"] is not None else "-"
        right = "-" if r["right_rank"] is None else ("yes" if r["right_rank"] else "NO")
        print(
            f"{r['kind']:<17}{med:>10}{mx:>9}{r['trials']:>8}{right:>7}{r['false_replacements']:>7}"
            f"{'yes' if r['trained_on'] else 'NO':>5}  {r['goal']}"
        )
    print(f"results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
