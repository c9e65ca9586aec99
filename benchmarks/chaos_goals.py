"""The chaos run's goals, in steady iterations of the fault-free twin, from its per-run comparisons (pure).

Contract: ``chaos.py`` passes one comparison per (failure rate, seed, strategy), as
``strategies.compare`` returns it plus ``gap``, ``seed`` and ``strategy``; :func:`trainmover_summary`
returns the keys the issue's checks read (``chaos.json``'s ``trainmover`` object) and :func:`goals_met`
says which goal holds. A quantity no event recorded is None, and its goal is then not met.

- controllable loss per scheduled failure (lost - fraction inside x s - detection): mean <= 1.2
  iterations, max <= 2.5 over failures without a cascade, a cascade counted as one event <= 3.5;
- recovery (detection to every rank's resume) with a warm joiner: median <= 1.0, max <= 1.5;
- post-promotion penalty: median <= 0.5, max <= 1.0 iteration-equivalents;
- ETTR relative to the twin: >= 0.90 at a failure every ~25 iterations, >= 0.975 every ~100;
- lost time per failure <= 0.15 x stop-restart's with forked ranks (Young/Daly checkpoints).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

GOALS = {
    "controllable_loss_iters_mean": ("<=", 1.2),
    "controllable_loss_iters_max": ("<=", 2.5),
    "controllable_loss_iters_cascade_max": ("<=", 3.5),
    "recovery_iters_median": ("<=", 1.0),
    "recovery_iters_max": ("<=", 1.5),
    "penalty_iters_median": ("<=", 0.5),
    "penalty_iters_max": ("<=", 1.0),
    "ettr_rel_g25": (">=", 0.90),
    "ettr_rel_g100": (">=", 0.975),
    "lost_over_fork_restart": ("<=", 0.15),
}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return _r(statistics.median(vals)) if vals else None


def _max(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return _r(max(vals)) if vals else None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return _r(statistics.mean(vals)) if vals else None


def _of(runs: list[dict], strategy: str) -> list[dict]:
    return [r for r in runs if r["strategy"] == strategy]


def lost_ratios(runs: list[dict], over: str = "restart_fork", strategy: str = "trainmover") -> list[dict]:
    """Per (gap, seed) run by both: ``strategy``'s lost time per failure over ``over``'s."""
    base = {(r["gap"], r["seed"]): r["lost_per_failure_s"] for r in _of(runs, over)}
    out = []
    for r in _of(runs, strategy):
        b = base.get((r["gap"], r["seed"]))
        if b:
            out.append({"gap": r["gap"], "seed": r["seed"], "ratio": round(r["lost_per_failure_s"] / b, 4)})
    return out


def _ettr_at(runs: list[dict], gap: float) -> float | None:
    return _median(r["ettr_rel"] for r in runs if r["gap"] == gap)


def trainmover_summary(runs: list[dict]) -> dict:
    """The ``trainmover`` object of ``chaos.json`` (see the module doc) from every run's comparison.
    ``ettr_rel_g25`` and ``ettr_rel_g100`` are the runs at a mean gap of exactly 25 and 100 iterations
    (None when that rate was not run); ``ettr_rel_by_gap`` has every rate run."""
    tm = _of(runs, "trainmover")
    events = [e for r in tm for e in r["events"]]
    plain = [e for e in events if not e.get("cascade")]
    cascades = [e for e in events if e.get("cascade")]
    warm = [e for e in events if e.get("joiner_warm") == "warm"]
    ratios = lost_ratios(runs)
    deferred = [e for r in _of(runs, "trainmover_refills_deferred") for e in r["events"]]
    return {
        "controllable_loss_iters_mean": _mean(e["controllable_loss_iters"] for e in events),
        "controllable_loss_iters_max": _max(e["controllable_loss_iters"] for e in plain),
        "controllable_loss_iters_cascade_max": _max(e["controllable_loss_iters"] for e in cascades),
        "recovery_iters_median": _median(e["recovery_iters"] for e in warm),
        "recovery_iters_max": _max(e["recovery_iters"] for e in warm),
        "recovery_iters_all_median": _median(e["recovery_iters"] for e in events),
        "warm_joiners": f"{len(warm)} of {len(events)}",
        "penalty_iters_median": _median(e["penalty_iters"] for e in events),
        "penalty_iters_max": _max(e["penalty_iters"] for e in events),
        "penalty_refills_deferred_iters_median": _median(e["penalty_iters"] for e in deferred),
        "penalty_refills_deferred_iters_max": _max(e["penalty_iters"] for e in deferred),
        "ettr_rel_g25": _ettr_at(tm, 25),
        "ettr_rel_g100": _ettr_at(tm, 100),
        "ettr_rel_by_gap": {str(g): _ettr_at(tm, g) for g in sorted({r["gap"] for r in tm})},
        "lost_s_per_failure": _median(r["lost_per_failure_s"] for r in tm),
        "lost_over_fork_restart": _median(x["ratio"] for x in ratios),
        "lost_over_fork_restart_by_run": ratios,
        "lost_over_nvrx": _median(x["ratio"] for x in lost_ratios(runs, over="nvrx")),
        "state_identical": bool(tm) and all(r["state_identical"] for r in tm),
        "bit_identical": bool(tm) and all(r["bit_identical"] for r in tm),
        "restarts": sum(r["restarts"] for r in tm),
        "scheduled_failures": sum(r["scheduled_failures"] for r in tm),
        "kills_with_cascades": sum(r["kills_with_cascades"] for r in tm),
    }


def baseline_summary(runs: list[dict], strategy: str) -> dict | None:
    """Lost time per failure, ETTR and identity of a baseline, over its runs (None: not run)."""
    rs = _of(runs, strategy)
    if not rs:
        return None
    return {
        "lost_s_per_failure": _median(r["lost_per_failure_s"] for r in rs),
        "lost_s_per_failure_range": [
            _r(min(r["lost_per_failure_s"] for r in rs)),
            _max(r["lost_per_failure_s"] for r in rs),
        ],
        "ettr_rel_by_gap": {str(g): _ettr_at(rs, g) for g in sorted({r["gap"] for r in rs})},
        "state_identical": all(r["state_identical"] for r in rs),
        "bit_identical": all(r["bit_identical"] for r in rs),
        "checkpoint_interval_by_gap": {str(r["gap"]): r.get("save_interval") for r in rs},
    }


def goals_met(summary: dict) -> dict[str, bool]:
    """Goal name -> whether ``summary`` meets it (a missing figure does not)."""
    out = {}
    for key, (op, bound) in GOALS.items():
        v = summary.get(key)
        out[key] = v is not None and (v <= bound if op == "<=" else v >= bound)
    return out
