"""Property-based tests of the controller's read (``read_view``) and its pure ``decide``: a control
plane that survives garbage.

Each example is one job's namespace in a :class:`MemoryKV`, drawn by :func:`.hostile.jobs`: a coherent
job with a hostile layer on top, every key labelled with what it says. The real read and decide run
on it, and the properties check them against the labels:

- reading, deciding and applying the decisions (the real executor) never raise, two rounds running;
- a plan's joiner is a registered member that is a warm, healthy, idle standby for the rank's role
  (or the joiner of the planned move under way, which serves the rank already), never the leaver;
- the epoch never moves backwards: a plan opens the committed epoch + 1, past every planned epoch,
  and a repair only moves it forward;
- every malformed value, and only those, is listed in ``View.malformed`` (the controller's report of
  them: ``trainmover status`` shows it, and a repair's event carries the garbage it replaced), and no
  decision deletes or overwrites one, except the repairs of ``epoch`` and ``alerts/<r>``.

Every run also checks, as explicit examples, the jobs on which the properties caught the original
read and decide (:func:`found_by_the_properties`). Each property has a companion test that runs the
same check against a deliberately broken read or decide and asserts that hypothesis finds a
counterexample: a property that cannot fail proves nothing. The profile below is derandomized and
bounded, so CI runs the same examples every time, in seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from trainmover_ext.control import records
from trainmover_ext.control import view as view_module
from trainmover_ext.control.decide import (
    CommitConvergence,
    CommitSwitchPoint,
    DropStaleReport,
    PlanMigration,
    RejectRequest,
    RepairEpoch,
    decide,
)
from trainmover_ext.control.executor import Executor, Outcome
from trainmover_ext.control.records import MAX_EPOCH, ROLES, MemberRecord, RankRecord, migration_key_suffix
from trainmover_ext.control.view import read_view
from trainmover_ext.errors import MalformedValue
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace

from .hostile import INVALID, Job, jobs, small_job

settings.register_profile(
    "control-properties",
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("control-properties")
BROKEN = settings(PROFILE, max_examples=60, phases=[Phase.generate], report_multiple_bugs=False)
"""For the companions: stop at the first counterexample, without shrinking it."""
NOW = 1000.0


# -- the properties -----------------------------------------------------------------------------


def apply_all(space: JobSpace, actions: list) -> None:
    """What the controller does with a decision: apply in order, stop at the first lost race."""
    executor = Executor(space)
    for action in actions:
        if executor.apply(action) is Outcome.CONFLICT:
            return


def never_raises(job: Job, space: JobSpace, read, decide_fn) -> None:
    for round_ in range(2):
        apply_all(space, decide_fn(read(space), NOW + round_))


def joiners_are_registered_warm_standbys(job: Job, space: JobSpace, read, decide_fn) -> None:
    committed = job.committed_epoch()
    for action in decide_fn(read(space), NOW):
        if not isinstance(action, PlanMigration):
            continue
        reps = action.plan.replacement_list()
        assert len({r.joiner for r in reps}) == len(reps), reps
        assert {u.rank: u.member_id for u in action.rank_updates} == {r.rank: r.joiner for r in reps}
        for rep in reps:
            assert rep.joiner != rep.leaver, rep
            rank, member = job.valid(f"ranks/{rep.rank}"), job.valid(f"members/{rep.joiner}")
            assert rank is not None and rank.role == rep.role, (rep, rank)
            assert member is not None, f"joiner {rep.joiner} is not a registered member: {rep}"
            # What etcd holds, read with the record's own definition, is what the generator wrote.
            entry = space.kv.get(space.key("members", rep.joiner))
            assert MemberRecord.from_bytes(entry.value, key=entry.key) == member
            if job.kept_joiner(rep, committed):
                continue
            assert member.kind == "standby" and member.health == "ok" and rep.role in member.warm_roles, (rep, member)
            assert job.serving(rep.joiner) <= {rep.rank}, f"{rep.joiner} serves another rank"


def epoch_never_moves_backwards(job: Job, space: JobSpace, read, decide_fn) -> None:
    committed, floor = job.committed_epoch(), max(job.planned_epochs(), default=0)
    entry = space.kv.get(space.key("epoch"))
    rev = entry.mod_revision if entry is not None else 0
    actions = decide_fn(read(space), NOW)
    if committed is None:
        assert all(isinstance(a, RepairEpoch) for a in actions), actions
    for a in actions:
        if isinstance(a, PlanMigration):
            assert (a.expected_epoch, a.expected_epoch_rev) == (committed, rev)
            assert committed < a.plan.epoch <= MAX_EPOCH and a.plan.epoch > floor, (committed, floor, a.plan.epoch)
            assert all(u.since_epoch == a.plan.epoch for u in a.rank_updates)
        elif isinstance(a, RepairEpoch):
            assert floor <= a.epoch <= MAX_EPOCH and (committed is None or a.epoch > committed), (committed, floor, a)
            assert a.expected_epoch_rev == rev
        elif isinstance(a, CommitConvergence):
            assert (a.record.epoch, a.expected_epoch_rev) == (committed, rev)
        elif isinstance(a, CommitSwitchPoint):
            assert a.epoch == committed


def malformed_values_are_reported_and_kept(job: Job, space: JobSpace, read, decide_fn) -> None:
    view = read(space)
    assert set(view.malformed) == {space.root + rel for rel, s in job.keys.items() if s.label == INVALID}
    deleted, written = set(), set()
    for a in decide_fn(view, NOW):
        if isinstance(a, PlanMigration):
            deleted |= set(a.consumed)
            written |= {
                space.key("epoch"),
                space.key("migrations", migration_key_suffix(a.plan.epoch)),
                *(space.key("ranks", u.rank) for u in a.rank_updates),
            }
        elif isinstance(a, (DropStaleReport, RejectRequest)):
            deleted.add(a.key)
        elif isinstance(a, CommitConvergence):
            deleted |= set(a.consumed)
        elif isinstance(a, RepairEpoch) and view.epoch is None:
            assert a.garbage == view.malformed[space.key("epoch")][:200], (
                "the repair event shows the garbage it replaced"
            )
        # RepairEpoch and RaiseAlert rewrite epoch / alerts/<r>: over garbage, that is the repair.
    assert not (deleted | written) & set(view.malformed), sorted((deleted | written) & set(view.malformed))


def check(*props, read=read_view, decide_fn=decide, profile=PROFILE, examples: tuple[Job, ...] = ()) -> None:
    """Run ``props`` over ``examples`` and generated jobs with the given read and decide, each prop on the job
    as generated (one generation for all of them: it is most of the cost)."""

    def body(job: Job) -> None:
        for prop in props:
            prop(job, job.build(), read, decide_fn)

    run = given(jobs())(body)
    for job in examples:
        run = example(job)(run)
    profile(run)()


def found_by_the_properties() -> dict[str, Job]:
    """The jobs on which the properties caught the read and decide as they were before this test existed."""
    return {
        # int(Infinity): OverflowError, which the read did not catch.
        "epoch Infinity": small_job().garbage("epoch", b'{"tm": "epoch", "v": 1, "data": {"epoch": Infinity}}'),
        # "3" was read as epoch 3: decisions compare-and-swapped on garbage.
        "epoch a string": small_job().garbage("epoch", encode("epoch", {"epoch": "3"})).drop("members/w1"),
        # `role in None` in decide: a TypeError that stops the controller.
        "warm_roles null": small_job()
        .garbage("members/s0", encode("member", {**_member("s0"), "warm_roles": None}))
        .drop("members/w1"),
        # json's RecursionError escaped the read.
        "deep nesting": small_job().garbage(
            "members/s1", b'{"tm": "member", "v": 1, "data": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        ),
        # An unregistered standby planned as joiner: its record lay under another key.
        "impostor standby": small_job()
        .drop("members/s0")
        .drop("members/s1")
        .drop("members/w1")
        .garbage("members/impostor", encode("member", _member("s1"))),
        # ranks/9 holding rank 0's record replaced the real ranks/0 (keys sort, the last one won).
        "impostor rank": small_job().garbage(
            "ranks/9", RankRecord(rank=0, member_id="ghost", role="middle").to_bytes()
        ),
        # The epoch behind a committed plan: a plan for epoch 4 again.
        "epoch behind a plan": small_job().drop("members/w1").plan(4),
        # The newest plan unreadable: the repair went back to the older plan's epoch.
        "repair past an unreadable plan": small_job()
        .plan(3)
        .garbage("epoch", b"garbage")
        .garbage("migrations/0000000004", b"\x00"),
        # No rank record readable while a recovery waits: min() of nothing in the convergence decision.
        "every rank unreadable": small_job().plan(3).garbage("ranks/0", b"?").garbage("ranks/1", b"?"),
        # A planned move whose leaver is its joiner, reported dead: the rank "replaced" by the dead member.
        "leaver is joiner": small_job()
        .plan(3, reason="planned", rank=1, leaver="s0", joiner="s0")
        .serve(1, "s0")
        .report(1, "s0"),
    }


def _member(mid: str) -> dict:
    return dataclasses.asdict(MemberRecord(member_id=mid, kind="standby", host="h1", pid=2, warm_roles=list(ROLES)))


def test_every_property_holds_on_hostile_jobs():
    check(
        joiners_are_registered_warm_standbys,
        epoch_never_moves_backwards,
        malformed_values_are_reported_and_kept,
        never_raises,
        examples=tuple(found_by_the_properties().values()),
    )


# -- each property can fail: the same check against a deliberately broken read or decide --------


def test_a_read_that_gives_up_at_the_first_garbage_value_is_caught(monkeypatch):
    class NeverRaised(Exception):
        pass

    monkeypatch.setattr(view_module, "MalformedValue", NeverRaised)  # the read no longer catches MalformedValue
    with pytest.raises(MalformedValue):
        check(never_raises, profile=BROKEN)


def test_a_read_without_type_checks_is_caught(monkeypatch):
    """Without its type checks, the read lets wrong-typed fields through to decide. The generated search
    needs a few hundred examples to reach a decision that trips on one, so this companion also gives
    hypothesis the jobs the properties caught before (explicit examples come first)."""
    monkeypatch.setattr(records, "field_type_problems", lambda obj: [])
    with pytest.raises(TypeError):
        check(
            never_raises,
            profile=settings(BROKEN, phases=[Phase.explicit, Phase.generate]),
            examples=tuple(found_by_the_properties().values()),
        )


def test_a_decide_that_plans_onto_an_arbitrary_member_is_caught():
    def onto_any_member(view, now, **kw):
        out = []
        for a in decide(view, now, **kw):
            if isinstance(a, PlanMigration):
                # The last name: a worker ("w...") wherever one is registered, so the broken plan is
                # wrong on almost every job, not only where hypothesis happens to draw a busy "s0".
                anyone = max(view.members) if view.members else "ghost"
                reps = [dict(r, joiner=anyone) for r in a.plan.replacements[:1]] + a.plan.replacements[1:]
                a = dataclasses.replace(
                    a,
                    plan=dataclasses.replace(a.plan, replacements=reps),
                    rank_updates=(dataclasses.replace(a.rank_updates[0], member_id=anyone), *a.rank_updates[1:]),
                )
            out.append(a)
        return out

    with pytest.raises(AssertionError):
        check(joiners_are_registered_warm_standbys, decide_fn=onto_any_member, profile=BROKEN)


def test_a_decide_that_reuses_the_epoch_is_caught():
    def reuse_epoch(view, now, **kw):
        return [
            dataclasses.replace(a, plan=dataclasses.replace(a.plan, epoch=a.expected_epoch))
            if isinstance(a, PlanMigration)
            else a
            for a in decide(view, now, **kw)
        ]

    with pytest.raises(AssertionError):
        check(epoch_never_moves_backwards, decide_fn=reuse_epoch, profile=BROKEN)


def test_a_read_that_hides_malformed_values_is_caught():
    def forgetful_read(space):
        view = read_view(space)
        view.malformed.clear()
        return view

    with pytest.raises(AssertionError):
        check(malformed_values_are_reported_and_kept, read=forgetful_read, profile=BROKEN)
