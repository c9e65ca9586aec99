"""The run directory's copy of a job's events and finished migrations (pure logic on the in-memory store)."""

from __future__ import annotations

import json

from trainmover_ext.control.archive import RunArchive, read_jsonl
from trainmover_ext.control.records import Event, MigrationPlan, event_key_suffix, migration_key_suffix
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.kv.memory import MemoryKV


def _space():
    space = JobSpace.create(MemoryKV(), "j", "tok")
    for t, what in ((10.0, "leader_elected"), (11.0, "migration_planned")):
        space.put(space.events_prefix + event_key_suffix(t), Event(time=t, what=what, detail={"n": 1}).to_bytes())
    space.put(space.events_prefix + "garbage", b"not json")
    for epoch, status in ((1, "done"), (2, "preparing")):
        plan = MigrationPlan(
            epoch=epoch,
            reason="failure",
            replacements=[],
            resume_iteration=4,
            status=status,
            steps={"detected": 10.0, "decided": 10.5},
        )
        space.put(space.key("migrations", migration_key_suffix(epoch)), plan.to_bytes())
    return space


def test_events_and_finished_migrations_are_copied_once(tmp_path):
    space = _space()
    archive = RunArchive(str(tmp_path))
    assert archive.poll(space) == 3  # two events (the garbage one skipped) and the one finished plan
    assert archive.poll(space) == 0
    assert [r["what"] for r in read_jsonl(archive.events_path)] == ["leader_elected", "migration_planned"]
    plans = list(read_jsonl(archive.migrations_path))
    assert [(p["epoch"], p["steps"]["decided"]) for p in plans] == [(1, 10.5)]
    # epoch 2 finishes later; a new archive of the same directory (another agent) writes only that
    plan = MigrationPlan(epoch=2, reason="failure", replacements=[], resume_iteration=4, status="done")
    space.put(space.key("migrations", migration_key_suffix(2)), plan.to_bytes())
    assert RunArchive(str(tmp_path)).poll(space) == 1
    assert [p["epoch"] for p in read_jsonl(archive.migrations_path)] == [1, 2]


def test_a_poll_reads_only_what_was_written_since_the_last_one(tmp_path):
    """The leader's agent polls every second for the job's life: a poll reads the records written since
    the previous one, not the whole history; a plan that finishes later is still copied."""
    space = _space()
    returned = []
    get_prefix = space.kv.get_prefix

    def counting(prefix, *, end=None, since=0):
        snap = get_prefix(prefix, end=end, since=since)
        returned.append(len(snap.entries))
        return snap

    space.kv.get_prefix = counting
    archive = RunArchive(str(tmp_path))
    assert archive.poll(space) == 3 and returned == [3, 2]  # everything once
    assert archive.poll(space) == 0 and returned[2:] == [0, 0]
    space.put(space.events_prefix + event_key_suffix(12.0), Event(time=12.0, what="x", detail={}).to_bytes())
    plan = MigrationPlan(epoch=2, reason="failure", replacements=[], resume_iteration=4, status="done")
    space.put(space.key("migrations", migration_key_suffix(2)), plan.to_bytes())
    assert archive.poll(space) == 2 and returned[4:] == [1, 1]
    assert [p["epoch"] for p in read_jsonl(archive.migrations_path)] == [1, 2]


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"key": "a", "what": "x"}) + "\n" + '{"key": "b", "wh')
    assert [r["key"] for r in read_jsonl(str(path))] == ["a"]


def test_the_thread_copies_only_while_leading(tmp_path):
    space = _space()
    leading = {"now": False}
    archive = RunArchive(str(tmp_path)).start(space, lambda: leading["now"], interval_s=0.01)
    try:
        import time

        time.sleep(0.1)
        assert not list(read_jsonl(archive.events_path))
    finally:
        leading["now"] = True
        archive.close()  # the final round copies (this agent leads now)
    assert len(list(read_jsonl(archive.events_path))) == 2


def test_two_archives_of_one_run_directory_never_write_a_record_twice(tmp_path):
    """Two agents of one run directory, leading in turn and both alive: the second one was made before
    the first wrote, and still copies only what the first did not (it reads the file's new lines first)."""
    space = _space()
    first, second = RunArchive(str(tmp_path)), RunArchive(str(tmp_path))
    assert first.poll(space) == 3
    assert second.poll(space) == 0
    space.put(space.events_prefix + event_key_suffix(12.0), Event(time=12.0, what="x", detail={}).to_bytes())
    plan = MigrationPlan(epoch=2, reason="failure", replacements=[], resume_iteration=4, status="done")
    space.put(space.key("migrations", migration_key_suffix(2)), plan.to_bytes())
    assert second.poll(space) == 2
    assert first.poll(space) == 0
    assert [r["what"] for r in read_jsonl(first.events_path)] == ["leader_elected", "migration_planned", "x"]
    assert [p["epoch"] for p in read_jsonl(first.migrations_path)] == [1, 2]


def test_a_line_torn_by_a_dead_writer_is_ended_before_the_next_record(tmp_path):
    space = _space()
    (tmp_path / "events.jsonl").write_text(json.dumps({"key": "old", "what": "y"}) + "\n" + '{"key": "b", "wh')
    archive = RunArchive(str(tmp_path))
    assert archive.poll(space) == 3
    assert [r["key"] for r in read_jsonl(archive.events_path)][0] == "old"
    assert [r["what"] for r in read_jsonl(archive.events_path)] == ["y", "leader_elected", "migration_planned"]
