"""Scheduled rebalancing: which rank rotates out, when a move is due, and that a busy job is asked nothing."""

from __future__ import annotations

from trainmover_ext.control.rebalance import POLICY_KEY, Rebalancer, rotation_choice
from trainmover_ext.control.records import MemberRecord, MigrationRequest, RankRecord, RebalancePolicy
from trainmover_ext.control.view import View, read_view
from trainmover_ext.kv import Guard, MemoryKV
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace

ALL = ["first", "middle", "last"]


def _view(standby_roles=ALL) -> View:
    """PP2 x DP2; rank 2 has been served by its member since epoch 0, the others since later moves."""
    v = View()
    for r, since in ((0, 2), (1, 1), (2, 0), (3, 3)):
        v.members[f"w{r}"] = MemberRecord(member_id=f"w{r}", kind="worker", host="h0", pid=r)
        v.ranks[r] = RankRecord(rank=r, member_id=f"w{r}", host="h0", role=("first", "last")[r // 2], since_epoch=since)
    if standby_roles is not None:
        v.members["s"] = MemberRecord(member_id="s", kind="standby", host="h1", pid=9, warm_roles=list(standby_roles))
    return v


def test_the_rank_served_longest_rotates_out_where_a_standby_can_take_it():
    assert rotation_choice(_view()) == 2
    assert rotation_choice(_view(["first"])) == 1  # rank 2's role (last) has no warm standby
    view = _view()
    view.finished.add(2)
    assert rotation_choice(view) == 1
    assert rotation_choice(_view(None)) is None


def _space(view: View, interval_s: float | None) -> JobSpace:
    space = JobSpace.create(MemoryKV(), "j", "tok")
    for m in view.members.values():
        space.put(space.key("members", m.member_id), m.to_bytes())
    for rec in view.ranks.values():
        space.put(space.key("ranks", rec.rank), rec.to_bytes())
    space.put(space.key("epoch"), encode("epoch", {"epoch": 3}))
    if interval_s is not None:
        space.put(space.key(*POLICY_KEY), RebalancePolicy(interval_s=interval_s, set_at=1000.0).to_bytes())
    return space


def _requests(space: JobSpace) -> list[MigrationRequest]:
    return list(read_view(space).requests.values())


def test_a_move_is_asked_once_per_interval_and_only_while_the_job_is_quiet():
    space = _space(_view(), interval_s=60)
    reb = Rebalancer(space, "ctl", lambda: Guard.absent(space.key("nobody")))
    assert reb.tick(read_view(space), now=1059) is None  # not due: 60 s after the policy was set
    assert reb.tick(read_view(space), now=1060) == 2
    (req,) = _requests(space)
    assert req.rank == 2 and req.requested_by == "rebalance (ctl)"
    assert reb.tick(read_view(space), now=1200) is None  # the request is in flight: not quiet
    space.delete(space.key("requests", req.request_id))  # the controller planned it
    assert reb.tick(read_view(space), now=1119) is None  # 60 s after the last move
    assert reb.tick(read_view(space), now=1120) == 2
    entry = space.kv.get(space.key(*POLICY_KEY))
    assert RebalancePolicy.from_bytes(entry.value, key=entry.key).last_at == 1120


def test_no_schedule_no_standby_or_no_lead_asks_nothing():
    for view, interval, guard_holds in (
        (_view(), None, True),
        (_view(), 0, True),
        (_view(None), 60, True),
        (_view(), 60, False),
    ):
        space = _space(view, interval)
        guard_key = space.key("nobody") if guard_holds else space.key("epoch")
        reb = Rebalancer(space, "ctl", lambda s=space, k=guard_key: Guard.absent(k))
        assert reb.tick(read_view(space), now=5000) is None
        assert _requests(space) == []
