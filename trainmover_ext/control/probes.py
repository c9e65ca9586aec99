"""Liveness probes of nodes: how a lost machine is found before its agent's lease expires.

A rank whose link to rank r broke (r's process closed the connection, or an op on the link
failed) reports r as a **suspect** (``reports/<r>/<reporter>`` with ``suspect``). A suspicion
replaces nothing by itself: a link can break because of the reporter, and a rank that died on a
live machine is reported by its own agent, which sees the child exit. The controller asks the
suspect's node instead:

- It writes ``probes/<host>`` (:class:`~trainmover_ext.control.records.ProbeRecord`), naming the
  node's agent and deleting the suspicions the probe answers (:func:`suspicions`).
- The node's agent answers at once by writing ``acked_at`` (:class:`ProbeResponder`).
- A probe its agent leaves unanswered for ``View.probe_s`` makes the node **unresponsive**
  (:func:`unresponsive_hosts`): ``decide`` then treats it as lost, and one plan replaces every rank
  it ran. Without probes, that waits for the agent's lease (one TTL).
- A probe of an agent that has since been replaced on the host (a new ``nodes/<host>``) counts for
  nothing; an answered probe lets the next suspicion probe again.

``probe_timeout_s`` is the one tunable: long enough that a live agent on a loaded machine answers
(a watch event and one write), short against the lease TTL.

Example (the agent)::

    responder = ProbeResponder(space, host="n1", agent_id=agent_member_id).start()
    ...
    responder.close()
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from trainmover_ext.control.actions import Action, ProbeHost
from trainmover_ext.control.records import FailureReport, ProbeRecord
from trainmover_ext.control.view import View
from trainmover_ext.errors import MalformedValue, StoreError
from trainmover_ext.kv.base import WatchEvent, WatchHandle
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


def probe_timeout_s(ttl_s: float) -> float:
    """``View.probe_s`` for a lease TTL: an eighth of it, at least 0.25 s (0.25 s at the default TTL of 2).
    A live agent answers in one watch event and one write (milliseconds, tens on a loaded machine)."""
    return max(0.25, float(ttl_s) / 8)


def _unanswered(view: View) -> dict[str, ProbeRecord]:
    """The probes, by host, that the host's current agent has not answered (a probe of an agent since
    replaced on the host counts for nothing)."""
    return {
        host: probe
        for host, probe in view.probes.items()
        if host in view.nodes and probe.agent == view.nodes[host].agent and probe.acked_at is None
    }


def unresponsive_hosts(view: View, now: float) -> frozenset[str]:
    """Hosts whose current agent left the controller's probe unanswered for ``view.probe_s``."""
    if view.probe_s <= 0:
        return frozenset()
    return frozenset(host for host, probe in _unanswered(view).items() if now - probe.probed_at >= view.probe_s)


def node_lost(view: View, host: str) -> tuple[str, float | None]:
    """Why the lost node ``host`` counts as lost, and since when (the start of its detection)."""
    probe = view.probes.get(host)
    if host in view.unresponsive and probe is not None:
        return f"node {host} lost: its agent did not answer a probe within {view.probe_s:.2f}s", probe.suspected_at
    return f"node {host} lost: its agent's lease expired", view.gone_at.get(view.nodes[host].agent)


def suspicions(
    view: View, now: float, suspects: dict[str, list[tuple[str, FailureReport]]], failed: set[int]
) -> tuple[list[Action], dict[int, list[str]]]:
    """What the peers' suspicions (by host, each ``(key, report)``) call for.

    Returns the probes to write and, per failed rank, its suspicions for the plan to delete. A suspect
    that fails anyway (its agent reported its exit, or its node is lost) needs no probe; otherwise the
    node's agent is probed, unless a probe of it is pending (its answer, or its silence, decides). A
    host without a live agent to ask, or whose ranks no standby on another host could take (a
    single-node job), waits for the leases."""
    actions: list[Action] = []
    consumed: dict[int, list[str]] = {}
    pending_probes = _unanswered(view)
    for host, reps in sorted(suspects.items()):
        pending = []
        for key, rep in reps:
            if rep.rank in failed:
                consumed.setdefault(rep.rank, []).append(key)
            else:
                pending.append((key, rep))
        node = view.nodes.get(host)
        if not pending or view.probe_s <= 0 or node is None or node.agent not in view.members:
            continue
        if not any(m.kind == "standby" and m.host != host for m in view.members.values()):
            continue  # no standby elsewhere could take the node's ranks: a lost node ends the job anyway
        if host in pending_probes:
            continue
        actions.append(
            ProbeHost(
                probe=ProbeRecord(
                    host=host,
                    agent=node.agent,
                    probed_at=now,
                    suspected_at=min(rep.reported_at for _, rep in pending),
                    ranks=sorted({rep.rank for _, rep in pending}),
                ),
                consumed=tuple(key for key, _ in pending),
            )
        )
    return actions, consumed


def next_probe_deadline(view: View, now: float) -> float | None:
    """When the earliest pending probe runs out after ``now`` (the controller decides again then), or None."""
    if view.probe_s <= 0:
        return None
    dues = (probe.probed_at + view.probe_s for probe in _unanswered(view).values())
    return min((due for due in dues if due > now), default=None)


class ProbeResponder:
    """The agent's side: answers every probe of ``probes/<host>`` that names ``agent_id``, at once, from
    a thread of its own (the watch thread only hands the probe over)."""

    def __init__(self, space: JobSpace, *, host: str, agent_id: str) -> None:
        self.space, self.host, self.agent_id = space, host, agent_id
        self.key = space.key("probes", host)
        self.answered = 0
        """Probes answered so far."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seen: tuple[bytes, int] | None = None
        """The value and revision of the newest probe the watch delivered."""
        self._watch: WatchHandle | None = None
        self._thread = threading.Thread(target=self._run, name=f"tm-probe-responder-{host}", daemon=True)

    def start(self) -> ProbeResponder:
        snap = self.space.kv.get_prefix(self.key)
        self._watch = self.space.kv.watch_prefix(self.key, self._on_events, start_revision=snap.revision + 1)
        self._thread.start()
        self._wake.set()  # a probe written before the watch began
        return self

    def _on_events(self, events: list[WatchEvent]) -> None:
        puts = [ev for ev in events if ev.key == self.key and ev.kind == "put"]
        if puts:
            self._seen = (puts[-1].value, puts[-1].mod_revision)  # answered without reading it again
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            if self._stop.is_set():
                return
            if not self._wake.is_set():
                continue
            self._wake.clear()
            try:
                self._answer()
            except StoreError as exc:  # etcd unreachable: the next event, or the next second, tries again
                logger.warning("could not answer the probe of %s: %s", self.host, exc)
                self._wake.set()
                self._stop.wait(0.1)

    def _answer(self) -> None:
        seen, self._seen = self._seen, None
        for _ in range(8):  # the controller may probe again between our read and our write
            if seen is None:
                entry = self.space.kv.get(self.key)
                if entry is None:
                    return
                seen = (entry.value, entry.mod_revision)
            (value, revision), seen = seen, None
            try:
                probe = ProbeRecord.from_bytes(value, key=self.key, strict=True)
            except MalformedValue as exc:
                logger.warning("ignoring an unreadable probe: %s", exc)
                return
            if probe.agent != self.agent_id or probe.acked_at is not None:
                return
            acked = dataclasses.replace(probe, acked_at=time.time())
            if self.space.kv.compare_and_swap(self.key, revision, acked.to_bytes()):
                self.answered += 1
                logger.info("answered the probe of node %s (suspected ranks %s)", self.host, probe.ranks)
                return

    def close(self) -> None:
        """Stop answering (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
