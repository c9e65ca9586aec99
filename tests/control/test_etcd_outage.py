"""An etcd outage longer than the lease TTL: the job's leases, watches and training outlive it.

A killed etcd, started again on its data dir, extends every lease by its TTL when it serves again, so
a member whose keeper kept asking through the outage still holds its lease. Only etcd's answer that
the lease is gone (revoked, or expired while etcd kept running: the SIGSTOP case, as for a member cut
off from a running etcd) makes the member lost: a plain worker membership then stops (MembershipLost),
a standby registers again, and so does a rank's worker (``rejoin_in_background``): the controller
waits for it (a lapse is evidence, not proof), so a job trains on through an etcd paused past the TTL."""

from __future__ import annotations

import secrets
import signal
import threading
import time
from collections.abc import Callable

import pytest

from helpers import LaunchedJob, run_job, start_job, tm_args, trajectory, wait_for, wait_iteration, wait_until
from trainmover_ext.control.election import LeaderElection
from trainmover_ext.control.membership import Membership, PlanInbox
from trainmover_ext.control.records import MemberRecord, MigrationPlan, migration_key_suffix
from trainmover_ext.errors import EtcdUnavailable, MembershipLost
from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig
from trainmover_ext.kv import EtcdClientConfig, EtcdKV
from trainmover_ext.kv.base import wait_prefix
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.netutil import free_port

TTL = 2
OUTAGE_S = 3 * TTL


def members(space: JobSpace) -> tuple[Membership, Membership]:
    """A worker (a lost lease is its end) and an unpromoted standby (it registers again)."""
    worker = Membership(space, MemberRecord(member_id="w0", kind="worker", host="h", pid=1), ttl_s=TTL).register()
    standby = Membership(
        space, MemberRecord(member_id="s0", kind="standby", host="h", pid=2), ttl_s=TTL, rejoin_on_loss=True
    ).register()
    return worker, standby


def plan_of(epoch: int) -> MigrationPlan:
    return MigrationPlan(epoch=epoch, reason="planned", replacements=[], resume_iteration=None, decided_by="test")


def test_leases_watches_and_leadership_outlive_an_etcd_outage_of_three_ttls(etcd):
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.5))
    space = JobSpace.create(kv, "outage")
    worker, standby = members(space)
    election = LeaderElection(space, candidate_id="ctl-0", ttl_s=TTL)
    assert election.campaign()
    heard: list[MigrationPlan] = []
    got = threading.Event()
    # No backstop re-read within the test: the plan must come through the watch, re-subscribed.
    inbox = PlanInbox(space, lambda plan: (heard.append(plan), got.set()), resync_s=3600)
    assert worker.keeper is not None and standby.keeper is not None
    lease = kv.get(worker.key).lease
    try:
        etcd.kill()  # SIGKILL: etcd keeps nothing but its data dir
        t0 = time.monotonic()
        # An unreachable server says nothing about a lease: never LeaseNotFound.
        with pytest.raises(EtcdUnavailable):
            kv.refresh_lease(lease)
        with pytest.raises(EtcdUnavailable):
            kv.put(space.key("x"), b"1", lease=lease)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))
        for who, keeper in (("worker", worker.keeper), ("standby", standby.keeper)):
            assert not keeper.lost.is_set(), f"the {who} gave its lease up during the outage"
        assert election.is_leader, "the leader gave its lease up during the outage"
        assert worker.keeper.unreachable_since is not None, "the keeper did not notice the outage"
        etcd.start(timeout=30)  # same ports, same data dir

        assert wait_until(lambda: worker.keeper.unreachable_since is None, 10), "the keeper never got through"
        space.put(space.key("migrations", migration_key_suffix(1)), plan_of(1).to_bytes())
        assert got.wait(10), "the plan inbox opened before the outage did not hear of a plan written after it"
        assert [p.epoch for p in heard] == [1]
        # Two more TTLs: the leases are kept alive, not only extended once by the restarted etcd.
        time.sleep(2 * TTL)
        worker.check()
        standby.check()
        assert standby.rejoins == 0
        entry = kv.get(worker.key)
        assert entry is not None and entry.lease == lease, "the worker's key did not survive on its own lease"
        assert kv.get(standby.key) is not None
        assert election.is_leader and election.campaign()
        assert kv.get(election.key).value == election.guard().expected
    finally:
        inbox.close()
        election.resign()
        worker.close()
        standby.close()
        kv.close()


def test_a_lease_revoked_after_the_outage_is_lost(etcd):
    """The companion: the same outage, then etcd says the lease is gone (it was revoked meanwhile, as for
    a member the job replaced): the keeper marks it lost; the worker stops, the standby registers again."""
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.5))
    space = JobSpace.create(kv, "outage-revoked")
    worker, standby = members(space)
    assert worker.keeper is not None and standby.keeper is not None
    try:
        etcd.kill()
        time.sleep(OUTAGE_S)
        etcd.start(timeout=30)
        kv.revoke_lease(worker.keeper.lease_id)
        kv.revoke_lease(standby.keeper.lease_id)
        assert wait_until(worker.keeper.lost.is_set, 5) and wait_until(standby.keeper.lost.is_set, 5)
        with pytest.raises(MembershipLost, match="w0 lost its lease"):
            worker.check()
        standby.check()
        assert standby.rejoins == 1 and kv.get(standby.key) is not None
        assert kv.get(worker.key) is None
    finally:
        worker.close()
        standby.close()
        kv.close()


def test_a_lease_that_expired_while_etcd_ran_on_is_lost(etcd):
    """etcd stopped (SIGSTOP) rather than killed keeps its clock: its leases expire meanwhile, as for a
    member cut off from a running etcd. When it answers again it says so, and the member is lost."""
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.5))
    space = JobSpace.create(kv, "outage-expired")
    worker, standby = members(space)
    assert worker.keeper is not None and standby.keeper is not None
    try:
        etcd.kill(signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)
            assert not worker.keeper.lost.is_set(), "the keeper gave up before etcd answered"
        finally:
            etcd.kill(signal.SIGCONT)
        assert wait_until(worker.keeper.lost.is_set, 10), "etcd's answer that the lease expired was not heeded"
        with pytest.raises(MembershipLost):
            worker.check()
        assert wait_until(standby.keeper.lost.is_set, 10)
        standby.check()
        assert standby.rejoins == 1 and kv.get(standby.key) is not None
    finally:
        worker.close()
        standby.close()
        kv.close()


def test_a_rank_that_lives_registers_again_by_itself_after_an_etcd_pause(etcd):
    """A rank's worker (``rejoin_in_background``) whose lease etcd dropped while paused registers again at
    once, with nobody calling ``check``; one the controller replaced (not allowed) does not."""
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.5))
    space = JobSpace.create(kv, "pause-rejoin")
    live = Membership(space, MemberRecord(member_id="w0", kind="worker", host="h", pid=1), ttl_s=TTL).register()
    replaced = Membership(space, MemberRecord(member_id="w1", kind="worker", host="h", pid=2), ttl_s=TTL).register()
    live.rejoin_in_background(lambda: True)
    replaced.rejoin_in_background(lambda: False)
    try:
        etcd.kill(signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)
        finally:
            etcd.kill(signal.SIGCONT)
        assert wait_until(lambda: live.rejoins == 1 and kv.get(live.key) is not None, 10), "w0 did not register again"
        assert replaced.keeper is not None and wait_until(replaced.keeper.lost.is_set, 10)
        time.sleep(TTL)
        assert kv.get(replaced.key) is None and replaced.rejoins == 0
    finally:
        live.close()
        replaced.close()
        kv.close()


def test_a_watch_whose_missed_history_was_compacted_reads_it_again(etcd):
    """While out of this client's reach etcd served others, who wrote plans and compacted the history the
    inbox's watch would resume from: the watch re-reads its range, and every plan is delivered."""
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.5))
    space = JobSpace.create(kv, "compacted")
    heard: list[int] = []
    got = threading.Event()
    inbox = PlanInbox(space, lambda plan: (heard.append(plan.epoch), plan.epoch == 3 and got.set()), resync_s=3600)
    home = etcd.config.client_port
    try:
        etcd.kill()
        etcd.config.client_port = free_port()  # etcd serves again, but not where this client looks
        etcd.start(timeout=30)
        with EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=3)) as other:
            theirs = JobSpace.open(other, "compacted", space.token)
            for epoch in (1, 2):
                theirs.put(theirs.key("migrations", migration_key_suffix(epoch)), plan_of(epoch).to_bytes())
            revision = other.get_prefix(theirs.key("migrations/")).revision
            other._etcd.compact(revision, physical=True)  # the client library's call: KV has none
        etcd.kill()
        etcd.config.client_port = home
        etcd.start(timeout=30)
        space.put(space.key("migrations", migration_key_suffix(3)), plan_of(3).to_bytes())
        assert got.wait(10), f"heard {heard}"
        assert heard == [1, 2, 3]
    finally:
        inbox.close()
        kv.close()


def test_a_wait_for_a_decision_goes_on_through_an_outage(etcd):
    """A rank waiting for the controller (``wait_prefix``, as ``wait_convergence`` does) keeps waiting while
    etcd is down, and sees the key written once etcd is back, within its own deadline."""
    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.0))
    key = "/trainmover/wait/decision"
    result: dict[str, object] = {}

    def waiter() -> None:
        try:
            result["values"] = wait_prefix(kv, key, lambda values: key in values, 30, recheck_s=0.2)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            result["error"] = exc

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        etcd.kill()
        time.sleep(OUTAGE_S / 2)  # several re-reads fail meanwhile
        etcd.start(timeout=30)
        kv.put(key, b"go")
        thread.join(15)
        assert "error" not in result, result
        assert result.get("values") == {key: b"go"}
    finally:
        kv.close()


ITERS_THROUGH = 80
"""~0.2 s each on two cores: the interruption and the reconnection fall well inside the run."""


@pytest.fixture(scope="module")
def through_reference(tmp_path_factory, corpus) -> dict[int, tuple]:
    """The fault-free trajectory both interruptions are compared with (one run for the module)."""
    tmp = tmp_path_factory.mktemp("through_ref")
    return trajectory(run_job(tmp, 8, tm_args(corpus, iters=ITERS_THROUGH), name="ref").metrics_path)


def _train_through(
    tmp_path, corpus, ref, name: str, interrupt: Callable[[EmbeddedEtcd, LaunchedJob], None]
) -> LaunchedJob:
    """A real job (tp2·pp2·dp2, one standby) on an external etcd that ``interrupt`` takes away mid-run, once
    the standby is warm: the job finishes, trains the fault-free trajectory bit for bit, and no migration
    is planned (no member was declared dead)."""
    args = tm_args(corpus, iters=ITERS_THROUGH)
    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd")).start(timeout=60)
    try:
        job = start_job(
            tmp_path,
            8,
            args,
            "--tm-job",
            name,
            "--tm-job-token",
            secrets.token_hex(16),
            "--tm-etcd-endpoints",
            ",".join(server.endpoints),
            name=name,
        )
        try:
            wait_iteration(job, 3, timeout=180)
            # The standby warms up through etcd (its fingerprint, its roles): let it finish first.
            wait_for(lambda: "waiting to be promoted" in job.stdout(), 60, 0.1, "the standby to be warm")
            interrupt(server, job)
            code = job.wait(240)
        finally:
            if job.popen.poll() is None:
                job.popen.kill()
        assert code == 0, f"exited {code}:\n{job.stderr()[-4000:]}"
        assert trajectory(job.metrics_path) == ref, "the trajectory differs from the fault-free run"
        assert not job.events("migration_planned"), job.events("migration_planned")
        assert not job.events("stop_restart")
        return job
    finally:
        server.stop()


@pytest.mark.slow
def test_training_runs_through_an_etcd_outage_of_three_ttls(tmp_path, corpus, through_reference):
    """etcd killed for three lease TTLs and started again: the ranks train on through the outage."""
    seen: dict[str, int] = {}

    def outage(server: EmbeddedEtcd, job: LaunchedJob) -> None:
        server.kill()
        seen["at_kill"] = max(trajectory(job.metrics_path))
        time.sleep(OUTAGE_S)
        assert job.popen.poll() is None, f"the job ended during the outage:\n{job.stderr()[-3000:]}"
        seen["at_restart"] = max(trajectory(job.metrics_path))
        server.start(timeout=30)

    _train_through(tmp_path, corpus, through_reference, "outage", outage)
    assert seen["at_kill"] < seen["at_restart"] < ITERS_THROUGH, f"trained {seen} of {ITERS_THROUGH} in the outage"


@pytest.mark.slow
def test_training_runs_through_an_etcd_pause_of_three_ttls(tmp_path, corpus, through_reference):
    """etcd stopped (SIGSTOP) for three lease TTLs: it keeps its clock, so every lease, the controller's
    own and the agent's included, has lapsed when it serves again. Nothing is replaced: the controller
    holds every lapse while its own lease lapsed this recently, and every live member registers again."""

    def pause(server: EmbeddedEtcd, job: LaunchedJob) -> None:
        server.kill(signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)
        finally:
            server.kill(signal.SIGCONT)

    job = _train_through(tmp_path, corpus, through_reference, "pause", pause)
    assert "registered again" in job.stderr() + job.stdout(), "no lease lapsed: the pause tested nothing"
