"""Deadlines: one clock for every bounded wait, and every recovery timeout derived from the lease TTL.

Contract:
- :class:`Deadline` is a point on the monotonic clock. A wait loop asks it for ``remaining()``
  (never negative) and ``expired``; nothing here sleeps or raises, the caller says what timed out.
- :class:`RecoveryTimeouts` holds the formulas that tie the runtime's waits to
  ``--tm-lease-ttl``: a lease is renewed every third of it, a hung rank is noticed within about
  one TTL, and everything that waits on a decision allows several.

Example::

    deadline = Deadline(timeout_s)
    while not ready():
        if deadline.expired:
            raise StoreTimeout(f"... not ready within {timeout_s:.0f}s")
        time.sleep(min(0.05, deadline.remaining()))
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class Deadline:
    """``seconds`` from now on the monotonic clock."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, 0.0 once passed."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at


@dataclass(frozen=True)
class RecoveryTimeouts:
    """The recovery's waits, from the lease TTL (``--tm-lease-ttl``, seconds)."""

    lease_ttl_s: float

    @property
    def renew_every_s(self) -> float:
        """How often a lease is renewed, and the controller's backstop round (a third of the TTL)."""
        return self.lease_ttl_s / 3.0

    @property
    def decision_s(self) -> float:
        """How long a rank waits for the controller at each step of a recovery or a planned move (a
        plan, a convergence record, a switch point, a link) before it gives up: ten TTLs, at least 30 s."""
        return max(30.0, 10.0 * self.lease_ttl_s)

    @property
    def replacement_s(self) -> float:
        """How long an agent waits, after it reported a rank's exit, for a plan that replaces the rank
        before it falls back to stop-restart: five TTLs, at least 10 s."""
        return max(10.0, 5.0 * self.lease_ttl_s)
