"""When a lapsed lease counts as a failure: the evidence rules ``decide`` applies before it replaces a rank.

Contract (pure functions of a :class:`View` and ``now``, no I/O):
- :func:`etcd_stalled`: the deciding controller's own lease lapsed within ``View.rejoin_s``; then no
  lapse counts (etcd's doing, not the members').
- :func:`lapse_waits`: a rank whose lease lapsed while its node's agent lives waits ``View.rejoin_s``
  (and ``View.settle_s`` where a whole-node plan could follow) before its lapse counts.
- :func:`note_unseen_lapses` (for the runner that fills ``View.gone_at``): a rank's member absent from
  the view whose deletion the runner has not seen since it last registered lapsed *now*, so its wait
  runs from the first round that saw it instead of being skipped.
"""

from __future__ import annotations

from trainmover_ext.control.records import RankRecord
from trainmover_ext.control.view import View


def etcd_stalled(view: View, now: float) -> bool:
    """Whether the controller's own lease lapsed within ``View.rejoin_s``: it runs, so the lapses of that
    moment are etcd's, not the members' (see the module docstring)."""
    gone = view.gone_at.get(view.own_member) if view.own_member else None
    return gone is not None and now - gone < view.rejoin_s


def lapse_waits(view: View, rec: RankRecord, now: float, lost: set[str]) -> bool:
    """Whether ``rec``'s expired lease waits for its node's agent (see ``View.rejoin_s``): a live rank
    registers again, and a dead or hung one is reported by the agent, which sees its process."""
    gone = view.gone_at.get(rec.member_id)
    if rec.host not in view.nodes or rec.host in lost or gone is None:
        return False
    return now - gone < max(view.rejoin_s, view.settle_s if standby_elsewhere(view, rec) else 0.0)


def standby_elsewhere(view: View, rec: RankRecord) -> bool:
    """Whether a whole-node plan could follow ``rec``'s loss: a standby lives on another node (a single-node
    job, or one whose standbys all share the rank's node, would lose them with it)."""
    return any(m.kind == "standby" and m.host != rec.host for m in view.members.values())


def note_unseen_lapses(view: View, gone_at: dict[str, float], back_at: dict[str, float], now: float) -> None:
    """Set ``gone_at[m] = now`` for each member ``m`` a rank record names that ``view`` lacks and whose
    deletion ``gone_at`` does not hold since ``m`` last registered (``back_at``, when the runner saw it
    register). A round's range read can show a lapse before the watch delivers its deletion: etcd expires
    the leases of a lost node one by one, each its own event, and a round woken by the first reads the
    others gone. Without a time such a lapse skipped :func:`lapse_waits` and was planned at once, alone
    with whichever ranks had lapsed by then (a node's ranks split over two plans); a rank that lapsed
    while it lives (a starved keepalive) would be replaced. The watch's deletion, when it comes, moves
    the time a few milliseconds later."""
    for rec in view.ranks.values():
        mid = rec.member_id
        if mid in view.members:
            continue
        gone = gone_at.get(mid)
        if gone is None or gone < back_at.get(mid, float("-inf")):
            gone_at[mid] = now
