"""Slowdown injection for straggler drills: one rank computes ``FACTOR`` times slower, with the same numerics.

``--tm-inject-slowdown RANK:FACTOR[:FROM]`` makes the worker serving logical rank RANK, from
iteration FROM (1-based, default 1) on, compute for ``FACTOR - 1`` times the compute time that
iteration took so far, at the end of every iteration (:func:`trainmover_ext.launch.progress.compute_so_far`:
the process's CPU time less its waits in collectives; the iteration's wall time where the process has
no progress record). The extra work spins the main thread until the process's CPU clock
(``progress.cpu_clock``) has advanced that far, outside any collective: it counts as compute as the
same work on a processor ``FACTOR`` times slower would (a sleep would not: compute time is CPU time
off the device), and its peers wait for it at the next collective, as for a slow GPU or a throttled
host. Nothing the model computes changes.

Only the original worker slows down: a standby that later serves the rank (on a healthy slot) does
not, which is what a straggler's migration is for.

``--tm-inject-link-delay A:B:SECONDS[:FROM]`` (:class:`LinkDelay`) slows the link between two ranks
instead: their point-to-point waits on each other end later; their compute does not change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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
        """Compute this iteration's share of extra work; returns its CPU seconds."""
        began, self._began = self._began, None
        if iteration < self.spec.start or began is None:
            return 0.0
        so_far = progress.compute_so_far()
        if so_far is None:
            so_far = time.monotonic() - began
        extra = (self.spec.factor - 1.0) * so_far
        if extra > 0:
            spin(extra)
        return extra


def spin(cpu_s: float) -> None:
    """Keep the calling thread busy until the process's CPU clock has advanced ``cpu_s`` seconds."""
    until = progress.cpu_clock() + cpu_s
    while progress.cpu_clock() < until:
        pass


@dataclass(frozen=True)
class LinkDelay:
    """A slow link between two ranks (``--tm-inject-link-delay A:B:SECONDS[:FROM]``): from iteration FROM on,
    every wait of either original worker in a point-to-point op with the other ends SECONDS later, as if
    the data crossed a slow network path. The wait is inside the op, so it counts as time waited on that
    peer, not as compute; the numerics do not change. A standby that takes either rank over is not
    delayed (the path it uses is another)."""

    ranks: tuple[int, int]
    seconds: float
    start: int = 1

    @classmethod
    def parse(cls, text: str) -> LinkDelay:
        parts = text.split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            spec = cls((int(parts[0]), int(parts[1])), float(parts[2]), int(parts[3]) if len(parts) == 4 else 1)
        except ValueError:
            raise ConfigError(
                f"--tm-inject-link-delay {text!r}: expected A:B:SECONDS[:FROM], e.g. 0:2:0.005:20 (from iteration "
                "20, each wait of rank 0 or 2 on the other ends 5 ms later)"
            ) from None
        a, b = spec.ranks
        if min(a, b) < 0 or a == b or not 0 < spec.seconds <= 10 or spec.start < 1:
            raise ConfigError(
                f"--tm-inject-link-delay {text!r}: A and B must be two ranks >= 0, SECONDS in (0, 10] and FROM >= 1"
            )
        return spec

    def peer_of(self, rank: int) -> int | None:
        """The other end when ``rank`` is one end of the link, else None."""
        a, b = self.ranks
        return b if rank == a else a if rank == b else None

    def wrap(
        self,
        observer: Callable[[str, int, int | None], AbstractContextManager[None]],
        rank: int,
        iteration: Callable[[], int],
    ) -> Callable[[str, int, int | None], AbstractContextManager[None]]:
        """``observer`` (a wait observer, ``nccl_delta.native_group.observe_waits``) with this delay added to
        ``rank``'s waits on the other end (``iteration()``: the iteration in progress)."""
        peer = self.peer_of(rank)

        @contextlib.contextmanager
        def delayed(group: str, op: int, on: int | None = None) -> Iterator[None]:
            with observer(group, op, on):
                yield
                if on is not None and on == peer and iteration() >= self.start:
                    time.sleep(self.seconds)

        return delayed
