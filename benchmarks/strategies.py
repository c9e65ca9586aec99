"""The strategies a benchmark compares, each run the same way: a job, a fault schedule, the run's records.

Contract: ``downtime.py`` and ``chaos.py`` build a :class:`Job` and call :meth:`Strategy.run` once with an
empty schedule (the fault-free twin) and once with the schedule (the faulted run), side by side in the
same invocation; :func:`compare` turns the pair into lost time, ETTR, per-event records and the state
comparison (``lost_time.py`` holds the definitions). Every process of every run writes its records
(``harness.recorder``); a run whose launcher exits non-zero raises ``RuntimeError`` naming its logs.

- ``trainmover``: ``--trainmover`` with warm standbys; a hang is found by its agent's heartbeat watch.
- ``restart`` / ``restart_fork``: stop-restart from the latest checkpoint (``--max-restarts``), the
  ranks started again as fresh interpreters (spawn) or forked from the warm agent; no hang detection
  of its own (the harness's, see ``faults.py``).
- ``nvrx``: NVIDIA resiliency-ext's in-process restart (``nvrx_inprocess.py``), spares for lost ranks.
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import faults
import run_records as rr
from common import Tail, start_launcher
from lost_time import (
    Fault,
    Iteration,
    ettr_relative,
    event_record,
    excess_by_phase,
    first_runs,
    lost_per_failure_s,
    steady_iteration_s,
    wall_s,
)

from harness.jobs import RECORDED_PRETRAIN
from harness.recorder import INITIAL_STANDBYS_ENV, RECORDS_ENV, REFILL_DELAY_ENV


@dataclass(kw_only=True)
class Job:
    """What every strategy trains: the Megatron flags (no ``--save``/``--load``/metrics), the world size
    and the checkpoint interval (0: no checkpoints)."""

    args: list[str]
    world: int
    iters: int
    save_interval: int = 0

    def __post_init__(self) -> None:
        if self.iters < 10:
            raise ValueError(f"--iters {self.iters}: a comparison needs at least 10 iterations")


@dataclass(kw_only=True)
class Run:
    """One finished run: its files, what the harness injected, and what its launcher said."""

    strategy: str
    name: str
    files: rr.RunFiles
    injected: list[dict]
    world: int
    detail: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Strategy:
    """How to run the job; see the module doc for the names."""

    name: str
    standbys: int = 1
    standby_duty: float | None = None
    standby_reserves: int | None = None
    refill_delay_s: float | None = None
    """TrainMover A/B: refills start this much later (``harness.recorder``), after the penalty window."""
    extra_args: tuple[str, ...] = ()
    launch_flags: tuple[str, ...] = ()
    warm_until_iteration: int = 0
    """TrainMover: the first fault waits until ``standbys`` standbys finished warming (a failure in a
    long job finds its standbys warm), but not past this iteration (0: it does not wait); the event's
    ``iteration`` says where it landed and ``joiner_warm`` whether the joiner was."""
    hang_timeout_s: float = faults.HANG_TIMEOUT_S
    timeout_s: float = 3600.0

    @property
    def finds_hangs(self) -> bool:
        return self.name == "trainmover"

    def run(self, workdir: str, name: str, job: Job, schedule: list[dict], steady_s: float) -> Run:
        files = rr.RunFiles(os.path.join(workdir, name))
        if self.name == "nvrx":
            return self._run_nvrx(files, name, job, schedule, steady_s)
        env = {RECORDS_ENV: files.records_dir}
        args = [*job.args, *self.extra_args, "--tm-metrics-file", files.metrics]
        ckpt = files.prefix + ".ckpt"
        if job.save_interval:
            args += ["--save", ckpt, "--load", ckpt, "--save-interval", str(job.save_interval)]
        flags = ["--run-dir", files.run_dir, "--metrics-port", "-1", *self.launch_flags]
        if self.name == "trainmover":
            args += ["--trainmover", "--tm-standbys", str(self.standbys)]
            if self.standby_duty is not None:
                args += ["--tm-standby-duty", str(self.standby_duty)]
            if self.standby_reserves is not None:
                args += ["--tm-standby-reserves", str(self.standby_reserves)]
            if self.refill_delay_s is not None:
                env |= {INITIAL_STANDBYS_ENV: str(self.standbys), REFILL_DELAY_ENV: f"{self.refill_delay_s:.2f}"}
            flags += ["--max-restarts", "5"]  # a fallback to stop-restart shows as restarts, not a crash
        elif self.name in ("restart", "restart_fork"):
            method = "spawn" if self.name == "restart" else "fork"
            flags += ["--max-restarts", str(4 * len(schedule) + 2), "--restart-start-method", method]
        else:
            raise ValueError(f"unknown strategy {self.name!r}")
        proc = start_launcher(job.world, args, flags, files.prefix, script=RECORDED_PRETRAIN, env=env)
        try:
            target = faults.LauncherTarget(proc, files.err, files.metrics, files.run_dir)
            injected = faults.inject(
                schedule,
                target,
                steady_s,
                fence_hangs_after_s=None if self.finds_hangs else self.hang_timeout_s,
                ready=self._standbys_warm(files) if self.name == "trainmover" and self.warm_until_iteration else None,
                ready_until_iteration=self.warm_until_iteration,
                timeout_s=self.timeout_s,
                label=name,
            )
            code = proc.wait(self.timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            # Megatron keeps every checkpoint it saves (26 MB each for the demo model); a chaos run's
            # 36 runs kept 69 GB. Nothing reads them once the run ended: its records say what it did.
            shutil.rmtree(ckpt, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"{name} exited {code}; see {files.err}")
        return Run(strategy=self.name, name=name, files=files, injected=injected, world=job.world)

    def _standbys_warm(self, files: rr.RunFiles) -> Callable[[], bool]:
        tail, warm = Tail(files.out), set()

        def ready() -> bool:
            for line in tail.lines():
                m = rr.WARM_RE.search(line)
                if m and m[2] == "waiting to be promoted":
                    warm.add(m[1])
            return len(warm) >= self.standbys

        return ready

    def _run_nvrx(self, files: rr.RunFiles, name: str, job: Job, schedule: list[dict], steady_s: float) -> Run:
        import nvrx_inprocess

        kills = sum(1 + bool(ev.get("cascade")) for ev in schedule)
        cfg = nvrx_inprocess.NvrxRunConfig(
            job_args=job.args,
            ranks=job.world,
            spares=max(2, kills + 1),
            victim=None,
            save_interval=job.save_interval,
            max_restarts=2 * kills + 2,  # every kill (a cascade's too) restarts; a hang is fenced into one
        )
        run = nvrx_inprocess.run_job(
            cfg,
            os.path.dirname(files.prefix),
            name,
            inject=lambda target: faults.inject(
                schedule, target, steady_s, fence_hangs_after_s=self.hang_timeout_s, label=name
            ),
            records_dir=files.records_dir,
        )
        return Run(
            strategy="nvrx",
            name=name,
            files=files,
            injected=run["injected"],
            world=job.world,
            detail={"events": run["events"], "terminated_by_nvrx": run["terminated_by_nvrx"], "spares": cfg.spares},
        )


RESTARTED_AS = {"restart": "spawn", "restart_fork": "fork", "nvrx": "in-process (nvrx spare or survivor)"}
"""How a baseline's replacement for a lost rank starts: no warm standby, ever."""


def _fault_of(
    run: Run, inj: dict, until: float, records: list[dict], archive: list[dict], log: str, run_epochs: list[dict]
) -> Fault:
    """What ``run``'s records say of one injected fault (detection, resumes, joiner), up to ``until``."""
    fault = Fault(
        kind=inj["kind"],
        rank=inj["rank"],
        t=inj["t"],
        iteration=inj["iteration"],
        cascade=(inj["cascade"] or {}).get("kind"),
        resume_t_by_rank=rr.resume_times(records, inj["t"], until),
    )
    extra: dict = {"cascade_kill": _rel(inj["cascade"], inj["t"])}
    if run.strategy == "trainmover":
        reason = "planned" if inj["kind"] == "migrate" else "failure"
        mine = [e for e in run_epochs if e["reason"] == reason and inj["t"] - 0.01 <= e["t"] < until]
        plan = next((e for e in mine if any(r["rank"] == inj["rank"] for r in e["replacements"])), None)
        if plan is not None:
            steps = plan["steps"]
            # A plan a newer one superseded (a cascade) was not archived with its steps: its decision
            # time bounds the detection from above, and the record says so.
            fault.detected_t = steps.get("detected", plan["t"] if reason == "failure" else None)
            # The joiner that kept the rank: a cascade may have killed the first plan's joiner.
            last = [e for e in mine if any(r["rank"] == inj["rank"] for r in e["replacements"])][-1]
            joiner = next(r["joiner"] for r in last["replacements"] if r["rank"] == inj["rank"])
            extra["plan"] = {
                "epoch": plan["epoch"],
                "joiner": joiner,
                "joiner_epoch": last["epoch"],
                "why": next(r.get("why") for r in plan["replacements"] if r["rank"] == inj["rank"]),
                "state_source": plan["state_sources"].get(inj["rank"]),
                "status": plan["status"],
                "detect_from": "the plan's detected step" if "detected" in steps else "its decision (no steps kept)",
                "steps_s": {k: round(v - inj["t"], 4) for k, v in sorted(steps.items(), key=lambda kv: kv[1])},
                "epochs_in_event": [e["epoch"] for e in mine],
            }
            extra["joiner_started"] = rr.standby_starts(archive).get(joiner, {}).get("how")
            extra["joiner_warm"] = rr.standby_warmth(log).get(joiner)
        extra["idle_standbys"] = rr.idle_standbys(archive, inj["t"])
    else:
        fault.detected_t = inj.get("fenced_t")
        restarted = rr.restarted_processes(records, inj["t"], until)
        starts = [r["process_start"] for r in restarted.values() if r.get("process_start")]
        extra.update(
            joiner_started=RESTARTED_AS[run.strategy],
            joiner_warm=False,
            idle_standbys=run.detail.get("spares", 0) if run.strategy == "nvrx" else 0,
            restart_started_s=_r(min(starts) - inj["t"]) if starts and run.strategy != "nvrx" else None,
            resumed_from_iteration=min((r.get("resumed_iteration") for r in restarted.values()), default=None),
        )
        if run.strategy == "nvrx":
            events = run.detail.get("events", [])
            aborts = [e["t"] for e in events if e.get("event") == "abort_start" and e["t"] > inj["t"]]
            if fault.detected_t is None and aborts:
                fault.detected_t = min(aborts)  # nvrx knew when its first rank began the abort
    fault.extra = extra
    return fault


def _rel(cascade: dict | None, t: float) -> dict | None:
    return None if cascade is None else dict(cascade, t_s=round(cascade["t"] - t, 4))


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def compare(faulted: Run, twin: Run, *, scheduled: int, window: tuple[int, int]) -> dict:
    """The faulted run against its fault-free twin over iterations ``window`` (first, last), both
    included (see the module doc of ``lost_time.py``); ``bit_identical`` looks at the whole run."""
    window_from, iters = window
    f_its, t_its = faulted.files.iterations(), twin.files.iterations()
    steady = steady_iteration_s(t_its)
    records = faulted.files.process_records()
    archive = faulted.files.archive_events() if faulted.strategy == "trainmover" else []
    log = faulted.files.launcher_log() if faulted.strategy == "trainmover" else ""
    run_epochs = rr.epochs(archive, faulted.files.plans()) if faulted.strategy == "trainmover" else []
    events = []
    injected = sorted(faulted.injected, key=lambda i: i["t"])
    for n, inj in enumerate(injected):
        until = injected[n + 1]["t"] if n + 1 < len(injected) else float("inf")
        fault = _fault_of(faulted, inj, until, records, archive, log, run_epochs)
        # the last event's share ends with the window (the twin's last iteration may come later)
        nxt = injected[n + 1]["iteration"] if n + 1 < len(injected) else iters + 1
        events.append(event_record(fault, f_its, t_its, nxt, steady))
    f_states = rr.state_hashes(records)
    t_states = rr.state_hashes(twin.files.process_records())
    f_traj, t_traj = rr.trajectory(faulted.files.metrics_records()), rr.trajectory(twin.files.metrics_records())
    twin_log = twin.files.launcher_log()
    return {
        "lost_per_failure_s": round(lost_per_failure_s(f_its, t_its, max(1, scheduled), window_from, iters), 4),
        "scheduled_failures": scheduled,
        "injected_failures": len(injected),
        "kills_with_cascades": len(injected) + sum(1 for i in injected if i["cascade"]),
        "ettr_rel": round(ettr_relative(f_its, t_its, window_from, iters), 4),
        "wall_s": round(wall_s(f_its, window_from, iters), 4),
        "twin_wall_s": round(wall_s(t_its, window_from, iters), 4),
        "steady_iteration_s": round(steady, 4),
        "window": list(window),
        "pre_fault_ratio": pre_fault_ratio(f_its, t_its, injected[0]["iteration"] if injected else iters),
        "bit_identical": bool(f_traj) and sorted(f_traj) == sorted(t_traj) and f_traj == t_traj,
        **rr.compare_states(f_states, t_states, faulted.world),
        "restarts": max(0, sum(1 for r in faulted.files.metrics_records() if r.get("event") == "startup") - 1),
        "twin": rr.fenced_and_planned(twin_log, twin.files.plans()),
        "unscheduled_epochs": unscheduled(run_epochs, injected),
        # where the lost time went: recoveries, iterations beside a refill standby's warm-up, the rest
        "excess_by_phase": excess_by_phase(
            f_its,
            t_its,
            [i["iteration"] for i in injected],
            rr.refill_warmups(archive, log, f_its[0].start) if f_its else [],
            window_from,
            iters,
        ),
        "events": events,
    }


def fault_window(
    records: list[dict], its: list[Iteration], t0: float, iteration: int, before: int, after: int, iters: int
) -> tuple[int, int]:
    """The iterations a single-fault run is compared over: ``before`` iterations before the fault's
    ``iteration`` to ``after`` iterations after the later of it and the first iteration after every
    rank resumed (a planned move resumes many iterations after it was asked for). ``records``: the
    run's process records; ``its``: its iterations."""
    resumed = rr.resume_times(records, t0, float("inf"))
    k = iteration
    if resumed:
        last = max(resumed.values())
        k = max(k, next((it.iteration for it in its if it.end > last), k))
    return max(1, iteration - before), min(iters, k + after)


def pre_fault_ratio(faulted: list[Iteration], twin: list[Iteration], iteration: int, n: int = 20) -> float | None:
    """The faulted run's median iteration over its twin's, over the ``n`` iterations before the first
    fault: 1 when the machine was as loaded in both runs. Off 1 by more than a few per cent, the lost
    time of that pair carries the machine's drift (another job started or stopped between the runs)."""

    def median_of(its: list[Iteration]) -> float | None:
        first = first_runs(its)
        vals = [first[i].seconds for i in range(max(1, iteration - n), iteration) if i in first]
        return statistics.median(vals) if vals else None

    f, t = median_of(faulted), median_of(twin)
    return round(f / t, 4) if f and t else None


def unscheduled(run_epochs: list[dict], injected: list[dict], within_s: float = 60.0) -> list[dict]:
    """Epochs of a faulted run that replaced a rank no injected fault or cascade touched in the
    ``within_s`` before: what the runtime did by itself (a lease that lapsed under load, a false hang)."""
    hits = [(i["rank"], i["t"]) for i in injected] + [
        (i["cascade"]["rank"], i["cascade"]["t"]) for i in injected if i["cascade"]
    ]
    out = []
    for e in run_epochs:
        for r in e["replacements"]:
            if not any(rank == r["rank"] and 0 <= e["t"] - t <= within_s for rank, t in hits):
                out.append({"epoch": e["epoch"], "rank": r["rank"], "why": r.get("why"), "t": round(e["t"], 3)})
    return out


def iteration_rows(run: Run, label: str) -> list[dict]:
    """The per-iteration list of a run: ``{"run", "iteration", "start", "end"}`` per record, re-runs included."""
    return [
        {"run": label, "iteration": it.iteration, "start": round(it.start, 4), "end": round(it.end, 4)}
        for it in run.files.iterations()
    ]
