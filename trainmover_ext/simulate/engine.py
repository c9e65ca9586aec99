"""Event-driven simulation of one long training job, and the standby-count search.

Contract: :func:`simulate` runs one strategy until the job has completed
``cfg.work_s`` seconds of fault-free progress and returns its accounting. It is
deterministic for a given ``(cfg, strategy, standbys, seed)`` and never mutates
its inputs. :func:`project` runs every strategy on the same seeded interruptions
and picks the TrainMover standby count that maximises ETTR.

Accounting (all in GPU-seconds of the ``cfg.gpus`` job):
    wasted = gpus x (wall - work)      downtime, redone progress, checkpoint stalls
           + shrunk GPU-seconds        capacity a shrunk job could not use
           + idle standby GPU-seconds  warm standbys not (yet) consumed: counted as waste
    ETTR   = gpus x work / (gpus x work + wasted)
Wasted GPU-hours are reported per week of training progress, so a strategy that
needs longer to finish the same work is charged for all of it.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trainmover_ext.simulate.config import HOUR_S, WEEK_S, SimConfig
from trainmover_ext.simulate.events import EventKind, Interruption, interruption_stream, next_rebalance_in, rates_per_s
from trainmover_ext.simulate.strategies import STRATEGIES, Strategy


class StandbyPool:
    """Warm standby machines of one job; consumed slots refill after ``refill_s`` of wall time.

    Idle standbys are integrated over wall time because an unused standby is waste.
    """

    def __init__(self, size: int, refill_s: float, gpus_per_node: int) -> None:
        self.size = size
        self.idle = size
        self._refill_s = refill_s
        self._gpus_per_node = gpus_per_node
        self._refills: list[float] = []  # wall times at which a slot holds a warm machine again
        self._clock = 0.0
        self.idle_gpu_s = 0.0

    def advance(self, wall_s: float) -> None:
        """Integrate idle standbys up to ``wall_s``, applying refills on the way."""
        while self._refills and self._refills[0] <= wall_s:
            ready = heapq.heappop(self._refills)
            self.idle_gpu_s += self.idle * self._gpus_per_node * (ready - self._clock)
            self._clock = ready
            self.idle += 1
        self.idle_gpu_s += self.idle * self._gpus_per_node * (wall_s - self._clock)
        self._clock = wall_s

    def take(self, wall_s: float) -> bool:
        """Consume one warm standby at ``wall_s``; False when none is free."""
        self.advance(wall_s)
        if self.idle == 0:
            return False
        self.idle -= 1
        heapq.heappush(self._refills, wall_s + self._refill_s)
        return True


@dataclass
class RunResult:
    """Accounting of one strategy over one or more seeded runs (sums, so runs can be merged)."""

    strategy: str
    gpus: int
    standbys: int = 0
    work_s: float = 0.0
    wall_s: float = 0.0
    downtime_s: float = 0.0
    redone_s: float = 0.0
    stall_s: float = 0.0
    shrunk_gpu_s: float = 0.0
    standby_idle_gpu_s: float = 0.0
    events: Counter = field(default_factory=Counter)
    standby_misses: int = 0
    downtimes: list[float] = field(default_factory=list)
    """Each interruption's downtime, in order (rebalances included; a cascade's recoveries are its event's)."""

    def downtime_distribution(self) -> dict[str, float | int]:
        """Per-event downtime: ``n``, ``mean``, ``p50``, ``p95`` and ``max`` seconds (zeros without events)."""
        if not self.downtimes:
            return {"n": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
        d = np.asarray(self.downtimes)
        return {
            "n": int(d.size),
            "mean": float(d.mean()),
            "p50": float(np.percentile(d, 50)),
            "p95": float(np.percentile(d, 95)),
            "max": float(d.max()),
        }

    @property
    def wasted_gpu_s(self) -> float:
        """Total GPU-seconds that did not produce progress."""
        return self.gpus * (self.wall_s - self.work_s) + self.shrunk_gpu_s + self.standby_idle_gpu_s

    @property
    def ettr(self) -> float:
        """Effective training time ratio, idle standbys charged: useful GPU-time over all GPU-time spent,
        the standbys' idle GPU-time and a shrunk job's idle GPUs included."""
        useful = self.gpus * self.work_s
        return useful / (useful + self.wasted_gpu_s) if useful > 0 else 1.0

    @property
    def ettr_job(self) -> float:
        """The job's own ETTR: its progress time over its wall time, what a run's log measures (a chaos run's
        ETTR); standbys waiting beside it are not charged."""
        return self.work_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def wasted_gpu_hours_per_week(self) -> float:
        """Wasted GPU-hours per week of training progress."""
        return self.wasted_gpu_s / HOUR_S * (WEEK_S / self.work_s) if self.work_s > 0 else 0.0

    def merge(self, other: RunResult) -> None:
        """Add another run of the same strategy and scale."""
        for name in ("work_s", "wall_s", "downtime_s", "redone_s", "stall_s", "shrunk_gpu_s", "standby_idle_gpu_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.events.update(other.events)
        self.standby_misses += other.standby_misses
        self.downtimes.extend(other.downtimes)


def simulate(
    cfg: SimConfig,
    strategy: Strategy,
    *,
    standbys: int = 0,
    seed: int = 0,
    events: Iterable[Interruption] | None = None,
) -> RunResult:
    """Run ``strategy`` until ``cfg.work_s`` of progress is done.

    ``events`` replaces the seeded stream (tests inject exact interruptions); rebalances
    still come from ``cfg.rebalance_minutes``.
    """
    pool = StandbyPool(
        standbys if strategy.standby_capable else 0, cfg.standby_replace_hours * HOUR_S, cfg.gpus_per_node
    )
    stream = iter(events) if events is not None else interruption_stream(cfg, seed)
    pending = next(stream, None)
    interval = cfg.checkpoint_interval_s(rolls_back_on_failure=strategy.uses_checkpoint)
    # Streams of their own (the hangs' is [seed, 1]), so that neither moves the interruptions.
    spread = np.random.default_rng([seed, 2]) if cfg.downtime_cv > 0 else None
    sigma = math.sqrt(math.log1p(cfg.downtime_cv**2))
    strikes = np.random.default_rng([seed, 3]) if cfg.cascades else None
    failure_rate, _ = rates_per_s(cfg)
    result = RunResult(strategy=strategy.name, gpus=cfg.gpus, standbys=pool.size, work_s=cfg.work_s)
    progress = run = wall = since_resume = 0.0
    while True:
        to_event = pending.run_s - run if pending is not None else math.inf
        to_rebalance = next_rebalance_in(cfg, since_resume)
        to_done = cfg.work_s - progress
        step = max(0.0, min(to_event, to_rebalance, to_done))
        if cfg.checkpoint_save_s > 0 and math.isfinite(interval):
            # saves happen at progress multiples of the interval, again after a rollback
            saves = math.floor((progress + step) / interval) - math.floor(progress / interval)
            wall += saves * cfg.checkpoint_save_s
            result.stall_s += saves * cfg.checkpoint_save_s
        progress += step
        run += step
        wall += step
        since_resume += step
        if to_done <= min(to_event, to_rebalance):
            break
        if to_rebalance <= to_event:
            kind, inflight, hang = EventKind.REBALANCE, 0.0, False
        else:
            kind, inflight, hang = pending.kind, pending.inflight_fraction, pending.hang
            pending = next(stream, None)
        lost = downtime = 0.0
        struck, struck_hang, first = kind, hang, True
        while True:  # the recovery, and each one a failure during it starts (a cascade)
            pool.advance(wall + downtime)
            recovery = strategy.recover(struck, cfg, standby_free=pool.idle > 0, hang=struck_hang)
            if recovery.used_standby:
                pool.take(wall + downtime)
            elif strategy.standby_capable and struck is EventKind.UNEXPECTED and pool.size > 0:
                result.standby_misses += 1
            if first:  # a cascade strikes a job that is not computing: nothing more to redo
                if recovery.rollback_to_checkpoint:
                    lost = progress - math.floor(progress / interval) * interval
                elif recovery.abandon_inflight:
                    lost = min(progress, inflight * cfg.iteration_s)
            this = recovery.downtime_s
            if spread is not None:  # lognormal of mean 1: exp(N(-sigma^2/2, sigma^2))
                this *= float(spread.lognormal(-(sigma**2) / 2, sigma))
            result.shrunk_gpu_s += recovery.shrunk_gpu_s
            strike = float(strikes.exponential(1.0 / failure_rate)) if strikes is not None else math.inf
            if strike >= this:
                downtime += this
                break
            # A machine fails before this recovery ends (an exit, not a hang: the recovery's own
            # timeouts notice it): the time spent so far is lost and a recovery of the failure starts.
            downtime += strike
            struck, struck_hang, first = EventKind.UNEXPECTED, False, False
            result.events["cascade"] += 1
        progress -= lost
        wall += downtime
        since_resume = 0.0
        result.redone_s += lost
        result.downtime_s += downtime
        result.downtimes.append(downtime)
        result.events[kind.value] += 1
        if hang:
            result.events["hang"] += 1
    pool.advance(wall)
    result.wall_s = wall
    result.standby_idle_gpu_s = pool.idle_gpu_s
    return result


def replica_seeds(cfg: SimConfig) -> list[int]:
    """Independent, reproducible seeds for ``cfg.replicas`` runs."""
    children = np.random.SeedSequence(cfg.seed).spawn(cfg.replicas)
    return [int(child.generate_state(1)[0]) for child in children]


def simulate_replicas(cfg: SimConfig, strategy: Strategy, standbys: int = 0) -> RunResult:
    """Sum of ``cfg.replicas`` seeded runs of one strategy."""
    merged: RunResult | None = None
    for seed in replica_seeds(cfg):
        one = simulate(cfg, strategy, standbys=standbys, seed=seed)
        if merged is None:
            merged = one
        else:
            merged.merge(one)
    assert merged is not None  # replicas >= 1 is validated by SimConfig
    return merged


def optimise_standbys(cfg: SimConfig) -> tuple[int, dict[int, RunResult]]:
    """The standby count with the least waste (highest ETTR), and every count evaluated.

    Waste is convex in practice: too few standbys leave failures on the slow path, too many
    sit idle. The scan starts a little below the expected number of consumed standbys
    (failure rate x refill time, Erlang-style) and stops once ``patience`` counts in a row
    did no better than the best.
    """
    strategy = STRATEGIES["trainmover"]
    if cfg.standbys is not None:
        return cfg.standbys, {cfg.standbys: simulate_replicas(cfg, strategy, cfg.standbys)}
    unexpected_rate, _ = rates_per_s(cfg)
    in_repair = unexpected_rate * cfg.standby_replace_hours * HOUR_S
    start = max(0, int(in_repair - 3 * math.sqrt(in_repair)))
    patience = 3 + int(math.sqrt(in_repair))
    evaluated: dict[int, RunResult] = {0: simulate_replicas(cfg, strategy, 0)}
    best = 0
    count = max(1, start)
    while count <= cfg.max_standbys:
        evaluated[count] = simulate_replicas(cfg, strategy, count)
        if evaluated[count].wasted_gpu_s < evaluated[best].wasted_gpu_s:
            best = count
        elif count - best >= patience and count > start + patience:
            break
        count += 1
    return best, evaluated


@dataclass
class Projection:
    """Every strategy at one scale, TrainMover at its best standby count."""

    cfg: SimConfig
    results: dict[str, RunResult]
    best_standbys: int
    standby_curve: dict[int, float]
    """Standby count -> TrainMover ETTR, for every count the search evaluated."""

    def waste_reduction_pct(self) -> dict[str, float]:
        """Percent by which TrainMover's wasted GPU-hours are below each baseline's."""
        ours = self.results["trainmover"].wasted_gpu_s
        out = {}
        for name, res in self.results.items():
            if name != "trainmover" and res.wasted_gpu_s > 0:
                out[name] = 100.0 * (1.0 - ours / res.wasted_gpu_s)
        return out

    def saved_gpu_hours_per_week(self) -> dict[str, float]:
        """Wasted GPU-hours per week TrainMover saves against each baseline."""
        ours = self.results["trainmover"].wasted_gpu_hours_per_week
        return {n: r.wasted_gpu_hours_per_week - ours for n, r in self.results.items() if n != "trainmover"}


def project(cfg: SimConfig, strategies: Iterable[str] | None = None) -> Projection:
    """Simulate the baselines and TrainMover (standby count optimised) at ``cfg.gpus``."""
    names = list(strategies) if strategies is not None else list(STRATEGIES)
    results: dict[str, RunResult] = {}
    for name in names:
        if name != "trainmover":
            results[name] = simulate_replicas(cfg, STRATEGIES[name])
    best, evaluated = optimise_standbys(cfg)
    results["trainmover"] = evaluated[best]
    curve = {count: res.ettr for count, res in sorted(evaluated.items())}
    return Projection(cfg=cfg, results=results, best_standbys=best, standby_curve=curve)
