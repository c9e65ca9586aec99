"""TrainMover's recovery composed from its measured phases, and the stated model of its growth with scale.

Contract: :func:`measured_phases` reads the events of a ``benchmarks/downtime.py`` JSON: for each
unexpected recovery its plan's ``steps_s`` (seconds from the fault, cumulative: ``detected``,
``decided``, ``joined``, ``transferred``, ``first_iteration``) and its ``penalty_iters``. It returns the
median of each phase (detection; decision; the communicators and the joiner, ``joined``; the state copy;
the first iteration's excess over the file's steady ``iteration_s``) and of the penalty, or None when the
file has no such events. Pure: no file is written, nothing is fitted.

The recovery is their sum: the redo of the killed iteration's computed part and the post-promotion
penalty are the engine's (the in-flight fraction, ``tm_promotion_penalty_iters``), so neither is
counted twice, as a lost time (``unexpected_s``) would count them. Nor is the first iteration's own
work: the engine runs that iteration after the recovery, so only what it took beyond a steady one
(warm-up) is recovery.

Scale model (stated, not fitted; :data:`CONTROL_S_PER_GPU`): detection, the communicator change (the
groups and members rebuilt per replacement are constant with the job's size: ``benchmarks/comm.py``'s
replacement rows and ``--scale-check``), the state copy (one rank's shard) and the first iteration do not
grow with the job. What grows is the control plane's fan-in and fan-out: the controller reads the job's
prefix once per decision (about two keys per rank, ``--scale-check``) and etcd notifies every rank of the
plan (one watch event each).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

STEPS = ("detected", "decided", "joined", "transferred", "first_iteration")
"""The plan's steps, in order; each phase runs from the previous step to this one."""

BASE_RANKS = 8
"""The job size of ``benchmarks/downtime.py``'s recoveries (its ``job``: 8 ranks) where the file has no ``ranks``."""
KEYS_READ_PER_RANK = 2
"""Keys the controller reads per rank of the job per decision (``trainmover simulate --scale-check``)."""
KEY_READ_S = 2e-6
"""etcd's time to serve one small key of a range read: an assumption (order of magnitude of etcd's
published range throughput, ~10^5-10^6 keys per second)."""
NOTIFY_S = 1e-5
"""etcd's time to deliver one watch event to one watcher: an assumption (order of magnitude)."""
CONTROL_S_PER_GPU = KEYS_READ_PER_RANK * KEY_READ_S + NOTIFY_S
"""Seconds a recovery grows per GPU of the job (one rank per GPU)."""


@dataclass(frozen=True)
class Phases:
    """Medians of the unexpected recoveries' phases, at the measured job size."""

    detect_s: float
    decide_s: float
    join_s: float
    transfer_s: float
    first_iteration_s: float
    """The first iteration after the recovery, beyond a steady one (its own work is the engine's)."""
    penalty_iters: float
    """The median as measured: below 0 when the recovered job ran faster than its twin (noise)."""
    ranks: int
    events: int

    @property
    def recovery_s(self) -> float:
        """Fault to the end of the first iteration after it, less a steady iteration: the phases' sum."""
        return self.detect_s + self.decide_s + self.join_s + self.transfer_s + self.first_iteration_s

    def describe(self) -> str:
        """The phases as the inputs list names them."""
        return (
            f"phases detect {self.detect_s:.3g} + decide {self.decide_s:.3g} + join {self.join_s:.3g} + "
            f"state {self.transfer_s:.3g} + first iteration beyond a steady one {self.first_iteration_s:.3g} s "
            f"(medians of {self.events} unexpected recoveries at {self.ranks} ranks)"
        )


def measured_phases(doc: dict[str, Any]) -> Phases | None:
    """The phases of ``doc``'s unexpected recoveries (see the module docstring); None without any."""
    steady = doc.get("iteration_s")
    steady = float(steady) if isinstance(steady, (int, float)) and steady > 0 else 0.0
    rows = []
    for event in doc.get("events") or []:
        if not isinstance(event, dict) or event.get("scenario") != "unexpected":
            continue
        steps = (event.get("plan") or {}).get("steps_s") or {}
        if not all(isinstance(steps.get(s), (int, float)) for s in STEPS):
            continue
        at = [float(steps[s]) for s in STEPS]
        phases = [at[0]] + [b - a for a, b in zip(at, at[1:], strict=False)]
        phases[-1] -= steady
        rows.append((phases, event.get("penalty_iters")))
    if not rows:
        return None
    phase = [statistics.median(max(0.0, r[0][i]) for r in rows) for i in range(len(STEPS))]
    penalties = [float(p) for _, p in rows if isinstance(p, (int, float))]
    return Phases(
        *phase,
        penalty_iters=statistics.median(penalties) if penalties else 0.0,
        ranks=int(doc.get("ranks") or BASE_RANKS),
        events=len(rows),
    )
