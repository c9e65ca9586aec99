"""The leading controller's straggler watch: feeds the ranks' compute times to the detector and acts on a flag.

Contract:
- :meth:`StragglerWatch.tick` runs in the leader's controller thread after each decision round (about
  three times per lease TTL). It takes the job's policy (``policy/stragglers``, the flags' defaults
  when absent), the nodes' compute reports (``compute/<host>``, :mod:`trainmover_ext.launch.compute_relay`)
  and GPU health (``health/<host>``) from the round's view: it reads nothing of its own.
- Iterations are fed to :class:`~trainmover_ext.control.stragglers.StragglerDetector` in order, each once:
  an iteration when every rank still training reported it, or, for a rank that reports late or no more,
  once another rank is :data:`LAG` iterations past it (its peers are then judged without it). The peers of
  a rank are the ranks of its pipeline role (``RankRecord.role``): stages of one role do the same work.
- A rank served by a new process (a promoted standby) restarts its streak and is not counted for the
  detector's ``settle`` iterations.
- A flagged rank is logged, recorded under ``stragglers/<rank>`` and on the timeline (``straggler``).
  With ``migrate`` the same transaction asks for its planned move (a ``requests/`` entry the controller
  decides on like ``trainmover migrate``) and quarantines its slot and process
  (:class:`~trainmover_ext.control.records.Quarantine`). The flag waits, unrecorded, while another
  request or plan is in flight or while no warm standby of the rank's role is idle (said once).
- **Slow links**: each iteration's point-to-point waits (each rank's seconds waited on each peer) add up per
  pair of ranks; a second detector with the same window compares each pair with the pairs of the same
  roles, at a ratio of at least :data:`LINK_THRESHOLD`. A pair flagged while neither end was slow in
  compute in that iteration (a slow rank makes its partner wait too: that is a straggler, not a link) is
  logged, recorded under ``slow_links/<a>-<b>`` and on the timeline (``slow_link``), naming both ends.
  Nothing is moved for it.
- **Moves and recoveries disturb everyone's timing** (a joiner's preparation shares the hosts, the ranks
  pause at the switch): an iteration reported while one is in flight (the view not quiet), or up to
  :data:`SETTLE_AFTER` iterations after a planned move's switch point (and the job's first as many), is not
  counted by either detector; nor is one reported while the pool's refill warms up beside ranks
  (:func:`refill_warming`). While in flight or warming, the iterations the ranks run until the next round
  (twice the last round's advance, at least :data:`LAG`) are held out too.
- Every write is guarded by the leader key: a controller that lost the lead writes nothing. The watch's
  streaks live in memory: a new leader starts them afresh (at most one window later).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainmover_ext.control.executor import event_put
from trainmover_ext.control.membership import migration_request_puts
from trainmover_ext.control.placement import warm_standbys
from trainmover_ext.control.records import (
    MemberRecord,
    Quarantine,
    SlowLinkRecord,
    StragglerPolicy,
    StragglerRecord,
    quarantine_key,
)
from trainmover_ext.control.stragglers import Sample, Straggler, StragglerConfig, StragglerDetector
from trainmover_ext.control.view import View
from trainmover_ext.errors import MalformedValue, TrainMoverError
from trainmover_ext.kv.base import Guard, Put
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)

LAG = 8
"""Iterations a rank may report behind the others before its peers are judged without it."""
POLICY_KEY = ("policy", "stragglers")
LINK_THRESHOLD = 1.5
"""The least ratio a pair's waits must keep over its peers' to be a slow link (the policy's threshold when that is
higher). Waits are small and the pipeline's bubbles in them vary: steady runs on 2 shared cores showed pairs
1.26x their peers' for 10 iterations with nothing slow; a 5 ms delay on a link shows as 5x."""
SETTLE_AFTER = 10
"""Iterations after a planned move's switch point that neither detector counts."""


def is_quarantined(space: JobSpace, host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` is quarantined as slow: a planned leaver that is must not rejoin the
    standby pool (it would never be promoted, and would keep the pool from being refilled). etcd trouble
    answers False: the process rejoins, and placement still skips it."""
    probe = MemberRecord(member_id="", kind="standby", host=host, pid=pid)
    try:
        entries = space.kv.get_prefix(space.key("quarantine") + "/").entries
    except TrainMoverError as exc:
        logger.warning("could not read the quarantine (%s); assuming pid %d is not in it", exc, pid)
        return False
    for entry in entries:
        try:
            if Quarantine.from_bytes(entry.value, key=entry.key).holds(probe):
                return True
        except MalformedValue:
            continue
    return False


def view_policy(view: View) -> StragglerPolicy:
    """The job's straggler policy in ``view``: the defaults when none was recorded, or when the recorded one
    is unreadable (the view's ``malformed`` says why) or out of range."""
    if view.straggler_policy is None:
        return StragglerPolicy()
    try:
        return view.straggler_policy.check()
    except ValueError as exc:
        logger.warning("straggler policy out of range (%s); using the defaults", exc)
        return StragglerPolicy()


@dataclass
class StragglerWatch:
    """See the module docstring."""

    space: JobSpace
    controller_id: str
    leader_guard: Callable[[], Guard]
    detector: StragglerDetector[int] | None = None
    policy: StragglerPolicy | None = None
    flagged: list[StragglerRecord] = field(default_factory=list)
    """Every straggler this watch flagged (tests and benchmarks read it)."""
    links: StragglerDetector[tuple[int, int]] | None = None
    """The slow-link detector (its keys: pairs of ranks, low first)."""
    slow_links: list[SlowLinkRecord] = field(default_factory=list)
    """Every slow link this watch flagged (tests and benchmarks read it)."""
    _pending: dict[int, dict[int, tuple[float, dict[int, float]]]] = field(default_factory=dict)
    """Iteration -> rank -> (compute seconds, seconds waited on each peer)."""
    _fed: int = 0
    first_counted: int = SETTLE_AFTER + 1
    """The job's first iteration counted (before it, its ranks start unevenly)."""
    _hold: int = 0
    """Iterations up to this one are not counted (a move or recovery disturbed them)."""
    _seen: int = 0
    """The newest iteration reported at the previous round."""
    _newest: dict[int, int] = field(default_factory=dict)
    _serving: dict[int, str] = field(default_factory=dict)
    _unacted: list[Straggler[int]] = field(default_factory=list)
    _waiting: set[int] = field(default_factory=set)
    """Flagged ranks whose move waits for a warm standby (said once)."""
    _unfit_seen: set[tuple[int, str]] = field(default_factory=set)
    """(rank, member) flagged for its GPU's health: once per process."""
    _reasons: dict[int, str] = field(default_factory=dict)
    """Why a pending flag was raised, when not its pace (its GPU's problems)."""

    def tick(self, view: View) -> list[StragglerRecord]:
        """One round (see the module docstring); returns the stragglers recorded in it."""
        policy = view_policy(view)
        if policy.action == "off":
            self.detector, self.policy, self._unacted = None, policy, []
            return []
        if (
            self.detector is None
            or self.policy is None
            or (policy.threshold, policy.window)
            != (
                self.policy.threshold,
                self.policy.window,
            )
        ):
            config = StragglerConfig(threshold=policy.threshold, window=policy.window)
            link_config = StragglerConfig(threshold=max(policy.threshold, LINK_THRESHOLD), window=policy.window)
            self.links = StragglerDetector[tuple[int, int]](link_config)
            self.detector, self._serving = StragglerDetector[int](config), {}
        self.policy, detector, links = policy, self.detector, self.links
        assert links is not None  # built with the detector
        for rank, rec in view.ranks.items():
            if self._serving.get(rank) not in (None, rec.member_id):
                detector.joined(rank, self._fed + 1)
                for pair in [pair for pair in links.keys if rank in pair]:
                    links.joined(pair, self._fed + 1)
                self._unacted = [s for s in self._unacted if s.rank != rank]
            self._serving[rank] = rec.member_id
        self._gather(view)
        self._hold = max(self._hold, self.first_counted - 1)
        self._hold_out_moves(view)
        training = set(view.ranks) - view.finished
        for iteration in self._due(training):
            row = {r: times for r, times in self._pending.pop(iteration).items() if r in view.ranks}
            samples = {r: Sample(peer_key=view.ranks[r].role, compute_s=compute) for r, (compute, _) in row.items()}
            held = iteration <= self._hold
            self._unacted += sorted(detector.observe(iteration, samples, excluded=held), key=lambda s: s.rank)
            found = links.observe(iteration, self._link_samples(view, row, detector.slow), excluded=held)
            for link in found:
                self._report_link(view, link)
            self._fed = iteration
        self._unacted += self._unfit_gpus(view)
        recorded = []
        while self._unacted:
            if (record := self._act(view, self._unacted[0], policy)) is None:
                break  # a move in flight: the flag waits for the next round
            self._unacted.pop(0)
            recorded.append(record)
        return recorded

    def _hold_out_moves(self, view: View) -> None:
        """Extend :attr:`_hold` over what a move or recovery in flight disturbs (see the module docstring)."""
        newest = max(self._newest.values(), default=0)
        advance, self._seen = max(0, newest - self._seen), newest
        if not _quiet(view) or refill_warming(view):
            self._hold = max(self._hold, newest + max(LAG, 2 * advance))
        plan = view.last_plan
        if plan is not None and plan.switch_at is not None:
            self._hold = max(self._hold, plan.switch_at + SETTLE_AFTER)

    @staticmethod
    def _link_samples(
        view: View, row: dict[int, tuple[float, dict[int, float]]], slow: set[int]
    ) -> dict[tuple[int, int], Sample]:
        """One iteration's pairs: (a, b) -> the seconds a waited on b plus b on a, keyed by their roles; a pair
        with an end slow in compute is left out (not counted)."""
        waited: dict[tuple[int, int], float] = {}
        for rank, (_, on_peer) in row.items():
            for peer, seconds in on_peer.items():
                if peer in view.ranks and peer != rank:
                    pair = (min(rank, peer), max(rank, peer))
                    waited[pair] = waited.get(pair, 0.0) + seconds
        return {
            (a, b): Sample(peer_key=(view.ranks[a].role, view.ranks[b].role), compute_s=seconds)
            for (a, b), seconds in waited.items()
            if a not in slow and b not in slow
        }

    def _report_link(self, view: View, found: Straggler[tuple[int, int]]) -> None:
        a, b = found.rank
        if a not in view.ranks or b not in view.ranks:
            return
        hosts = [view.ranks[a].host, view.ranks[b].host]
        now = time.time()
        record = SlowLinkRecord(
            ranks=[a, b],
            hosts=hosts,
            iteration=found.iteration,
            ratio=round(found.ratio, 4),
            peers_median_s=round(found.peers_median_s, 6),
            waited_s=round(found.ratio * found.peers_median_s, 6),
            flagged_at=now,
        )
        detail = {"ranks": [a, b], "hosts": hosts, "iteration": found.iteration, "ratio": record.ratio}
        puts = [
            Put(slow_link_key(self.space, a, b), record.to_bytes()),
            event_put(self.space, "slow_link", detail, now),
        ]
        if not self.space.commit([self.leader_guard()], puts):
            return  # the lead changed hands
        logger.warning(
            "slow link: ranks %d (%s) and %d (%s) waited %.2fx their peers' median on each other (%.4f s an "
            "iteration, peers %.4f s) for %d iterations up to %d, neither computing slowly: check the network path "
            "between them",
            a,
            hosts[0],
            b,
            hosts[1],
            found.ratio,
            record.waited_s,
            found.peers_median_s,
            self.links.config.window if self.links else 0,
            found.iteration,
        )
        self.slow_links.append(record)

    def _unfit_gpus(self, view: View) -> list[Straggler[int]]:
        """The ranks whose slot's GPU its agent reports unfit (``health/<host>``), each process once."""
        unfit: dict[tuple[str, int], list[str]] = {}
        for report in view.gpu_health.values():
            try:
                unfit |= {(report.host, int(slot)): found for slot, found in report.unfit.items() if found}
            except ValueError as exc:
                logger.warning("GPU health report of %s unreadable: %s", report.host, exc)
        flagged = []
        for rank, rec in sorted(view.ranks.items()):
            found = unfit.get((rec.host, rec.local_rank))
            if found and (rank, rec.member_id) not in self._unfit_seen and rank not in view.finished:
                self._unfit_seen.add((rank, rec.member_id))
                self._reasons[rank] = "GPU " + "; ".join(found)
                flagged.append(Straggler(rank=rank, iteration=self._fed, ratio=0.0, peers_median_s=0.0))
        return flagged

    def _gather(self, view: View) -> None:
        for report in view.compute.values():
            try:
                for rank_text, pairs in report.samples.items():
                    rank = int(rank_text)
                    for iteration, seconds, on_peer in map(_sample, pairs):
                        if iteration > self._fed:
                            self._pending.setdefault(iteration, {})[rank] = (seconds, on_peer)
                        self._newest[rank] = max(self._newest.get(rank, 0), iteration)
            except (MalformedValue, ValueError, TypeError) as exc:
                logger.warning("compute report of %s unreadable: %s", report.host, exc)

    def _due(self, training: set[int]) -> list[int]:
        newest = max((self._newest.get(r, 0) for r in training), default=0)
        due = []
        for iteration in sorted(self._pending):
            complete = all(self._newest.get(r, 0) >= iteration for r in training)
            if not complete and newest - iteration < LAG:
                break
            due.append(iteration)
        return due

    def _act(self, view: View, found: Straggler[int], policy: StragglerPolicy) -> StragglerRecord | None:
        rec = view.ranks.get(found.rank)
        if rec is None:
            return None
        member = view.members.get(rec.member_id)
        migrate = policy.action == "migrate"
        why = self._reasons.get(found.rank) or (
            f"computed {found.ratio:.2f}x its peers' median for {policy.window} iterations up to {found.iteration}"
        )
        if migrate and not _quiet(view):
            return None
        if migrate and not warm_standbys(view, rec.role):
            if found.rank not in self._waiting:
                self._waiting.add(found.rank)
                logger.warning(
                    "straggler: rank %d %s; its move waits for a warm standby of role %r", found.rank, why, rec.role
                )
            return None
        self._waiting.discard(found.rank)
        now = time.time()
        record = StragglerRecord(
            rank=found.rank,
            member_id=rec.member_id,
            host=rec.host,
            slot=rec.local_rank,
            iteration=found.iteration,
            ratio=round(found.ratio, 4),
            peers_median_s=round(found.peers_median_s, 6),
            action=policy.action,
            reason=self._reasons.get(found.rank, ""),
            flagged_at=now,
        )
        puts: list[Put] = []
        if migrate:
            request, puts = migration_request_puts(
                self.space, rank=found.rank, requested_by=f"straggler watch ({self.controller_id})"
            )
            record.request = request
            quarantine = Quarantine(
                host=rec.host,
                slot=rec.local_rank,
                pid=member.pid if member is not None else 0,
                reason=f"rank {found.rank} {why}",
                since=now,
            )
            puts.append(Put(quarantine_key(self.space, rec.host, rec.local_rank), quarantine.to_bytes()))
        puts.append(Put(self.space.key("stragglers", found.rank), record.to_bytes()))
        keys = ("rank", "member_id", "host", "slot", "iteration", "ratio", "action", "reason", "request")
        puts.append(event_put(self.space, "straggler", {k: getattr(record, k) for k in keys}, now))
        if not self.space.commit([self.leader_guard()], puts):
            return None  # the lead changed hands: the new leader judges afresh
        self._reasons.pop(found.rank, None)
        logger.warning(
            "straggler: rank %d (%s on %s slot %d) %s; %s",
            found.rank,
            rec.member_id,
            rec.host,
            rec.local_rank,
            why,
            f"planned move requested ({record.request}), slot quarantined" if migrate else "reported",
        )
        self.flagged.append(record)
        return record


def slow_link_key(space: JobSpace, a: int, b: int) -> str:
    """``slow_links/<a>-<b>`` of the job (``a < b``)."""
    return space.key("slow_links", f"{min(a, b)}-{max(a, b)}")


def _sample(entry: list[float]) -> tuple[int, float, dict[int, float]]:
    """A report's ``[iteration, compute_s, peer, wait_s, ...]``."""
    links = entry[2:]
    if len(links) % 2:
        raise ValueError(f"compute sample {entry!r}: peers and waits must pair up")
    return int(entry[0]), float(entry[1]), {int(links[k]): float(links[k + 1]) for k in range(0, len(links), 2)}


def refill_warming(view: View) -> bool:
    """Whether a standby that registered after the last plan was decided (the pool's refill) still warms up
    on a host that runs ranks: it takes their CPU (14-30 s on 2 shared cores, measured) as a move would."""
    plan = view.last_plan
    if plan is None:
        return False
    hosts = {rec.host for rec in view.ranks.values()}
    return any(
        m.kind == "standby" and (not m.warm_roles or m.warming) and m.host in hosts
        for m in view.members.values()
        if m.registered_at > plan.decided_at
    )


def _quiet(view: View) -> bool:
    from trainmover_ext.control.controller import quiet  # the controller imports this module

    return quiet(view)
