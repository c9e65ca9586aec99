"""Leader election among controllers through one lease-backed etcd key, ``/trainmover/<job>/leader``.

Contract: :meth:`LeaderElection.campaign` creates the key on this candidate's
lease if nobody holds it (compare-and-swap on absence) and returns whether this
candidate leads. Leadership ends when the lease does: a killed or hung leader's
key vanishes within about one TTL and the next campaign wins. An etcd outage does
not end it: the lease's keeper asks through it, and etcd extends every lease when
it serves again (:class:`~trainmover_ext.control.membership.LeaseKeeper`); only
etcd's answer that the lease is gone does. :meth:`guard` is a fencing guard: every
controller write includes it, so a leader that lost its lease (and does not know
it yet) cannot commit anything.

Example::

    election = LeaderElection(space, candidate_id="agent-n1", ttl_s=2)
    if election.campaign():
        Executor(space, leader_guard=election.guard()).apply(action)
    election.resign()
"""

from __future__ import annotations

import logging
import time

from trainmover_ext.control.executor import event_put
from trainmover_ext.control.membership import LeaseKeeper
from trainmover_ext.kv.base import Guard, Put
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


class LeaderElection:
    """See the module docstring."""

    def __init__(self, space: JobSpace, *, candidate_id: str, ttl_s: int = 2) -> None:
        self.space, self.candidate_id, self.ttl_s = space, candidate_id, ttl_s
        self.key = space.key("leader")
        self._value = b""
        self._keeper: LeaseKeeper | None = None

    @property
    def is_leader(self) -> bool:
        """True while this candidate's leader lease holds (as far as this process knows)."""
        return self._keeper is not None and not self._keeper.lost.is_set() and self._won

    _won = False

    def campaign(self) -> bool:
        """Try to become leader; returns whether this candidate leads now. Never blocks past the client timeout."""
        if self.is_leader:
            return True
        if self._keeper is None or self._keeper.lost.is_set():
            # A lease that expired (e.g. this process was stopped) cannot be reused: start over.
            if self._keeper is not None:
                self._keeper.close(revoke=False)
            self._keeper = LeaseKeeper(self.space, self.ttl_s, name=f"leader {self.candidate_id}")
        # The lease id makes the value unique per term, so the fencing guard of an old term never matches a new one.
        self._value = encode("leader", {"id": self.candidate_id, "lease": self._keeper.lease_id})
        now = time.time()
        self._won = self.space.commit(
            [Guard.absent(self.key)],
            [
                Put(self.key, self._value, self._keeper.lease_id),
                event_put(self.space, "leader_elected", {"controller": self.candidate_id}, now),
            ],
        )
        if self._won:
            logger.info("controller %s leads job %s", self.candidate_id, self.space.job)
        return self._won

    def guard(self) -> Guard:
        """Holds only while the leader key is this candidate's."""
        return Guard.value(self.key, self._value)

    def resign(self) -> None:
        """Give up leadership now (revokes the lease, deleting the key). Idempotent."""
        if self._keeper is not None:
            self._keeper.close(revoke=True)
            self._keeper = None
        self._won = False
