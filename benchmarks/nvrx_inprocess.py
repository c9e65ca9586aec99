#!/usr/bin/env python3
"""NVIDIA resiliency-ext (nvrx 0.4.1) in-process restart of the demo job: the ``nvrx_inprocess_s`` baseline.

The job is the one ``downtime.py`` measures (8 ranks, TP2 x PP2 x DP2, the demo
flags, trained by ``trainmover_training.pretrain`` as ``pretrain_gpt.py`` does),
on CPU with gloo, with each rank's training call wrapped in
``nvidia_resiliency_ext.inprocess.Wrapper``. ``--spares`` extra processes (2 by
default) are nvrx's reserve: the rank assignment
``Compose(MaxActiveWorldSize(8), FillGaps())`` keeps them INACTIVE (waiting in
nvrx's reserve loop) until an active rank is lost, then gives one the lost
rank's index.

What happens after the SIGKILL of rank 5 (after iteration 6 is logged):

1. the victim's nvrx monitor process (a daemon forked per rank) sees its target
   gone and records the rank as terminated in nvrx's store; ranks whose gloo
   operations touch the dead peer fail ("Connection closed by peer") and record
   an exception;
2. every rank's nvrx monitor thread sees the interruption and runs the abort:
   ``AbortGloo`` (composed in because nvrx's ``AbortTorchDistributed`` aborts
   only NCCL), then ``AbortTorchDistributed``, then raises ``RankShouldRestart``
   in the main thread, which unwinds ``pretrain``;
3. a main thread blocked in a gloo collective with a *surviving* peer (e.g. the
   data-parallel gradient all-reduce) cannot take an asynchronous exception
   while in C++, and ``ProcessGroupGloo.abort()`` (torch 2.13) does not fail an
   operation already waiting. So ``AbortGloo`` also shuts the rank's gloo TCP
   connections down (``--gloo-abort sockets``, the default): the pending
   operations fail at once, here and at the peers. This is the gloo
   counterpart of what nvrx's abort does to NCCL communicators on GPUs. With
   ``--gloo-abort backend`` (the earlier behaviour) such a rank stays blocked
   until nvrx's hard progress timeout (30 s here, nvrx's default 90 s) makes its
   monitor process SIGTERM it; it is then lost like the victim and takes a
   spare. On the demo job that lost more ranks than 3 spares, restarted on 7
   ranks, which TP2 x PP2 cannot use, and gave up after 3 restarts;
4. nvrx meets the survivors at its iteration barrier and re-assigns ranks
   (``FillGaps``): spares take the lost ranks' indices, the others keep theirs;
5. the wrapped function runs again in the same OS processes (no new interpreter,
   no re-import): it first completes any torch.distributed teardown the
   asynchronous exception cut short (:func:`finish_torch_teardown`),
   then builds a new gloo process group, the model, and the state restored
   from the latest checkpoint on disk (``--save``/``--load``, saved every 5
   iterations), which is what an nvrx user of Megatron does (nvrx 0.4.1 restores
   nothing by itself; the in-memory alternative is nvrx's separate local
   checkpointing, which is not part of the in-process wrapper).

``nvrx_inprocess_s`` is ``lost_time.py``'s lost time: the killed run's wall time
minus its fault-free twin's (the second run here) over the same iterations.
Iterations since the checkpoint (here iteration 6) are re-run, so they count.
``bit_identical`` compares the loss trajectory (last value logged per iteration)
with the fault-free run. ``downtime.py`` and ``chaos.py`` run nvrx through
``strategies.py`` (:func:`run_job` with a fault schedule), with the same faults
as every other strategy; this script's own ``main`` is the single-kill check.

    python benchmarks/nvrx_inprocess.py --json bench_out/nvrx.json

Needs ``pip install -r requirements-bench.txt``; without the package
:func:`unavailable_reason` says why and nothing runs.
"""

# No `from __future__ import annotations` here: nvrx finds the parameter that receives its
# CallWrapper by comparing real annotation objects; string annotations make it raise.

import argparse
import datetime
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ROOT, print_table, read_events, wait_until, write_json  # noqa: E402

from harness.jobs import DEFAULT_CORPUS_PREFIX, demo_args, ensure_corpus  # noqa: E402
from harness.recorder import RECORDS_ENV  # noqa: E402
from trainmover_ext.netutil import free_port  # noqa: E402

PACKAGE = "nvidia-resiliency-ext"
VERSION = "0.4.1"
GLOO_ABORTS = ("sockets", "backend")
TOKEN_ENV = "NVRX_BENCH_TOKEN"
"""Every process of a run (ranks, nvrx's monitor daemons) inherits this; cleanup finds them by it."""


def unavailable_reason() -> str | None:
    """None when ``nvidia_resiliency_ext.inprocess`` imports at the pinned version, else why not."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version(PACKAGE)
        except PackageNotFoundError:
            return f"{PACKAGE} is not installed (pip install -r requirements-bench.txt)"
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except Exception as exc:  # an import failure of any kind means: cannot measure
        return f"{PACKAGE} does not import: {type(exc).__name__}: {exc}"
    if installed != VERSION:
        return f"{PACKAGE} {installed} is installed; this baseline is written against {VERSION}"
    return None


@dataclass
class WrapperTimings:
    """nvrx ``Wrapper`` intervals and timeouts (seconds). The intervals are tuned below nvrx's 1 s
    defaults so that polling is not what makes nvrx slow. The progress timeouts are cut from nvrx's
    60 s / 90 s defaults to 20 s / 30 s: with ``--gloo-abort backend`` a rank whose main thread is
    blocked in a collective that never fails is only recovered by the hard timeout (its monitor
    process terminates it), so this bound is then part of the measured downtime; lower risks
    terminating healthy ranks at start-up. With ``--gloo-abort sockets`` they are only a backstop."""

    monitor_thread_interval_s: float = 0.1
    monitor_process_interval_s: float = 0.1
    progress_watchdog_interval_s: float = 0.1
    last_call_wait_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    soft_timeout_s: float = 20.0
    hard_timeout_s: float = 30.0
    barrier_timeout_s: float = 120.0
    completion_timeout_s: float = 120.0
    termination_grace_s: float = 5.0


@dataclass
class NvrxRunConfig:
    """One nvrx-wrapped job. ``job_args`` are the Megatron flags (without ``--save``/``--load``)."""

    job_args: list[str]
    ranks: int = 8
    spares: int = 2
    """nvrx reserve ranks: the killed rank, and each rank the hard timeout terminates, take one."""
    gloo_abort: str = "sockets"
    """How nvrx's abort frees a rank blocked in gloo: "sockets" shuts its gloo connections down;
    "backend" only calls ProcessGroupGloo.abort(), which leaves such a rank to the hard timeout."""
    victim: int | None = 5
    """Rank SIGKILLed once ``at_iteration`` is logged; None for a fault-free run."""
    at_iteration: int = 6
    save_interval: int = 5
    max_restarts: int = 2
    pg_timeout_s: float = 120.0
    """Timeout of the gloo process group the wrapped function creates (and of its stores)."""
    run_timeout_s: float = 900.0
    timings: WrapperTimings = field(default_factory=WrapperTimings)

    def __post_init__(self):
        if self.gloo_abort not in GLOO_ABORTS:
            raise ValueError(f"--gloo-abort must be one of {GLOO_ABORTS}, not {self.gloo_abort!r}")
        if self.spares < 1:
            raise ValueError(f"--spares must be at least 1 (the killed rank's replacement), not {self.spares}")


def _token_pids(token: str) -> list[int]:
    """Processes whose environment carries ``TOKEN_ENV=token`` (ours: started by this run)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _kill_token(token: str) -> list[int]:
    """SIGKILL every process of the run (one by one, by pid); returns the pids signalled."""
    killed = []
    for pid in _token_pids(token):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


class NvrxTarget:
    """An nvrx job as ``faults.inject`` sees it: which process serves each rank comes from the workers'
    ``fn_start`` stamps (nvrx reassigns ranks at each restart), progress from the metrics file."""

    def __init__(self, procs: list[subprocess.Popen], events_path: str, metrics_path: str):
        from common import LastIteration, Tail

        self.procs = procs
        self._tail = Tail(events_path)
        self._last = LastIteration(metrics_path)
        self.by_iteration: dict[int, dict[int, int]] = {}
        """nvrx iteration -> {active rank: pid} of the ranks that started training in it."""

    def _read(self) -> None:
        for line in self._tail.lines():
            rec = json.loads(line)
            if rec.get("event") == "fn_start":
                self.by_iteration.setdefault(rec["nvrx_iteration"], {})[rec["rank"]] = rec["pid"]

    def last_iteration(self) -> int:
        return self._last()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def pid_of(self, rank: int) -> int | None:
        self._read()
        for it in sorted(self.by_iteration, reverse=True):
            if rank in self.by_iteration[it]:
                return self.by_iteration[it][rank]
        return self.procs[rank].pid if rank < len(self.procs) else None

    def recoveries(self) -> int:
        self._read()
        return max(self.by_iteration, default=0)

    def replacement_pid(self, rank: int, after: int) -> int | None:
        self._read()
        return next((self.by_iteration[it].get(rank) for it in sorted(self.by_iteration) if it > after), None)


def run_job(
    cfg: NvrxRunConfig,
    workdir: str,
    name: str,
    *,
    inject: Callable[[NvrxTarget], list[dict]] | None = None,
    records_dir: str | None = None,
) -> dict:
    """Start ``ranks + spares`` workers, SIGKILL ``victim`` after ``at_iteration`` (if set) or let
    ``inject`` carry out a fault schedule (``faults.inject``; what it did is ``injected``), wait for the
    job to finish (at most ``run_timeout_s``), and return its records. ``records_dir``: where every
    process writes its ``harness.recorder`` records. Raises RuntimeError, with the log paths, when the
    job does not complete; every process of the run is SIGKILLed on the way out."""
    world = cfg.ranks + cfg.spares
    metrics = os.path.join(workdir, f"{name}.jsonl")
    events = os.path.join(workdir, f"{name}.events.jsonl")
    ckpt = os.path.join(workdir, f"{name}.ckpt")
    spec = {
        "argv": cfg.job_args
        + ["--save", ckpt, "--load", ckpt, "--save-interval", str(cfg.save_interval), "--tm-metrics-file", metrics],
        "events": events,
        "active": cfg.ranks,
        "pg_port": free_port(),
        "pg_timeout_s": cfg.pg_timeout_s,
        "max_restarts": cfg.max_restarts,
        "timings": asdict(cfg.timings),
        "gloo_abort": cfg.gloo_abort,
        "monitor_log": os.path.join(workdir, f"{name}.monitor{{rank}}.log"),
    }
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    token = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMOVER_")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        PYTHONUNBUFFERED="1",
        **{TOKEN_ENV: token},
    )
    if records_dir is not None:
        env[RECORDS_ENV] = records_dir
    train_iters = int(cfg.job_args[cfg.job_args.index("--train-iters") + 1])
    procs: list[subprocess.Popen] = []
    t_kill, terminated, injected = None, [], []
    victims: set[int] = set()
    # Both stores are hosted here, not by rank 0: nvrx's hard timeout may terminate rank 0 too (see the
    # module doc), and a store dying with its host takes every rank down. nvrx's TCPStore falls back to
    # a client when the port is taken.
    import torch

    servers = [
        torch.distributed.TCPStore(
            "127.0.0.1",
            port,
            world_size=None,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=True,
            timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
        )
        for port in (int(env["MASTER_PORT"]), spec["pg_port"])
    ]
    try:
        for rank in range(world):
            log = os.path.join(workdir, f"{name}.rank{rank}")
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--worker", spec_path],
                    stdout=open(log + ".out", "w"),
                    stderr=open(log + ".err", "w"),
                    cwd=ROOT,
                    env=dict(env, RANK=str(rank)),
                )
            )
        deadline = time.time() + cfg.run_timeout_s
        if inject is not None:
            injected = inject(NvrxTarget(procs, events, metrics))
            pids = {p.pid: r for r, p in enumerate(procs)}
            victims = {pids[i["pid"]] for i in injected if i["pid"] in pids}
            victims |= {pids[i["cascade"]["pid"]] for i in injected if i["cascade"] and i["cascade"]["pid"] in pids}
        elif cfg.victim is not None:

            def reached():
                if any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"{name}: a rank exited before the kill; see {workdir}/{name}.rank*.err")
                return any(
                    e.get("event") == "iteration" and e["iteration"] >= cfg.at_iteration for e in read_events(metrics)
                )

            wait_until(reached, cfg.run_timeout_s, 0.01)
            t_kill = time.time()
            os.kill(procs[cfg.victim].pid, signal.SIGKILL)
        codes = [proc.wait(max(1.0, deadline - time.time())) for proc in procs]
        # nvrx's hard timeout terminates a rank it sees stuck (SIGTERM, then SIGKILL): a recovery, not a failure.
        victims.add(cfg.victim if inject is None else -1)
        terminated = [r for r, rc in enumerate(codes) if r not in victims and rc in (-signal.SIGTERM, -signal.SIGKILL)]
        failed = [r for r, rc in enumerate(codes) if r not in victims and rc != 0 and r not in terminated]
        done = [e for e in read_events(metrics) if e.get("event") == "iteration" and e["iteration"] >= train_iters]
        if failed or not done:
            raise RuntimeError(
                f"{name}: ranks {failed} failed (exit codes {codes}), iteration {train_iters} "
                f"{'reached' if done else 'not reached'}; see {workdir}/{name}.rank*.err"
            )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"{name}: not finished within {cfg.run_timeout_s:.0f} s; see {workdir}/{name}.rank*.err"
        ) from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(30)
        _kill_token(token)  # nvrx's monitor daemons (double-forked, re-parented to init)
        del servers
        shutil.rmtree(ckpt, ignore_errors=True)  # Megatron keeps every save; nothing reads them after the run
    return {
        "t_kill": t_kill,
        "injected": injected,
        "terminated_by_nvrx": terminated,
        "metrics_path": metrics,
        "metrics": read_events(metrics),
        "events": read_events(events),
    }


def trajectory(records: list[dict]) -> dict[int, float]:
    """iteration -> loss; a re-run iteration keeps the value logged last (as downtime.py)."""
    return {e["iteration"]: e["loss"] for e in records if e.get("event") == "iteration"}


def analyse(cfg: NvrxRunConfig, run: dict, twin: dict) -> dict:
    """Lost time of a killed run against its fault-free ``twin`` (``lost_time.py``: the wall-time
    difference over the same iterations, from 3 before the killed one to the last), plus nvrx's phases."""
    from lost_time import iterations_from_records, lost_per_failure_s, steady_iteration_s

    t0, events = run["t_kill"], run["events"]
    startups = [e for e in run["metrics"] if e.get("event") == "startup"]
    after = [e for e in startups if e["process_start"] < t0 < e["rendezvous"]]
    if not after:
        raise RuntimeError("the logging rank recorded no start-up after the kill: nvrx did not restart the job")
    resumed = after[0]
    f_its, t_its = iterations_from_records(run["metrics"]), iterations_from_records(twin["metrics"])
    killed = 1 + max(it.iteration for it in f_its if it.end <= t0)
    window = (max(1, killed - 3), max(it.iteration for it in t_its))
    result = {
        "lost_s": lost_per_failure_s(f_its, t_its, 1, *window),
        "window": list(window),
        "iteration_s": steady_iteration_s(t_its),
        "resumed_iteration": resumed["resumed_iteration"],
        "to_resume_s": resumed["checkpoint_loaded"] - t0,
    }
    last = max((e["nvrx_iteration"] for e in events if e["event"] == "fn_start"), default=0)
    restarted = [e for e in events if e["event"] == "fn_start" and e["nvrx_iteration"] == last and last >= 1]
    # The restart the job resumed from: its interrupted iteration's finalizes (spares' included).
    faults = [e for e in events if e["event"] == "nvrx_finalize" and e["t"] > t0 and e["nvrx_iteration"] == last - 1]
    spare = [e for e in restarted if e["initial_rank"] >= cfg.ranks]
    first = next(
        e for e in run["metrics"] if e.get("event") == "iteration" and e["t_end"] > resumed["checkpoint_loaded"]
    )
    phases = {}
    if faults and restarted:
        all_aborted, all_started = max(e["t"] for e in faults), max(e["t"] for e in restarted)
        phases = {
            "first_rank_aborted_s": min(e["t"] for e in faults) - t0,  # informative: not a term of the sum
            "detect_and_abort_s": all_aborted - t0,  # every process has aborted gloo and unwound
            "barrier_reassign_s": all_started - all_aborted,  # nvrx's iteration barrier, FillGaps, gc
            "process_group_and_args_s": resumed["rendezvous"] - all_started,
            "model_build_s": resumed["model_built"] - resumed["rendezvous"],
            "checkpoint_load_s": resumed["checkpoint_loaded"] - resumed["model_built"],
            "first_iteration_s": first["t_end"] - resumed["checkpoint_loaded"],
        }
    result.update(
        nvrx_inprocess_s=result["lost_s"],
        phases={k: round(v, 4) for k, v in phases.items()},
        restarts=last,
        spare_took_rank=spare[0]["rank"] if spare else None,
        spares_took_ranks=sorted(e["rank"] for e in spare),
        terminated_by_nvrx=run["terminated_by_nvrx"],
        fault_reports=sorted({e["error"] for e in faults}),
        lost_iterations=(
            max(e["iteration"] for e in run["metrics"] if e.get("event") == "iteration" and e["t_end"] <= t0)
            - resumed["resumed_iteration"]
        ),
    )
    return result


def _first_difference(a: dict[int, float], b: dict[int, float]) -> list | None:
    """``[iteration, a's loss, b's loss]`` at the first iteration where they differ, or None."""
    for it in sorted(set(a) | set(b)):
        if a.get(it) != b.get(it):
            return [it, a.get(it), b.get(it)]
    return None


def measure(
    data_prefix: str,
    iters: int = 16,
    victim: int = 5,
    at_iteration: int = 6,
    save_interval: int = 5,
    reference: dict[int, float] | None = None,
    job_args: list[str] | None = None,
    ranks: int = 8,
    workdir: str | None = None,
    keep: bool = False,
    spares: int = 2,
    gloo_abort: str = "sockets",
) -> dict:
    """The nvrx baseline end to end: a killed run and a fault-free nvrx run of the same job;
    ``bit_identical`` compares the two. With ``reference`` (another fault-free trajectory of the job,
    e.g. TrainMover's) it also says whether nvrx's fault-free run matches it and where it first
    differs. Logs stay in ``workdir`` when a run fails or ``keep``."""
    cfg = NvrxRunConfig(
        job_args=job_args or demo_args(data_prefix, iters),
        ranks=ranks,
        victim=victim,
        at_iteration=at_iteration,
        save_interval=save_interval,
        spares=spares,
        gloo_abort=gloo_abort,
    )
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tm_nvrx_")
    ok = False
    try:
        killed = run_job(cfg, workdir, "killed")
        twin = run_job(replace(cfg, victim=None), workdir, "fault_free")
        result = analyse(cfg, killed, twin)
        fault_free = trajectory(twin["metrics"])
        traj = trajectory(killed["metrics"])
        result["bit_identical"] = traj == fault_free
        result["first_difference"] = _first_difference(traj, fault_free)
        if reference is not None:
            result["fault_free_matches_reference"] = fault_free == reference
            result["first_difference_from_reference"] = _first_difference(fault_free, reference)
        result["final_iteration"] = max(traj) if traj else None
        result["config"] = {
            "ranks": ranks,
            "spares": cfg.spares,
            "victim": victim,
            "at_iteration": at_iteration,
            "save_interval": save_interval,
            "restore": "latest checkpoint on disk",
            "gloo_abort": gloo_abort,
            "wrapper": asdict(cfg.timings),
        }
        ok = True
        return result
    finally:
        if ok and own and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"nvrx run failed: its logs are kept in {workdir}", file=sys.stderr)


# ---------------------------------------------------------------- worker (one per rank, nvrx-wrapped)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="Write the result as JSON to this path.")
    parser.add_argument("--iters", type=int, default=16, help="Training iterations of each run.")
    parser.add_argument("--victim", type=int, default=5, help="Rank SIGKILLed (8-rank layout).")
    parser.add_argument("--at-iteration", type=int, default=6, help="Kill once this iteration is logged.")
    parser.add_argument("--save-interval", type=int, default=5, help="Checkpoint interval the restart resumes from.")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    parser.add_argument(
        "--spares",
        type=int,
        default=2,
        help="nvrx reserve processes started beside the ranks; each rank lost (the victim, and any "
        "rank nvrx's hard timeout terminates) takes one. With --gloo-abort backend on the demo "
        "job use --spares 8: up to every rank can be terminated.",
    )
    parser.add_argument(
        "--gloo-abort",
        choices=GLOO_ABORTS,
        default="sockets",
        help="What nvrx's abort does to gloo: 'sockets' shuts the rank's gloo connections down, so a "
        "rank blocked in a collective raises at once (the gloo analogue of nvrx aborting NCCL); "
        "'backend' only calls ProcessGroupGloo.abort(), which leaves such a rank blocked until "
        "nvrx's hard timeout terminates it (the previous, slower behaviour).",
    )
    parser.add_argument("--keep", action="store_true", help="Keep the run directory (logs, checkpoints).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from nvrx_worker import run_worker

        return run_worker(args.worker)
    reason = unavailable_reason()
    if reason:
        print(f"nvrx_inprocess_s skipped: {reason}", file=sys.stderr)
        return 2
    ensure_corpus(args.data_prefix)
    print(
        f"nvrx in-process restart, SIGKILL of rank {args.victim} after iteration {args.at_iteration}, "
        f"then a fault-free nvrx run ...",
        flush=True,
    )
    result = measure(
        args.data_prefix,
        args.iters,
        args.victim,
        args.at_iteration,
        args.save_interval,
        keep=args.keep,
        spares=args.spares,
        gloo_abort=args.gloo_abort,
    )
    rows = [
        ("nvrx_inprocess_s", f"{result['nvrx_inprocess_s']:.3f}"),
        ("iteration_s", f"{result['iteration_s']:.3f}"),
        ("bit_identical", str(result["bit_identical"])),
        ("lost_iterations", str(result["lost_iterations"])),
    ]
    rows += [(f"  {k}", f"{v:.3f}") for k, v in result["phases"].items()]
    rows += [
        ("ranks terminated by nvrx", str(result["terminated_by_nvrx"])),
        ("ranks taken by spares", str(result["spares_took_ranks"])),
    ]
    print_table("nvrx in-process restart (seconds)", rows, ("measure", "value"))
    write_json(args.json, result)
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
