"""Where joiners go: the standbys a plan may name, and which of them takes which rank.

Pure functions of the :class:`~trainmover_ext.control.view.View`, used by
:mod:`trainmover_ext.control.decide` (the rules are in its module docstring: placement of one
rank, of a lost node's ranks, of a drained node's ranks) and by ``trainmover migrate --to``.
"""

from __future__ import annotations

from trainmover_ext.control.records import MemberRecord, RankRecord
from trainmover_ext.control.view import View


def lost_hosts(view: View) -> set[str]:
    """Hosts of ``nodes/`` whose agent is no member any more (it died with its machine, or hangs), or left
    the controller's probe unanswered (``View.unresponsive``)."""
    return {host for host, node in view.nodes.items() if node.agent not in view.members} | set(view.unresponsive)


def available_standbys(view: View, excluded: set[str]) -> list[str]:
    serving = {rec.member_id for rec in view.ranks.values()}
    lost = lost_hosts(view)
    return sorted(
        (
            m.member_id
            for m in view.members.values()
            if m.kind == "standby"
            and m.health == "ok"
            and m.member_id not in serving
            and m.member_id not in excluded
            and m.host not in lost  # its lease has not expired yet, but it died with its node
            and not any(q.holds(m) for q in view.quarantine)  # a straggler's slot or process
        ),
        key=lambda mid: (view.members[mid].registered_at, mid),
    )


def warm_standbys(view: View, role: str | None = None) -> list[str]:
    """The standbys a move may name as joiner: idle (serving no rank), healthy and warm for ``role`` (for
    some role when None), oldest first. ``trainmover migrate --to`` checks its target against this list."""
    return [
        c
        for c in available_standbys(view, set())
        if (role in view.members[c].warm_roles if role is not None else view.members[c].warm_roles)
    ]


def pick_standby(view: View, candidates: list[str], rec: RankRecord) -> str | None:
    able = [c for c in candidates if rec.role in view.members[c].warm_roles]
    if not able:
        return None
    # A machine that lost one process may lose the rest: prefer a standby on another host.
    leaver_host = view.members[rec.member_id].host if rec.member_id in view.members else rec.host
    other_host = [c for c in able if view.members[c].host != leaver_host]
    pool = other_host or able
    # Then one that kept this very rank's model (it adopts it instead of building one), one done warming,
    # one on a machine already partly in use (whole machines stay free for whole nodes), the rank's slot.
    used = {r.host for r in view.ranks.values()}

    def preference(c: str) -> tuple[bool, bool, bool, bool]:
        m = view.members[c]
        return (m.kept_rank != rec.rank, m.warming, m.host not in used, m.slot not in (None, rec.local_rank))

    return min(pool, key=preference)  # min is stable: the oldest of equals


def machine_for(view: View, ranks: list[RankRecord], free: list[str]) -> tuple[dict[int, str], int] | None:
    """The best standby machine for a lost node's ``ranks``: rank -> standby, all on one host, each warm
    for its rank's role, and how many kept their slot; None when no host has enough such standbys.
    Preferred: most slots kept, then a standby machine over standbys beside active ranks, then the
    oldest standbys."""
    by_host: dict[str, list[str]] = {}
    for c in free:
        by_host.setdefault(view.members[c].host, []).append(c)
    best: tuple[tuple[int, int], dict[int, str], int] | None = None
    for host, standbys in by_host.items():
        if len(standbys) < len(ranks):
            continue
        left, pick = list(standbys), {}
        for rec in ranks:  # each rank in the slot of its own local rank, where that slot is warm for it
            same = [
                c for c in left if view.members[c].slot == rec.local_rank and rec.role in view.members[c].warm_roles
            ]
            if same:
                pick[rec.rank] = same[0]
                left.remove(same[0])
        kept = len(pick)
        for rec in ranks:
            if rec.rank not in pick:
                able = [c for c in left if rec.role in view.members[c].warm_roles]
                if not able:
                    break
                pick[rec.rank] = able[0]
                left.remove(able[0])
        if len(pick) < len(ranks):
            continue
        node = view.nodes.get(host)
        score = (-kept, 0 if node is not None and node.role == "standby" else 1)
        if best is None or score < best[0]:
            best = (score, pick, kept)
    return None if best is None else (best[1], best[2])


def slot_or(member: MemberRecord, local_rank: int) -> int:
    """The ``LOCAL_RANK`` a joiner serves with: its slot on a standby machine, else the rank's own."""
    return local_rank if member.slot is None else member.slot
