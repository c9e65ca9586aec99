"""The plan inbox every process reads migration plans from: delivery once per write, its backstop, its waiters."""

from __future__ import annotations

import pytest

from trainmover_ext.control.records import MigrationPlan
from trainmover_ext.kv import MemoryKV
from trainmover_ext.kv.job import JobSpace


def test_plan_inbox_delivers_each_plan_write_once_even_when_its_watch_is_deaf():
    """The watch delivers plans; a backstop read every resync_s delivers what a deaf watch missed, and a
    write both saw is delivered once."""
    import time

    from trainmover_ext.control.membership import PlanInbox

    class DeafKV(MemoryKV):
        def watch_prefix(self, prefix, callback, *, start_revision=0):
            return super().watch_prefix(prefix, lambda events: None, start_revision=start_revision)

    def plan(epoch, step=None):
        return MigrationPlan(
            epoch=epoch, reason="failure", replacements=[], resume_iteration=0, steps={step: 1.0} if step else {}
        ).to_bytes()

    for kv_class, resync_s in ((MemoryKV, 0.05), (DeafKV, 0.05)):
        space = JobSpace.create(kv_class(), "j", "tok")
        space.put(space.key("migrations", 1), plan(1))  # before the watcher: never delivered
        got = []
        watcher = PlanInbox(space, lambda p, got=got: got.append((p.epoch, sorted(p.steps))), resync_s=resync_s)
        try:
            space.put(space.key("migrations", 2), plan(2))
            space.put(space.key("migrations", 2), plan(2, "joined"))  # a step marked: a new write
            deadline = time.monotonic() + 5.0
            while (not got or got[-1] != (2, ["joined"])) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # several resyncs: nothing more may arrive
            assert got in ([(2, []), (2, ["joined"])], [(2, ["joined"])]), (kv_class.__name__, got)
            assert got[-1] == (2, ["joined"])
        finally:
            watcher.close()


def test_plan_inbox_backstop_reads_no_plan_while_none_is_written():
    """The backstop asks only for the plans written since its last read: with a long history and no new
    write, its reads return nothing; a write the watch missed still arrives."""
    import time

    from trainmover_ext.control.membership import PlanInbox

    returned = []

    class CountingDeafKV(MemoryKV):
        def watch_prefix(self, prefix, callback, *, start_revision=0):
            return super().watch_prefix(prefix, lambda events: None, start_revision=start_revision)

        def get_prefix(self, prefix, *, end=None, since=0):
            snap = super().get_prefix(prefix, end=end, since=since)
            returned.append(len(snap.entries))
            return snap

    space = JobSpace.create(CountingDeafKV(), "j", "tok")
    for epoch in range(1, 51):
        space.put(
            space.key("migrations", epoch),
            MigrationPlan(epoch=epoch, reason="failure", replacements=[], resume_iteration=0).to_bytes(),
        )
    got = []
    inbox = PlanInbox(space, lambda p: got.append(p.epoch), resync_s=0.02)
    try:
        time.sleep(0.3)
        assert len(returned) >= 5 and returned[0] == 50, returned  # the inbox's first read, then the backstop's
        assert returned[1:] == [0] * (len(returned) - 1), "a backstop read returned plans nobody wrote"
        space.put(
            space.key("migrations", 51),
            MigrationPlan(epoch=51, reason="failure", replacements=[], resume_iteration=0).to_bytes(),
        )
        deadline = time.monotonic() + 5.0
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == [51]
    finally:
        inbox.close()


def test_plan_inbox_keeps_the_newest_write_of_each_epoch_and_wakes_waiters():
    """One inbox serves every process: ``latest`` holds each epoch's newest write, ``take`` what arrived
    since the last call, ``wait_until`` blocks until a pick finds something (None after its timeout),
    ``since_start`` adds the plans committed before the inbox opened, and ``on_plan`` runs before the
    plan is visible to waiters while ``after_plan`` runs after."""
    import threading
    import time

    from trainmover_ext.control.membership import PlanInbox

    def plan(epoch, reason="failure", step=None):
        return MigrationPlan(
            epoch=epoch, reason=reason, replacements=[], resume_iteration=0, steps={step: 1.0} if step else {}
        ).to_bytes()

    space = JobSpace.create(MemoryKV(), "j", "tok")
    space.put(space.key("migrations", 1), plan(1))
    seen_by_waiters = []
    inbox: PlanInbox | None = None

    def on_plan(p):  # the plan is not yet visible: a waiter could not have acted on it
        seen_by_waiters.append(("on", inbox is not None and inbox.latest.get(p.epoch) is p))

    def after_plan(p):
        seen_by_waiters.append(("after", inbox.latest.get(p.epoch) is p))

    inbox = PlanInbox(space, on_plan, after_plan=after_plan, resync_s=3600)
    late = PlanInbox(space, since_start=True, resync_s=3600)
    try:
        assert inbox.latest == {} and inbox.wait_until(lambda latest: latest.get(2), 0.05) is None
        assert sorted(late.latest) == [1]
        threading.Timer(0.1, lambda: space.put(space.key("migrations", 2), plan(2, "planned"))).start()
        t0 = time.monotonic()
        got = inbox.wait_until(lambda latest: latest.get(2), 5.0)
        assert got is not None and got.reason == "planned" and time.monotonic() - t0 < 4.0
        space.put(space.key("migrations", 2), plan(2, "planned", "ready"))
        space.put(space.key("migrations", 3), plan(3))
        ready = inbox.wait_until(lambda latest: latest[2] if "ready" in latest[2].steps else None, 5.0)
        assert ready is not None
        assert inbox.wait_until(lambda latest: latest.get(3), 5.0) is not None
        assert [(p.epoch, sorted(p.steps)) for p in inbox.take()] == [(2, []), (2, ["ready"]), (3, [])]
        assert inbox.take() == []
        assert inbox.newest().epoch == 3 and inbox.newest("planned").epoch == 2
        assert ("on", True) not in seen_by_waiters and ("after", False) not in seen_by_waiters
        assert seen_by_waiters.count(("on", False)) == 3 and seen_by_waiters.count(("after", True)) == 3
        with pytest.raises(TimeoutError, match="epoch 9"):
            inbox.wait_for_epoch(9, 0.05)
    finally:
        inbox.close()
        late.close()


# -- convergence: the controller alone decides where every rank resumes ---------------------


def test_etcd_keeps_only_the_newest_plans_and_convergences_and_the_inbox_forgets_the_pruned():
    """Every controller round reads the whole control range: a plan commit prunes the plan and the
    convergence of the epoch PLANS_KEPT before it, so that read does not grow with the job's life."""
    import time

    from trainmover_ext.control.actions import PlanMigration
    from trainmover_ext.control.executor import PLANS_KEPT, Executor, Outcome
    from trainmover_ext.control.membership import PlanInbox
    from trainmover_ext.control.records import ConvergenceRecord, convergence_key
    from trainmover_ext.control.view import epoch_value, read_view

    space = JobSpace.create(MemoryKV(), "j", "tok")
    space.put(space.key("epoch"), epoch_value(0))
    inbox = PlanInbox(space, resync_s=0.05)
    last = PLANS_KEPT + 4
    try:
        for e in range(1, last + 1):
            rev = space.kv.get(space.key("epoch")).mod_revision
            plan = MigrationPlan(epoch=e, reason="failure", replacements=[], resume_iteration=0)
            action = PlanMigration(plan=plan, expected_epoch=e - 1, expected_epoch_rev=rev, rank_updates=())
            assert Executor(space).apply(action) is Outcome.APPLIED
            space.put(convergence_key(space, e), ConvergenceRecord(epoch=e, resume_iteration=0).to_bytes())

        def epochs(kind: str) -> list[int]:
            return [int(x.key.rsplit("/", 1)[1]) for x in space.kv.get_prefix(space.key(kind) + "/").entries]

        kept = list(range(last - PLANS_KEPT + 1, last + 1))
        assert epochs("migrations") == kept and epochs("convergence") == kept
        view = read_view(space)
        assert view.epoch == last and view.last_plan.epoch == last and view.newest_plan_epoch == last
        assert sorted(view.converged) == kept
        deadline = time.monotonic() + 5.0
        while sorted(inbox.snapshot()) != kept and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(inbox.snapshot()) == kept
    finally:
        inbox.close()
