"""The one definition of lost time every benchmark uses, and what is derived from it (pure: no I/O, no clock).

Contract: callers (``downtime.py``, ``chaos.py``, ``render_figures.py`` and the tests) pass what a run
logged: the logging rank's iteration records, the faults the harness injected, and what the run's
records say of each fault (detection, every rank's resume). Nothing here reads a file or the time.

- **Lost time** of a faulted run = its wall time minus its fault-free twin's over the same iterations,
  divided by the number of *scheduled* failures (a cascade kill is part of the failure it follows, not
  one more). The wall time over iterations ``first..last`` runs from the start of the first run of
  ``first`` to the end of the last run of ``last``: an iteration rolled back and run again counts, and
  so does the part of the killed iteration computed before the kill.
- **Per event**, the run is cut at iteration boundaries: event ``e`` owns the time from the end of the
  first run of the iteration before its killed one to the same boundary of the next event (the last
  event: to the end of the run), in the faulted run and in the twin alike. The events' shares and the
  share before the first event add up to the run's lost time.
- **In iterations**: ``s`` is the twin's median steady iteration. Controllable loss = lost - fraction
  inside x s - detection; recovery = detection to every rank's resume; the post-promotion penalty =
  sum(t_i - t_ref,i) over the ``PENALTY_WINDOW`` iterations after the resume (the first one
  included) against the same run's iterations before the failure.
- **The resume step's excess** (``resume_step_excess_s``): the time from the last iteration boundary
  before every rank resumed to the first boundary after it, less the twin's between the same two
  boundaries. For a planned move it is phase 2, the switch: the stall at the agreed boundary (the
  hand-over, the communicator swap) and the joiner's first iteration. A phase of the lost time, reported
  beside it, never instead of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from trainmover_ext.simulate.checkpointing import young_daly_interval_s

PENALTY_WINDOW = 20
"""Iterations after a resume whose time is compared with as many before the failure."""


@dataclass(frozen=True, kw_only=True)
class Iteration:
    """One logged run of an iteration (a re-run after a rollback is another record)."""

    iteration: int
    """Megatron's iteration number (1-based: the first trained iteration is 1)."""
    start: float
    """Wall time its step started (the record's ``t_end - iteration_s``)."""
    end: float
    """Wall time its step ended (after the optimizer step)."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def iterations_from_records(records: Iterable[dict]) -> list[Iteration]:
    """The ``iteration`` records of a metrics file, in the order they were logged."""
    return [
        Iteration(iteration=r["iteration"], start=r["t_end"] - r["iteration_s"], end=r["t_end"])
        for r in records
        if r.get("event") == "iteration"
    ]


def steady_iteration_s(its: Sequence[Iteration], skip: int = 2) -> float:
    """The median iteration time of a (fault-free) run, its first ``skip`` iterations left out."""
    times = [it.seconds for it in its[skip:]] or [it.seconds for it in its]
    if not times:
        raise ValueError("a run with no iteration records has no steady iteration time")
    return statistics.median(times)


def first_runs(its: Sequence[Iteration]) -> dict[int, Iteration]:
    """Each iteration's first run (a re-run after a rollback is left out)."""
    out: dict[int, Iteration] = {}
    for it in its:
        out.setdefault(it.iteration, it)
    return out


def _first_run(its: Sequence[Iteration], iteration: int) -> Iteration:
    for it in its:
        if it.iteration == iteration:
            return it
    raise ValueError(f"iteration {iteration} was never logged")


def boundary(its: Sequence[Iteration], iteration: int) -> float:
    """The end of the first run of ``iteration``: where the next iteration first started. Iteration 0
    (nothing trained yet) is the start of the first run of iteration 1."""
    if iteration <= 0:
        return _first_run(its, 1).start
    return _first_run(its, iteration).end


def wall_s(its: Sequence[Iteration], first: int, last: int | None = None) -> float:
    """Wall time from the start of the first run of ``first`` to the end of the last run of ``last``
    (default: the run's last record)."""
    start = _first_run(its, first).start
    if last is None:
        return its[-1].end - start
    ends = [it.end for it in its if it.iteration == last]
    if not ends:
        raise ValueError(f"iteration {last} was never logged")
    return ends[-1] - start


def lost_per_failure_s(
    faulted: Sequence[Iteration], twin: Sequence[Iteration], scheduled: int, first: int, last: int
) -> float:
    """(faulted wall - twin wall) over iterations ``first..last``, per scheduled failure."""
    if scheduled < 1:
        raise ValueError("lost time per failure needs at least one scheduled failure")
    return (wall_s(faulted, first, last) - wall_s(twin, first, last)) / scheduled


def ettr_relative(faulted: Sequence[Iteration], twin: Sequence[Iteration], first: int, last: int) -> float:
    """The twin's wall time over the faulted run's, over the same iterations."""
    return wall_s(twin, first, last) / wall_s(faulted, first, last)


def segment_s(its: Sequence[Iteration], after: int, until: int | None) -> float:
    """Time from the end of the first run of iteration ``after`` to the same boundary of ``until``
    (None: the end of the run's last record)."""
    end = its[-1].end if until is None else boundary(its, until)
    return end - boundary(its, after)


@dataclass(kw_only=True)
class Fault:
    """One scheduled failure as injected and as the run's records tell it (times are wall clock)."""

    kind: str
    """``kill`` (SIGKILL) or ``hang`` (SIGSTOP)."""
    rank: int
    t: float
    """When the signal was sent."""
    iteration: int
    """The iteration it landed in (the harness signalled once ``iteration - 1`` was logged)."""
    detected_t: float | None = None
    """When the strategy knew (a plan's ``detected`` step, a hang watchdog's kill); None: not recorded."""
    resume_t_by_rank: dict[int, float] = field(default_factory=dict)
    """When each rank started training again (its last resume before the next fault)."""
    cascade: str | None = None
    """``joiner`` or ``other`` when a second kill landed during this failure's recovery."""
    extra: dict = field(default_factory=dict)
    """Strategy-specific facts copied into the record as they are (plan, joiner, standbys, phases)."""


def event_record(
    fault: Fault,
    faulted: Sequence[Iteration],
    twin: Sequence[Iteration],
    next_iteration: int | None,
    steady_s: float,
    window: int = PENALTY_WINDOW,
) -> dict:
    """The per-event record (see the module doc); ``next_iteration``: the next fault's iteration (None:
    this is the last). Fields that the run did not record are None, never guessed."""
    before_kill = boundary(faulted, fault.iteration - 1)
    fraction = max(0.0, fault.t - before_kill) / steady_s
    lost = segment_s(faulted, fault.iteration - 1, _minus1(next_iteration)) - segment_s(
        twin, fault.iteration - 1, _minus1(next_iteration)
    )
    detect = None if fault.detected_t is None else fault.detected_t - fault.t
    resumed = {r: t - fault.t for r, t in sorted(fault.resume_t_by_rank.items())}
    last_resume = max(fault.resume_t_by_rank.values()) if fault.resume_t_by_rank else None
    first_end = None
    if last_resume is not None:
        first_end = next((it.end for it in faulted if it.end > last_resume), None)
    recovery = None if last_resume is None or fault.detected_t is None else last_resume - fault.detected_t
    penalty = penalty_window(faulted, fault, last_resume, next_iteration, window)
    step_excess = None if last_resume is None else resume_step_excess_s(faulted, twin, last_resume)
    controllable = lost - fraction * steady_s - (detect or 0.0)
    return {
        "kind": fault.kind,
        "rank": fault.rank,
        "t": round(fault.t, 4),
        "iteration": fault.iteration,
        "fraction_inside": round(fraction, 4),
        "detect_s": _r(detect),
        "resume_s_by_rank": {str(r): round(v, 4) for r, v in resumed.items()},
        "first_iteration_s": _r(None if first_end is None else first_end - fault.t),
        "recovery_s": _r(recovery),
        "lost_s": round(lost, 4),
        "lost_iters": round(lost / steady_s, 4),
        "controllable_loss_s": round(controllable, 4),
        "controllable_loss_iters": round(controllable / steady_s, 4),
        "recovery_iters": _r(None if recovery is None else recovery / steady_s),
        "resume_step_excess_s": _r(step_excess),
        "cascade": fault.cascade,
        **penalty,
        "penalty_iters": _r(None if penalty["penalty_s"] is None else penalty["penalty_s"] / steady_s),
        **fault.extra,
    }


def resume_step_excess_s(faulted: Sequence[Iteration], twin: Sequence[Iteration], last_resume: float) -> float | None:
    """(end of the first iteration ending after ``last_resume`` - end of the record before it) in ``faulted``,
    less the twin's time between the same two iteration ends; None when the two records are not
    consecutive iterations (a rollback re-runs older ones) or the twin lacks them."""
    i = next((n for n, it in enumerate(faulted) if it.end > last_resume), None)
    if not i:  # None, or the run's first record: no boundary before it
        return None
    it, prev = faulted[i], faulted[i - 1]
    ref = first_runs(twin)
    if prev.iteration != it.iteration - 1 or it.iteration not in ref or prev.iteration not in ref:
        return None
    return (it.end - prev.end) - (ref[it.iteration].end - ref[prev.iteration].end)


def penalty_window(
    faulted: Sequence[Iteration],
    fault: Fault,
    last_resume: float | None,
    next_iteration: int | None,
    window: int = PENALTY_WINDOW,
) -> dict:
    """Sum of (t_i - t_ref,i) over up to ``window`` iterations after the last rank's resume (the first
    included, stopping before the next fault's iteration) against as many iterations logged right
    before the failure; ``penalty_n`` says how many were compared."""
    if last_resume is None:
        return {"penalty_s": None, "penalty_n": 0, "penalty_window": None}
    before = [it for it in faulted if it.end <= fault.t][-window:]
    after = [it for it in faulted if it.end > last_resume]
    if next_iteration is not None:
        stop = next((i for i, it in enumerate(after) if it.iteration >= next_iteration), len(after))
        after = after[:stop]
    n = min(window, len(before), len(after))
    if n == 0:
        return {"penalty_s": None, "penalty_n": 0, "penalty_window": None}
    after, before = after[:n], before[-n:]
    penalty = sum(it.seconds for it in after) - sum(it.seconds for it in before)
    return {
        "penalty_s": round(penalty, 4),
        "penalty_n": n,
        "penalty_window": [after[0].iteration, after[-1].iteration],
    }


def _minus1(iteration: int | None) -> int | None:
    return None if iteration is None else iteration - 1


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def spread(values: Iterable[float | None]) -> dict:
    """``{"median", "min", "max", "n", "values"}`` of the values that are not None (all None: n 0)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": round(statistics.median(vals), 4),
        "min": round(min(vals), 4),
        "max": round(max(vals), 4),
        "n": len(vals),
        "values": [round(v, 4) for v in vals],
    }


def young_daly_interval_iters(checkpoint_s: float, steady_s: float, mean_gap_iters: float) -> int:
    """:func:`young_daly_interval_s` in whole iterations (at least 1), for a failure every
    ``mean_gap_iters`` iterations of ``steady_s``."""
    return max(1, round(young_daly_interval_s(checkpoint_s, mean_gap_iters * steady_s) / steady_s))


def excess_by_phase(
    faulted: Sequence[Iteration],
    twin: Sequence[Iteration],
    fault_iterations: Sequence[int],
    busy: Sequence[tuple[float, float]],
    first: int,
    last: int,
    after: int = 3,
) -> dict[str, float]:
    """Where a run's lost time went: its excess over the twin (wall time over ``first..last``) split into
    the iterations within a recovery (``k - 1`` to ``k + after`` for a fault in iteration ``k``), the other
    iterations that overlap one of the ``busy`` wall-clock intervals (a refill standby warming beside the
    job), the remaining iterations, and the rest: pauses between iterations and re-runs after a rollback.
    Each iteration counts its first run's time minus the twin's; the four add up to the total."""
    f_first, t_first = first_runs(faulted), first_runs(twin)
    out = {"recovery_s": 0.0, "refill_s": 0.0, "other_iterations_s": 0.0}
    for i in range(first, last + 1):
        f, t = f_first.get(i), t_first.get(i)
        if f is None or t is None:
            continue
        if any(k - 1 <= i <= k + after for k in fault_iterations):
            key = "recovery_s"
        elif any(a < f.end and f.start < b for a, b in busy):
            key = "refill_s"
        else:
            key = "other_iterations_s"
        out[key] += f.seconds - t.seconds
    total = wall_s(faulted, first, last) - wall_s(twin, first, last)
    out["between_iterations_s"] = total - sum(out.values())
    return {k: round(v, 4) for k, v in out.items()} | {"total_s": round(total, 4)}
