"""Seeded interruption streams.

Contract: :func:`interruption_stream` yields :class:`Interruption` objects in
increasing *running time* (the seconds the job has spent computing, useful or
redone). Failures are a Poisson process in running time with rate
``gpus / gpu_mttf``, a share ``hang_fraction`` of them hangs (drawn from a stream of their own, so
the share moves no other draw); failures during a recovery are the engine's (cascades), so
downtime does not advance this clock. Planned interruptions are a second Poisson
process at ``1 / unexpected_per_planned`` of the failure rate, job losses a third (every
``job_loss_mttf_hours``, from a stream of their own: they move no other
interruption). The same ``(config, seed)`` always yields the same stream, so
every strategy is evaluated on the same interruptions (common random numbers:
the differences between strategies are not sampling noise).

Rebalances are not random: the engine asks :func:`next_rebalance_in` how much
running time remains before the next one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trainmover_ext.simulate.config import SimConfig

# Draw random numbers in blocks: one numpy call per block keeps a 128K-GPU week
# (thousands of events) fast without materialising an unbounded list.
_BLOCK = 256


class EventKind(enum.Enum):
    """Why the job is interrupted."""

    UNEXPECTED = "unexpected"
    """A machine failed; its state is gone."""
    PLANNED = "planned"
    """Maintenance takes a machine away; it is alive until the switch (infra cost applies)."""
    REBALANCE = "rebalance"
    """The scheduler moves a machine at a boundary it chose (no infra cost)."""
    JOB_LOSS = "job_loss"
    """The whole job is lost: every strategy restarts it from its last checkpoint."""


@dataclass(frozen=True)
class Interruption:
    """One interruption of the job."""

    run_s: float
    """Running time of the job at which it happens."""
    kind: EventKind
    """Unexpected or planned (rebalances come from the engine's timer)."""
    inflight_fraction: float = 0.0
    """Fraction of the in-flight iteration already computed, uniform in [0, 1); that work is
    abandoned by strategies that do not roll back to a checkpoint."""
    hang: bool = False
    """An unexpected interruption that is a hang: its detection time comes first."""


def rates_per_s(cfg: SimConfig) -> tuple[float, float]:
    """(unexpected, planned) interruption rates per second of running time."""
    unexpected = 1.0 / cfg.job_mttf_s
    planned = unexpected / cfg.unexpected_per_planned if cfg.unexpected_per_planned > 0 else 0.0
    return unexpected, planned


def interruption_stream(cfg: SimConfig, seed: int) -> Iterator[Interruption]:
    """Infinite, seeded stream of unexpected and planned interruptions and job losses in running time."""
    machines = _machine_stream(cfg, seed)
    if cfg.job_loss_mttf_hours <= 0:
        yield from machines
        return
    losses = np.random.default_rng([seed, 4])
    loss_at = float(losses.exponential(cfg.job_loss_mttf_s))
    for event in machines:
        while loss_at < event.run_s:
            yield Interruption(run_s=loss_at, kind=EventKind.JOB_LOSS)
            loss_at += float(losses.exponential(cfg.job_loss_mttf_s))
        yield event


def _machine_stream(cfg: SimConfig, seed: int) -> Iterator[Interruption]:
    """The unexpected and planned interruptions of single machines."""
    unexpected_rate, planned_rate = rates_per_s(cfg)
    total_rate = unexpected_rate + planned_rate
    planned_share = planned_rate / total_rate
    rng = np.random.default_rng(seed)
    hangs = np.random.default_rng([seed, 1])  # a stream of its own: the others do not move with the share
    clock = 0.0
    while True:
        gaps = rng.exponential(1.0 / total_rate, _BLOCK)
        kinds = rng.random(_BLOCK)
        fractions = rng.random(_BLOCK)
        hang_draws = hangs.random(_BLOCK)
        for gap, kind_draw, fraction, hang in zip(gaps, kinds, fractions, hang_draws, strict=False):
            clock += float(gap)
            kind = EventKind.PLANNED if kind_draw < planned_share else EventKind.UNEXPECTED
            hung = kind is EventKind.UNEXPECTED and hang < cfg.hang_fraction
            yield Interruption(run_s=clock, kind=kind, inflight_fraction=float(fraction), hang=hung)


def next_rebalance_in(cfg: SimConfig, running_since_resume_s: float) -> float:
    """Running time left before the next rebalance; ``inf`` when rebalancing is off.

    The timer restarts at every resume, so a strategy whose recovery takes longer than the
    period still trains M minutes between rebalances (it is never starved to zero).
    """
    if cfg.rebalance_minutes <= 0:
        return float("inf")
    return max(0.0, cfg.rebalance_minutes * 60.0 - running_since_resume_s)
