"""The straggler path's pieces: a rank's compute samples (progress record), the agent's relay, the leader's watch,
and the quarantine in placement. The whole path on a real job is tests/migration/test_stragglers.py."""

from __future__ import annotations

import time

import pytest

from trainmover_ext.control.placement import available_standbys
from trainmover_ext.control.records import (
    ComputeReport,
    MemberRecord,
    MigrationPlan,
    Quarantine,
    RankRecord,
    StragglerPolicy,
    StragglerRecord,
    migration_key_suffix,
)
from trainmover_ext.control.straggler_watch import POLICY_KEY, SETTLE_AFTER, StragglerWatch
from trainmover_ext.control.view import View, read_view
from trainmover_ext.errors import ConfigError
from trainmover_ext.kv import Guard, MemoryKV
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.launch import progress
from trainmover_ext.launch.compute_relay import ComputeRelay
from trainmover_ext.runtime.slowdown import spin


@pytest.fixture
def record_file(tmp_path, monkeypatch):
    """A heartbeat file this (main) thread publishes its progress into, as a rank does."""
    path = tmp_path / "beat"
    path.write_bytes(b"\0" * 8)
    monkeypatch.setattr(progress, "_writer", None)
    progress.start(str(path))
    yield str(path)
    monkeypatch.setattr(progress, "_writer", None)


def test_a_compute_sample_is_the_iterations_cpu_time_less_its_waits(record_file):
    progress.mark("iteration")
    spin(0.05)
    time.sleep(0.1)  # off the CPU (as when other processes have the cores): not compute
    with progress.waiting("dp", 1):
        spin(0.05)  # CPU time spent waiting (gloo's threads move the data): not compute either
        time.sleep(0.1)
    progress.iteration_done(7)
    (sample,) = progress.read_compute(record_file)
    assert sample.iteration == 7
    assert 0.045 <= sample.compute_s < 0.09, sample
    assert sample.links == ()  # a collective's wait is on no one peer
    assert progress.read_compute(record_file, after=7) == []


def test_a_sample_carries_the_point_to_point_waits_by_peer(record_file):
    progress.mark("iteration")
    with progress.waiting("pp-0", 1, peer=2):
        time.sleep(0.06)
    with progress.waiting("dp-0", 2):
        time.sleep(0.03)
    with progress.waiting("pp-0", 3, peer=5):
        time.sleep(0.02)
    with progress.waiting("pp-0", 4, peer=2):
        time.sleep(0.06)
    with progress.waiting("pp-0", 5, peer=9):  # a third peer, waited on least: not carried
        time.sleep(0.001)
    progress.iteration_done(4)
    (sample,) = progress.read_compute(record_file)
    assert [peer for peer, _ in sample.links] == [2, 5]
    assert 0.12 <= sample.links[0][1] < 0.2 and 0.02 <= sample.links[1][1] < 0.06, sample
    assert sample.compute_s < 0.05, sample
    progress.mark("iteration")
    progress.iteration_done(5)
    assert progress.read_compute(record_file, after=4)[0].links == ()  # counted per iteration


def test_an_iteration_cut_by_a_save_or_a_recovery_makes_no_sample(record_file):
    progress.mark("iteration")
    progress.mark("recovery")
    progress.iteration_done(3)
    assert progress.read_compute(record_file) == []


def test_the_ring_keeps_the_last_64_iterations(record_file):
    for i in range(1, 101):
        progress.mark("iteration")
        progress.iteration_done(i)
    assert [s.iteration for s in progress.read_compute(record_file)] == list(range(37, 101))


def _space() -> JobSpace:
    return JobSpace.create(MemoryKV(), "j", "tok")


def test_the_relay_writes_one_report_per_node_with_each_ranks_new_samples(record_file):
    space = _space()
    relay = ComputeRelay(space, "n1", publish_s=1.0)
    for i in (1, 2):
        progress.mark("iteration")
        progress.iteration_done(i)
    relay.collect({3: record_file})
    assert relay.publish(now=10.0)
    assert not relay.publish(now=10.5)  # nothing new, and not due
    progress.mark("iteration")
    progress.iteration_done(3)
    relay.collect({3: record_file})
    assert not relay.publish(now=10.5)  # new, but not due yet
    assert relay.publish(now=11.0)
    entry = space.kv.get(space.key("compute", "n1"))
    report = ComputeReport.from_bytes(entry.value, key=entry.key, strict=True)
    assert [entry[0] for entry in report.samples["3"]] == [1, 2, 3]


# -- the watch ----------------------------------------------------------------------------------------


def _job(space: JobSpace, *, standby: bool = True) -> None:
    """PP2 x DP2 on two hosts (ranks 0, 1 first stage; 2, 3 last), a warm standby on h2."""
    for r in range(4):
        host = f"h{r // 2}"
        member = MemberRecord(member_id=f"w{r}", kind="worker", host=host, pid=100 + r)
        space.put(space.key("members", member.member_id), member.to_bytes())
        rec = RankRecord(rank=r, member_id=f"w{r}", host=host, role="first" if r < 2 else "last", local_rank=r % 2)
        space.put(space.key("ranks", r), rec.to_bytes())
    if standby:
        s = MemberRecord(member_id="s1", kind="standby", host="h2", pid=200, warm_roles=["first", "middle", "last"])
        space.put(space.key("members", "s1"), s.to_bytes())
    space.put(space.key("epoch"), encode("epoch", {"epoch": 0}))


def _report(space: JobSpace, iterations: range, times: dict[int, float]) -> None:
    """Each host's ranks' compute times: ``times`` rank -> seconds in every iteration (default 0.1)."""
    for host, ranks in (("h0", (0, 1)), ("h1", (2, 3))):
        samples = {str(r): [[i, times.get(r, 0.1)] for i in iterations] for r in ranks}
        space.put(space.key("compute", host), ComputeReport(host=host, samples=samples).to_bytes())


def _report_links(space: JobSpace, iterations: range, waits: dict[tuple[int, int], float], slow: int = -1) -> None:
    """Compute 0.1 s everywhere (0.2 s on ``slow``); each pipeline's pair (0, 2) and (1, 3) waits 0.02 s on each
    other, or ``waits[(a, b)]`` (each end half of it)."""
    for host, ranks in (("h0", (0, 1)), ("h1", (2, 3))):
        samples = {}
        for r in ranks:
            peer = r + 2 if r < 2 else r - 2
            pair = (min(r, peer), max(r, peer))
            each = waits.get(pair, 0.04) / 2
            samples[str(r)] = [[i, 0.2 if r == slow else 0.1, peer, each] for i in iterations]
        space.put(space.key("compute", host), ComputeReport(host=host, samples=samples).to_bytes())


def test_a_slow_link_is_named_as_its_pair_and_nothing_moves():
    space = _space()
    _job(space)
    watch = _watch(space, "migrate")
    _report_links(space, range(1, 11), {(0, 2): 0.1})
    assert watch.tick(read_view(space)) == []  # no straggler
    (link,) = watch.slow_links
    assert (link.ranks, link.hosts, link.iteration) == ([0, 2], ["h0", "h1"], 5)
    assert link.ratio == pytest.approx(2.5) and link.peers_median_s == pytest.approx(0.04)
    view = read_view(space)
    assert [lk.ranks for lk in view.slow_links] == [[0, 2]]
    assert view.requests == {} and view.quarantine == [] and view.stragglers == {}
    _report_links(space, range(1, 21), {(0, 2): 0.1})
    watch.tick(read_view(space))
    assert len(watch.slow_links) == 1  # flagged once while it stays slow


def test_a_slow_rank_makes_its_partner_wait_but_is_no_slow_link():
    """Rank 2 computes 2x slower and rank 0 waits for it: a straggler (2), no slow link (0, 2)."""
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    _report_links(space, range(1, 21), {(0, 2): 0.14}, slow=2)
    (found,) = watch.tick(read_view(space))
    assert found.rank == 2 and watch.slow_links == []


def _moved_rank_3(space: JobSpace, switch_at: int, decided_at: float = 0.0) -> MigrationPlan:
    """Epoch 1: rank 3 moved to s1 by a planned move, transferred, switching at ``switch_at``."""
    plan = MigrationPlan(
        epoch=1,
        reason="planned",
        replacements=[{"rank": 3, "leaver": "w3", "joiner": "s1", "role": "last", "state_source": {"kind": "leaver"}}],
        resume_iteration=None,
        switch_at=switch_at,
        decided_at=decided_at,
        steps={"transferred": 1.0},
    )
    space.put(space.key("migrations", migration_key_suffix(1)), plan.to_bytes())
    space.put(space.key("epoch"), encode("epoch", {"epoch": 1}))
    return plan


def test_iterations_a_move_disturbs_are_not_counted():
    """A request in flight holds out what the ranks run until the next round (twice the last advance); after
    the move, SETTLE_AFTER iterations past its switch point. A slow pair is named only from then on."""
    from trainmover_ext.control.membership import migration_request_puts
    from trainmover_ext.control.straggler_watch import SETTLE_AFTER

    space = _space()
    _job(space)
    watch = _watch(space, "report")
    _report_links(space, range(1, 11), {(0, 2): 0.1})
    request, puts = migration_request_puts(space, rank=3)
    assert space.commit([], puts)
    watch.tick(read_view(space))
    assert watch.slow_links == [] and watch._hold == 10 + 2 * 10  # the 10 reported, and 20 more
    space.kv.delete(space.key("requests", request))
    _moved_rank_3(space, switch_at=25)
    _report_links(space, range(1, 46), {(0, 2): 0.1})
    watch.tick(read_view(space))
    (link,) = watch.slow_links
    assert (link.ranks, link.iteration) == ([0, 2], max(30, 25 + SETTLE_AFTER) + 5)  # the window of 5 after


def _refill(space: JobSpace, host: str, warm: bool, registered_at: float) -> None:
    roles = ["first", "middle", "last"] if warm else []
    s = MemberRecord(member_id="s2", kind="standby", host=host, pid=300, warm_roles=roles, registered_at=registered_at)
    space.put(space.key("members", "s2"), s.to_bytes())


@pytest.mark.parametrize("host,registered_at", [("h0", 101.0), ("h2", 101.0), ("h0", 99.0)])
def test_iterations_run_while_the_pools_refill_warms_beside_ranks_are_not_counted(host, registered_at):
    """A standby with no warm role yet that registered after the last plan (the pool's refill) on a host that
    runs ranks holds the watch like a move in flight, until it advertises its roles. One on a host without
    ranks, or one there since before the plan, holds nothing."""
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    plan = _moved_rank_3(space, switch_at=2, decided_at=100.0)
    _refill(space, host, warm=False, registered_at=registered_at)
    _report(space, range(1, 31), {1: 0.2})
    held = host == "h0" and registered_at > plan.decided_at
    found = watch.tick(read_view(space))
    assert [(f.rank, f.iteration) for f in found] == ([] if held else [(1, 2 + SETTLE_AFTER + 5)])
    if held:
        _refill(space, host, warm=True, registered_at=registered_at)
        _report(space, range(1, 101), {1: 0.2})
        (late,) = watch.tick(read_view(space))
        assert (late.rank, late.iteration) == (1, 30 + 2 * 30 + 5)  # the round's advance after it held out too


def test_the_jobs_first_iterations_are_not_counted():
    space = _space()
    _job(space)
    _watch(space, "report")  # the policy
    watch = StragglerWatch(space, "ctl", lambda: Guard.absent(space.key("no-such-key")))
    _report(space, range(1, 21), {1: 0.2})
    (found,) = watch.tick(read_view(space))
    assert (found.rank, found.iteration) == (1, SETTLE_AFTER + 5)  # the window of 5 after the first 10


@pytest.mark.parametrize("ratio", [1.1, 1.3])
def test_pairs_below_the_links_threshold_are_no_slow_links(ratio):
    """1.3x is above the straggler threshold (1.15) but below LINK_THRESHOLD (1.5): waits are noisier."""
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    _report_links(space, range(1, 41), {(0, 2): 0.04 * ratio, (1, 3): 0.04})
    assert watch.tick(read_view(space)) == [] and watch.slow_links == []


def _watch(space: JobSpace, action: str) -> StragglerWatch:
    space.put(space.key(*POLICY_KEY), StragglerPolicy(action=action, threshold=1.15, window=5).to_bytes())
    return StragglerWatch(space, "ctl", lambda: Guard.absent(space.key("no-such-key")), first_counted=1)


@pytest.mark.parametrize("slow", [1.2, 1.5, 2.0])
def test_a_slow_rank_is_named_after_the_window_and_its_move_requested(slow):
    space = _space()
    _job(space)
    watch = _watch(space, "migrate")
    _report(space, range(1, 5), {1: 0.1 * slow})
    assert watch.tick(read_view(space)) == []  # 4 slow iterations: under the window
    _report(space, range(1, 7), {1: 0.1 * slow})
    (found,) = watch.tick(read_view(space))
    assert (found.rank, found.iteration, found.host, found.slot) == (1, 5, "h0", 1)
    assert found.ratio == pytest.approx(slow)
    view = read_view(space)
    (request,) = view.requests.values()
    assert (request.rank, request.request_id) == (1, found.request)
    (q,) = view.quarantine
    assert (q.host, q.slot, q.pid) == ("h0", 1, 101)
    stored = space.kv.get(space.key("stragglers", 1))
    assert StragglerRecord.from_bytes(stored.value, key=stored.key).rank == 1


def test_the_move_waits_for_a_warm_standby():
    space = _space()
    _job(space, standby=False)
    watch = _watch(space, "migrate")
    _report(space, range(1, 11), {0: 0.2})
    assert watch.tick(read_view(space)) == []
    assert read_view(space).requests == {}
    s = MemberRecord(member_id="s1", kind="standby", host="h2", pid=200, warm_roles=["first"])
    space.put(space.key("members", "s1"), s.to_bytes())
    (found,) = watch.tick(read_view(space))
    assert found.rank == 0 and [r.request_id for r in read_view(space).requests.values()] == [found.request]


def test_equal_ranks_and_a_slower_stage_are_no_stragglers():
    """The last stage at 1.5x the first is its role's pace, not a straggler; ranks within 10% are peers."""
    space = _space()
    _job(space)
    watch = _watch(space, "migrate")
    _report(space, range(1, 41), {0: 0.1, 1: 0.109, 2: 0.15, 3: 0.15})
    assert watch.tick(read_view(space)) == []
    view = read_view(space)
    assert view.requests == {} and view.quarantine == []


def test_report_records_without_moving_and_off_judges_nothing():
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    _report(space, range(1, 11), {2: 0.2})
    (found,) = watch.tick(read_view(space))
    assert (found.rank, found.action, found.request) == (2, "report", None)
    view = read_view(space)
    assert view.requests == {} and view.quarantine == []
    space2 = _space()
    _job(space2)
    off = _watch(space2, "off")
    _report(space2, range(1, 11), {2: 0.2})
    assert off.tick(read_view(space2)) == [] and space2.kv.get(space2.key("stragglers", 2)) is None


def test_a_rank_that_reports_late_holds_its_peers_back_only_for_a_while():
    """Rank 3 stopped reporting at iteration 2: iterations are judged without it once the others are 8 past."""
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    samples = {str(r): [[i, 0.3 if r == 1 else 0.1] for i in range(1, 21)] for r in (0, 1, 2)}
    samples["3"] = [[1, 0.1], [2, 0.1]]
    space.put(space.key("compute", "h0"), ComputeReport(host="h0", samples=samples).to_bytes())
    (found,) = watch.tick(read_view(space))
    assert found.rank == 1 and watch._fed == 12  # 20 - 8


def test_a_new_process_in_the_rank_settles_before_it_is_judged():
    space = _space()
    _job(space)
    watch = _watch(space, "report")
    _report(space, range(1, 4), {1: 0.3})
    watch.tick(read_view(space))
    promoted = RankRecord(rank=1, member_id="s1", host="h2", role="first", local_rank=0, since_epoch=1)
    space.put(space.key("ranks", 1), promoted.to_bytes())
    # the new process is as slow for 7 iterations: 3 settle, 4 counted: under the window of 5
    _report(space, range(1, 11), {1: 0.3})
    assert watch.tick(read_view(space)) == []


def test_a_policy_outside_its_range_is_refused_with_the_flag_named():
    with pytest.raises(ConfigError, match="--tm-straggler-threshold"):
        StragglerPolicy(threshold=1.0).check()
    with pytest.raises(ConfigError, match="--tm-straggler-action"):
        StragglerPolicy(action="kill").check()
    with pytest.raises(ConfigError, match="--tm-straggler-window"):
        StragglerPolicy(window=0).check()


def test_a_quarantined_slot_or_process_is_never_a_candidate():
    view = View()
    for mid, host, pid, slot in (("a", "h0", 7, None), ("b", "h1", 8, 1), ("c", "h1", 9, 2), ("d", "h2", 7, None)):
        view.members[mid] = MemberRecord(member_id=mid, kind="standby", host=host, pid=pid, slot=slot)
    assert available_standbys(view, set()) == ["a", "b", "c", "d"]
    view.quarantine = [Quarantine(host="h0", slot=0, pid=7, reason="slow"), Quarantine(host="h1", slot=1, reason="")]
    assert available_standbys(view, set()) == ["c", "d"]
