#!/usr/bin/env python3
"""Chaos run: a seeded schedule of failures against TrainMover, stop-restart and a fault-free run.

The demo job (8 ranks, TP2 x PP2 x DP2, Megatron's dropout 0.1, bf16) trains ``--iters``
iterations (300 by default) three times, one run after the other, on this machine:

- ``fault_free``: under ``--trainmover --tm-standbys 3``, nothing killed: the reference
  trajectory and the steady iteration time.
- ``trainmover``: the same, while the schedule kills ranks. Each event waits until its
  iteration is logged, then kills the process serving its rank at a random point inside the
  next iteration: SIGKILL, or SIGSTOP (a hang: its agent sees the heartbeat stop while the
  process uses no CPU, and fences and reports it, ``launch.heartbeat``).
  Some events cascade into a kill during the migration they caused: of the **joiner** as
  soon as the plan names it, or of **another rank** just after the plan. Standbys are
  refilled as the job goes (``--tm-standby-duty`` paces their warm-up).
- ``stop_restart``: the job without ``--trainmover`` under ``--max-restarts``, every rank a
  fresh interpreter on restart, resuming from its checkpoint; the same events as SIGKILLs
  (a hang would wait for the collective timeout, and a cascade kill would land in a
  restart: both are left out, in the baseline's favour).

Every run checkpoints every ``--save-interval`` iterations. Reported, per run:

- ``ettr``: productive time / wall time, where productive time is the number of iterations
  times the fault-free steady iteration time, and wall time runs from the start of the first
  iteration to the end of the last;
- ``lost_s_per_failure``: (wall time - the fault-free run's) / processes killed;
- ``failures``, ``survived_without_restart`` (failures minus restarts of the whole job);
- ``bit_identical``: every iteration logged (re-runs included) equals the fault-free run's
  loss and consumed samples; for stop-restart, every re-run after a restart equals that
  iteration's first run (it trains on native gloo, whose 4-rank gradient-norm sum runs in
  another order than nccl_delta's: from the first clipped step its losses differ from the
  fault-free run's in the last bits, restart or not);
- ``post_promotion_ratio`` (TrainMover): the median iteration time of the (up to) 20
  iterations after each recovery's first iteration, stopping at the next kill, over the
  fault-free steady time; the largest of these medians is ``post_promotion_ratio``.

    python benchmarks/chaos.py --json benchmarks/results/chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    LastIteration,
    Tail,
    median,
    print_table,
    read_events,
    start_launcher,
    wait_until,
    write_json,
)

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus  # noqa: E402

WORLD = 8
PLAN_RE = re.compile(r"epoch (\d+) \((failure|planned)\): rank (\d+) -> (\S+) \(pid (\d+)\)")
GOALS = {"ettr": 0.9, "lost_over_restart": 0.05, "post_promotion_ratio": 1.1}


def job_args(data_prefix: str, iters: int, save_dir: str, save_interval: int) -> list[str]:
    return demo_args(data_prefix, iters) + [
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
        "--bf16",
        "--save",
        save_dir,
        "--load",
        save_dir,
        "--save-interval",
        str(save_interval),
    ]


def make_schedule(
    seed: int, iters: int, mean_gap: float, first: int, stop_share: float, cascade_share: float
) -> list[dict]:
    """The failures, in order: after which iteration, where inside the next, which rank, how."""
    rng = random.Random(seed)
    every = max(1, round(1 / cascade_share)) if cascade_share > 0 else 0
    events, it = [], first
    while True:
        it += max(4, round(rng.expovariate(1.0 / (mean_gap - 2))) + 2)
        if it > iters - 10:
            return events
        ev = {
            "after_iteration": it,
            "inside": round(rng.random(), 3),
            "rank": rng.randrange(WORLD),
            "signal": "STOP" if rng.random() < stop_share else "KILL",
            "cascade": None,
        }
        if every and len(events) % every == every - 1:  # spread evenly, alternating the two kinds
            ev["cascade"] = ("joiner", "other")[(len(events) // every) % 2]
            ev["cascade_rank"] = rng.choice([r for r in range(WORLD) if r != ev["rank"]])
            ev["cascade_delay_s"] = round(rng.uniform(0.0, 0.2), 3)
        events.append(ev)


class Pids:
    """Which process serves each rank, from the launcher's log (initial pids, restarts, plans), read
    incrementally: the harness polls it while the job runs (see ``common.Tail``)."""

    def __init__(self, err_path: str):
        self._tail = Tail(err_path)
        self._text_so_far = ""
        self._plans: list[re.Match] = []

    def _text(self) -> str:
        new = self._tail.lines()
        if new:
            chunk = "\n".join(new) + "\n"
            self._plans.extend(PLAN_RE.finditer(chunk))  # one plan is one line: new lines hold the new plans
            self._text_so_far += chunk
        return self._text_so_far

    def of(self, rank: int) -> int | None:
        text = self._text()
        starts = [m.end() for m in re.finditer(r"started \d+ ranks(?: \(\w+\))?, pids", text)]
        if not starts:
            return None
        pid = json.loads(re.findall(r"pids (\[[\d, ]+\])", text)[-1])[rank]
        for m in PLAN_RE.finditer(text, starts[-1]):
            if int(m[3]) == rank:
                pid = int(m[5])
        return pid

    def plans(self) -> list[re.Match]:
        self._text()
        return list(self._plans)


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def run(
    workdir: str,
    name: str,
    args: list[str],
    launch_flags: list[str],
    schedule: list[dict],
    *,
    trainmover: bool,
    steady_s: float,
) -> dict:
    """Run the job, carrying out ``schedule``; returns what happened."""
    metrics = os.path.join(workdir, f"{name}.jsonl")
    log = os.path.join(workdir, name)
    proc = start_launcher(WORLD, args + ["--tm-metrics-file", metrics], launch_flags, log)
    pids = Pids(log + ".err")
    last_iteration = LastIteration(metrics)
    kills: list[dict] = []
    try:
        for n, ev in enumerate(schedule):
            wait_until(lambda ev=ev: last_iteration() >= ev["after_iteration"] or proc.poll() is not None, 1800, 0.01)
            if proc.poll() is not None:
                break
            time.sleep(ev["inside"] * steady_s)
            sig = signal.SIGSTOP if trainmover and ev["signal"] == "STOP" else signal.SIGKILL
            plans_before = len(pids.plans())
            t = time.time()
            if _signal(pids.of(ev["rank"]), sig):
                kills.append({"t": t, "rank": ev["rank"], "signal": sig.name, "event": n})
                print(
                    f"  [{name}] {sig.name} rank {ev['rank']} inside iteration {ev['after_iteration'] + 1}", flush=True
                )
            if not (trainmover and ev["cascade"]):
                continue
            try:
                plan = wait_until(
                    lambda ev=ev, before=plans_before: next(
                        (m for m in pids.plans()[before:] if int(m[3]) == ev["rank"]), None
                    ),
                    60,
                    0.002,
                )
            except TimeoutError:
                continue
            if ev["cascade"] == "joiner":
                victim, pid = ev["rank"], int(plan[5])
            else:
                time.sleep(ev["cascade_delay_s"])
                victim, pid = ev["cascade_rank"], pids.of(ev["cascade_rank"])
            t = time.time()
            if _signal(pid, signal.SIGKILL):
                kills.append({"t": t, "rank": victim, "signal": "SIGKILL", "event": n, "cascade": ev["cascade"]})
                print(
                    f"  [{name}] cascade: SIGKILL {'the joiner of' if ev['cascade'] == 'joiner' else 'rank'} "
                    f"{victim} during the migration",
                    flush=True,
                )
        code = proc.wait(3600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise RuntimeError(f"{name} exited {code}; see {log}.err")
    events = read_events(metrics)
    return {
        "metrics": metrics,
        "events": events,
        "kills": kills,
        "restarts": sum(1 for e in events if e.get("event") == "startup") - 1,
    }


def wall_s(events: list[dict]) -> float:
    its = [e for e in events if e.get("event") == "iteration"]
    first = its[0]
    return its[-1]["t_end"] - (first["t_end"] - first["iteration_s"])


def values(events: list[dict]) -> dict[int, set]:
    out: dict[int, set] = {}
    for e in events:
        if e.get("event") == "iteration":
            out.setdefault(e["iteration"], set()).add((e["loss"], e["consumed_samples"]))
    return out


def bit_identical(events: list[dict], ref: dict[int, set], iters: int) -> bool:
    got = values(events)
    return sorted(got) == list(range(1, iters + 1)) and all(got[i] == ref[i] for i in got)


def post_promotion(events: list[dict], kills: list[dict], steady_s: float, window: int = 20) -> list[float]:
    """Per recovery: median iteration time of the ``window`` iterations after its first one, before the
    next kill, over ``steady_s``."""
    its = [e for e in events if e.get("event") == "iteration"]
    resumes = sorted(
        e.get("t", e.get("state_ready"))
        for e in events
        if e.get("event") in ("recovered", "promoted") and e.get("reason", "failure") == "failure"
    )
    ratios = []
    for t in resumes:
        nxt = min((k["t"] for k in kills if k["t"] > t), default=float("inf"))
        after = [e for e in its if e["t_end"] > t and e["t_end"] < nxt][1 : window + 1]
        if len(after) >= 5:
            ratios.append(round(median([e["iteration_s"] for e in after]) / steady_s, 3))
    return ratios


def reruns_reproduce(events: list[dict], iters: int) -> bool:
    """Every iteration logged, and every re-run of one (after a restart) equal to its first run."""
    got = values(events)
    return sorted(got) == list(range(1, iters + 1)) and all(len(v) == 1 for v in got.values())


def summarize(res: dict, ref_wall: float, ref_values: dict | None, iters: int, steady_s: float) -> dict:
    """``ref_values`` None: ``bit_identical`` checks the run against itself (:func:`reruns_reproduce`)."""
    failures = len(res["kills"])
    wall = wall_s(res["events"])
    return {
        "ettr": round(iters * steady_s / wall, 4),
        "wall_s": round(wall, 2),
        "lost_s_per_failure": round((wall - ref_wall) / failures, 3) if failures else None,
        "failures": failures,
        "restarts": res["restarts"],
        "survived_without_restart": max(0, failures - res["restarts"]),
        "bit_identical": (
            bit_identical(res["events"], ref_values, iters)
            if ref_values is not None
            else reruns_reproduce(res["events"], iters)
        ),
        "kills": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in kill.items()} for kill in res["kills"]],
        # (iteration, end time, seconds) of every iteration logged, re-runs included: where the time went
        "iterations": [
            [e["iteration"], round(e["t_end"], 3), round(e["iteration_s"], 4)]
            for e in res["events"]
            if e.get("event") == "iteration"
        ],
        "recoveries": [
            {k: e.get(k) for k in ("event", "epoch", "t", "state_ready", "resumed_iteration")}
            for e in res["events"]
            if e.get("event") in ("recovered", "promoted")
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--iters", type=int, default=300, help="Training iterations of each run (at least 60).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the failure schedule.")
    parser.add_argument(
        "--mean-gap",
        type=float,
        default=20.0,
        help="Mean number of steady iterations between failures (exponentially distributed).",
    )
    parser.add_argument("--stop-share", type=float, default=0.2, help="Share of failures that are hangs (SIGSTOP).")
    parser.add_argument(
        "--cascade-share",
        type=float,
        default=0.25,
        help="Share of failures followed by a kill during their migration (the joiner or another rank).",
    )
    parser.add_argument("--standbys", type=int, default=3, help="--tm-standbys of the TrainMover runs.")
    parser.add_argument(
        "--standby-duty",
        type=float,
        default=0.25,
        help="--tm-standby-duty of the TrainMover runs (pacing of a refilled standby's warm-up; default 0.25, "
        "where benchmarks/warmup.py's isolation probe puts a warming standby's cost under 2%%).",
    )
    parser.add_argument(
        "--standby-reserves",
        type=int,
        default=16,
        help="--tm-standby-reserves of the TrainMover runs: refills wake one of these pre-forked "
        "children instead of starting a new interpreter (enough for every failure by default).",
    )
    parser.add_argument("--save-interval", type=int, default=25, help="Checkpoint interval of every run.")
    parser.add_argument("--skip-restart", action="store_true", help="Skip the stop-restart run.")
    parser.add_argument("--keep-logs", action="store_true", help="Keep every run's logs and metrics (printed path).")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    args = parser.parse_args(argv)
    if args.iters < 60:
        parser.error("--iters must be at least 60")
    ensure_corpus(args.data_prefix)
    schedule = make_schedule(
        args.seed, args.iters, args.mean_gap, first=10, stop_share=args.stop_share, cascade_share=args.cascade_share
    )
    print(
        f"schedule: {len(schedule)} failures over {args.iters} iterations "
        f"({sum(1 for e in schedule if e['cascade'])} cascading)",
        flush=True,
    )
    workdir = tempfile.mkdtemp(prefix="tm_chaos_")
    tm_flags = [
        "--trainmover",
        "--tm-standbys",
        str(args.standbys),
        "--tm-standby-duty",
        str(args.standby_duty),
        "--tm-standby-reserves",
        str(args.standby_reserves),
    ]
    ok = False
    try:

        def fresh(name: str) -> list[str]:
            return job_args(args.data_prefix, args.iters, os.path.join(workdir, f"{name}.ckpt"), args.save_interval)

        print("fault-free run ...", flush=True)
        ref = run(
            workdir,
            "fault_free",
            fresh("fault_free") + tm_flags,
            ["--run-dir", os.path.join(workdir, "fault_free.run"), "--metrics-port", "-1"],
            [],
            trainmover=True,
            steady_s=0.0,
        )
        its = [e for e in ref["events"] if e.get("event") == "iteration"]
        steady_s = median([e["iteration_s"] for e in its[5:]])
        ref_wall, ref_values = wall_s(ref["events"]), values(ref["events"])
        print(f"TrainMover under the schedule (steady iteration {steady_s * 1000:.0f} ms) ...", flush=True)
        tm = run(
            workdir,
            "trainmover",
            fresh("trainmover") + tm_flags,
            ["--run-dir", os.path.join(workdir, "trainmover.run"), "--metrics-port", "-1", "--max-restarts", "5"],
            schedule,
            trainmover=True,
            steady_s=steady_s,
        )
        trainmover = summarize(tm, ref_wall, ref_values, args.iters, steady_s)
        ratios = post_promotion(tm["events"], tm["kills"], steady_s)
        trainmover.update(
            post_promotion_ratio=max(ratios) if ratios else None,
            post_promotion_median_ratio=round(median(ratios), 3) if ratios else None,
            post_promotion_ratios=ratios,
        )
        stop_restart = None
        if not args.skip_restart:
            print("stop-restart under the same schedule ...", flush=True)
            sr = run(
                workdir,
                "stop_restart",
                fresh("stop_restart"),
                [
                    "--run-dir",
                    os.path.join(workdir, "stop_restart.run"),
                    "--metrics-port",
                    "-1",
                    "--max-restarts",
                    str(len(schedule) + 2),
                    "--restart-start-method",
                    "spawn",
                ],
                schedule,
                trainmover=False,
                steady_s=steady_s,
            )
            # Its own re-runs, not the fault-free run: native gloo sums the 4-rank gradient norm in another
            # order than nccl_delta, so the two differ in the last bits from the first clipped step on.
            stop_restart = summarize(sr, ref_wall, None, args.iters, steady_s)
            stop_restart["bit_identical_against"] = "its own first run of each iteration (native gloo)"
        ok = True
    finally:
        if ok and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        elif ok:
            print(f"logs kept in {workdir}")
        else:
            print(f"a run failed: its logs are kept in {workdir}", file=sys.stderr)
    lost_ratio = (
        trainmover["lost_s_per_failure"] / stop_restart["lost_s_per_failure"]
        if stop_restart and stop_restart["lost_s_per_failure"] and trainmover["lost_s_per_failure"] is not None
        else None
    )
    result = {
        "command": " ".join(["python", "benchmarks/chaos.py", *(sys.argv[1:] if argv is None else argv)]),
        "job": "demo: 8 ranks TP2 x PP2 x DP2, 4 layers, hidden 128, seq 128, bf16, dropout 0.1 (CPU gloo, 2 cores)",
        "config": {
            k: getattr(args, k)
            for k in (
                "iters",
                "seed",
                "mean_gap",
                "stop_share",
                "cascade_share",
                "standbys",
                "standby_duty",
                "standby_reserves",
                "save_interval",
            )
        },
        "schedule": schedule,
        "steady_iteration_s": round(steady_s, 4),
        "fault_free": {"wall_s": round(ref_wall, 2)},
        "trainmover": trainmover,
        "stop_restart": stop_restart,
        "lost_over_restart": round(lost_ratio, 4) if lost_ratio is not None else None,
        "goals": GOALS,
    }
    rows = [
        (
            "TrainMover",
            trainmover["ettr"],
            trainmover["lost_s_per_failure"],
            trainmover["failures"],
            trainmover["survived_without_restart"],
            trainmover["bit_identical"],
        )
    ]
    if stop_restart:
        rows.append(
            (
                "stop-restart",
                stop_restart["ettr"],
                stop_restart["lost_s_per_failure"],
                stop_restart["failures"],
                stop_restart["survived_without_restart"],
                stop_restart["bit_identical"],
            )
        )
    print_table(
        f"chaos run: {args.iters} iterations, steady {steady_s * 1000:.0f} ms",
        rows,
        ("run", "ETTR", "lost s/failure", "failures", "survived w/o restart", "bit-identical"),
    )
    print(
        f"post-promotion iteration time over steady: max {trainmover['post_promotion_ratio']}, "
        f"median {trainmover['post_promotion_median_ratio']} ({len(ratios)} recoveries)"
    )
    if lost_ratio is not None:
        print(f"TrainMover's lost time per failure = {lost_ratio:.4f} x stop-restart's")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
