"""Scheduled rebalancing: one planned move at a time rotates the job's members through the standby pool.

Contract:
- The schedule is the job's :class:`~trainmover_ext.control.records.RebalancePolicy` (``policy/rebalance``,
  from ``--tm-rebalance-interval`` or ``trainmover rebalance --interval``). It lives in etcd, with the
  time of the last scheduled move, so a new leader keeps the schedule.
- :meth:`Rebalancer.tick` runs in the leading controller after each round with nothing left to decide.
  When a move is due (``interval_s`` after the last one, or after the policy was set) and the job is
  quiet (no request, no plan in flight, no pending probe: :func:`~trainmover_ext.control.controller.quiet`),
  it asks for one planned move of :func:`rotation_choice`'s rank and records the time, in one
  transaction guarded by the leader key and the policy's revision. A move that is not possible now (no
  idle warm standby for any rank) waits; nothing is asked during a recovery.
- :func:`rotation_choice` is the rank its member has served longest (the oldest ``since_epoch``, then the
  lowest rank) among the ranks still training whose stage role an idle warm standby has warmed.
  ``trainmover rebalance --now`` asks for the same move at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trainmover_ext.control.executor import event_put
from trainmover_ext.control.membership import migration_request_puts
from trainmover_ext.control.placement import warm_standbys
from trainmover_ext.control.view import View
from trainmover_ext.kv.base import Guard, Put
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)

POLICY_KEY = ("policy", "rebalance")


def rotation_choice(view: View) -> int | None:
    """The rank to rotate out next (see the module docstring); None when no idle warm standby can take any."""
    able = [rec for rank, rec in view.ranks.items() if rank not in view.finished and warm_standbys(view, rec.role)]
    if not able:
        return None
    return min(able, key=lambda rec: (rec.since_epoch, rec.rank)).rank


def rebalance_puts(space: JobSpace, view: View, requested_by: str, now: float) -> tuple[int, str, list[Put]] | None:
    """The rank, request id and writes of one rotation move (request and timeline event); None when none is
    possible now."""
    rank = rotation_choice(view)
    if rank is None:
        return None
    request, puts = migration_request_puts(space, rank=rank, requested_by=requested_by)
    puts.append(event_put(space, "rebalance", {"rank": rank, "request": request, "by": requested_by}, now))
    return rank, request, puts


class Rebalancer:
    """See the module docstring."""

    def __init__(self, space: JobSpace, controller_id: str, leader_guard: Callable[[], Guard]) -> None:
        self.space, self.controller_id, self.leader_guard = space, controller_id, leader_guard
        self.asked: list[tuple[int, str]] = []
        """(rank, request id) of every move this rebalancer asked for (tests and benchmarks read it)."""

    def tick(self, view: View, now: float | None = None) -> int | None:
        """Ask for one rotation move when due; returns its rank (None: nothing asked)."""
        now = time.time() if now is None else now
        if view.rebalance_policy is None:  # none set, or unreadable (the view's ``malformed`` says why)
            return None
        try:
            policy = view.rebalance_policy.check()
        except ValueError as exc:
            logger.warning("rebalance policy out of range (%s); no scheduled moves", exc)
            return None
        if policy.interval_s <= 0 or now < max(policy.last_at, policy.set_at) + policy.interval_s:
            return None
        from trainmover_ext.control.controller import quiet  # the controller imports this module

        if not quiet(view):
            return None
        planned = rebalance_puts(self.space, view, f"rebalance ({self.controller_id})", now)
        if planned is None:
            return None
        rank, request, puts = planned
        policy.last_at = now
        key = self.space.key(*POLICY_KEY)
        puts.append(Put(key, policy.to_bytes()))
        if not self.space.commit([self.leader_guard(), Guard.mod_revision(key, view.rebalance_policy_rev)], puts):
            return None  # the lead or the policy changed meanwhile: judged again at the next round
        logger.info("rebalance: planned move of rank %d requested (%s)", rank, request)
        self.asked.append((rank, request))
        return rank
