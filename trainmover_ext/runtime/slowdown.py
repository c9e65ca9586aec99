"""Slowdown injection for straggler drills: one rank computes ``FACTOR`` times slower, with the same numerics.

``--tm-inject-slowdown RANK:FACTOR[:FROM]`` makes the worker serving logical rank RANK, from
iteration FROM (1-based, default 1) on, sleep at the end of every iteration for ``FACTOR - 1`` times
the compute time that iteration took so far (:func:`trainmover_ext.launch.progress.compute_so_far`:
the main thread's time less its waits in collectives; the iteration's wall time where the process
has no progress record). The sleep is on the main thread outside any collective, so it counts as
compute and its peers wait for it at the next collective, as for a slow GPU or a throttled host.
Nothing the model computes changes.

Only the original worker slows down: a standby that later serves the rank (on a healthy slot) does
not, which is what a straggler's migration is for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainmover_ext.errors import ConfigError
from trainmover_ext.launch import progress


@dataclass(frozen=True)
class Slowdown:
    """One rank's injected slowdown."""

    rank: int
    factor: float
    start: int = 1
    """The first iteration (1-based) that is slowed."""

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            spec = cls(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) == 3 else 1)
        except ValueError:
            raise ConfigError(
                f"--tm-inject-slowdown {text!r}: expected RANK:FACTOR[:FROM], e.g. 3:1.5:20 (rank 3 computes "
                "1.5x slower from iteration 20)"
            ) from None
        if spec.rank < 0 or not spec.factor >= 1.0 or spec.start < 1:
            raise ConfigError(
                f"--tm-inject-slowdown {text!r}: RANK must be >= 0, FACTOR >= 1 and FROM >= 1 (iterations count from 1)"
            )
        return spec


class SlowdownClock:
    """Applies a :class:`Slowdown` to the process serving its rank: :meth:`began` at the iteration's start,
    :meth:`ended` at its end (before its compute time is published)."""

    def __init__(self, spec: Slowdown) -> None:
        self.spec = spec
        self._began: float | None = None

    def began(self) -> None:
        self._began = time.monotonic()

    def ended(self, iteration: int) -> float:
        """Sleep for this iteration's share; returns the seconds slept."""
        began, self._began = self._began, None
        if iteration < self.spec.start or began is None:
            return 0.0
        so_far = progress.compute_so_far()
        if so_far is None:
            so_far = time.monotonic() - began
        pause = (self.spec.factor - 1.0) * so_far
        if pause > 0:
            time.sleep(pause)
        return pause
