"""Which rank is a straggler: the pure detector over per-iteration compute times.

Contract (pure logic, no I/O, no clock; the caller feeds it what the ranks published):
- :meth:`StragglerDetector.observe` takes one iteration's compute times (forward, backward and step,
  without the time spent waiting in communication) of the ranks that reported, each with its **peer
  key**: ranks with the same key do the same work (the same pipeline stage and layout position), so
  a last stage that is slower than a first one is no straggler.
- A rank's *pace* in an iteration is the mean of its last ``smooth`` counted compute times less the
  highest ``trim`` of them (:func:`pace`): one garbage collection or page fault is left out, and the rest
  is averaged, which on shared cores is steadier than a median (see :class:`StragglerConfig`). It is
  *slow* in an iteration when its pace exceeds the median of its peers' paces (the other ranks of its
  key) by ``threshold`` or more. It is flagged when it was slow in ``window`` consecutive counted
  iterations; each flag is returned once, and the rank is flagged again only after it was seen at its
  peers' pace in between.
- Not counted, so that one-off spikes never add up to a flag: an iteration the caller marks
  ``excluded`` (a checkpoint save, an evaluation), and a rank's first ``settle`` iterations after it
  joined (a promoted standby warms its caches; its peers are not compared with it meanwhile
  either). A single spike (a garbage collection) breaks no streak of the others and makes none.
- A key with one rank has no peers: it is never judged.
- The same detector judges links (``control.straggler_watch``): its "ranks" are then any hashable keys
  (a pair of ranks) and its times the seconds waited on the pair's point-to-point ops.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
"""What a detector judges: a rank (int), or a pair of ranks (a link)."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """The detector's thresholds."""

    threshold: float = 1.15
    """A rank is slow in an iteration when its compute time is at least this many times its peers' median."""
    window: int = 20
    """Consecutive slow iterations that make a straggler. 20, not 10, with the pace below: CPU compute times of
    identical work on 2 shared cores drift apart 1.2-1.4x for 10-20 iterations at a time (one rank preempted
    more than its peer, ~80 times an iteration, refills its caches more). Replayed over 9 recorded
    300-iteration steady runs (tests/control/data/compute_cpu_2cores_runs.json), the former detector (window 10,
    median of 9) named a healthy rank in 4 of them, this one in none; it names the rank slowed 1.2x (1.16x
    its peer as measured) in each of 3 recorded runs, 20-61 iterations after its slowdown began."""
    smooth: int = 15
    """Compute times whose trimmed mean is a rank's pace."""
    trim: int = 3
    """The highest of those ``smooth`` left out of the mean (one-off spikes: a garbage collection)."""
    settle: int = 3
    """Iterations of a newly joined rank that are not counted (nor compared with its peers)."""

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"straggler threshold must be > 1, got {self.threshold}")
        if self.window < 1 or self.settle < 0 or self.smooth < 1 or not 0 <= self.trim < self.smooth:
            raise ValueError(
                f"straggler window and smooth must be >= 1, settle >= 0 and trim in [0, smooth), got {self.window}, "
                f"{self.smooth}, {self.settle}, {self.trim}"
            )


@dataclass(frozen=True)
class Sample:
    """One rank's compute time in one iteration, and the key of the ranks that do the same work."""

    peer_key: Hashable
    compute_s: float


@dataclass(frozen=True)
class Straggler(Generic[K]):
    """A flagged rank: at ``iteration`` it had been slow for ``window`` counted iterations."""

    rank: K
    """The flagged rank, or the flagged pair of a detector of links."""
    iteration: int
    ratio: float
    """Its pace over its peers' median pace in that iteration."""
    peers_median_s: float


@dataclass
class StragglerDetector(Generic[K]):
    """Streaks of slow iterations per rank (see the module docstring)."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    _streak: dict[K, int] = field(default_factory=dict)
    _flagged: set[K] = field(default_factory=set)
    _joined_at: dict[K, int] = field(default_factory=dict)
    _recent: dict[K, deque[float]] = field(default_factory=dict)

    @property
    def keys(self) -> list[K]:
        """Every rank (or pair) observed since it last joined."""
        return list(self._recent)

    @property
    def slow(self) -> set[K]:
        """The ranks that were slow in the last iteration they were counted in."""
        return {r for r, n in self._streak.items() if n > 0}

    def joined(self, rank: K, iteration: int) -> None:
        """``rank`` is served by a new process from ``iteration`` on: its streak restarts, and its next
        ``settle`` iterations are not counted."""
        self._joined_at[rank] = iteration
        self._streak.pop(rank, None)
        self._recent.pop(rank, None)
        self._flagged.discard(rank)

    def observe(self, iteration: int, samples: Mapping[K, Sample], *, excluded: bool = False) -> list[Straggler[K]]:
        """Count ``iteration``; returns the ranks flagged in it (each flag once), in the order of ``samples``."""
        if excluded:
            return []
        counted = {r: s for r, s in samples.items() if not self._settling(r, iteration)}
        groups: dict[Hashable, dict[K, float]] = {}
        for r, s in counted.items():
            recent = self._recent.setdefault(r, deque(maxlen=self.config.smooth))
            recent.append(s.compute_s)
            groups.setdefault(s.peer_key, {})[r] = pace(recent, self.config)
        flagged: list[Straggler[K]] = []
        for members in groups.values():
            if len(members) < 2:
                continue
            for r, t in members.items():
                median = statistics.median(v for q, v in members.items() if q != r)
                if median > 0 and t >= self.config.threshold * median:
                    self._streak[r] = self._streak.get(r, 0) + 1
                else:
                    self._streak[r] = 0
                    self._flagged.discard(r)
                if self._streak[r] >= self.config.window and r not in self._flagged:
                    self._flagged.add(r)
                    flagged.append(Straggler(rank=r, iteration=iteration, ratio=t / median, peers_median_s=median))
        return flagged

    def _settling(self, rank: K, iteration: int) -> bool:
        joined = self._joined_at.get(rank)
        return joined is not None and iteration < joined + self.config.settle


def pace(recent: Iterable[float], config: StragglerConfig) -> float:
    """The mean of ``recent`` (at most ``config.smooth`` times) less its highest ones: ``config.trim`` of a full
    ``smooth``, proportionally fewer of a shorter history (a rank that just started)."""
    times = sorted(recent)
    keep = len(times) - len(times) * config.trim // config.smooth
    return sum(times[:keep]) / keep
