#!/usr/bin/env python3
"""Sandbox warm-up: a warm standby's first iteration after promotion against a cold process's.

One tiny PP=3 GPT job (3 ranks, real megatron-core on nccl_delta over gloo
pair links, forked from this process) records its first ``--record-iters``
iterations, then trains on. For each role (first, middle, last) the rank of
that role is handed over ``--repeats`` times each with nccl_delta's planned
swap (only that rank's links change; no other process rebuilds anything):

* to a **cold** process: it builds the model and joins;
* to a **warm** general standby: it first warms all three roles alone in its
  sandbox (replaying the recordings; no link to the job), then builds and joins;
* to a **kept** one: the same warm-up, keeping the role it is then promoted
  into (``--tm-keep-role``), whose model it adopts instead of building one
  (``sandbox/adopt.py``). In this job every rank is its role's recorded rank.

The hand-over is the real one (``harness.promotion``): at the
boundary the leaver streams its state (model, optimizer state, scheduler, RNG,
data position) with ``migration.transfer`` and the newcomer receives it as a
promoted standby does, so its first iteration does not pay what a real one
does not (e.g. Adam's state, which a state-less newcomer would create lazily
inside its first step). The transfer's duration is left out: stayers start the
timed iteration once the newcomer holds the state. The leaver tears down only
after the measured iterations, and the next hand-over starts once it is gone
(its exit would otherwise run on the same cores inside a measured window).

Per hand-over, with s the boundary (the newcomer's first iteration is s+1) and
a job iteration's time taken as the slowest *stayer's* (the pipeline waits for
the newcomer, so its lazy start-up shows there):

    ratio      = iteration s+1 / median of iterations s-9..s and s+3..s+12 (s-4 left out)
    null_ratio = iteration s-4 / the same median   (an undisturbed iteration: the noise floor)

``kept_ratio`` / ``warm_ratio`` / ``cold_ratio`` is the median over the hand-overs of a role;
every trial's ratio and null ratio is in the JSON, never a chosen one. Also
reported: the newcomer's own first iteration against its own steady ones,
garbage-collection time inside the first iteration, recording size and
overhead per role, that the recorder hooks are gone after recording, the job's
iteration time while a standby warms against the rest (isolation), and the
standby's peak RSS against the job ranks'. Each newcomer and rank has its own
inductor cache (a machine of its own). The isolation probes' standby runs as a
launched one does (nice 0), unpaced and paced by ``--tm-standby-duty``
(``--probe-duties``): on these two shared cores the pacing is what keeps a
standby from slowing the job, as a machine of its own would.

    python benchmarks/warmup.py --compile off --repeats 5 --probe-repeats 3 --json bench_out/warmup.json
    python benchmarks/warmup.py --compile on --repeats 2 --no-probe --json bench_out/warmup_compile.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, write_json  # noqa: E402

ROLES = ("first", "middle", "last")
KINDS = ("cold", "warm", "kept")
"""cold: builds its model; warm: sandbox warm-up of every role, then builds its model; kept: the same warm-up
keeping the role it is promoted into, whose model it then adopts (``sandbox/adopt.py``)."""
RANK_OF = {"first": 0, "middle": 1, "last": 2}
WORLD = 3


MODELS = {
    "demo": dict(layers=3, hidden=128, heads=4, seq=128, mbs=2, gbs=8),
    "tiny": dict(layers=3, hidden=64, heads=4, seq=32, mbs=1, gbs=4),
}
"""demo: the demo job's model (hidden 128, sequence 128, micro-batch 2), one layer per stage; tiny: the
sessions-1-6 model, whose ~30 ms iteration puts a few milliseconds of scheduling noise at 20%."""


def job_argv(corpus: str, compile_: bool, model: str) -> list[str]:
    from harness.jobs import model_args

    return model_args(**MODELS[model], iters=100000, lr=1e-3) + [
        "--pipeline-model-parallel-size",
        "3",
        "--data-path",
        corpus + "_text_document",
        *(["--tm-compile"] if compile_ else []),
    ]


class Run:
    """The forked processes of one variant and the parent's view of the control keys."""

    def __init__(self, port: int, deadline_s: float):
        from torch.distributed import PrefixStore, TCPStore

        from harness.sandbox import CTX

        self.ctl = PrefixStore(
            "ctl", TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=deadline_s))
        )
        self.queue = CTX.Queue()
        self.procs: dict = {}
        self.results: dict = {}
        self.deadline = time.monotonic() + deadline_s

    def fork(self, key, fn, *args) -> None:
        from harness.sandbox import CTX, _child

        proc = CTX.Process(target=_child, args=(key, fn, args, self.queue, 0), daemon=True)
        proc.start()
        self.procs[key] = proc

    def progress(self) -> int:
        return int(self.ctl.get("progress").decode()) if self.ctl.check(["progress"]) else 0

    def wait(self, predicate, what: str):
        while True:
            self._drain()
            value = predicate()
            if value:
                return value
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"benchmark deadline passed waiting for {what}")
            time.sleep(0.05)

    def _drain(self) -> None:
        import queue

        while True:
            try:
                key, ok, value = self.queue.get_nowait()
            except queue.Empty:
                break
            if not ok:
                self.kill()
                raise RuntimeError(f"process {key} failed:\n{value}")
            self.results[key] = value
        dead = [k for k, p in self.procs.items() if not p.is_alive() and k not in self.results]
        if dead and self.queue.empty():
            time.sleep(0.5)
            if self.queue.empty():
                self.kill()
                raise RuntimeError(f"process(es) {dead} died without reporting")

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_variant(
    corpus: str,
    compile_: bool,
    record_iters: int,
    steady_iters: int,
    repeats: int,
    deadline_s: float,
    roles: tuple = ROLES,
    nice: int = 0,
    probe_duties: tuple = (0.25,),
    kinds: tuple = KINDS,
    probe_repeats: int = 1,
    *,
    model: str,
) -> dict:
    from harness import promotion
    from harness import sandbox as harness
    from trainmover_ext.sandbox.recording import load_recordings

    workdir = tempfile.mkdtemp(prefix="tm-warmup-")
    record_dir = os.path.join(workdir, "recordings")
    argv = job_argv(corpus, compile_, model)
    store = harness.host_store()
    run = Run(store.port, deadline_s)
    try:
        for rank in range(WORLD):
            run.fork(("job", rank), promotion.job_member, rank, WORLD, store.port, argv, record_dir, record_iters)
        run.wait(
            lambda: all(os.path.isfile(os.path.join(record_dir, r, "index.json")) for r in ROLES), "the recordings"
        )
        run.wait(lambda: run.progress() >= record_iters + steady_iters, "steady iterations")
        # Isolation probes: a standby warms every role while the job trains, paced to each duty in turn;
        # then the job trains as long without it.
        probes = [(duty, i) for i in range(probe_repeats) for duty in probe_duties]
        for n, (duty, _) in enumerate(probes):
            run.fork(("probe", n), promotion.warm_only, argv, WORLD, record_dir, nice, duty)
            run.wait(lambda n=n: ("probe", n) in run.results, "the isolation probe")
            window = run.results[("probe", n)]
            quiet_until = time.time() + (window["warm_end"] - window["warm_start"])
            run.wait(lambda until=quiet_until: time.time() >= until, "the quiet window after the probe")
        trials, epoch = [], 0
        serving = {rank: ("job", rank) for rank in range(WORLD)}
        for role, _, kind in ((r, i, k) for r in roles for i in range(repeats) for k in kinds):
            epoch += 1
            rank = RANK_OF[role]
            # Newcomers warm at normal priority (the probe above measures interference); the job then
            # trains steady_iters more iterations before the switch, so the baseline excludes the warm-up.
            run.fork(
                ("newcomer", epoch),
                promotion.newcomer,
                rank,
                WORLD,
                store.port,
                argv,
                epoch,
                None if kind == "cold" else record_dir,
                0,
                role if kind == "kept" else None,
            )
            run.wait(lambda e=epoch: run.ctl.check([f"ready/{e}"]), f"newcomer {epoch} to be ready")
            ready_at = run.progress()
            run.wait(
                lambda at=ready_at: run.progress() >= at + steady_iters, f"steady iterations before switch {epoch}"
            )
            switch_at = run.progress() + 3
            run.ctl.set(f"plan/{epoch}", json.dumps({"rank": rank, "switch_at": switch_at}))
            run.wait(lambda at=switch_at: run.progress() >= at + steady_iters, f"iterations after switch {epoch}")
            # Only now may the leaver tear down, and the next trial starts once it is gone: its exit
            # runs on these same cores and must not fall into any measured window.
            run.ctl.set(f"release/{epoch}", "1")
            leaver, serving[rank] = serving[rank], ("newcomer", epoch)
            run.wait(lambda who=leaver: who in run.results, f"the leaver of epoch {epoch} to finish")
            trials.append({"role": role, "kind": kind, "epoch": epoch, "switch_at": switch_at, "rank": rank})
        run.ctl.set("stop_at", str(run.progress() + 3))
        run.wait(lambda: len(run.results) == len(run.procs), "every process to finish")
    finally:
        run.kill()
    recordings = load_recordings(record_dir)
    return analyse(run.results, trials, recordings, compile_, record_iters, roles, len(probes), steady_iters, kinds)


def _iteration_times(results: dict) -> dict[int, list[tuple]]:
    """iteration -> [(process key, rank, t0, t1, gc seconds)] over every process that ran it."""
    out: dict[int, list[tuple]] = {}
    for key, res in results.items():
        for step in res["steps"]:
            out.setdefault(step["iteration"], []).append(
                (key, res.get("rank"), step["t0"], step["t1"], step.get("gc_s", 0.0))
            )
    return out


# Per trial, with s the switch boundary (the newcomer's first iteration is s+1):
FIRST_AFTER = 1  # the measured iteration
NULL_ITERATION = -4  # an undisturbed iteration, measured the same way (noise floor)
BEFORE = range(-9, 1)  # baseline: the 10 iterations up to the switch ...
AFTER = range(3, 13)  # ... and 10 after it, once the newcomer is steady


def trial_figures(its: dict, trial: dict, steady_iters: int) -> dict:
    """One hand-over: the stayers' iteration right after the switch (the pipeline waits for the newcomer,
    so its lazy start shows there) over the median stayers' iteration beside it, before and after."""
    s, rank, newcomer = trial["switch_at"], trial["rank"], ("newcomer", trial["epoch"])

    def stayers(k: int) -> float:
        return max(t1 - t0 for key, r, t0, t1, _ in its[s + k] if r != rank)

    offsets = [k for k in (*BEFORE, *AFTER) if k != NULL_ITERATION and k <= steady_iters]
    steady = median(stayers(k) for k in offsets)
    own = [t1 - t0 for key, _, t0, t1, _ in its[s + FIRST_AFTER] if key == newcomer]
    own_steady = [t1 - t0 for k in AFTER if k <= steady_iters for key, _, t0, t1, _ in its[s + k] if key == newcomer]
    gc_first = max((g for _, _, _, _, g in its[s + FIRST_AFTER]), default=0.0)
    return {
        "ratio": stayers(FIRST_AFTER) / steady,
        "null_ratio": stayers(NULL_ITERATION) / steady,
        "first_s": stayers(FIRST_AFTER),
        "steady_s": steady,
        "own_ratio": own[0] / median(own_steady) if own and own_steady else None,
        "own_first_s": own[0] if own else None,
        "gc_first_s": gc_first,
    }


def analyse(
    results: dict,
    trials: list[dict],
    recordings: dict,
    compile_: bool,
    record_iters: int,
    roles_measured: tuple,
    probes: int,
    steady_iters: int = 12,
    kinds: tuple = KINDS,
) -> dict:
    its = _iteration_times(results)
    job_time = {k: max(t1 - t0 for _, _, t0, t1, _ in v) for k, v in its.items()}
    roles = []
    for role in roles_measured:
        entry = {"role": role, "compile": compile_, "record_bytes": recordings[role].data_bytes}
        for kind in kinds:
            entry[f"{kind}_adopted"] = [
                results[("newcomer", t["epoch"])]["adopted"] for t in trials if t["role"] == role and t["kind"] == kind
            ]
            figs = [trial_figures(its, t, steady_iters) for t in trials if t["role"] == role and t["kind"] == kind]
            # The median trial: one noisy iteration on shared cores does not make the figure.
            entry[f"{kind}_ratio"] = round(median(f["ratio"] for f in figs), 3)
            entry[f"{kind}_ratios"] = [round(f["ratio"], 3) for f in figs]
            entry[f"{kind}_null_ratios"] = [round(f["null_ratio"], 3) for f in figs]
            entry[f"{kind}_first_iteration_s"] = round(median(f["first_s"] for f in figs), 4)
            own = [f["own_ratio"] for f in figs if f["own_ratio"] is not None]
            entry[f"{kind}_newcomer_own_ratio"] = round(median(own), 3) if own else None
            entry[f"{kind}_newcomer_first_iteration_s"] = round(median(f["own_first_s"] for f in figs), 4)
            entry[f"{kind}_steady_s"] = round(median(f["steady_s"] for f in figs), 4)
            # garbage collection inside the first iteration, slowest process (newcomer or stayer)
            entry[f"{kind}_first_iteration_gc_s"] = [round(f["gc_first_s"], 4) for f in figs]
        entry["null_ratio"] = round(median(n for kind in kinds for n in entry[f"{kind}_null_ratios"]), 3)
        recorder = next(r for key, r in results.items() if key[0] == "job" and r["recorded"]["role"] == role)
        rec = recorder["recorded"]
        entry["record_overhead_s_per_iteration"] = round(rec["overhead_s"] / len(rec["iteration_s"]), 5)
        entry["record_overhead_ratio"] = round(
            entry["record_overhead_s_per_iteration"] / entry[f"{kinds[0]}_steady_s"], 4
        )
        roles.append(entry)
    return {
        "compile": compile_,
        "roles": roles,
        "isolation": isolation_by_duty([isolation(results, job_time, record_iters, n) for n in range(probes)]),
        "memory": memory(results),
        "hooks_left_after_recording": sorted(
            {h for key, r in results.items() if key[0] == "job" for h in r["hooks_after"]}
        ),
    }


def isolation_by_duty(probes: list[dict]) -> list[dict]:
    """Per probe duty: the median ratio over its repeats, and every probe."""
    out = []
    for duty in sorted({p["standby_duty"] for p in probes}, reverse=True):
        mine = [p for p in probes if p["standby_duty"] == duty]
        ratios = [p["ratio_of_medians"] for p in mine if p["ratio_of_medians"] is not None]
        out.append(
            {
                "standby_duty": duty,
                "ratio_of_medians": round(median(ratios), 3) if ratios else None,
                "ratios": ratios,
                "probes": mine,
            }
        )
    return out


def isolation(results: dict, job_time: dict, record_iters: int, n: int) -> dict:
    """Job iterations inside probe ``n``'s warm-up against those in the quiet window as long right after it
    (nothing else of the benchmark runs then; the next probe starts after that window)."""
    probe = results[("probe", n)]
    w0, w1 = probe["warm_start"], probe["warm_end"]
    spans: dict[int, tuple] = {}
    for res in results.values():
        for step in res["steps"]:
            lo, hi = spans.get(step["iteration"], (step["t0"], step["t1"]))
            spans[step["iteration"]] = (min(lo, step["t0"]), max(hi, step["t1"]))
    during, quiet = [], []
    for k, (t0, t1) in spans.items():
        if k <= record_iters + 2:
            continue  # the job's own first iterations
        if w0 <= t0 and t1 <= w1:
            during.append(job_time[k])
        elif w1 <= t0 and t1 <= 2 * w1 - w0:  # the quiet window right after it, as long
            quiet.append(job_time[k])
    ratio = round(median(during) / median(quiet), 3) if during and quiet else None
    return {
        "ratio_of_medians": ratio,
        "iterations_during": len(during),
        "iterations_quiet": len(quiet),
        "median_during_s": round(median(during), 4) if during else None,
        "median_quiet_s": round(median(quiet), 4) if quiet else None,
        "warm_s": round(w1 - w0, 2),
        "standby_nice": probe["nice"],
        "standby_duty": probe["duty"],
        "standby_paused_s": round(probe["paused_s"], 2),
        "standby_new_sockets": probe["warm_new_sockets"],
    }


def memory(results: dict) -> dict:
    job_peak = max(r["peak_rss_bytes"] for key, r in results.items() if key[0] == "job")
    standby_peak = max(
        (
            r.get("warm_rss_bytes", 0)
            for key, r in results.items()
            if key[0] == "probe" or (key[0] == "newcomer" and r["warm"])
        ),
        default=None,
    )
    if standby_peak is None:
        return {"job_rank_peak_rss_bytes": job_peak, "standby_warm_peak_rss_bytes": None, "standby_over_job": None}
    return {
        "job_rank_peak_rss_bytes": job_peak,
        "standby_warm_peak_rss_bytes": standby_peak,
        "standby_over_job": round(standby_peak / job_peak, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the results here.")
    parser.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="both",
        help="Measure eager, --tm-compile, or both (default).",
    )
    parser.add_argument("--record-iters", type=int, default=2)
    parser.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES), help="Roles to hand over.")
    parser.add_argument(
        "--standby-nice",
        type=int,
        default=0,
        help="Niceness of the isolation probes' standby (default 0, as a launched standby; above 0 it "
        "also runs at SCHED_IDLE).",
    )
    parser.add_argument(
        "--probe-duties",
        default="1,0.25",
        help="Comma-separated --tm-standby-duty values the isolation probes' standby is paced to, "
        "one probe each (default '1,0.25': unpaced, then a quarter core).",
    )
    parser.add_argument("--probe-repeats", type=int, default=1, help="Probes per duty (default 1).")
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="Skip the isolation probes (with --tm-compile a paced warm-up takes long).",
    )
    parser.add_argument("--steady-iters", type=int, default=12, help="Iterations before each switch and after it.")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="Newcomer kinds to hand over to (default: all three).",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="Hand-overs per role and kind; the median trial is reported (default 1)."
    )
    parser.add_argument("--deadline", type=float, default=1800.0, help="Seconds one variant may take.")
    parser.add_argument("--data-prefix", default=None, help="Corpus prefix (default: the bundled one).")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="demo",
        help="Model size: the demo job's (default) or the tiny one of earlier figures.",
    )
    args = parser.parse_args()

    import trainmover_training  # noqa: F401  (imported once here: every forked process starts warm)
    from harness.jobs import DEFAULT_CORPUS_PREFIX, ensure_corpus

    corpus = ensure_corpus(args.data_prefix or DEFAULT_CORPUS_PREFIX)
    variants = [c for c in (False, True) if args.compile in ("both", "on" if c else "off")]
    runs = [
        run_variant(
            corpus,
            c,
            args.record_iters,
            args.steady_iters,
            args.repeats,
            args.deadline,
            tuple(args.roles),
            args.standby_nice,
            () if args.no_probe else tuple(float(d) for d in args.probe_duties.split(",")),
            tuple(args.kinds),
            args.probe_repeats,
            model=args.model,
        )
        for c in variants
    ]
    rows = [
        (
            r["role"],
            "on" if r["compile"] else "off",
            *(r.get(f"{k}_ratio") for k in ("kept", "warm", "cold")),
            r["null_ratio"],
            r.get("warm_newcomer_own_ratio"),
            r["record_bytes"],
            f"{r['record_overhead_ratio']:.2%}",
        )
        for run in runs
        for r in run["roles"]
    ]
    print_table(
        f"First iteration after promotion / steady iteration (PP=3 {args.model} GPT, CPU)",
        rows,
        (
            "role",
            "--tm-compile",
            "kept_ratio",
            "warm_ratio",
            "cold_ratio",
            "null_ratio",
            "warm own",
            "record_bytes",
            "record overhead/iter",
        ),
    )
    for run in runs:
        iso, mem = run["isolation"], run["memory"]
        iso_text = (
            "; ".join(f"duty {i['standby_duty']}: {i['ratio_of_medians']} (probes {i['ratios']})" for i in iso)
            if iso
            else "not probed"
        )
        print(
            f"compile {'on' if run['compile'] else 'off'}: job iteration while a standby warms / otherwise = "
            f"{iso_text}; standby peak RSS / job rank peak = {mem['standby_over_job']}; hooks left after "
            f"recording: {run['hooks_left_after_recording'] or 'none'}"
        )
    write_json(
        args.json,
        {
            "model": args.model,
            "roles": [r for run in runs for r in run["roles"]],
            "variants": runs,
            "machine": f"{os.cpu_count()} CPUs",
            "time": time.time(),
        },
    )


if __name__ == "__main__":
    main()
