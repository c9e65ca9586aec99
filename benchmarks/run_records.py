"""What a finished benchmark run left behind, read back: per-process records, the run archive, the launcher's log.

Contract: the benchmarks call these after a run (``strategies.py``), on the files of one run prefix
``<workdir>/<name>``: ``.jsonl`` (the logging rank's metrics), ``.records/`` (every process's records,
``harness.recorder``), ``.run/`` (the run directory: ``migrations.jsonl`` and ``events.jsonl`` of the
leading agent), ``.out`` and ``.err`` (the launcher's output). Reading never raises on a file that is
missing or a torn last line: what was not recorded comes back empty, and the callers report it as
missing (None), never as zero.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass

from common import read_events
from lost_time import Iteration, iterations_from_records


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if isinstance(rec, dict):
                out.append(rec)
    return out


@dataclass(frozen=True)
class RunFiles:
    """The files of one run, by its prefix ``<workdir>/<name>``."""

    prefix: str

    @property
    def metrics(self) -> str:
        return self.prefix + ".jsonl"

    @property
    def records_dir(self) -> str:
        return self.prefix + ".records"

    @property
    def run_dir(self) -> str:
        return self.prefix + ".run"

    @property
    def out(self) -> str:
        return self.prefix + ".out"

    @property
    def err(self) -> str:
        return self.prefix + ".err"

    def iterations(self) -> list[Iteration]:
        return iterations_from_records(read_events(self.metrics))

    def metrics_records(self) -> list[dict]:
        return read_events(self.metrics)

    def process_records(self) -> list[dict]:
        """Every process's records (``harness.recorder``), in time order."""
        records = [r for path in glob.glob(os.path.join(self.records_dir, "*.jsonl")) for r in _jsonl(path)]
        return sorted(records, key=lambda r: r.get("t_written", 0.0))

    def plans(self) -> list[dict]:
        """The finished migration plans the leading agent archived (``migrations.jsonl``), by epoch."""
        return sorted(_jsonl(os.path.join(self.run_dir, "migrations.jsonl")), key=lambda p: p.get("epoch", 0))

    def archive_events(self) -> list[dict]:
        return sorted(_jsonl(os.path.join(self.run_dir, "events.jsonl")), key=lambda e: e.get("time", 0.0))

    def launcher_log(self) -> str:
        return "".join(open(p).read() for p in (self.err, self.out) if os.path.exists(p))


def resume_times(records: list[dict], after: float, before: float) -> dict[int, float]:
    """When each rank started training again after ``after`` (its last resume before ``before``): a
    stayer's ``recovered``, a joiner's ``promoted`` (at ``state_ready``), a restarted process's
    ``startup`` (at ``checkpoint_loaded``: stop-restart and nvrx)."""
    out: dict[int, float] = {}
    for r in records:
        event, rank = r.get("event"), r.get("rank")
        if rank is None:
            continue
        t = {"recovered": r.get("t"), "promoted": r.get("state_ready"), "startup": r.get("checkpoint_loaded")}.get(
            event
        )
        if t is not None and after < t < before:
            out[int(rank)] = max(t, out.get(int(rank), t))
    return out


def restarted_processes(records: list[dict], after: float, before: float) -> dict[int, dict]:
    """Per rank, the ``startup`` record of the last process that started between the two times (a
    stop-restart or nvrx restart), with its ``process_start``."""
    out: dict[int, dict] = {}
    for r in records:
        if r.get("event") == "startup" and r.get("rank") is not None and after < r.get("checkpoint_loaded", 0) < before:
            out[int(r["rank"])] = r
    return out


def state_hashes(records: list[dict]) -> dict[int, dict]:
    """rank -> ``{"params", "optimizer"}`` of the last ``state_hash`` record of each rank."""
    out: dict[int, dict] = {}
    for r in records:
        if r.get("event") == "state_hash" and r.get("rank") is not None:
            out[int(r["rank"])] = {"params": r["params"], "optimizer": r["optimizer"]}
    return out


def compare_states(faulted: dict[int, dict], twin: dict[int, dict], world: int) -> dict:
    """``state_identical`` only when every rank of ``world`` has a hash in both runs and they are equal."""
    missing = sorted(set(range(world)) - (set(faulted) & set(twin)))
    differing = sorted(r for r in set(faulted) & set(twin) if faulted[r] != twin[r])
    return {"state_identical": not missing and not differing, "missing_ranks": missing, "differing_ranks": differing}


def trajectory(records: list[dict]) -> dict[int, tuple]:
    """iteration -> (loss, consumed samples) as logged last (a re-run replaces its first run)."""
    return {r["iteration"]: (r["loss"], r.get("consumed_samples")) for r in records if r.get("event") == "iteration"}


WARM_RE = re.compile(r"standby (\S+) warm in [\d.]+s \([^)]*\)[^;]*; (waiting to be promoted|warming stopped: [^\[]*)")
PLAN_LOG_RE = re.compile(r"epoch (\d+) \((failure|planned)\): rank (\d+) -> (\S+) \(pid (\d+)\)")
FENCED_RE = re.compile(r"rank (\d+) \((\S+)\) hung: ")


def standby_warmth(log: str) -> dict[str, str]:
    """member -> ``warm`` (it finished warming and waited), or why it stopped warming (promoted first)."""
    out = {}
    for m in WARM_RE.finditer(log):
        out[m[1]] = "warm" if m[2] == "waiting to be promoted" else m[2].removeprefix("warming stopped: ").strip()
    return out


def standby_starts(archive_events: list[dict]) -> dict[str, dict]:
    """member -> ``{"t", "how"}`` from the archive's ``standby_started`` events (fork, pre-forked, spawn)."""
    return {
        e["detail"]["member"]: {"t": e["time"], "how": e["detail"].get("how")}
        for e in archive_events
        if e.get("what") == "standby_started" and "member" in e.get("detail", {})
    }


WARM_IN_RE = re.compile(r"standby (\S+) warm in ([\d.]+)s \(")


def refill_warmups(archive_events: list[dict], log: str, after: float) -> list[tuple[float, float]]:
    """(start, end) wall times of the warm-up of each standby started after ``after`` (a refill, started
    while the job trained): from its ``standby_started`` event for the seconds the launcher logged it took
    (``warm in``, to warm or to stop warming). One with no such line was still warming when the run ended
    (the agent stops a warming standby with the job): busy until then (``inf``)."""
    took = {m[1]: float(m[2]) for m in WARM_IN_RE.finditer(log)}
    return sorted(
        (s["t"], s["t"] + took.get(member, math.inf))
        for member, s in standby_starts(archive_events).items()
        if s["t"] > after
    )


def idle_standbys(archive_events: list[dict], at: float) -> int:
    """Standbys registered (``member_joined`` of kind standby) before ``at`` and not yet a joiner or gone."""
    joined, used = set(), set()
    for e in archive_events:
        if e.get("time", 0.0) >= at:
            break
        d = e.get("detail", {})
        if e.get("what") == "member_joined" and d.get("kind") == "standby":
            joined.add(d.get("member"))
        elif e.get("what") == "migration_planned":
            used |= {r.get("joiner") for r in d.get("replacements", [])}
        elif e.get("what") == "standby_exited":
            used.add(d.get("member"))
    return len(joined - used)


def epochs(archive_events: list[dict], plans: list[dict]) -> list[dict]:
    """Every migration epoch, in order: ``{"epoch", "reason", "t" (decided), "replacements", "steps",
    "status"}``. The archive's ``migration_planned`` events have them all; a plan's step times only
    when it finished (a plan superseded by a newer one, e.g. after a cascade, has ``steps`` empty)."""
    finished = {p["epoch"]: p for p in plans}
    out = []
    for e in archive_events:
        if e.get("what") != "migration_planned":
            continue
        d = e.get("detail", {})
        plan = finished.get(d.get("epoch"), {})
        out.append(
            {
                "epoch": d.get("epoch"),
                "reason": d.get("reason"),
                "t": e.get("time"),
                "replacements": d.get("replacements", []),
                "steps": plan.get("steps", {}),
                "state_sources": {r["rank"]: r.get("state_source") for r in plan.get("replacements", [])},
                "status": plan.get("status", "superseded or unfinished"),
            }
        )
    return out


def fenced_and_planned(log: str, plans: list[dict]) -> dict:
    """What a fault-free run must show none of: processes its agent fenced as hung, migration plans."""
    return {"fenced": len(FENCED_RE.findall(log)), "plans": max(len(plans), len(set(PLAN_LOG_RE.findall(log))))}
